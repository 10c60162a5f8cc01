"""The headline block of one model (untreated arm, schema frame, default error payload): rates
with intervals, cell counts, the source matrix, and the matcher sensitivity of the same replies."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pandas as pd

from memtoc.core import metrics, stats
from memtoc.core.io import plain
from memtoc.core.metrics import metric_units
from memtoc.core.vocab import CELLS, CONFLICT_CONDITIONS, CORE_CONDITIONS, FOUR_CELLS, HEADLINE_METRICS, POOLED
from memtoc.stages.evaluation import score_episodes
from memtoc.stages.evaluation.analyses.subsets import present_formulations, select_arm


def headline_metrics(scored: pd.DataFrame, formulations: Sequence[str] | None = None,
                     n_boot: int = stats.DEFAULT_N_BOOT, seed: int = 0, alpha: float = 0.05) -> dict:
    """``{form|pooled: {metric: interval, n_<cell>: int}}`` for one model's untreated, schema-frame,
    default-payload episodes (every question of the run), from ``metrics.summarize_group``: every
    metric of ``metrics.RATE_METRICS`` (the four headline ones and the secondary ones) with a
    question-cluster CI, pooled = unweighted mean over formulations, plus the cell sizes."""

    d = select_arm(scored, conditions=CORE_CONDITIONS)
    if formulations:
        d = d[d["formulation"].isin(formulations)]
    if d.empty:
        return {}
    return plain(metrics.summarize_group(d, n_boot=n_boot, seed=seed, alpha=alpha))


def cell_counts(scored: pd.DataFrame, formulations: Sequence[str] | None = None) -> dict:
    """``{form: {cell: n}}``: tool_wrong episodes (untreated, schema) per cell."""
    d = select_arm(scored, conditions=["tool_wrong"])
    return {f: {c: int(((d["formulation"] == f) & (d["cell"] == c)).sum()) for c in CELLS}
            for f in present_formulations(d, formulations)}


def source_matrix(scored: pd.DataFrame, formulations: Sequence[str] | None = None) -> dict:
    """``{form|pooled: {cell: {n, follow_rate, keep_rate, correct_rate}}}`` over the four cells
    (tool_right + tool_wrong, untreated, schema). Pooled sums the episodes of all formulations."""
    d = select_arm(scored, conditions=CONFLICT_CONDITIONS)
    forms = present_formulations(d, formulations)
    out: dict[str, dict] = {}
    for f in forms + [POOLED]:
        df_ = d if f == POOLED else d[d["formulation"] == f]
        out[f] = {}
        for c in FOUR_CELLS:
            x = df_[df_["cell"] == c]
            n = len(x)
            out[f][c] = {"n": int(n),
                         "follow_rate": float(x["followed_tool"].mean()) if n else None,
                         "keep_rate": float(x["kept_memory"].mean()) if n else None,
                         "correct_rate": float(x["final_correct"].mean()) if n else None}
    return out


def point_metrics(scored: pd.DataFrame, formulations: Sequence[str] | None = None,
                  metric_names: Sequence[str] = HEADLINE_METRICS) -> dict:
    """``{form|pooled: {metric: value|None}}`` without intervals (untreated, schema, default payload)."""
    d = select_arm(scored)
    forms = present_formulations(d, formulations)
    out: dict[str, dict] = {}
    for f in forms:
        out[f] = {}
        for m in metric_names:
            u = metric_units(d[d["formulation"] == f], m)
            out[f][m] = float(u["value"].mean()) if len(u) else None
    out[POOLED] = {}
    for m in metric_names:
        vals = [out[f][m] for f in forms if out[f][m] is not None]
        out[POOLED][m] = float(np.mean(vals)) if vals else None
    return out


def matcher_sensitivity(scored: pd.DataFrame, memory: pd.DataFrame, formulations: Sequence[str] | None = None,
                        metric_names: Sequence[str] = HEADLINE_METRICS + ("cra_conflict",)) -> dict:
    """Re-score the same replies with ``matcher="strict"`` (memory status too) and report the
    headline metric values under both matchers: ``{form|pooled: {metric: {paper, strict, delta}}}``,
    plus ``changed_decisions``: the share of episodes whose followed_tool / kept_memory /
    final_correct / cell differs."""
    d = select_arm(scored)
    paper = d if (d.get("matcher") is None or (d["matcher"] == "paper").all()) else \
        score_episodes(d, d["response"].tolist(), memory, matcher="paper", model_label=None)
    strict = score_episodes(d, d["response"].tolist(), memory, matcher="strict", model_label=None)
    pp, ss = point_metrics(paper, formulations, metric_names), point_metrics(strict, formulations, metric_names)
    out: dict[str, Any] = {}
    for f in pp:
        out[f] = {}
        for m in metric_names:
            a, b = pp[f].get(m), ss.get(f, {}).get(m)
            out[f][m] = {"paper": a, "strict": b, "delta": None if a is None or b is None else b - a}
    ch = {}
    for col in ("followed_tool", "kept_memory", "final_correct", "cell"):
        x = paper[col].astype(object).where(paper[col].notna(), None).to_numpy()
        y = strict[col].astype(object).where(strict[col].notna(), None).to_numpy()
        ch[col] = float(np.mean([a != b for a, b in zip(x, y)])) if len(x) else None
    out["changed_decisions"] = ch
    out["n_episodes"] = int(len(d))
    return plain(out)
