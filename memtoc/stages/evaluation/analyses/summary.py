"""One model's summary and the whole of ``summaries/evaluation.json`` (layout in the package
docstring): every section, the Holm families applied once every model's contrasts exist, the
cross-model comparisons."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from memtoc.config.runconfig import RunConfig, RunPaths
from memtoc.core import metrics, stats
from memtoc.core.io import plain
from memtoc.core.vocab import (
    BASELINE_ARM,
    CORE_CONDITIONS,
    DEFAULT_FRAME,
    DEFAULT_PAYLOAD,
    HEADLINE_METRICS,
    POOLED,
    PROMPTING_ARMS,
    PROTOCOL_ARM,
    REFERENCE_FORMULATION,
)
from memtoc.stages.evaluation.analyses.arms import (
    add_reference_contrasts,
    add_success,
    arm_comparison,
    far_comparison,
    frames_comparison,
    noop_comparison,
    payload_comparison,
)
from memtoc.stages.evaluation.analyses.closed_book import closed_book_section
from memtoc.stages.evaluation.analyses.cross_model import (
    base_models,
    cross_model_families,
    cross_model_section,
    paired_base_vs_instruct,
    ranking_section,
)
from memtoc.stages.evaluation.analyses.headline import cell_counts, headline_metrics, matcher_sensitivity, source_matrix
from memtoc.stages.evaluation.analyses.subsets import select_arm

SCHEMA_VERSION = 1


def _extra_questions(scored: pd.DataFrame) -> set:
    """The questions of the episodes outside the headline block (an extra arm's)."""
    return set(scored.loc[(scored["arm"] != BASELINE_ARM) | (scored["frame"] != DEFAULT_FRAME)
                          | ~scored["condition"].isin(CORE_CONDITIONS)
                          | (scored["payload_kind"].fillna(DEFAULT_PAYLOAD) != DEFAULT_PAYLOAD), "qkey"])


def model_summary(scored: pd.DataFrame, memory: pd.DataFrame | None = None,
                  formulations: Sequence[str] | None = None, n_boot: int = stats.DEFAULT_N_BOOT, n_perm: int = 10000,
                  seed: int = 0, alpha: float = 0.05) -> dict:
    """Every analysis of one model's scored frame (see the package docstring for the layout)."""
    kw = dict(formulations=formulations, n_boot=n_boot, n_perm=n_perm, seed=seed)
    head = select_arm(scored)
    out: dict[str, Any] = {
        "n_questions": {"headline": int(head["qkey"].nunique()), "extra": len(_extra_questions(scored))},
        "n_episodes": int(len(scored)),
        "headline": headline_metrics(scored, formulations, n_boot=n_boot, seed=seed, alpha=alpha),
        "formulation_spread": {},
        "cells": cell_counts(scored, formulations),
        "source_matrix": source_matrix(scored, formulations),
    }
    out["formulation_spread"] = {m: metrics.formulation_spread(
        {f: (v.get(m) or {}).get("value") for f, v in out["headline"].items() if f != POOLED})
        for m in HEADLINE_METRICS}
    mets = HEADLINE_METRICS
    prompting = arm_comparison(scored, PROMPTING_ARMS, mets, "prompting", **kw)
    if prompting:       # the success criterion is added once the Holm families are applied
        out["prompting"] = prompting
    protocol = arm_comparison(scored, (PROTOCOL_ARM,), mets, "protocol", **kw)
    if protocol:
        add_reference_contrasts(protocol, scored, PROTOCOL_ARM, mets, n_boot, n_perm, seed)
        out["protocol"] = protocol
    for name, fn in (("frames", frames_comparison), ("far", far_comparison),
                     ("payloads", payload_comparison), ("noop", noop_comparison)):
        sec = fn(scored, **kw)
        if sec:
            out[name] = sec
    if memory is not None and "response" in scored.columns:
        out["matcher_sensitivity"] = matcher_sensitivity(scored, memory, formulations)
    return plain(out)


def apply_families(models: dict[str, dict], alpha: float = 0.05) -> dict[str, dict]:
    """Holm-correct the evaluation families whose contrasts sit in the model summaries (in place;
    ``stats.apply_families``: prompting and frames per formulation and pooled, far on the Reference
    formulation, the base models left out where a family says so) and return ``{family: {slice:
    {member: p_holm}}}``. Contrasts of other metrics (the diagnostics) keep ``p_holm`` None. Then the
    success criterion of each prompting arm (``stats.success_criterion``) reads the family-adjusted
    retention and correct-tool following p values."""
    out = stats.apply_families(models, "evaluation", base_models(models), alpha)
    for ms in models.values():
        if ms.get("prompting"):
            add_success(ms["prompting"], alpha)
    return plain(out)


def evaluation_summary(scored_by_model: dict[str, pd.DataFrame], memory_by_model: dict[str, pd.DataFrame] | None,
                       cfg: RunConfig) -> dict:
    """The content of ``summaries/evaluation.json`` for the run ``cfg`` (the closed-book section reads
    the permissive pass from ``cfg.run_dir`` when the run elicited it)."""
    forms = list(cfg.formulations)
    kw = dict(formulations=forms, n_boot=cfg.n_boot, n_perm=cfg.n_perm, seed=0, alpha=float(cfg.alpha))
    models = {m: model_summary(df, (memory_by_model or {}).get(m), **kw) for m, df in scored_by_model.items()}
    for m, df in scored_by_model.items():
        cb = closed_book_section(df, (memory_by_model or {}).get(m), cfg.run_dir, m)
        if cb:
            models[m]["closed_book"] = cb
    applied = apply_families(models, kw["alpha"])
    cross = cross_model_section(models, alpha=kw["alpha"])
    for metric, paired in paired_base_vs_instruct(scored_by_model, kw["n_boot"], kw["n_perm"], kw["seed"],
                                                  kw["alpha"]).items():
        cross.setdefault(metric, {"formulation": REFERENCE_FORMULATION})["base_vs_instruct_paired"] = paired
    applied.update(cross_model_families(cross))
    return plain({
        "schema_version": SCHEMA_VERSION,
        "run_name": cfg.run_name,
        "matcher": cfg.matcher,
        "n_boot": kw["n_boot"], "n_perm": kw["n_perm"], "alpha": kw["alpha"], "seed": kw["seed"],
        "formulations": forms,
        "metrics": metrics.definitions(),
        "models": models,
        "holm_families": stats.families_summary("evaluation", applied),
        "ranking_stability": ranking_section(models),
        "cross_model": cross,
    })


def write_summary(summary: dict, run_dir) -> Path:
    """Write ``summaries/evaluation.json`` under ``run_dir``."""
    return RunPaths(run_dir).write_summary("evaluation", summary)
