"""The ``transfer`` block (notebook 06)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from memtoc.config.blocks.base import Block, Fail, as_list, is_int
from memtoc.core.errors import ordered_subset
from memtoc.core.vocab import BUILTIN, FORMULATIONS, FORWARD_POOLS, OBJECTIVES, POOLS, UNMATCHED_GAP

CLOSED_BOOK_BAND = 0.03     # the paper's pre-registered band on the closed-book accuracy change


@dataclass(frozen=True)
class TransferConfig(Block):
    """Every key of the ``transfer`` block with its default (params/*.yaml override)."""
    BLOCK = "transfer"

    enabled: bool = True
    dataset: str = BUILTIN                     # "builtin" (the plumbing set), "hub" (FaithEval x ARC-Challenge,
                                               # imported once; the paper's set) or a validated JSONL
    n_counterfactual: Optional[int] = None     # first n counterfactual items (None: all)
    n_unanswerable: Optional[int] = None       # first n unanswerable items (None: all)
    verified_only: bool = False                # keep only rows with verified: true (the paper's human-verified pools)
    formulations: Optional[tuple[str, ...]] = None   # None: the run's formulations
    models: Optional[tuple[str, ...]] = None   # None: notebook 04's models (finetune.models: the run's instruction-
                                               # tuned models, as the paper's Table 6); else a list of the run's models
    frames: tuple[str, ...] = POOLS
    forward_objectives: tuple[str, ...] = OBJECTIVES
    forward_folds: tuple[int, ...] = (0,)      # which of notebook 04's fold adapters to read (any: none saw this set)
    forward_pool: str = "fold"                 # fold: 04's adapters of forward_folds; full: 06 trains one adapter per
                                               # forward objective on the whole 575 pool (Table 6's), arm = objective
    adapters_from: Optional[str] = None        # None: this run's adapters/; else another run directory
    extra_adapters: dict = field(default_factory=dict)   # {arm name: peft adapter dir}, e.g. adapters trained on
                                               # the full 575 pool
    reverse: bool = True                       # train and evaluate the reverse-transfer adapter
    reverse_max_steps: int = 2                 # optimizer steps of the reverse DPO (-1: one epoch)
    reverse_batch_size: int = 2
    reverse_train_formulations: tuple[str, ...] = ("reference",)
    reverse_eval_questions: int = 8            # MemToC analysis questions the reverse adapter is scored on
    closed_book_band: float = CLOSED_BOOK_BAND
    n_boot: Optional[int] = None               # None: the run's n_boot (Table 6: a paired bootstrap, B = 2,000)
    unmatched_gap: float = UNMATCHED_GAP

    @classmethod
    def check(cls, t: dict[str, Any], run: Mapping[str, Any], fail: Fail, *,
              finetune_models: Sequence[str] = (), **context: Any) -> None:
        """``finetune_models``: notebook 04's models, the default of ``models``."""
        if not isinstance(t["dataset"], str) or not t["dataset"]:
            fail("dataset", "must be 'builtin', 'hub' or the path of a JSONL file (check it with "
                        "`memtoc transfer validate`)")
        for key in ("n_counterfactual", "n_unanswerable"):
            v = t[key]
            if v is not None and (not is_int(v) or v < 0):
                fail(key, f"must be null (all) or a non-negative integer, got {v!r}")
        nb = t["n_boot"]
        if nb is None:
            t["n_boot"] = int(run["n_boot"])
        elif not is_int(nb) or nb < 1:
            fail("n_boot", f"must be null (the run's n_boot) or a positive integer, got {nb!r}")
        _selection(t, run, finetune_models, fail)
        _forward(t, fail)
        _reverse(t, fail)


def _selection(t: dict, run: Mapping[str, Any], finetune_models: Sequence[str], fail: Fail) -> None:
    forms = ordered_subset(t["formulations"] if t["formulations"] is not None else list(run["formulations"]),
                           FORMULATIONS)
    if forms is None:
        fail("formulations", f"must be null (the run's) or a non-empty list drawn from {list(FORMULATIONS)}")
    t["formulations"] = forms
    run_models = list(run["models"])
    if t["models"] is None:
        t["models"] = [m for m in finetune_models if m in run_models]
    t["models"] = as_list(t["models"])
    if not isinstance(t["models"], list) or any(m not in run_models for m in t["models"]):
        fail("models", f"must be null (notebook 04's models) or a list drawn from the run's models {run_models}")
    if not isinstance(t["frames"], list) or not t["frames"] or any(f not in POOLS for f in t["frames"]):
        fail("frames", f"must be a non-empty list drawn from {list(POOLS)}")
    t["frames"] = [f for f in POOLS if f in t["frames"]]


def _forward(t: dict, fail: Fail) -> None:
    objs = t["forward_objectives"]
    if not isinstance(objs, list) or any(o not in OBJECTIVES for o in objs):
        fail("forward_objectives", f"must be a list drawn from {list(OBJECTIVES)} (empty: no forward arms)")
    folds = t["forward_folds"]
    if not isinstance(folds, list) or any(k not in (0, 1) or isinstance(k, bool) for k in folds):
        fail("forward_folds", "must be a list drawn from [0, 1]")
    if t["forward_pool"] not in FORWARD_POOLS:
        fail("forward_pool", f"unknown value {t['forward_pool']!r}; valid: {', '.join(FORWARD_POOLS)}")
    if t["adapters_from"] is not None and not isinstance(t["adapters_from"], str):
        fail("adapters_from", "must be null (this run) or a run directory")
    ea = t["extra_adapters"]
    if ea is None:
        t["extra_adapters"] = ea = {}
    if t["forward_pool"] == "full" and isinstance(ea, dict) and set(ea) & set(objs):
        fail("extra_adapters", f"names {sorted(set(ea) & set(objs))} are the full-pool arms of forward_pool full; "
                               "rename the extra adapters")
    if not isinstance(ea, dict) or not all(isinstance(k, str) and k and k != "untreated" and "/" not in k
                                           and isinstance(v, str) and v for k, v in ea.items()):
        fail("extra_adapters", "must be a mapping {arm name: adapter directory} (names other than 'untreated', "
                               "without '/')")


def _reverse(t: dict, fail: Fail) -> None:
    ms = t["reverse_max_steps"]
    if not is_int(ms) or ms == 0 or ms < -1:
        fail("reverse_max_steps", f"must be -1 (one epoch) or a positive integer, got {ms!r}")
    for key in ("reverse_batch_size", "reverse_eval_questions"):
        v = t[key]
        if not is_int(v) or v < 1:
            fail(key, f"must be a positive integer, got {v!r}")
    rf = ordered_subset(t["reverse_train_formulations"], FORMULATIONS)
    if rf is None:
        fail("reverse_train_formulations", f"must be a non-empty list drawn from {list(FORMULATIONS)}")
    t["reverse_train_formulations"] = rf
    for key in ("closed_book_band", "unmatched_gap"):
        v = t[key]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (0 <= v < 1):
            fail(key, f"must be a number in [0, 1), got {v!r}")
