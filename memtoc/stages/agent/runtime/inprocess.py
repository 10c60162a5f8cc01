"""The in-process runtime: memtoc renders the messages, the transformers backend generates the free
turns (batched, batch-invariant, cached by the generator), llguidance decodes named calls' arguments
(:mod:`.constrained`, cached through :class:`.caching.ReplyCache`)."""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from transformers import AutoTokenizer

from memtoc.generation import cache as _cache, models
from memtoc.generation.backends.base import LazyGenerator, load_signature
from memtoc.generation.backends.hf import TransformersGenerator
from memtoc.stages.agent.parsers import RAW_STOP, Parsed, cut_at_stop, format_for, get_format
from memtoc.stages.agent.runtime.base import AgentRuntimeError, ChatRequest, ChatResponse, Runtime, forced_name
from memtoc.stages.agent.runtime.caching import CONSTRAINED_FILE, FREE_FILE, ReplyCache, constrained_key
from memtoc.stages.agent.runtime.constrained import (
    JSON_OPTIONS,
    TIE_MARGIN,
    ConstrainedDecoder,
    ConstrainedJob,
    constrained_library,
)
from memtoc.stages.agent.runtime.render import parse_reply, render_messages, template_renders_tools
from memtoc.stages.agent.tools import name_of, parameters_of


class TransformersRuntime(Runtime):
    """In-process runtime on memtoc's transformers backend (see the module docstring).

    ``cache_dir``: folder of the generation caches (``generations.jsonl`` for free turns,
    ``constrained.jsonl`` for schema-constrained calls); None: no cache. ``tool_format``: a name of
    :data:`~memtoc.stages.agent.parsers.FORMATS` (default: from the model family / its template).
    ``adapter``: a peft LoRA adapter directory (notebook 04's) loaded on the weights; its hash enters
    the generator's identity, hence every cache key."""

    kind = "transformers"
    named_tool_choice = True
    constrained = True
    enforces_none = True

    def __init__(self, model: str, max_tokens_per_call: int = 64, cache_dir: str | os.PathLike | None = None,
                 model_cache_dir: Optional[str] = None, batch_size: Any = "auto", dtype: str = "auto",
                 tool_format: Optional[str] = None, adapter: str | os.PathLike | None = None,
                 **backend_options: Any):
        self.spec = models.get_model(model)
        self.path = models.prepare_model(model, cache_dir=model_cache_dir)
        self.max_tokens_per_call = int(max_tokens_per_call)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.chat_model = bool(self.spec.chat and getattr(self.tokenizer, "chat_template", None))
        renders = template_renders_tools(self.tokenizer) if self.chat_model else False
        self.format = get_format(tool_format) if tool_format else format_for(
            [self.spec.name, self.spec.hub_id or "", self.spec.label], self.chat_model,
            getattr(self.tokenizer, "chat_template", None), renders)
        if self.format.native and not renders:
            raise AgentRuntimeError(f"{model}: tool format {self.format.name!r} needs a chat template that renders "
                                    "tools, and this model's template does not; use tool_format: smollm2")
        self.template_renders_tools = renders
        ids = self.tokenizer("a")["input_ids"]
        bos = self.tokenizer.bos_token
        self.strip_bos = bool(bos and self.tokenizer.bos_token_id is not None and ids
                              and ids[0] == self.tokenizer.bos_token_id)
        # prompts are rendered here: the backend sees them as raw text (chat=False), BOS added by the
        # tokenizer; base models stop at their first complete line, every reply at a FINAL line
        raw_spec = dataclasses.replace(self.spec, chat=False)
        opts = dict(backend_options)
        opts.setdefault("show_progress", False)
        opts.setdefault("stop_at_final", True)
        opts.setdefault("stop_at_first_line", not self.chat_model)
        weights = models.weights_hash(self.path, model_cache_dir)
        self.adapter = None if adapter is None else str(adapter)
        sig = load_signature("transformers", self.spec.name, weights,
                             None if adapter is None else models.adapter_hash(adapter), path=str(self.path),
                             batch_size=batch_size, dtype=dtype, max_new_tokens=self.max_tokens_per_call,
                             options={k: v for k, v in opts.items() if k != "show_progress"},
                             prompt_format="memtoc.stages.agent: rendered text")
        kwargs = dict(adapter=self.adapter, dtype=dtype, max_new_tokens=self.max_tokens_per_call,
                      cache_dir=model_cache_dir, batch_size=batch_size, **opts)
        self.gen = LazyGenerator.of(TransformersGenerator, (raw_spec, self.path), kwargs, sig,
                                    models.model_cache_root(model_cache_dir) / "_identities")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.constrained_cache = ReplyCache(self._cache(CONSTRAINED_FILE))
        self._decoder: Optional[ConstrainedDecoder] = None
        self.library = None

    # -- rendering ---------------------------------------------------------------------------------
    def render(self, messages: Sequence[dict], tools: Optional[list[dict]]) -> str:
        text = render_messages(self.tokenizer, self.chat_model, self.format, messages, tools)
        if self.strip_bos and text.startswith(self.tokenizer.bos_token):
            text = text[len(self.tokenizer.bos_token):]   # the tokenizer adds it again
        return text

    def n_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0

    # -- generation --------------------------------------------------------------------------------
    def _cache(self, name: str) -> Optional[Path]:
        return None if self.cache_dir is None else self.cache_dir / name

    def chat_many(self, requests: Sequence[ChatRequest]) -> list[ChatResponse]:
        requests = list(requests)
        texts = [self.render(r.messages, r.tools) for r in requests]
        out: list[Optional[ChatResponse]] = [None] * len(requests)
        jobs: list[tuple[int, str, Optional[ChatResponse]]] = []     # (request, prefix, free reply)
        free = [i for i, r in enumerate(requests) if forced_name(r.tool_choice, r.tools) is None]
        if free:
            replies = self.gen.generate([texts[i] for i in free], cache_path=self._cache(FREE_FILE),
                                        desc=f"agent {self.spec.label}")
            for i, rep in zip(free, replies):
                r = requests[i]
                text, n_new, finish = rep.text, rep.n_new_tokens, rep.finish
                if not self.chat_model:
                    text, cut = cut_at_stop(text, RAW_STOP)
                    if cut:
                        n_new, finish = self.n_tokens(text), "stop"
                p = parse_reply(self.format, text, r.tool_choice)
                ignored = r.tool_choice == "none" and self.format.parse(text).opened
                out[i] = ChatResponse(text, p.content, p.calls, p.error, p.opened, rep.n_prompt_tokens, n_new, finish,
                                      rep.cached, rep.seconds, _cache.sha256_text(texts[i]), call_text_ignored=ignored)
                if r.constrained and r.tool_choice != "none" and r.tools:
                    m = self.format.trigger.search(text)
                    if m is not None:        # the lazy grammar: from the call's opening on, constrained
                        jobs.append((i, text[: m.start()], out[i]))
        jobs += [(i, "", None) for i in range(len(requests)) if out[i] is None]
        if jobs:
            for (i, _, _), resp in zip(jobs, self._constrained_calls(
                    [(texts[i], prefix, requests[i], fr) for i, prefix, fr in jobs])):
                out[i] = resp
        return out  # type: ignore[return-value]

    def _constrained_calls(self, items: list[tuple[str, str, ChatRequest, Optional[ChatResponse]]]) -> list[ChatResponse]:
        """Per item (prompt, prefix, request, free reply): the reply ``prefix`` + the forced call with
        schema-constrained arguments; cached in ``constrained.jsonl``, the misses decoded in batches."""
        self.library = self.library or constrained_library()
        prepared = [self._prepare_constrained(*item) for item in items]
        known = self.constrained_cache.get_many(p["key"] for p in prepared)
        todo = list({p["key"]: p for p in prepared if p["key"] not in known}.values())
        if todo:
            known.update(self._decode_constrained(todo))
        return [self._constrained_response(p, known[p["key"]]) for p in prepared]

    def _prepare_constrained(self, prompt: str, prefix: str, req: ChatRequest,
                             free: Optional[ChatResponse]) -> dict[str, Any]:
        name = self._name(req)
        tool = next((t for t in req.tools or [] if name_of(t) == name), None)
        if tool is None:
            raise AgentRuntimeError(f"tool_choice names {name!r}, which is not among the request's tools")
        schema = parameters_of(tool)
        head = prefix + self.format.begin(name)
        key = constrained_key(self.gen.identity, self.library, JSON_OPTIONS, schema, req.max_tokens, TIE_MARGIN,
                              prompt + head)
        return {"prompt": prompt, "prefix": prefix, "head": head, "req": req, "free": free, "schema": schema,
                "key": key, "name": name}

    def _decode_constrained(self, todo: list[dict[str, Any]]) -> dict[str, dict]:
        """Decode the cache misses in batches; their records (also appended to the cache), by key."""
        t0 = time.perf_counter()
        dec = self.decoder()
        tok = dec.tokenizer
        jobs, meta = [], []
        for p in todo:
            ids = tok(p["prompt"] + p["head"], add_special_tokens=True)["input_ids"]
            n_prompt = len(tok(p["prompt"], add_special_tokens=True)["input_ids"])
            # generated tokens only (as vLLM counts a named call's arguments): the model's own text
            # before the call, then the arguments; the inserted call text is not decoded
            n_free = self.n_tokens(p["prefix"])
            jobs.append(ConstrainedJob(ids, p["schema"], max(1, p["req"].max_tokens - n_free)))
            meta.append((n_free, n_prompt))
        results = dec.decode_many(jobs)
        dt = (time.perf_counter() - t0) / len(todo)
        recs = []
        for p, (n_head, n_prompt), (arg_ids, how) in zip(todo, meta, results):
            args = tok.decode(arg_ids, skip_special_tokens=True)
            body = p["head"] + args + (self.format.end() if how == "complete" else "")
            recs.append({"key": p["key"], "text": body, "n_prompt_tokens": n_prompt,
                         "n_new_tokens": n_head + len(arg_ids), "constrained_tokens": len(arg_ids), "finish": how,
                         "seconds": round(dt, 6), "prompt_sha256": _cache.sha256_text(p["prompt"])})
        self.constrained_cache.put(recs)
        return {r["key"]: dict(r, fresh=True) for r in recs}

    def _constrained_response(self, p: dict[str, Any], rec: dict) -> ChatResponse:
        text = rec["text"]
        parsed = self.format.parse(text)
        if rec["finish"] != "complete" and parsed.error is None and not parsed.calls:
            parsed = Parsed(parsed.content, [], "the constrained call did not complete within the token budget", True)
        fr = p["free"]
        return ChatResponse(text, parsed.content, parsed.calls, parsed.error, True, int(rec["n_prompt_tokens"]),
                            int(rec["n_new_tokens"]), "length" if rec["finish"] == "length" else "stop",
                            not rec.get("fresh", False), float(rec.get("seconds", 0.0)) + (fr.seconds if fr else 0.0),
                            _cache.sha256_text(p["prompt"]), int(rec.get("constrained_tokens", 0)))

    @staticmethod
    def _name(req: ChatRequest) -> str:
        return forced_name(req.tool_choice, req.tools) or name_of(req.tools[0])

    def decoder(self) -> ConstrainedDecoder:
        if self._decoder is None:
            real = self.gen.load()
            self._decoder = ConstrainedDecoder(real.model, real.tokenizer, real.device)
        return self._decoder

    @property
    def constrained_stats(self) -> Optional[dict[str, Any]]:
        return self._decoder.cost() if self._decoder is not None else None

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(model=self.spec.name, chat=self.chat_model, tool_format=self.format.name,
                 template_renders_tools=self.template_renders_tools,
                 prompt="chat template" if self.chat_model else "raw transcript",
                 max_tokens_per_call=self.max_tokens_per_call, constrained_decoding=self.library, adapter=self.adapter,
                 constrained_cost=self.constrained_stats)
        return d

    def close(self) -> None:
        self.gen.close()

