"""Notebook 04's stage: train every adapter, evaluate each on its held-out fold, write
``summaries/finetuning.json``."""
from __future__ import annotations

from typing import Any

import pandas as pd

from memtoc.config.runconfig import RunConfig, expect_config
from memtoc.core import stats
from memtoc.core.io import write_jsonl
from memtoc.core.metrics import definitions
from memtoc.data.benchmark import load_benchmark
from memtoc.generation import models
from memtoc.stages import elicitation
from memtoc.stages.construction import related_summary
from memtoc.stages.finetune.common import (
    METRICS,
    SCHEMA_VERSION,
    FinetuneError,
    adapter_dir,
    close_generator,
    write_summary,
)
from memtoc.stages.finetune.crossfit import plan
from memtoc.stages.finetune.evaluate import (
    closed_book_counts,
    eval_episodes,
    eval_generator_kwargs,
    evaluate_adapter,
    paired_deltas,
    score_with,
    shares_engine,
)
from memtoc.stages.finetune.training import train_adapter


def run(cfg: RunConfig, progress: bool = True, force_train: bool = False) -> dict[str, Any]:
    """Train every adapter (model × objective × fold; resumed when finished), evaluate each on its
    held-out fold against its *own* closed-book answers, compute the paired deltas on the
    case-stable common support and write ``summaries/finetuning.json``. Returns the summary dict.

    Every reply of this stage (untreated and adapters, closed-book and with-tool) is generated on
    ``finetune.eval_backend`` with :func:`eval_generator_kwargs`, through the generation cache (the
    untreated replies of notebooks 02/03 are reused when their generator settings are the same).
    ``cfg``: the run configuration (a dict is refused)."""
    cfg = expect_config(cfg, "finetune.run")
    bench = load_benchmark(cfg.release_dir)
    plans, examples = plan(cfg, bench)
    gen_kw = eval_generator_kwargs(cfg)
    summary = summary_head(cfg, bench, gen_kw)
    for model in cfg.finetune.models:
        base = models.prepare_model(model, cache_dir=cfg.model_cache_dir)
        msum: dict[str, Any] = {"base": str(base), "folds": {}, "adapters": {}, "objectives": {}}
        for p in plans:
            msum["folds"][p.name] = {**p.describe(len(examples[p.train_fold])), "leakage_checked": True}
        msum["adapters"] = train_all(cfg, model, base, plans, examples, progress, force_train)
        evaluate_model(cfg, model, plans, gen_kw, msum)
        summary["models"][model] = msum
    # the paper's Holm families (stats.FAMILIES): retention and correct-tool following, each over
    # models x objectives per slice; the other metrics uncorrected; criteria recomputed (H4)
    stats.apply_finetune_families(summary, cfg.alpha)
    write_summary(summary, cfg.run_dir)
    return summary


def summary_head(cfg: RunConfig, bench, gen_kw: dict[str, Any]) -> dict[str, Any]:
    """The summary document before any model (layout: the package docstring)."""
    related = related_summary(bench.questions)
    return {
        "schema_version": SCHEMA_VERSION, "run_name": cfg.run_name, "alpha": cfg.alpha, "n_boot": cfg.n_boot,
        "n_perm": cfg.n_perm, "matcher": cfg.matcher, "formulations": list(cfg.formulations),
        "config": cfg.finetune.to_dict(), "closed_book_variant": cfg.closed_book_variant,
        "metrics": definitions(METRICS),
        "support": ("each checkpoint is scored against its own closed-book answers; a delta compares the units "
                    "(formulation, question) in the metric's cell for both checkpoints (case-stable common "
                    "support); n_treated_only / n_untreated_only count the units in the cell for one side only"),
        "holm_families": {"pooled": "per model x objective: the four metrics' pooled deltas",
                          "per_formulation": "per model x objective: the four metrics x the formulations"},
        "folds": {**bench.folds_source, "related_cross_fold_links": related["n_cross_fold"],
                  "exclude_linked": cfg.finetune.exclude_linked},
        "eval_generator": {k: v for k, v in gen_kw.items() if k != "model_cache_dir"},
        "models": {},
    }


def train_all(cfg: RunConfig, model: str, base, plans, examples, progress: bool, force: bool) -> dict[str, Any]:
    """Train (or resume) every objective × fold adapter of ``model``; ``{objective: {fold<k>: record}}``."""
    spec = models.get_model(model)
    out: dict[str, Any] = {}
    for obj in cfg.finetune.objectives:
        for p in plans:
            path = adapter_dir(cfg.run_dir, model, obj, p.train_fold)
            if progress:
                print(f"[finetune] {model} {obj} {p.name}: {len(examples[p.train_fold])} examples -> {path}")
            rec = train_adapter(base, spec, examples[p.train_fold], obj, cfg.finetune, path, progress=progress,
                                force=force)
            out.setdefault(obj, {})[p.name] = {"path": str(path), **{k: rec[k] for k in (
                "config_hash", "resumed", "steps", "examples", "seconds", "seconds_per_step", "first_loss",
                "final_loss")}}
    return out


def evaluate_model(cfg: RunConfig, model: str, plans, gen_kw: dict[str, Any], msum: dict[str, Any]) -> None:
    """The untreated model on every held-out episode (its closed-book answers elicited by the same
    generator: served from 02/03's cache when the settings are the same), then each adapter against
    its own closed-book answers; fills ``msum``'s ``untreated_closed_book`` and ``objectives``."""
    forms, variant, run_dir = list(cfg.formulations), cfg.closed_book_variant, cfg.run_dir
    eps_by_fold = {p.train_fold: eval_episodes(p.eval_questions, forms, cfg.finetune.eval_conditions) for p in plans}
    all_eps = list({e.episode_id: e for eps in eps_by_fold.values() for e in eps}.values())
    if not all_eps:
        raise FinetuneError("no held-out questions to evaluate (n_questions / eval_questions_per_fold too small)")
    all_qs = list({q.id: q for p in plans for q in p.eval_questions}.values())
    gen = models.load_generator(model, **gen_kw)
    try:
        memory = elicitation.elicit(gen, model, all_qs, forms, variant, run_dir, matcher=cfg.matcher,
                                    scored_file=cfg.paths.untreated_closed_book(model, variant))
        untreated = score_with(gen, model, all_eps, memory, run_dir, cfg.matcher)
        msum["untreated_closed_book"] = closed_book_counts(memory)
        # merged adapters each load their own model: the untreated one is closed first; served adapters
        # (vLLM LoRA) run on the untreated model's engine, which stays open until the last adapter
        base = gen if shares_engine(gen_kw) else None
        if base is None:
            close_generator(gen)
        for obj in cfg.finetune.objectives:
            res = evaluate_objective(cfg, model, obj, plans, eps_by_fold, gen_kw, memory, untreated,
                                     msum["adapters"], base)
            if res is not None:
                msum["objectives"][obj] = res
    finally:
        close_generator(gen)


def evaluate_objective(cfg: RunConfig, model: str, obj: str, plans, eps_by_fold, gen_kw, memory, untreated,
                       adapters: dict[str, Any], base=None) -> dict[str, Any] | None:
    """Both folds' adapters of one objective on their held-out episodes, and the paired deltas with
    the untreated model (None when no fold has held-out questions). ``base``: the untreated model's
    generator when its engine serves the adapters (:func:`evaluate.shares_engine`)."""
    forms = list(cfg.formulations)
    parts, mems = [], []
    for p in plans:
        path = adapter_dir(cfg.run_dir, model, obj, p.train_fold)
        if not eps_by_fold[p.train_fold]:
            print(f"[finetune] {model} {obj} {p.name}: no held-out questions in this slice; not evaluated")
            continue
        df, amem = evaluate_adapter(model, path, f"{model}__{obj}__{p.name}", list(p.eval_questions),
                                    eps_by_fold[p.train_fold], forms, cfg.run_dir, gen_kw, cfg.closed_book_variant,
                                    cfg.matcher, base)
        adapters[obj][p.name]["closed_book"] = closed_book_counts(amem, memory)
        df["train_fold"] = p.train_fold
        write_jsonl(path / "scored.jsonl", df.drop(columns=["schema"], errors="ignore").to_dict("records"))
        parts.append(df)
        mems.append(amem)
    if not parts:
        return None
    treated = pd.concat(parts, ignore_index=True)
    res = paired_deltas(treated, untreated, forms, METRICS, n_boot=cfg.n_boot, n_perm=cfg.n_perm, seed=0,
                        alpha=cfg.alpha)
    res["n_episodes"] = int(len(treated))
    res["closed_book"] = closed_book_counts(pd.concat(mems, ignore_index=True), memory)
    return res
