"""The chain-level cross-fitting plan (pure but for :func:`plan`, which loads the benchmark)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import pandas as pd

from memtoc.config.params import PAPER_SEED
from memtoc.config.runconfig import RunConfig, expect_config
from memtoc.core.records import Question
from memtoc.data.benchmark import load_benchmark, select_questions
from memtoc.data.selection import run_selection
from memtoc.stages.construction import related_links
from memtoc.stages.finetune.common import FinetuneError
from memtoc.stages.finetune.data import TrainExample, training_examples


@dataclass(frozen=True)
class FoldPlan:
    """Training questions of fold ``train_fold`` and the held-out questions its adapter is scored on."""

    train_fold: int
    train_questions: tuple[Question, ...]
    eval_questions: tuple[Question, ...]
    train_linked_excluded: tuple[str, ...] = ()    # ids dropped by exclude_linked

    @property
    def name(self) -> str:
        return f"fold{self.train_fold}"

    def describe(self, n_train_examples: Optional[int] = None) -> dict[str, Any]:
        return {"train_fold": self.train_fold,
                "train_questions": len(self.train_questions),
                "train_chains": len({q.instance_id for q in self.train_questions}),
                "train_excluded": sum(q.excluded for q in self.train_questions),
                "train_linked_excluded": len(self.train_linked_excluded),
                "train_examples": n_train_examples,
                "eval_questions": len(self.eval_questions),
                "eval_chains": len({q.instance_id for q in self.eval_questions})}


def crossfit_plan(pool: Sequence[Question], eval_pool: Sequence[Question], folds: Sequence[int] = (0, 1),
                  train_questions_per_fold: Optional[int] = None, eval_questions_per_fold: Optional[int] = None,
                  seed: int = PAPER_SEED, exclude_linked: bool = False) -> list[FoldPlan]:
    """One :class:`FoldPlan` per training fold.

    ``pool``: the 575-question construction pool (``Benchmark.questions``; ``fold`` set). Training
    questions of fold k: the pool's fold-k questions (excluded ones included), the first
    ``train_questions_per_fold`` of ``select_questions`` (stratified, nested) when set.
    ``eval_pool``: the analysis questions the run evaluates (in selection order); evaluation
    questions of the fold-k adapter: those of another fold, not excluded, the first
    ``eval_questions_per_fold`` when set.

    ``exclude_linked``: drop from fold k's training questions every question linked
    (``construct.related_links``, either direction) to a question of another fold of the pool, before
    the slice is taken, so no adapter is trained on a question about its held-out questions' answers
    (or the reverse). Off by default: the paper's folds as released.
    """
    missing = [q.id for q in list(pool) + list(eval_pool) if q.fold is None]
    if missing:
        raise FinetuneError(f"questions without a cross-fitting fold (e.g. {missing[:3]}); load them with "
                            "benchmark.load_benchmark, which assigns the chain-level folds")
    cross = [r for r in related_links(pool) if r["cross_fold"]] if exclude_linked else []
    plans = []
    for k in folds:
        train = [q for q in pool if q.fold == k]
        if not train:
            raise FinetuneError(f"fold {k} has no questions in the pool; nothing to train on")
        linked = {r["gold_id"] if r["gold_fold"] == k else r["subject_id"] for r in cross
                  if k in (r["gold_fold"], r["subject_fold"])}
        dropped = tuple(sorted(q.id for q in train if q.id in linked))
        train = [q for q in train if q.id not in linked]
        if train_questions_per_fold is not None:
            train = select_questions(train, train_questions_per_fold, seed)
        held = [q for q in eval_pool if q.fold != k and not q.excluded]
        if eval_questions_per_fold is not None:
            held = held[:eval_questions_per_fold]
        plans.append(FoldPlan(k, tuple(train), tuple(held), dropped))
    return plans


def check_no_leakage(plans: Sequence[FoldPlan], examples: Optional[dict[int, Sequence[TrainExample]]] = None) -> None:
    """Raise FinetuneError if any evaluated question's chain (ToolHop instance) is in the training
    data of the adapter that evaluates it, or if an excluded question would be scored.

    ``examples`` (optional): the built training examples per training fold, checked as well."""
    for p in plans:
        train_chains = {q.instance_id for q in p.train_questions}
        if examples is not None:
            train_chains |= {e.instance_id for e in examples.get(p.train_fold, ())}
        leak = sorted({q.instance_id for q in p.eval_questions} & train_chains)
        if leak:
            raise FinetuneError(f"{p.name}: {len(leak)} evaluated chain(s) are in the adapter's training "
                                f"data (e.g. instance {leak[:5]}); cross-fitting must evaluate on the other fold")
        excl = [q.id for q in p.eval_questions if q.excluded]
        if excl:
            raise FinetuneError(f"{p.name}: excluded question(s) {excl[:5]} would be scored; they may be "
                                "trained on but never evaluated")


def plan(cfg: RunConfig, bench=None):
    """(plans, examples per training fold) for the run configuration ``cfg`` (a dict is refused),
    leakage-checked (no training). ``bench``: the loaded benchmark, if the caller has it (else it is
    loaded from the run's release)."""
    cfg = expect_config(cfg, "finetune.plan")
    ft = cfg.finetune
    if bench is None:
        bench = load_benchmark(cfg.release_dir)
    plans = crossfit_plan(bench.questions, run_selection(cfg, bench).headline, ft.folds,
                          ft.train_questions_per_fold, ft.eval_questions_per_fold, cfg.seed,
                          exclude_linked=ft.exclude_linked)
    examples = {p.train_fold: training_examples(p.train_questions, ft.train_formulations) for p in plans}
    check_no_leakage(plans, examples)
    return plans, examples


def plan_table(cfg: RunConfig):
    """One row per training fold: training questions / chains / excluded / examples and the held-out
    questions / chains its adapters are scored on."""
    plans, examples = plan(cfg)
    return pd.DataFrame([p.describe(len(examples[p.train_fold])) for p in plans]).set_index("train_fold")
