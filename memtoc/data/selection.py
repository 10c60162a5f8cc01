"""The deterministic, stratified and nested question selection every stage draws its questions with,
and the run's selection (:func:`run_selection`): the questions and formulations of a run, computed
once from its configuration and read by every stage (notebook 02, the episodes, fine-tuning,
transfer, the agent loop)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from memtoc.config.params import PAPER_SEED
from memtoc.config.runconfig import RunConfig, expect_config
from memtoc.core.records import Question
from memtoc.generation.models import formulations_for


def select_questions(questions: Iterable[Question], n: int, seed: int = PAPER_SEED) -> list[Question]:
    """``n`` questions, deterministic for ``seed``, stratified by ``gold_kind`` and nested.

    Each answer type's questions (sorted by id) are shuffled with ``random.Random(f"{seed}|{kind}")``;
    the types are then interleaved so that every prefix keeps the pool's proportions as closely as
    possible (at each step the type furthest below its quota is drawn; ties by type name). The
    selection is the first ``n`` of that order, so a smaller selection is a prefix of a larger one.
    ``n`` at or above the pool size returns the whole pool (in selection order).
    """
    pool = sorted(questions, key=lambda q: (q.instance_id, q.hop_idx, q.id))
    by_kind: dict[str, list[Question]] = {}
    for q in pool:
        by_kind.setdefault(q.gold_kind, []).append(q)
    for kind, lst in by_kind.items():
        random.Random(f"{seed}|{kind}").shuffle(lst)
    total = len(pool)
    taken = {k: 0 for k in by_kind}
    order: list[Question] = []
    for step in range(1, min(n, total) + 1):
        kind = max((k for k in sorted(by_kind) if taken[k] < len(by_kind[k])),
                   key=lambda k: (step * len(by_kind[k]) / total - taken[k], -sorted(by_kind).index(k)))
        order.append(by_kind[kind][taken[kind]])
        taken[kind] += 1
    return order


@dataclass(frozen=True)
class Selection:
    """The questions and formulations of a run.

    ``order`` is the whole analysis set in the run's selection order (:func:`select_questions` with
    the run's seed); since the selection is nested, every stage's questions are a prefix of it:
    ``headline`` (the first ``n_questions``: notebooks 02-04, transfer's reverse evaluation),
    ``extra`` (the first ``n_questions_extra``: the extra arms) and ``first(n)`` (a stage's own size,
    e.g. ``agent.n_questions``)."""
    order: tuple[Question, ...]
    n_questions: int
    n_questions_extra: int
    formulations: tuple[str, ...]
    base_formulations: Optional[tuple[str, ...]]

    @property
    def headline(self) -> list[Question]:
        return self.first(self.n_questions)

    @property
    def extra(self) -> list[Question]:
        return self.first(self.n_questions_extra)

    def first(self, n: int) -> list[Question]:
        """The first ``n`` questions of the run's selection (``select_questions(analysis, n, seed)``)."""
        return list(self.order[:max(0, int(n))])

    def formulations_for(self, model: str, formulations: Optional[Sequence[str]] = None) -> list[str]:
        """The formulations ``model`` runs on: the run's (or ``formulations``, in their order), for a
        base model only those in the run's ``base_formulations`` (``models.formulations_for``)."""
        forms = list(self.formulations if formulations is None else formulations)
        base = None if self.base_formulations is None else list(self.base_formulations)
        return formulations_for(model, forms, base)


def run_selection(cfg: RunConfig, bench) -> Selection:
    """The run's selection from its configuration (a dict is refused)
    and the loaded benchmark (``benchmark.load_benchmark(cfg.release_dir)``): the benchmark's analysis
    set ordered by :func:`select_questions` with ``cfg.seed``, the run's sizes and formulations."""
    cfg = expect_config(cfg, "selection.run_selection")
    analysis = list(bench.analysis)
    return Selection(order=tuple(select_questions(analysis, len(analysis), cfg.seed)),
                     n_questions=cfg.n_questions, n_questions_extra=cfg.n_questions_extra,
                     formulations=tuple(cfg.formulations), base_formulations=cfg.base_formulations)
