"""The agent runtime: one ``chat(messages, tools, tool_choice)`` interface, two implementations.

``TransformersRuntime``  in-process transformers (CPU by default, GPU when there is one). Messages
    are rendered to text here (:func:`render_messages`: the model's chat template with
    ``tools=...`` when the template renders tools, else the documented ``smollm2`` text format in the
    system turn; a raw transcript for base models), generated greedily in batches through
    memtoc's transformers backend (``backends.hf.TransformersGenerator``: shared prefixes,
    batch-invariant float32 replies on CPU, the generation cache ``agent/<model>/cache/generations.jsonl``)
    and parsed with the family's :class:`~memtoc.agent.parsers.ToolFormat`.
    A *named* ``tool_choice`` (the guided protocol) is honoured the way vLLM honours it: the call's
    fixed text (``format.begin(name)``) is inserted and its arguments are decoded under the JSON
    schema of the tool's parameters; ``constrained=True`` with ``tool_choice="auto"`` (the
    ``auto_constrained`` repair arm) generates exactly as ``auto`` and, where the free reply opens a
    call (the format's trigger), replaces the call's text by the same schema-constrained decoding
    (a *lazy* grammar, like llama.cpp's grammar triggers or xgrammar's structural tags): same
    weights, same prompt, only the arguments are constrained. Constrained decoding is batch-1
    greedy with ``llguidance`` (a maintained Rust grammar engine with CPU wheels) masking the
    logits at every step; its cost per token is measured (:attr:`TransformersRuntime.constrained_stats`).
    ``tool_choice="none"`` leaves the tools in the prompt (as vLLM does) and parses no call.

``OpenAIRuntime``  any OpenAI-compatible ``/v1/chat/completions`` server (``vllm serve MODEL
    --enable-auto-tool-choice --tool-call-parser <family>`` is the paper's stack). Native formats
    send ``tools`` / ``tool_choice`` and read ``tool_calls``; text formats (SmolLM2, base models)
    are rendered and parsed by memtoc. A server that does not honour ``tool_choice`` (``transformers
    serve`` ignores it, it only logs "Ignoring unsupported fields") gets none, and the protocols that
    need it (guided, two_stage: a named call; auto_constrained: a grammar) are **refused** with
    :class:`ProtocolUnsupported` before any request, never silently degraded. The server kind is
    detected from its OpenAPI paths (``server="auto"``) or given (``vllm`` | ``transformers`` |
    ``other``); ``honors_tool_choice=True`` vouches for another server.

Requirements per protocol (checked by :meth:`Runtime.check_protocols`): guided and two_stage need a
named tool choice; auto_constrained needs in-process constrained decoding; auto and oracle run
anywhere (after the call they ask for ``tool_choice="none"``; a runtime that does not enforce it may
return a further call, which the loop ends as ``max_calls``).
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Optional, Sequence

import llguidance
import llguidance.hf
import numpy as np
import requests
import torch
from llguidance.torch import fill_next_token_bitmask
from transformers import AutoTokenizer, LogitsProcessorList, StoppingCriteriaList

from .. import cache as _cache
from .. import models
from ..backends.base import LazyGenerator, load_signature
from ..backends.hf import TransformersGenerator
from ..backends.openai import BackendError, post_json
from ..config import MemtocError
from .parsers import RAW_ROLES, RAW_STOP, Parsed, ToolCall, ToolFormat, cut_at_stop, format_for, get_format
from .tools import function_tool, name_of, parameters_of

NAMED = "named"
CONSTRAINED = "constrained"
#: what each protocol needs from a runtime
PROTOCOL_NEEDS: dict[str, tuple[str, ...]] = {"guided": (NAMED,), "auto": (), "two_stage": (NAMED,),
                                              "oracle": (), "auto_constrained": (CONSTRAINED,)}
SERVERS = ("auto", "vllm", "transformers", "other")


class AgentRuntimeError(MemtocError):
    """The runtime cannot serve a request as configured."""


class ProtocolUnsupported(AgentRuntimeError):
    """A protocol needs a capability this runtime does not have (it would silently degrade)."""


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: Optional[list[dict[str, Any]]] = None        # OpenAI function tools
    tool_choice: Any = "auto"                           # auto | none | required | {"type": "function", ...}
    max_tokens: int = 64
    constrained: bool = False                           # decode a call's arguments under the schema grammar


@dataclass
class ChatResponse:
    text: str                        # the reply as generated (call text included)
    content: str                     # text outside calls
    calls: list[ToolCall] = field(default_factory=list)
    parse_error: Optional[str] = None
    opened: bool = False             # a call region was opened (parsed or not)
    n_prompt_tokens: int = 0
    n_new_tokens: int = 0
    finish: str = ""
    cached: bool = False
    seconds: float = 0.0
    prompt_sha256: Optional[str] = None
    constrained_tokens: int = 0      # tokens decoded under the grammar
    call_text_ignored: bool = False  # tool_choice "none": the reply looked like a call, kept as text

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["calls"] = [c.to_dict() for c in self.calls]
        return d


def named_choice(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def forced_name(tool_choice: Any, tools: Optional[list[dict]]) -> Optional[str]:
    """The tool a ``tool_choice`` forces (named, or ``required`` with one tool), else None."""
    if isinstance(tool_choice, dict):
        return tool_choice.get("function", {}).get("name")
    if tool_choice == "required" and tools and len(tools) == 1:
        return name_of(tools[0])
    return None


def call_id(n: int) -> str:
    """Tool-call ids of 9 alphanumeric characters (Mistral's template requires exactly that)."""
    return f"call{n:05d}"


def assistant_call_message(content: str, calls: Sequence[ToolCall], raw: Optional[str], first_id: int = 0) -> dict:
    """The assistant message of a turn that made calls (OpenAI shape; ``raw`` keeps the model's own
    text for text formats)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content or "",
                           "tool_calls": [{"id": call_id(first_id + i), "type": "function",
                                           "function": {"name": c.name,
                                                        "arguments": c.arguments if isinstance(c.arguments, str)
                                                        else json.dumps(c.arguments, ensure_ascii=False)}}
                                          for i, c in enumerate(calls)]}
    if raw is not None:
        msg["raw"] = raw
    return msg


def _args_dict(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


# ==================================================================================================
# rendering

def text_messages(messages: Sequence[dict], tools: Optional[list[dict]], fmt: ToolFormat) -> list[dict]:
    """Messages for a template that ignores ``tools``: the tool prompt appended to the system turn
    (or a system turn of its own), the model's calls as its raw text, tool results as a user turn
    ``<tool_response>...</tool_response>``."""
    out: list[dict] = []
    tool_prompt = fmt.tool_prompt(tools) if tools and hasattr(fmt, "tool_prompt") else ""
    for m in messages:
        role = m["role"]
        if role == "system":
            out.append({"role": "system", "content": m["content"] + ("\n\n" + tool_prompt if tool_prompt else "")})
            tool_prompt = ""
        elif role == "assistant":
            text = m.get("raw")
            if text is None:
                text = (m.get("content") or "")
                for tc in m.get("tool_calls") or []:
                    fn = tc["function"]
                    text = (text + ("\n" if text else "")
                            + fmt.render_call(fn["name"], _args_dict(fn["arguments"])))
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": role, "content": m["content"]})
    if tool_prompt:
        out.insert(0, {"role": "system", "content": tool_prompt})
    return out


def raw_transcript(messages: Sequence[dict], tools: Optional[list[dict]], fmt: ToolFormat) -> str:
    """A base model's prompt (no chat template; memtoc's own layout): the system text, then
    ``User: ...`` / ``Assistant: ...`` lines, ending with ``Assistant:`` for the model to continue."""
    parts: list[str] = []
    for m in text_messages(messages, tools, fmt):
        if m["role"] == "system":
            parts.append(m["content"].rstrip() + "\n")
        else:
            parts.append(RAW_ROLES[m["role"]] + m["content"].strip())
    return "\n".join(parts) + "\nAssistant:"


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """Messages for a template that renders tools (arguments as objects, ``raw`` dropped)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "raw"}
        if m.get("tool_calls"):
            m["tool_calls"] = [{**tc, "function": {**tc["function"], "arguments": _args_dict(tc["function"]["arguments"])}}
                               for tc in m["tool_calls"]]
        out.append(m)
    return out


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template shows ``tools`` (rendering with and without a tool differs)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    msgs = [{"role": "user", "content": "x"}]
    probe = [function_tool({"name": "memtoc_probe_tool", "description": "d",
                            "parameters": {"type": "object", "properties": {}}})]
    try:
        a = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        b = tokenizer.apply_chat_template(msgs, tools=probe, tokenize=False, add_generation_prompt=True)
    except Exception:
        return False
    return a != b and "memtoc_probe_tool" in b


def render_messages(tokenizer, chat: bool, fmt: ToolFormat, messages: Sequence[dict],
                    tools: Optional[list[dict]]) -> str:
    """The text a model continues for ``messages`` (see the module docstring)."""
    if not chat or not getattr(tokenizer, "chat_template", None):
        return raw_transcript(messages, tools, fmt)
    if fmt.native:
        return tokenizer.apply_chat_template(template_messages(messages), tools=tools or None, tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.apply_chat_template(text_messages(messages, tools, fmt), tokenize=False,
                                         add_generation_prompt=True)


def parse_reply(fmt: ToolFormat, text: str, tool_choice: Any) -> Parsed:
    """Calls of a reply; with ``tool_choice="none"`` nothing is a call (the text stays content)."""
    if tool_choice == "none":
        return Parsed(text.strip())
    return fmt.parse(text)


# ==================================================================================================
# the interface

class Runtime:
    """``chat(messages, tools, tool_choice)`` -> :class:`ChatResponse`; ``chat_many`` batches."""

    kind = "base"
    named_tool_choice = False       # a named tool_choice is honoured (the call is forced)
    constrained = False             # call arguments can be decoded under the schema grammar
    enforces_none = False           # tool_choice "none" is honoured

    def chat(self, messages: list[dict], tools: Optional[list[dict]] = None, tool_choice: Any = "auto",
             max_tokens: int = 64, constrained: bool = False) -> ChatResponse:
        return self.chat_many([ChatRequest(messages, tools, tool_choice, max_tokens, constrained)])[0]

    def chat_many(self, requests: Sequence[ChatRequest]) -> list[ChatResponse]:
        raise NotImplementedError

    def capabilities(self) -> dict[str, bool]:
        return {NAMED: self.named_tool_choice, CONSTRAINED: self.constrained, "enforces_none": self.enforces_none}

    def why_not(self, need: str) -> str:
        return f"the {self.kind} runtime has no {need} capability"

    def check_protocols(self, protocols: Sequence[str]) -> None:
        """Raise :class:`ProtocolUnsupported` naming every protocol this runtime cannot run faithfully."""
        caps = self.capabilities()
        bad = []
        for p in protocols:
            if p not in PROTOCOL_NEEDS:
                raise AgentRuntimeError(f"unknown protocol {p!r}; valid: {', '.join(PROTOCOL_NEEDS)}")
            missing = [n for n in PROTOCOL_NEEDS[p] if not caps.get(n)]
            if missing:
                bad.append(f"{p} (needs {' and '.join(missing)}: {self.why_not(missing[0])})")
        if bad:
            raise ProtocolUnsupported(
                "refusing to run " + "; ".join(bad) + ". memtoc will not silently run a different protocol. "
                "Drop these from agent.protocols, or use the in-process runtime (agent.runtime: transformers), "
                "or a server that honours a named tool_choice (vllm serve MODEL --enable-auto-tool-choice "
                "--tool-call-parser <family>, with agent.runtime_options.server: vllm)")

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "capabilities": self.capabilities()}

    def close(self) -> None:
        pass


# ==================================================================================================
# constrained decoding (llguidance)

def constrained_library() -> dict[str, str]:
    """Name and version of the constrained-decoding library."""
    return {"library": "llguidance", "version": metadata.version("llguidance")}


JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "strict": True}


def strict_schema(schema: Any) -> Any:
    """A copy of a JSON schema whose objects allow no properties beyond those named, unless they say
    otherwise: the *grammar* a constrained call is decoded under (xgrammar's ``strict_mode``, the
    default of vLLM's guided decoding). Validation still uses the schema as given."""
    if isinstance(schema, list):
        return [strict_schema(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
TIE_MARGIN = 2e-3        # as the transformers backend's float32 tie_margin (backends.hf.FLOAT32_TIE_MARGIN)


@dataclass
class ConstrainedJob:
    prompt_ids: list[int]
    schema: dict[str, Any]
    max_tokens: int


class _GrammarMask:
    """``model.generate`` logits processor: row i's scores are masked by its llguidance matcher; a
    row whose matcher stopped (or whose budget is spent) is given EOS, which ends it; a step whose
    top-2 allowed scores are closer than ``tie_margin`` is decided by the row computed alone (batch
    1, no padding, no cache), so the replies do not depend on the batch (as in backends.hf)."""

    def __init__(self, dec: "ConstrainedDecoder", matchers, jobs: list[ConstrainedJob], P: int, eos: int):
        self.dec, self.matchers, self.jobs, self.P, self.eos = dec, matchers, jobs, P, eos
        self.out: list[list[int]] = [[] for _ in jobs]
        self.finish = ["length"] * len(jobs)
        self.done = [False] * len(jobs)
        words = (dec.lltok.vocab_size + 31) // 32
        self.bitmask = torch.full((len(jobs), words), -1, dtype=torch.int32)

    def __call__(self, input_ids, scores):
        t0 = time.perf_counter()
        step = input_ids.shape[1] - self.P
        st = self.dec.stats
        for i, m in enumerate(self.matchers):
            if self.done[i]:
                continue
            if step > 0:
                tok = int(input_ids[i, -1])
                if not m.consume_token(tok):
                    self.done[i], self.finish[i] = True, "error"
                    continue
                self.out[i].append(tok)
                st["tokens"] += 1
                if m.is_stopped():
                    self.done[i], self.finish[i] = True, "complete"
                    continue
                if len(self.out[i]) >= self.jobs[i].max_tokens:
                    self.done[i] = True
                    continue
            fill_next_token_bitmask(m, self.bitmask, i)
        V = scores.shape[-1]
        allowed = np.unpackbits(self.bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :V]
        masked = scores.to(torch.float32).masked_fill(torch.from_numpy(allowed == 0).to(scores.device), float("-inf"))
        for i in range(len(self.jobs)):
            if self.done[i]:
                masked[i] = float("-inf")
                masked[i, self.eos] = 0.0
        st["mask_seconds"] += time.perf_counter() - t0
        top = torch.topk(masked, 2, dim=-1).values
        for i in ((top[:, 0] - top[:, 1]) < TIE_MARGIN).nonzero().flatten().tolist():
            if self.done[i] or not torch.isfinite(top[i, 1]):
                continue
            t = self.dec.canonical_next(self.jobs[i].prompt_ids + self.out[i], allowed[i])
            masked[i] = float("-inf")
            masked[i, t] = 0.0
        return masked


class ConstrainedDecoder:
    """Greedy decoding of JSON values under JSON schemas, batched (``model.generate`` with a
    left-padded batch and llguidance masking every row's logits).

    The JSON is compact with ``", "`` / ``": "`` separators and no free whitespace (the paper's
    Qwen guided cell "looped on JSON whitespace"; here whitespace is not a choice), and objects admit
    only their named properties (:func:`strict_schema`, as vLLM's default xgrammar backend)."""

    def __init__(self, model, tokenizer, device: str = "cpu", max_batch: int = 16):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.vocab = int(getattr(model.config, "vocab_size", 0) or len(tokenizer))
        self.lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab)
        self.max_batch = int(max_batch)
        eos = model.generation_config.eos_token_id
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos = int(eos[0] if isinstance(eos, (list, tuple)) else eos)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.stats = {"calls": 0, "batches": 0, "tokens": 0, "mask_seconds": 0.0, "seconds": 0.0,
                      "prefill_tokens": 0, "tie_recomputes": 0}

    def grammar(self, schema: dict[str, Any]) -> str:
        opts = {k: v for k, v in JSON_OPTIONS.items() if k != "strict"}
        return llguidance.LLMatcher.grammar_from_json_schema(strict_schema(schema) if JSON_OPTIONS["strict"] else schema,
                                                             defaults=opts)

    def canonical_next(self, ids: list[int], allowed) -> int:
        self.stats["tie_recomputes"] += 1
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=x, use_cache=False, logits_to_keep=1).logits[0, -1].to(torch.float32)
        V = logits.shape[-1]
        logits[torch.from_numpy(allowed[:V] == 0).to(logits.device)] = float("-inf")
        return int(torch.argmax(logits))

    def decode_many(self, jobs: Sequence[ConstrainedJob]) -> list[tuple[list[int], str]]:
        """Per job: (token ids of the JSON value, finish ``complete`` | ``length`` | ``error``)."""
        out: list[tuple[list[int], str]] = []
        for k in range(0, len(jobs), self.max_batch):
            out += self._batch(list(jobs[k:k + self.max_batch]))
        return out

    def _batch(self, jobs: list[ConstrainedJob]) -> list[tuple[list[int], str]]:
        t0 = time.perf_counter()
        matchers = []
        for j in jobs:
            m = llguidance.LLMatcher(self.lltok, self.grammar(j.schema), log_level=0)
            if m.is_error():
                raise AgentRuntimeError(f"llguidance rejected the schema grammar: {m.get_error()}")
            matchers.append(m)
        P = max(len(j.prompt_ids) for j in jobs)
        ids = torch.full((len(jobs), P), self.pad, dtype=torch.long)
        attn = torch.zeros((len(jobs), P), dtype=torch.long)
        for r, j in enumerate(jobs):
            ids[r, P - len(j.prompt_ids):] = torch.tensor(j.prompt_ids)
            attn[r, P - len(j.prompt_ids):] = 1
        proc = _GrammarMask(self, matchers, jobs, P, self.eos)

        def all_done(input_ids, scores, **kw):
            return torch.tensor([proc.done[i] for i in range(len(jobs))], dtype=torch.bool, device=input_ids.device)

        with torch.inference_mode():
            self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device),
                                max_new_tokens=max(j.max_tokens for j in jobs) + 1, do_sample=False,
                                temperature=None, top_p=None, top_k=None, pad_token_id=self.pad,
                                eos_token_id=self.eos, logits_processor=LogitsProcessorList([proc]),
                                stopping_criteria=StoppingCriteriaList([all_done]))
        st = self.stats
        st["calls"] += len(jobs)
        st["batches"] += 1
        st["prefill_tokens"] += int(attn.sum())
        st["seconds"] += time.perf_counter() - t0
        return [(proc.out[i], proc.finish[i]) for i in range(len(jobs))]

    def cost(self) -> dict[str, Any]:
        """Measured cost: the grammar mask's milliseconds per constrained token, and its share of
        the constrained decoding's wall time (prefill included)."""
        st = dict(self.stats)
        n = max(1, st["tokens"])
        st["mask_ms_per_token"] = round(1000 * st["mask_seconds"] / n, 3)
        st["ms_per_token_all_in"] = round(1000 * st["seconds"] / n, 3)
        st["mask_share"] = round(st["mask_seconds"] / st["seconds"], 4) if st["seconds"] else None
        return st


# ==================================================================================================
# in-process transformers

class TransformersRuntime(Runtime):
    """In-process runtime on memtoc's transformers backend (see the module docstring).

    ``cache_dir``: folder of the generation caches (``generations.jsonl`` for free turns,
    ``constrained.jsonl`` for schema-constrained calls); None: no cache. ``tool_format``: a name of
    :data:`~memtoc.agent.parsers.FORMATS` (default: from the model family / its template)."""

    kind = "transformers"
    named_tool_choice = True
    constrained = True
    enforces_none = True

    def __init__(self, model: str, max_tokens_per_call: int = 64, cache_dir: str | os.PathLike | None = None,
                 model_cache_dir: Optional[str] = None, batch_size: Any = "auto", dtype: str = "auto",
                 tool_format: Optional[str] = None, **backend_options: Any):
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
        sig = load_signature("transformers", self.spec.name, weights, None, path=str(self.path),
                             batch_size=batch_size, dtype=dtype, max_new_tokens=self.max_tokens_per_call,
                             options={k: v for k, v in opts.items() if k != "show_progress"},
                             prompt_format="memtoc.agent: rendered text")
        kwargs = dict(adapter=None, dtype=dtype, max_new_tokens=self.max_tokens_per_call,
                      cache_dir=model_cache_dir, batch_size=batch_size, **opts)
        self.gen = LazyGenerator.of(TransformersGenerator, (raw_spec, self.path), kwargs, sig,
                                    models.model_cache_root(model_cache_dir) / "_identities")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
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
            replies = self.gen.generate([texts[i] for i in free], cache_path=self._cache("generations.jsonl"),
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
        lib = self.library or constrained_library()
        self.library = lib
        path = self._cache("constrained.jsonl")
        known = _cache.read_cache(path) if path is not None else {}
        prepared, todo = [], []
        for prompt, prefix, req, fr in items:
            name = self._name(req)
            tool = next((t for t in req.tools or [] if name_of(t) == name), None)
            if tool is None:
                raise AgentRuntimeError(f"tool_choice names {name!r}, which is not among the request's tools")
            schema = parameters_of(tool)
            head = prefix + self.format.begin(name)
            ident = {"generator": self.gen.identity, "constrained": lib, "json_options": JSON_OPTIONS, "schema": schema,
                     "max_tokens": int(req.max_tokens), "tie_margin": TIE_MARGIN}
            key = _cache.request_key(ident, prompt + head)
            prepared.append([prompt, head, req, fr, schema, key, known.get(key)])
            if known.get(key) is None:
                todo.append(len(prepared) - 1)
        if todo:
            t0 = time.perf_counter()
            dec = self.decoder()
            tok = dec.tokenizer
            jobs, meta = [], []
            for k in todo:
                prompt, head, req, fr, schema, key, _ = prepared[k]
                ids = tok(prompt + head, add_special_tokens=True)["input_ids"]
                n_prompt = len(tok(prompt, add_special_tokens=True)["input_ids"])
                # generated tokens only (as vLLM counts a named call's arguments): the model's own text
                # before the call, then the arguments; the inserted call text is not decoded
                n_free = self.n_tokens(head[: len(head) - len(self.format.begin(self._name(req)))])
                jobs.append(ConstrainedJob(ids, schema, max(1, req.max_tokens - n_free)))
                meta.append((n_free, n_prompt))
            results = dec.decode_many(jobs)
            dt = (time.perf_counter() - t0) / len(todo)
            recs = []
            for k, (n_head, n_prompt), (arg_ids, how) in zip(todo, meta, results):
                prompt, head, req, _, schema, key, _ = prepared[k]
                args = tok.decode(arg_ids, skip_special_tokens=True)
                body = head + args + (self.format.end() if how == "complete" else "")
                rec = {"key": key, "text": body, "n_prompt_tokens": n_prompt, "n_new_tokens": n_head + len(arg_ids),
                       "constrained_tokens": len(arg_ids), "finish": how, "seconds": round(dt, 6),
                       "prompt_sha256": _cache.sha256_text(prompt)}
                prepared[k][6] = dict(rec, fresh=True)
                recs.append(rec)
            if path is not None:
                _cache.append_records(path, recs)
        out = []
        for prompt, head, req, fr, schema, key, rec in prepared:
            text = rec["text"]
            p = self.format.parse(text)
            if rec["finish"] != "complete" and p.error is None and not p.calls:
                p = Parsed(p.content, [], "the constrained call did not complete within the token budget", True)
            out.append(ChatResponse(text, p.content, p.calls, p.error, True, int(rec["n_prompt_tokens"]),
                                    int(rec["n_new_tokens"]), "length" if rec["finish"] == "length" else "stop",
                                    not rec.get("fresh", False), float(rec.get("seconds", 0.0)) + (fr.seconds if fr else 0.0),
                                    _cache.sha256_text(prompt), int(rec.get("constrained_tokens", 0))))
        return out

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
                 max_tokens_per_call=self.max_tokens_per_call, constrained_decoding=self.library,
                 constrained_cost=self.constrained_stats)
        return d

    def close(self) -> None:
        self.gen.close()


# ==================================================================================================
# OpenAI-compatible servers

def detect_server(base_url: str, session=None, timeout: float = 10.0) -> str:
    """``vllm`` | ``transformers`` | ``other``, from the server's OpenAPI paths (FastAPI serves
    ``/openapi.json``): ``transformers serve`` has ``/load_model`` and ``/v1/systemone``, vLLM
    ``/tokenize`` and ``/version``."""
    s = session or requests
    root = re.sub(r"/v1/?$", "", base_url.rstrip("/"))
    try:
        r = s.get(root + "/openapi.json", timeout=timeout)
        paths = set((r.json() or {}).get("paths", {})) if r.status_code == 200 else set()
    except (requests.RequestException, ValueError):
        paths = set()
    if {"/load_model", "/v1/systemone"} & paths:
        return "transformers"
    if {"/tokenize", "/version"} <= paths or "/v1/tokenize" in paths:
        return "vllm"
    return "other"


class OpenAIRuntime(Runtime):
    """A runtime on an OpenAI-compatible server (see the module docstring).

    Options: ``base_url`` (default ``$OPENAI_BASE_URL`` or ``http://127.0.0.1:8000/v1``), ``api_key``,
    ``served_model`` (the name the server knows; default the registry hub id, else the name given),
    ``server`` (auto | vllm | transformers | other), ``honors_tool_choice`` (None: vLLM only),
    ``tool_format``, ``chat`` (None: the registry's), ``timeout``, ``max_retries``, ``backoff``,
    ``concurrency``, ``weights_hash`` (into the cache identity)."""

    kind = "openai"

    def __init__(self, model: str, max_tokens_per_call: int = 64, cache_dir: str | os.PathLike | None = None,
                 base_url: Optional[str] = None, api_key: Optional[str] = None, served_model: Optional[str] = None,
                 server: str = "auto", honors_tool_choice: Optional[bool] = None, tool_format: Optional[str] = None,
                 chat: Optional[bool] = None, timeout: float = 120.0, max_retries: int = 4, backoff: float = 1.0,
                 concurrency: int = 4, weights_hash: Optional[str] = None, seed: Optional[int] = None):
        if server not in SERVERS:
            raise AgentRuntimeError(f"agent runtime option server must be one of {', '.join(SERVERS)}, got {server!r}")
        try:
            self.spec = models.get_model(model)
        except models.ModelError:
            self.spec = models.ModelSpec(model, re.sub(r"[^A-Za-z0-9_.-]+", "_", model), "remote", chat=True,
                                         system_turn="template")
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or "http://127.0.0.1:8000/v1").rstrip("/")
        self.served_model = served_model or self.spec.hub_id or self.spec.name
        self.session = requests.Session()
        self.session.headers.update({"Authorization": f"Bearer {api_key or os.environ.get('OPENAI_API_KEY') or 'EMPTY'}",
                                     "Content-Type": "application/json"})
        self.timeout, self.max_retries, self.backoff = float(timeout), int(max_retries), float(backoff)
        self.concurrency = max(1, int(concurrency))
        self.max_tokens_per_call = int(max_tokens_per_call)
        self.seed = seed
        self.chat_model = self.spec.chat if chat is None else bool(chat)
        self.format = get_format(tool_format) if tool_format else format_for(
            [self.spec.name, self.spec.hub_id or "", self.spec.label, self.served_model], self.chat_model)
        self.server = detect_server(self.base_url, self.session) if server == "auto" else server
        honours = (self.server == "vllm") if honors_tool_choice is None else bool(honors_tool_choice)
        self.honors_tool_choice = honours
        self.named_tool_choice = honours and self.format.native and self.chat_model
        self.enforces_none = honours and self.format.native and self.chat_model
        self.constrained = False
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.identity = {"model": self.spec.name, "served_model": self.served_model, "weights_sha256": weights_hash,
                         "backend": "openai", "server": self.server, "tool_format": self.format.name,
                         "chat": self.chat_model, "honors_tool_choice": honours, "seed": seed, "greedy": True}

    def why_not(self, need: str) -> str:
        if need == CONSTRAINED:
            return ("a server cannot constrain only the arguments of a call the model chose to make; the repair arm "
                    "runs in-process (agent.runtime: transformers)")
        text = (f"memtoc renders the tools of {self.spec.name} as text ({self.format.name} format), so no server "
                "can force its call")
        if not self.honors_tool_choice:
            return (f"the server at {self.base_url} is {self.server!r}, which does not honour tool_choice"
                    + (" (transformers serve ignores it and only logs 'Ignoring unsupported fields')"
                       if self.server == "transformers" else "; pass honors_tool_choice: true if it does")
                    + ("" if self.format.native and self.chat_model else "; moreover " + text))
        return text

    # -- request bodies ----------------------------------------------------------------------------
    def request_body(self, req: ChatRequest) -> tuple[str, dict[str, Any]]:
        if not self.chat_model:
            body: dict[str, Any] = {"model": self.served_model, "prompt": raw_transcript(req.messages, req.tools, self.format),
                                    "temperature": 0, "max_tokens": int(req.max_tokens), "n": 1, "stream": False,
                                    "stop": list(RAW_STOP)}
            path = "/completions"
        elif self.format.native:
            msgs = [{k: v for k, v in m.items() if k != "raw"} for m in req.messages]
            body = {"model": self.served_model, "messages": msgs, "temperature": 0,
                    "max_tokens": int(req.max_tokens), "n": 1, "stream": False}
            if req.tools:
                body["tools"] = req.tools
                if self.honors_tool_choice:
                    body["tool_choice"] = req.tool_choice
            path = "/chat/completions"
        else:
            body = {"model": self.served_model, "messages": text_messages(req.messages, req.tools, self.format),
                    "temperature": 0, "max_tokens": int(req.max_tokens), "n": 1, "stream": False}
            path = "/chat/completions"
        if self.seed is not None:
            body["seed"] = self.seed
        return path, body

    def _post(self, path: str, body: dict) -> dict:
        return post_json(self.session, self.base_url + path, body, self.timeout, self.max_retries, self.backoff,
                         f"served_model={self.served_model!r}")

    def _one(self, req: ChatRequest) -> ChatResponse:
        path, body = self.request_body(req)
        key = _cache.request_key(self.identity, _cache.canonical_json(body))
        cpath = None if self.cache_dir is None else self.cache_dir / "generations_openai.jsonl"
        rec = _cache.read_cache(cpath).get(key) if cpath is not None else None
        cached = rec is not None
        if rec is None:
            t0 = time.perf_counter()
            data = self._post(path, body)
            rec = {"key": key, "text": "", "response": data, "seconds": round(time.perf_counter() - t0, 6)}
            choice = (data.get("choices") or [{}])[0]
            rec["text"] = (choice.get("text") if not self.chat_model else (choice.get("message") or {}).get("content")) or ""
            if cpath is not None:
                _cache.append_records(cpath, [rec])
        return self.response_from(rec["response"], req, cached, float(rec.get("seconds", 0.0)),
                                  _cache.sha256_text(_cache.canonical_json(body)))

    def response_from(self, data: dict, req: ChatRequest, cached: bool = False, seconds: float = 0.0,
                      body_sha256: Optional[str] = None) -> ChatResponse:
        """A :class:`ChatResponse` from a server's JSON answer."""
        try:
            choice = data["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise BackendError(f"{self.base_url}: unexpected response {str(data)[:300]}") from None
        usage = data.get("usage") or {}
        finish = choice.get("finish_reason") or ""
        if not self.chat_model:
            text, _ = cut_at_stop(choice.get("text") or "", RAW_STOP)
            p = parse_reply(self.format, text, req.tool_choice)
        else:
            msg = choice.get("message") or {}
            text = msg.get("content") or ""
            server_calls = msg.get("tool_calls") or []
            if server_calls and req.tool_choice != "none" or (server_calls and not self.enforces_none):
                calls = [ToolCall(tc.get("function", {}).get("name"), _args_dict(tc.get("function", {}).get("arguments")),
                                  json.dumps(tc.get("function", {}), ensure_ascii=False)) for tc in server_calls]
                p = Parsed(text.strip(), calls, None, True)
            else:
                p = parse_reply(self.format, text, req.tool_choice if self.enforces_none else "auto")
        ignored = req.tool_choice == "none" and not p.calls and self.format.parse(text).opened
        return ChatResponse(text, p.content, p.calls, p.error, p.opened, int(usage.get("prompt_tokens") or 0),
                            int(usage.get("completion_tokens") or 0), finish, cached, seconds, body_sha256,
                            call_text_ignored=ignored)

    def chat_many(self, requests: Sequence[ChatRequest]) -> list[ChatResponse]:
        requests = list(requests)
        if self.concurrency == 1 or len(requests) == 1:
            return [self._one(r) for r in requests]
        with ThreadPoolExecutor(self.concurrency) as ex:
            return list(ex.map(self._one, requests))

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(model=self.spec.name, served_model=self.served_model, base_url=self.base_url, server=self.server,
                 honors_tool_choice=self.honors_tool_choice, tool_format=self.format.name, chat=self.chat_model,
                 max_tokens_per_call=self.max_tokens_per_call)
        return d

    def close(self) -> None:
        self.session.close()


RUNTIMES = {"transformers": TransformersRuntime, "openai": OpenAIRuntime}


def make_runtime(kind: str, model: str, max_tokens_per_call: int, cache_dir=None, **options: Any) -> Runtime:
    """A runtime by kind (``transformers`` | ``openai``); options are the runtime's keyword arguments."""
    if kind not in RUNTIMES:
        raise AgentRuntimeError(f"unknown agent runtime {kind!r}; valid: {', '.join(RUNTIMES)}")
    cls = RUNTIMES[kind]
    valid = [n for n in inspect.signature(cls).parameters if n not in ("model", "max_tokens_per_call", "cache_dir")]
    bad = [k for k in options if k not in valid and cls is OpenAIRuntime]
    if bad:
        raise AgentRuntimeError(f"unknown {kind} agent runtime option(s) {bad}; valid: {', '.join(valid)}")
    return cls(model, max_tokens_per_call=max_tokens_per_call, cache_dir=cache_dir, **options)
