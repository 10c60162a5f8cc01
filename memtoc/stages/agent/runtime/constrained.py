"""Schema-constrained decoding of a call's arguments with llguidance (batched, greedy, batch-invariant)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Sequence

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance.torch import fill_next_token_bitmask
from transformers import LogitsProcessorList, StoppingCriteriaList

from memtoc.stages.agent.runtime.base import AgentRuntimeError


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
    left-padded batch and llguidance masking every row's logits; one job at a time for a CPU model
    that is not float32, whose batches the tie-break cannot make batch-invariant).

    The JSON is compact with ``", "`` / ``": "`` separators and no free whitespace (the paper's
    Qwen guided cell "looped on JSON whitespace"; here whitespace is not a choice), and objects admit
    only their named properties (:func:`strict_schema`, as vLLM's default xgrammar backend)."""

    def __init__(self, model, tokenizer, device: str = "cpu", max_batch: int = 16):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.vocab = int(getattr(model.config, "vocab_size", 0) or len(tokenizer))
        self.lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab)
        self.max_batch = int(max_batch)
        if not str(device).startswith("cuda") and next(model.parameters()).dtype != torch.float32:
            # the tie-break guards float32's batch noise only: a CPU bf16 model's left-padded batches
            # move logits by up to 1.0 (memtoc.generation.backends.hf), so each job is decoded alone there
            self.max_batch = 1
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

