"""Intervals of the agent loop: the paper's percentile bootstrap (App. G: "percentile bootstrap over
the per-model memory-right slice, B = 2,000") beside memtoc's question-cluster bootstrap, and the
paired protocol contrasts the paper prints (guided -> auto for Llama-3.1-8B: -0.664 [-0.744, -0.576]).

``agent.bootstrap``
    ``percentile``  one unit per question: its value (per formulation: the episode's 0/1; pooled: the
                    mean over the formulations the question ran on); B replicates draw the questions
                    with replacement (``numpy.random.default_rng(seed).integers(0, n, (B, n))``) and the
                    interval is ``numpy.percentile`` of the replicate means at 2.5 / 97.5.
    ``cluster``     ``analyses.rate_intervals`` / ``analyses.contrast`` (``memtoc.core.stats``: question
                    clusters, the release's index rule for the percentiles).

A contrast ``treatment - baseline`` is paired by question on common support ((formulation, question)
units present on both sides): ``delta`` is the mean over questions of the per-question mean
difference, its interval the bootstrap above on those differences, ``p`` the sign-flip permutation
p-value over questions (``stats.sign_flip_pvalue``).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pandas as pd

from memtoc.core.intervals import contrast, interval_obj, rate_intervals
from memtoc.core.io import plain
from memtoc.core.metrics import paired_units
from memtoc.core.stats import sign_flip_pvalue
from memtoc.core.vocab import BOOTSTRAPS, POOLED

#: the protocol contrasts (treatment, baseline) the paper prints side by side (Table 7, Section 5.4);
#: the repair arm (auto_constrained - auto) is reported as ``repair``
PROTOCOL_CONTRASTS: tuple[tuple[str, str], ...] = (("auto", "guided"), ("two_stage", "guided"), ("two_stage", "auto"))


def contrast_name(treatment: str, baseline: str) -> str:
    """``guided_to_auto`` for auto - guided: the change from the baseline protocol to the treatment."""
    return f"{baseline}_to_{treatment}"


def percentile_bootstrap(values: Sequence[float], n_boot: int, seed: int = 0, alpha: float = 0.05) -> list:
    """``[lo, hi]``: ``numpy.percentile`` of the means of ``n_boot`` resamples (with replacement) of
    ``values``; ``[None, None]`` without values or replicates."""
    v = np.asarray(values, dtype=float)
    if v.size == 0 or n_boot < 1:
        return [None, None]
    idx = np.random.default_rng(seed).integers(0, v.size, size=(n_boot, v.size))
    lo, hi = np.percentile(v[idx].mean(axis=1), [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return [float(lo), float(hi)]


def question_means(units: pd.DataFrame) -> pd.Series:
    """Per question (qkey, sorted): the mean of its units' values."""
    return units.groupby("qkey", sort=True)["value"].mean()


def percentile_rates(units: pd.DataFrame, formulations: Sequence[str], n_boot: int, seed: int = 0) -> dict:
    """As ``analyses.rate_intervals`` (``{form: interval, "pooled": interval}``), with the percentile
    bootstrap; pooled: the mean over questions of each question's mean over formulations."""
    out: dict[str, Any] = {}
    if len(units) == 0:
        return out
    present = [f for f in formulations if (units["formulation"] == f).any()]
    for f in present:
        v = question_means(units[units["formulation"] == f])
        out[f] = interval_obj(float(v.mean()), percentile_bootstrap(v.to_numpy(), n_boot, seed), int(len(v)))
    u = units[units["formulation"].isin(present)]
    v = question_means(u)
    out[POOLED] = dict(interval_obj(float(v.mean()), percentile_bootstrap(v.to_numpy(), n_boot, seed), int(len(u))),
                       n_questions=int(len(v)))
    return out


def percentile_contrast(treat: pd.DataFrame, base: pd.DataFrame, n_boot: int, n_perm: int = 10000, seed: int = 0,
                        treatment: str = "", baseline: str = "") -> dict:
    """``treatment - baseline`` paired by question (see the module docstring); units: columns
    formulation, qkey, value."""
    pu = paired_units(treat, base)
    res: dict[str, Any] = {"treatment": treatment, "baseline": baseline, "n_units": int(len(pu)),
                           "n_clusters": int(pu["qkey"].nunique()) if len(pu) else 0,
                           "n_treated_only": pu.attrs["n_treated_only"], "n_untreated_only": pu.attrs["n_untreated_only"],
                           "bootstrap": "percentile", "n_boot": int(n_boot)}
    if len(pu) == 0:
        res.update(delta=None, ci95=None, p=None)
        return res
    d = pu.assign(value=pu["t"] - pu["b"]).groupby("qkey", sort=True)["value"].mean().to_numpy(float)
    delta = float(d.mean())
    res.update(delta=delta, ci95=percentile_bootstrap(d, n_boot, seed),
               p=sign_flip_pvalue(d, d.size, delta, n_perm=n_perm, seed=seed) if n_perm else None)
    return plain(res)


def rates(units: pd.DataFrame, formulations: Sequence[str], bootstrap: str, n_boot: int, seed: int = 0) -> dict:
    """A rate's intervals under ``bootstrap`` (``percentile`` | ``cluster``)."""
    if bootstrap == "percentile":
        return percentile_rates(units, formulations, n_boot, seed)
    if bootstrap == "cluster":
        return rate_intervals(units, formulations, n_boot=n_boot, seed=seed)
    raise ValueError(f"unknown bootstrap {bootstrap!r}; valid: {', '.join(BOOTSTRAPS)}")


def paired(treat: pd.DataFrame, base: pd.DataFrame, bootstrap: str, n_boot: int, n_perm: int, seed: int = 0,
           treatment: str = "", baseline: str = "") -> dict:
    """A paired contrast under ``bootstrap`` (``percentile`` | ``cluster``)."""
    if bootstrap == "percentile":
        return percentile_contrast(treat, base, n_boot, n_perm, seed, treatment, baseline)
    if bootstrap == "cluster":
        return dict(contrast(treat, base, n_boot=n_boot, n_perm=n_perm, seed=seed, treatment=treatment,
                             baseline=baseline), bootstrap="cluster", n_boot=int(n_boot))
    raise ValueError(f"unknown bootstrap {bootstrap!r}; valid: {', '.join(BOOTSTRAPS)}")
