"""Stopping rules of the transformers backend's ``model.generate`` path: the per-sequence stop (EOS,
a completed FINAL line, the first line) and the canonical tie-break as a logits processor.

The compact decode loop (:mod:`memtoc.generation.backends.engine.compact`) applies the same rules inline; the
tie-break itself (``tie_margin``, the canonical batch-1 forward) is described in
:mod:`memtoc.generation.backends.hf`.
"""
from __future__ import annotations

from typing import Optional

from transformers import LogitsProcessor, StoppingCriteria

from memtoc.generation.backends.base import line_stop

FLOAT32_TIE_MARGIN = 2e-3   # ~50x the largest float32 logit change between batch compositions (4.4e-5)


class StopCriteria(StoppingCriteria):
    """Per-sequence stop: EOS, or a completed FINAL line. Records where each sequence ended."""

    def __init__(self, tokenizer, prompt_len: int, eos_ids: set[int], newline_ids: set[int],
                 check_final: bool, check_first_line: bool = False):
        self.tok = tokenizer
        self.prompt_len = prompt_len
        self.eos_ids = eos_ids
        self.newline_ids = newline_ids
        self.check_final = check_final
        self.check_first_line = check_first_line
        self.end: Optional[list[Optional[int]]] = None
        self.reason: Optional[list[str]] = None

    def __call__(self, input_ids, scores, **kwargs):
        import torch
        B, L = input_ids.shape
        if self.end is None:
            self.end = [None] * B
            self.reason = ["length"] * B
        last = input_ids[:, -1].tolist()
        for i in range(B):
            if self.end[i] is not None:
                continue
            t = last[i]
            if t in self.eos_ids:
                self.end[i] = L - 1
                self.reason[i] = "eos"
            elif (self.check_final or self.check_first_line) and t in self.newline_ids:
                text = self.tok.decode(input_ids[i, self.prompt_len:], skip_special_tokens=True)
                rule = line_stop(text, self.check_final, self.check_first_line)
                if rule:
                    self.end[i] = L
                    self.reason[i] = rule
        return torch.tensor([e is not None for e in self.end], dtype=torch.bool, device=input_ids.device)


class TieGuard(LogitsProcessor):
    """``generate``'s version of the compact loop's canonical tie-break: a row whose top-2 scores
    are closer than the generator's ``tie_margin`` gets the canonical token (all other scores -inf).
    ``prompts``: each row's prompt ids without padding; ``P``: the padded prompt width."""

    def __init__(self, gen, prompts: list[list[int]], P: int, stop: StopCriteria):
        self.gen, self.prompts, self.P, self.stop = gen, prompts, P, stop

    def __call__(self, input_ids, scores):
        for i in self.gen._near_ties(scores):
            if self.stop.end is not None and self.stop.end[i] is not None:
                continue  # a finished row: its later tokens are discarded
            t = self.gen._canonical_next(self.prompts[i] + input_ids[i, self.P:].tolist())
            scores[i] = float("-inf")
            scores[i, t] = 0.0
        return scores
