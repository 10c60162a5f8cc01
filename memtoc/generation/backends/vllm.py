"""vllm backend: the offline ``vllm.LLM`` engine with automatic prefix caching (GPU users).

Install the optional extra (``pip install 'memtoc[gpu]'``); vllm is imported only when this backend
is chosen. Prompts are formatted exactly as in the transformers backend (memtoc's rule: the
model's chat template with one user turn, the embedded model without any system turn; base models
the raw text), tokenized with the model's own tokenizer and handed to ``LLM.generate`` as token ids,
so the three backends see identical prompt tokens. Prefix caching (``enable_prefix_caching=True``)
lets the conditions of one question share the KV cache of their common instruction+schema prefix;
requests are submitted sorted by prompt so that shared prefixes sit next to each other.

Options (``load_generator(..., backend="vllm", **options)``): ``stop_at_final`` (default True; the
reply is cut after its first completed FINAL line, as in the other backends), ``chunk`` (requests
per ``LLM.generate`` call, default 4096: each chunk is written to the cache when it finishes), and
any ``vllm.LLM`` keyword (``gpu_memory_utilization``, ``max_model_len``, ``tensor_parallel_size``...).
A LoRA ``adapter`` is served through ``LoRARequest`` (``enable_lora=True``); an engine started with
``enable_lora=True`` serves further adapters without a second engine (:meth:`VLLMGenerator.with_adapter`).

Decoding follows :mod:`memtoc.generation.decoding`: greedy with the model's generation-config penalties, as the
transformers backend. ``batch_invariant`` (``auto`` | true | false; ``auto`` = on where the GPU
meets vLLM's documented requirement) sets ``VLLM_BATCH_INVARIANT`` before vLLM is imported, so that
replies do not depend on the batch; it is part of the cache identity.
"""
from __future__ import annotations

import copy
import gc
import json
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from tqdm.auto import tqdm

from memtoc.generation.backends.base import Generator, Reply, line_stop, truncate_reply
from memtoc.generation.backends.openai import BackendError
from memtoc.generation.decoding import (DecodingPolicy, batch_invariant_on, checkpoint_quantization, read_policy,
                                        set_batch_invariant_env)
from memtoc.generation.hardware import auto_dtype_name, gpu_capability
from memtoc.generation.templates import render_prompt
from memtoc.generation.weights import adapter_hash, weights_hash


def vllm_dtype(dtype: str, cuda: bool = True) -> str:
    """The engine's ``dtype``. On a CPU, ``auto`` follows memtoc's CPU rule (bfloat16 where the CPU has
    bf16 instructions, float32 elsewhere), as the transformers backend: vLLM's own ``auto`` downcasts
    to bfloat16 on any CPU, which is emulated and ~5x slower without the instructions (and its replies
    differ from float32's)."""
    if dtype == "auto" and not cuda:
        return auto_dtype_name(False)
    return {"auto": "auto", "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}[dtype]


#: the stop string at which each request pauses while a line rule is on (:meth:`VLLMGenerator._complete`)
LINE_END = "\n"

#: the share of host memory a CPU engine reserves for its KV cache (vLLM's ``gpu_memory_utilization``)
CPU_MEMORY_FRACTION = 0.25

#: the ``max_lora_rank`` values vLLM's LoRA config accepts
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank(adapter: str | Path) -> int:
    """The ``max_lora_rank`` an adapter needs: its largest rank (``r`` and any ``rank_pattern``), rounded
    up to a value vLLM accepts. vLLM pads every adapter to ``max_lora_rank``: a rank-8 adapter served
    at 64 took 6x as long (238 s against 38 s for 16 prompts on a CPU)."""
    path = Path(adapter) / "adapter_config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        r = max([int(cfg["r"])] + [int(v) for v in (cfg.get("rank_pattern") or {}).values()])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BackendError(f"{path}: cannot read the adapter's LoRA rank 'r' ({e}); a peft LoRA adapter folder "
                           "holds adapter_config.json") from None
    return served_rank(r, str(path))


def served_rank(r: int, what: str = "the adapter") -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that serves a LoRA of rank ``r``."""
    fit = [k for k in VLLM_LORA_RANKS if k >= int(r)]
    if not fit:
        raise BackendError(f"{what}: LoRA rank {r} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")
    return fit[0]


def new_token_count(token_ids, finish_reason: Optional[str], stop_reason: Any, eos_ids: set[int]) -> int:
    """New tokens as the transformers backend counts them: without the end-of-sequence token that
    vLLM keeps in ``token_ids`` when it stopped on it (``finish_reason == "stop"`` with no stop
    string, ``stop_reason`` None or an EOS id)."""
    n = len(token_ids)
    if n and finish_reason == "stop" and (stop_reason is None or stop_reason in eos_ids) \
            and token_ids[-1] in eos_ids:
        return n - 1
    return n


def eos_token_ids(tokenizer, path: Path) -> set[int]:
    """The ids that end a reply: the tokenizer's EOS and the generation config's ``eos_token_id``."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        gc_eos = json.loads((Path(path) / "generation_config.json").read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError):
        gc_eos = None
    ids |= set(gc_eos if isinstance(gc_eos, list) else [gc_eos] if gc_eos is not None else [])
    return {int(i) for i in ids}


def build_requests(tokenizer, spec, prompts: list[str]) -> list[dict[str, Any]]:
    """vLLM prompt dicts (``{"prompt_token_ids": [...]}``) for user-turn prompts, memtoc's format."""
    out = []
    for p in prompts:
        text, special = render_prompt(tokenizer, spec, p)
        out.append({"prompt_token_ids": tokenizer(text, add_special_tokens=special)["input_ids"]})
    return out


def sampling_kwargs(max_new_tokens: int, seed: Optional[int] = None,
                    policy: Optional[DecodingPolicy] = None) -> dict[str, Any]:
    """Greedy decoding settings for ``vllm.SamplingParams``, with the model's penalties (``policy``)."""
    return (policy or DecodingPolicy()).vllm_sampling(max_new_tokens, seed)


#: the attention backend named to vLLM when batch invariance is on and the options name none: vLLM 0.19.x
#: refuses to start in batch-invariant mode without one ("requires an attention backend in ['FLASH_ATTN',
#: 'TRITON_ATTN', ...], but got 'None'", vllm/model_executor/layers/batch_invariant.py); FLASH_ATTN is the
#: backend that file calls best supported (decode-invariant), and later releases accept it too
BATCH_INVARIANT_ATTENTION = "FLASH_ATTN"


def engine_kwargs(path: Path, dtype: str, adapter: Optional[str], options: dict[str, Any],
                  cuda: bool = True, batch_invariant: bool = False) -> dict[str, Any]:
    """``vllm.LLM``'s keyword arguments: prefix caching, seed 0, the dtype (:func:`vllm_dtype`), LoRA
    serving at the adapter's own rank (:func:`lora_rank`), and with ``batch_invariant`` an attention
    backend (:data:`BATCH_INVARIANT_ATTENTION`) unless the options choose one (``attention_backend`` or
    ``attention_config``); ``options`` override any of them."""
    kw = {"model": str(path), "dtype": vllm_dtype(dtype, cuda), "enable_prefix_caching": True, "seed": 0}
    if batch_invariant and "attention_backend" not in options and "attention_config" not in options:
        kw["attention_backend"] = BATCH_INVARIANT_ATTENTION
    if not cuda:
        # on a CPU the fraction is of host memory (vLLM's default 0.92 refuses to start wherever anything
        # else holds memory); memtoc's models and prompts need a few GiB of KV cache
        kw["gpu_memory_utilization"] = CPU_MEMORY_FRACTION
    if adapter is not None:
        kw.update(enable_lora=True, max_lora_rank=options.get("max_lora_rank") or lora_rank(adapter))
    kw.update(options)
    return kw


def submission_order(prompts: list[str]) -> list[int]:
    """Indices sorted by prompt text: requests sharing a prefix are submitted next to each other."""
    return sorted(range(len(prompts)), key=lambda i: (prompts[i], i))


class VLLMGenerator(Generator):
    backend = "vllm"

    def __init__(self, spec, path: Path, adapter=None, dtype: str = "auto", max_new_tokens: int = 48,
                 cache_dir=None, stop_at_final: bool = True, stop_at_first_line: bool = False, chunk: int = 4096, seed: Optional[int] = None,
                 show_progress: bool = True, batch_size: Any = None, batch_invariant: Any = "auto",
                 **llm_options):
        capability = gpu_capability()
        self.batch_invariant = batch_invariant_on(batch_invariant, capability, quantization=(
            llm_options.get("quantization") or checkpoint_quantization(Path(path))))
        set_batch_invariant_env(self.batch_invariant)   # before vllm is imported: some releases read it then
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise BackendError("backend 'vllm' needs the vllm package (a GPU install): pip install "
                               "'memtoc[gpu]'; on a CPU use backend 'transformers'") from None
        from transformers import AutoTokenizer


        self.spec = spec
        self.path = Path(path)
        self.max_new_tokens = int(max_new_tokens)
        self.stop_at_final = bool(stop_at_final)
        self.stop_at_first_line = bool(stop_at_first_line)
        self.chunk = int(chunk)
        self.seed = seed
        self.show_progress = show_progress
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.policy = read_policy(self.path)
        self.adapter = str(adapter) if adapter is not None else None
        self.eos_ids = eos_token_ids(self.tokenizer, self.path)
        kw = engine_kwargs(self.path, dtype, self.adapter, llm_options, cuda=capability is not None,
                           batch_invariant=self.batch_invariant)
        self.engine_kwargs = kw
        self.llm = vllm.LLM(**kw)
        self.owns_engine = True
        self.lora = None
        self._lora_ids = [1]     # LoRARequest ids handed out on this engine (shared with with_adapter's siblings)
        if self.adapter is not None:
            from vllm.lora.request import LoRARequest
            self.lora = LoRARequest("adapter", 1, self.adapter)
        super().__init__({
            "model": spec.name, "weights_sha256": weights_hash(self.path, cache_dir),
            "adapter_sha256": adapter_hash(adapter) if adapter is not None else None,
            "backend": self.backend,
            "prompt_format": {"chat": spec.chat, "system_turn": spec.system_turn},
            "decoding": {"greedy": True, "max_new_tokens": self.max_new_tokens,
                         "stop_at_final": self.stop_at_final,
                         "dtype": dtype if capability is not None else kw["dtype"],
                         **({"stop_at_first_line": True} if self.stop_at_first_line else {}),
                         **self.policy.identity()},
            **({"batch_invariant": True} if self.batch_invariant else {}),
        })

    def with_adapter(self, adapter) -> "VLLMGenerator":
        """A generator of ``adapter`` on this generator's engine: no second engine and no merge; its
        requests carry the adapter's ``LoRARequest``, so the base model and every adapter are served
        by one engine in one dtype. The engine must have been started with LoRA (backend options
        ``enable_lora: true`` and a ``max_lora_rank`` at least the adapter's, :func:`lora_rank`). The
        identity is the one a generator loaded with ``adapter=`` has. Closing the sibling leaves the
        engine to this generator."""
        if self.llm is None:
            raise BackendError("with_adapter: this vLLM generator is closed")
        need = lora_rank(adapter)
        have = self.engine_kwargs.get("max_lora_rank") or 0
        if not self.engine_kwargs.get("enable_lora") or have < need:
            raise BackendError(f"{adapter}: this vLLM engine was started without LoRA serving at rank {need} "
                               f"(enable_lora={bool(self.engine_kwargs.get('enable_lora'))}, max_lora_rank={have}); "
                               f"start it with backend options enable_lora: true, max_lora_rank: {need}")
        from vllm.lora.request import LoRARequest
        sib = copy.copy(self)
        self._lora_ids.append(self._lora_ids[-1] + 1)
        n = self._lora_ids[-1]
        sib.adapter, sib.owns_engine = str(adapter), False
        sib.lora = LoRARequest(f"adapter{n}", n, str(adapter))
        sib.identity = {**self.identity, "adapter_sha256": adapter_hash(adapter)}
        return sib

    def _complete(self, reqs: list[dict[str, Any]]) -> tuple[list[list[int]], list[tuple[Any, Any]]]:
        """Generate each request to its end: EOS, the token budget or memtoc's line rule. The line rules
        are applied inside vLLM, where the transformers backend applies them: every request stops at its
        next line end (a ``"\\n"`` stop string) and only the ones whose rule is not yet met go on,
        continuing from their own tokens (prefix caching keeps the prompt), so a reply ends on the same
        token as there and its token count is comparable. Returns the new token ids and the last
        ``(finish_reason, stop_reason)`` of each request."""
        from vllm import SamplingParams
        line_rules = self.stop_at_final or self.stop_at_first_line
        base = sampling_kwargs(self.max_new_tokens, self.seed, self.policy)
        if line_rules:
            base.update(stop=[LINE_END], include_stop_str_in_output=True)
        new_ids: list[list[int]] = [[] for _ in reqs]
        ends: list[tuple[Any, Any]] = [(None, None)] * len(reqs)
        todo = list(range(len(reqs)))
        while todo:
            batch = [{"prompt_token_ids": reqs[i]["prompt_token_ids"] + new_ids[i]} for i in todo]
            params = [SamplingParams(**{**base, "max_tokens": self.max_new_tokens - len(new_ids[i])}) for i in todo]
            outs = self.llm.generate(batch, params, use_tqdm=False, lora_request=self.lora)
            going = []
            for i, o in zip(todo, outs):
                c = o.outputs[0]
                new_ids[i].extend(c.token_ids)
                ends[i] = (c.finish_reason, getattr(c, "stop_reason", None))
                if line_rules and ends[i][1] == LINE_END and len(new_ids[i]) < self.max_new_tokens \
                        and line_stop(self._decode(new_ids[i]), self.stop_at_final, self.stop_at_first_line) is None:
                    going.append(i)
            todo = going
        return new_ids, ends

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _generate_batches(self, prompts: list[str], desc: Optional[str]) -> Iterator[tuple[list[int], list[Reply]]]:
        order = submission_order(prompts)
        bar = tqdm(total=len(prompts), desc=desc or f"generate {self.spec.label}", unit="req",
                   disable=not self.show_progress, leave=False)
        try:
            for k in range(0, len(order), self.chunk):
                idx = order[k:k + self.chunk]
                reqs = build_requests(self.tokenizer, self.spec, [prompts[i] for i in idx])
                t0 = time.perf_counter()
                new_ids, ends = self._complete(reqs)
                dt = time.perf_counter() - t0
                replies = []
                for req, ids, (reason, stop_reason) in zip(reqs, new_ids, ends):
                    # decoded as the transformers backend decodes (vLLM's text stops at the stop string)
                    text = self._decode(ids)
                    finish = "eos" if reason == "stop" and stop_reason != LINE_END else reason or ""
                    cut, rule = truncate_reply(text, self.stop_at_final, self.stop_at_first_line)
                    if rule:
                        text, finish = cut, rule
                    replies.append(Reply(text=text, n_prompt_tokens=len(req["prompt_token_ids"]),
                                         n_new_tokens=new_token_count(ids, reason, stop_reason, self.eos_ids),
                                         seconds=dt / len(idx), key="", cached=False, finish=finish))
                bar.update(len(idx))
                yield idx, replies
        finally:
            bar.close()

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        self.llm = None
        if llm is not None and getattr(self, "owns_engine", True):
            del llm
            try:
        
                import torch
                gc.collect()
                torch.cuda.empty_cache()
            except Exception:
                pass
