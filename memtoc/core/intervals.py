"""Rates with question-cluster intervals and paired contrasts on per-episode units: the statistics
every stage's summary shares (evaluation, judge, fine-tuning, transfer, agent).

A *unit table* is the output of :func:`memtoc.core.metrics.metric_units`: one row per episode with
columns ``formulation, qkey, value`` (``value`` 0/1). An *interval object* is ``{"value", "ci95",
"n"}`` (:func:`interval_obj`); a *contrast object* is the dict of :func:`contrast`. Resampling,
sign-flip tests and Holm come from :mod:`memtoc.core.stats`; the pooled estimator (the unweighted mean
over formulations with one joint draw of questions) from :func:`memtoc.core.metrics.pooled_interval`.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import pandas as pd

from memtoc.core import stats
from memtoc.core.io import plain
from memtoc.core.metrics import paired_units, pooled_interval
from memtoc.core.vocab import POOLED


def interval_obj(value, ci, n) -> dict:
    """``{"value", "ci95", "n"}`` with plain floats (NaN -> None); value and interval None when ``n`` is 0."""
    ci = None if ci is None else [None if c is None or (isinstance(c, float) and math.isnan(c)) else float(c) for c in ci]
    v = None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)
    return {"value": v if n else None, "ci95": ci if n else None, "n": int(n)}


def _pooled_entry(u: pd.DataFrame, present: Sequence[str], n_boot: int, seed: int, alpha: float) -> dict:
    """The pooled interval of :func:`rate_intervals`: per-question sums and counts of every present
    formulation (K x F), one draw of the K questions per replicate for all formulations."""
    labels = np.array(sorted(u["qkey"].unique()))
    code = {q: i for i, q in enumerate(labels)}
    k = len(labels)
    num = np.zeros((k, len(present)))
    den = np.zeros((k, len(present)))
    for j, f in enumerate(present):
        uf = u[u["formulation"] == f]
        idx = uf["qkey"].map(code).to_numpy()
        num[:, j] = np.bincount(idx, weights=uf["value"].to_numpy(float), minlength=k)
        den[:, j] = np.bincount(idx, minlength=k)
    reps = stats.ratio_replicates(num, den, stats.resample_weights(k, n_boot, seed=seed))      # (B, F)
    p = pooled_interval(num.sum(0) / den.sum(0), reps.T, den.sum(0), alpha)
    out = interval_obj(p.value, [p.lo, p.hi] if n_boot else [None, None], p.n)
    # replicates that drew no question of some formulation leave the pooled mean undefined:
    # report how many replicates the interval rests on
    out["n_boot_used"] = p.n_boot_used
    return out


def rate_intervals(units: pd.DataFrame, formulations: Sequence[str], n_boot: int = 1000, seed: int = 0,
                   alpha: float = 0.05) -> dict:
    """``{form: interval, ..., "pooled": interval}`` for per-episode 0/1 ``units`` (columns
    formulation, qkey, value).

    Per formulation: the rate with a question-cluster percentile bootstrap CI
    (``stats.cluster_bootstrap``). Pooled: the unweighted mean of the formulation rates (the paper's
    pooling, ``metrics.pooled_interval``); its CI resamples question clusters jointly across
    formulations (one draw of questions per replicate, applied to every formulation, since the same
    question appears in each), ``n`` is the total number of units and ``n_boot_used`` the
    replicates in which every formulation drew at least one unit (the pooled interval rests on
    those). Formulations without units are omitted; pooled uses those present.

    ``metrics.summarize_group`` (the headline block) pools with the same estimator but draws over
    every question of the arm, once for all metrics; here the questions drawn are those holding
    units of this one table (each formulation's own for its interval), so the two give the same
    rates and, in general, other interval ends on the same episodes.
    """
    out: dict[str, Any] = {}
    if len(units) == 0:
        return out
    present = [f for f in formulations if (units["formulation"] == f).any()]
    for f in present:
        u = units[units["formulation"] == f]
        r = stats.cluster_bootstrap(u["value"].to_numpy(float), u["qkey"].to_numpy(), n_boot=n_boot,
                                    seed=seed, alpha=alpha)
        out[f] = interval_obj(r["value"], r["ci95"], r["n"])
    if present:
        out[POOLED] = _pooled_entry(units[units["formulation"].isin(present)], present, n_boot, seed, alpha)
    return out


def add_rates(section: dict, metric: str, units: pd.DataFrame, formulations: Sequence[str], n_boot: int,
              seed: int) -> dict:
    """``section[form|pooled][metric] = interval`` for every entry of :func:`rate_intervals` (in place)."""
    for k, v in rate_intervals(units, formulations, n_boot, seed).items():
        section.setdefault(k, {})[metric] = v
    return section


def contrast(treat: pd.DataFrame, base: pd.DataFrame, n_boot: int = 1000, n_perm: int = 10000,
             seed: int = 0, treatment: str = "", baseline: str = "") -> dict:
    """Paired contrast treatment − baseline on common support (units (formulation, qkey), clusters
    qkey): delta, question-cluster bootstrap CI, sign-flip permutation p (``stats.paired_contrast``),
    and ``n_treated_only`` / ``n_untreated_only`` (units outside the common support)."""
    pu = paired_units(treat, base)
    res: dict[str, Any] = {"treatment": treatment, "baseline": baseline, "n_units": int(len(pu)),
                           "n_clusters": int(pu["qkey"].nunique()) if len(pu) else 0,
                           "n_treated_only": pu.attrs["n_treated_only"],
                           "n_untreated_only": pu.attrs["n_untreated_only"]}
    if len(pu) == 0:
        res.update(delta=None, ci95=None, p=None, p_holm=None)
        return res
    r = stats.paired_contrast(pu["t"].to_numpy(float), pu["b"].to_numpy(float), pu["qkey"].to_numpy(),
                              n_boot=n_boot, n_perm=n_perm, seed=seed)
    res.update(delta=r["delta"], ci95=r["ci95"], p=r["p_signflip"], p_holm=None)
    return plain(res)


def apply_holm(contrasts: dict[str, dict]) -> dict[str, dict]:
    """Fill ``p_holm`` of a family of contrast objects (keys = family members; missing p skipped)."""
    keys = [k for k, c in contrasts.items() if c.get("p") is not None]
    if keys:
        adj = stats.holm([contrasts[k]["p"] for k in keys])
        for k, a in zip(keys, adj):
            contrasts[k]["p_holm"] = float(a)
    return contrasts
