"""Cells, the metric set, pooling over formulations and common support (PROTOCOL.md §5-§6).

A scored DataFrame has one row per episode with at least the columns
``qkey, condition, cell, followed_tool, kept_memory, outcome, final_correct, abstain``
(plus ``formulation`` and the grouping columns for :func:`summarize`).

Metric definitions (condition / cell filter / numerator); every rate is NaN for an empty
denominator (never 0):

=============  ===========================  ======================  ==================================
metric         condition                    cell                    numerator
=============  ===========================  ======================  ==================================
retention      tool_wrong                   arb                     outcome == "kept_memory" (both out)
keep_flag      tool_wrong                   arb                     kept_memory (includes both; legacy)
cra_arb        tool_wrong                   arb                     final_correct
tool_follow    tool_right                   tool_gold               followed_tool
wrong_follow   tool_wrong                   both_wrong              followed_tool
bw_gold        tool_wrong                   both_wrong              final_correct
err_abstain    tool_error                   all (incl. mem_absent)  abstain
cra_conflict   tool_wrong + tool_right      arb + tool_gold         final_correct
agree_acc      tool_right                   agree                   final_correct
nc_acc         tool_right                   tool_gold               final_correct (the paper's nc_CRA; see below)
=============  ===========================  ======================  ==================================

``nc_acc`` is printed for comparison with the release only: the release's no_conflict condition is
a byte-identical re-generation of tool_right, so under deterministic (greedy) decoding it equals
correct-answer accuracy on the tool_gold cell, which itself equals correct-tool following whenever
the tool value is the gold (tool_right). It carries no information beyond ``tool_follow`` here.

``cra_conflict`` pools the two genuine conflict cells: memory right / tool wrong (tool_wrong, arb)
and memory wrong / tool right (tool_right, tool_gold). tool_error episodes are not conflicts and
are left out. Cell sizes: n_arb / n_both_wrong (tool_wrong), n_tool_gold / n_agree (tool_right),
n_err (all tool_error episodes), n_mem_absent (questions whose memory is absent), n_both_in_arb.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence, Union

import numpy as np
import pandas as pd

from memtoc.core import stats as _stats
from memtoc.core.errors import DataError
from memtoc.core.vocab import (
    CELL_SIZES,
    CELLS,
    CORE_CONDITIONS,
    FORMULATIONS,
    HEADLINE_METRICS,
    METRIC_NAMES,
    SECONDARY_METRICS,
)

REQUIRED_COLUMNS = ("qkey", "condition", "cell", "followed_tool", "kept_memory", "outcome",
                    "final_correct", "abstain")


def assign_cell(memory_correct: Optional[bool], mem_absent: bool, tool_correct: Optional[bool]) -> Optional[str]:
    """Cell of an episode (PROTOCOL §5): None when tool_correct is None (no_tool / noop);
    "mem_absent" when the memory was not elicited; else agree / arb / tool_gold / both_wrong by
    (memory_correct, tool_correct)."""
    if tool_correct is None or isna(tool_correct):
        return None
    if bool(mem_absent):
        return "mem_absent"
    if memory_correct is None or isna(memory_correct):
        raise ValueError("assign_cell: memory_correct is None but mem_absent is False; "
                         "memory_status() gives memory_correct=None only for an absent memory")
    mc, tc = bool(memory_correct), bool(tool_correct)
    return {(True, True): "agree", (True, False): "arb",
            (False, True): "tool_gold", (False, False): "both_wrong"}[(mc, tc)]


def isna(x: Any) -> bool:
    try:
        return bool(pd.isna(x))
    except (TypeError, ValueError):
        return False


Flag = Union[str, tuple, Callable[[pd.DataFrame], pd.Series]]


@dataclass(frozen=True)
class MetricSpec:
    """One metric: which episodes form its denominator and which flag is its numerator.

    ``support`` maps each condition to the cells counted (None: every episode of the condition);
    an empty ``support`` means "the condition the caller names" (``accuracy``, ``abstain``: the
    noop and no_tool analyses). ``cell_metric``: computed per arm by :func:`arm_metrics` /
    :func:`summarize_group` (the headline block); the others are condition-level rates used by the
    frames / far / noop analyses. ``families``: the Holm families (``stats.FAMILIES``) that correct
    this metric's contrasts; every other contrast of it is an uncorrected diagnostic."""
    name: str
    support: tuple[tuple[str, Optional[tuple[str, ...]]], ...]
    flag: Flag                          # column name, (column, value) or callable
    definition: str
    label: str                          # the name prose and the report use
    column: str                         # the short table column
    cell_metric: bool = True

    @property
    def conditions(self) -> tuple[str, ...]:
        return tuple(c for c, _ in self.support)

    @property
    def cells(self) -> Optional[tuple[str, ...]]:
        """The cells of the first condition (None: all); the full rule is ``support``."""
        return self.support[0][1] if self.support else None

    @property
    def headline(self) -> bool:
        return self.name in HEADLINE_METRICS

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(f.name for f in _stats.FAMILIES.values() if f.metric == self.name)


def _spec(name: str, support: dict, flag: Flag, definition: str, label: str, column: str,
          cell_metric: bool = True) -> MetricSpec:
    return MetricSpec(name, tuple((c, None if v is None else tuple(v)) for c, v in support.items()), flag,
                      definition, label, column, cell_metric)


#: The metric registry: every metric a table, figure, summary section, claim or the report names.
METRICS: dict[str, MetricSpec] = {s.name: s for s in (
    _spec("retention", {"tool_wrong": ["arb"]}, ("outcome", "kept_memory"),
          "tool_wrong, arb cell (memory correct, tool incorrect): outcome kept_memory (ties 'both' excluded)",
          "correct-answer retention", "Ret."),
    _spec("keep_flag", {"tool_wrong": ["arb"]}, "kept_memory",
          "tool_wrong, arb cell: kept_memory flag (ties 'both' included; legacy)",
          "kept-memory flag", "Keep"),
    _spec("cra_arb", {"tool_wrong": ["arb"]}, "final_correct", "tool_wrong, arb cell: final answer correct",
          "correct answers in the arb cell", "CRA arb"),
    _spec("tool_follow", {"tool_right": ["tool_gold"]}, "followed_tool",
          "tool_right, tool_gold cell (memory incorrect, tool correct): followed the tool value",
          "correct-tool following", "Tool"),
    _spec("wrong_follow", {"tool_wrong": ["both_wrong"]}, "followed_tool",
          "tool_wrong, both_wrong cell (memory and tool incorrect): followed the incorrect tool value",
          "incorrect-tool following", "Wrong"),
    _spec("bw_gold", {"tool_wrong": ["both_wrong"]}, "final_correct",
          "tool_wrong, both_wrong cell: final answer correct",
          "correct answers in the both-wrong cell", "BW gold"),
    _spec("err_abstain", {"tool_error": None}, "abstain",
          "tool_error, all episodes (mem_absent included): the final answer abstains",
          "tool-error abstention", "Err."),
    _spec("cra_conflict", {"tool_wrong": ["arb"], "tool_right": ["tool_gold"]}, "final_correct",
          "tool_wrong in the arb cell + tool_right in the tool_gold cell: final answer correct",
          "correct answers under conflict", "CRA conflict"),
    _spec("agree_acc", {"tool_right": ["agree"]}, "final_correct", "tool_right, agree cell: final answer correct",
          "accuracy when memory and tool agree", "Agree acc."),
    _spec("nc_acc", {"tool_right": ["tool_gold"]}, "final_correct",
          "tool_right, tool_gold cell: final answer correct (the release's no-conflict accuracy; under "
          "deterministic decoding it equals correct-tool following by construction, since the release's "
          "no_conflict episodes re-generate tool_right byte for byte)",
          "no-conflict accuracy", "NC acc."),
    _spec("correct_value_follow", {"tool_right": None}, "followed_tool",
          "tool_right, all episodes: followed the (correct) tool value",
          "correct-value following", "Follows correct value", cell_metric=False),
    _spec("incorrect_value_follow", {"tool_wrong": None}, "followed_tool",
          "tool_wrong (or tool_far), all episodes: followed the (incorrect) tool value",
          "incorrect-value following", "Follows incorrect value", cell_metric=False),
    _spec("accuracy", {}, "final_correct", "all episodes of the condition: final answer correct",
          "answer accuracy", "Acc.", cell_metric=False),
    _spec("abstain", {}, "abstain", "all episodes of the condition: the final answer abstains",
          "abstention", "Abstain", cell_metric=False),
)}
assert tuple(METRICS) == METRIC_NAMES, "metrics.METRICS must define every vocab.METRIC_NAMES, in that order"
#: the per-arm metric set of the headline block (arm_metrics / summarize_group), in registry order
CELL_METRICS: tuple[MetricSpec, ...] = tuple(s for s in METRICS.values() if s.cell_metric)
SIZE_NAMES = CELL_SIZES


class UnknownMetricError(DataError):
    """A metric name that is not in the registry."""


def metric_spec(name: str) -> MetricSpec:
    """The registry entry of ``name``; an unknown name is an error listing the known ones."""
    if name not in METRICS:
        raise UnknownMetricError(f"unknown metric {name!r}; known metrics: {', '.join(METRICS)} "
                                 "(memtoc.core.metrics.METRICS; docs/architecture.md, recipe 'add a metric')")
    return METRICS[name]


def definitions(names: Optional[Iterable[str]] = None) -> dict[str, str]:
    """``{metric: one-line definition}``: the given metrics, or every metric with the headline ones
    first, then the secondary ones, then the rest in registry order (``/metrics`` of the summaries)."""
    if names is None:
        names = list(dict.fromkeys(HEADLINE_METRICS + SECONDARY_METRICS + tuple(METRICS)))
    return {n: metric_spec(n).definition for n in names}


def _as_tuple(x: Union[None, str, Iterable[str]]) -> Optional[tuple[str, ...]]:
    if x is None:
        return None
    return (x,) if isinstance(x, str) else tuple(x)


def _bool(s: pd.Series) -> np.ndarray:
    return s.astype(object).where(s.notna(), False).astype(bool).to_numpy()


def flag_values(df: pd.DataFrame, flag: Flag) -> np.ndarray:
    """0/1 values of a flag: a boolean column name, a (column, value) equality, or a callable."""
    if callable(flag):
        return _bool(pd.Series(flag(df), index=df.index))
    if isinstance(flag, tuple):
        col, val = flag
        return (df[col] == val).fillna(False).to_numpy(bool)
    return _bool(df[flag])


def metric_mask(df: pd.DataFrame, spec: MetricSpec) -> np.ndarray:
    """Rows of ``df`` in the metric's denominator (its ``support``)."""
    m = np.zeros(len(df), dtype=bool)
    for cond, cells in spec.support:
        mc = df["condition"] == cond
        if cells is not None:
            mc &= df["cell"].isin(cells)
        m |= mc.to_numpy()
    return m


def metric_units(df: pd.DataFrame, metric: str, condition: Optional[str] = None) -> pd.DataFrame:
    """Per-episode 0/1 values of ``metric``: columns ``formulation, qkey, value`` (+ model / arm /
    frame / payload_kind when present). Rows outside the metric's denominator are dropped.

    ``condition`` makes the episodes of another condition play the metric's condition (e.g.
    ``tool_far`` episodes for far retention, ``noop`` for accuracy); a metric with an empty support
    (``accuracy``, ``abstain``) requires it."""
    spec = metric_spec(metric)
    d = df
    if condition is not None:
        d = df[df["condition"] == condition]
        if spec.support:
            d = d.assign(condition=spec.conditions[0])
        sub = d[metric_mask(d, spec)] if spec.support else d
    elif not spec.support:
        raise UnknownMetricError(f"metric {metric!r} needs an explicit condition")
    else:
        sub = d[metric_mask(d, spec)]
    val = flag_values(sub, spec.flag)
    cols = [c for c in ("model", "arm", "frame", "payload_kind", "formulation", "qkey") if c in sub.columns]
    out = sub[cols].copy()
    out["value"] = np.asarray(val, dtype=float)
    return out.reset_index(drop=True)


def paired_units(treat: pd.DataFrame, base: pd.DataFrame) -> pd.DataFrame:
    """Inner join of two unit tables (:func:`metric_units`) on (formulation, qkey): the common
    support of a paired contrast. Columns formulation, qkey, t, b. ``attrs`` carries
    ``n_treated_only`` / ``n_untreated_only``: the units outside the common support on either side
    (the paper reports them beside every delta)."""
    t = treat.groupby(["formulation", "qkey"], sort=False)["value"].mean().rename("t")
    b = base.groupby(["formulation", "qkey"], sort=False)["value"].mean().rename("b")
    out = pd.concat([t, b], axis=1, join="inner").reset_index()
    out.attrs["n_treated_only"] = int(len(t) - len(out))
    out.attrs["n_untreated_only"] = int(len(b) - len(out))
    return out


def subset(df: pd.DataFrame, condition: Union[str, Iterable[str]], cell: Union[None, str, Iterable[str]] = None
           ) -> pd.DataFrame:
    """Episodes of the given condition(s), restricted to the given cell(s) (None: all cells)."""
    m = df["condition"].isin(_as_tuple(condition))
    cells = _as_tuple(cell)
    if cells is not None:
        m &= df["cell"].isin(cells)
    return df[m]


def rate(df: pd.DataFrame, condition: Union[str, Iterable[str]], cell: Union[None, str, Iterable[str]],
         flag: Flag) -> float:
    """Mean of ``flag`` over the episodes of ``condition`` in ``cell`` (None: all cells); NaN when
    there are none. ``flag``: a boolean column name ("followed_tool"), a (column, value) pair
    (("outcome", "kept_memory") for retention), or a callable df -> bool Series. Use it for other
    arms with the same code, e.g. ``rate(far_df, "tool_wrong", "arb", ("outcome", "kept_memory"))``
    or ``rate(noop_df, "noop", None, "final_correct")``."""
    sub = subset(df, condition, cell)
    if len(sub) == 0:
        return float("nan")
    return float(flag_values(sub, flag).mean())


def check_columns(df: pd.DataFrame, needed: Sequence[str] = REQUIRED_COLUMNS, what: str = "scored DataFrame") -> None:
    missing = [c for c in needed if c not in df.columns]
    if missing:
        raise DataError(f"{what} lacks column(s) {missing}; it needs {list(needed)} "
                        "(evaluation.evaluate() returns them)")


def _sizes(df: pd.DataFrame) -> dict[str, int]:
    cond, cell = df["condition"], df["cell"]
    tw, tr = cond == "tool_wrong", cond == "tool_right"
    arb = tw & (cell == "arb")
    return {
        "n_arb": int(arb.sum()),
        "n_tool_gold": int((tr & (cell == "tool_gold")).sum()),
        "n_both_wrong": int((tw & (cell == "both_wrong")).sum()),
        "n_agree": int((tr & (cell == "agree")).sum()),
        "n_mem_absent": int(df.loc[cell == "mem_absent", "qkey"].nunique()),
        "n_err": int((cond == "tool_error").sum()),
        "n_both_in_arb": int((arb & (df["outcome"] == "both")).sum()),
    }


def arm_metrics(df: pd.DataFrame) -> dict[str, Any]:
    """Point values of every metric (see the module table) for one (model, arm, formulation),
    plus the cell sizes. Rates are floats, NaN for an empty denominator."""
    check_columns(df)
    out: dict[str, Any] = {}
    for spec in CELL_METRICS:
        m = metric_mask(df, spec)
        out[spec.name] = float(flag_values(df[m], spec.flag).mean()) if m.any() else float("nan")
    out.update(_sizes(df))
    return out


def _num_den(df: pd.DataFrame, codes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-cluster numerators and denominators (K x M) of every rate metric."""
    num = np.zeros((k, len(CELL_METRICS)))
    den = np.zeros((k, len(CELL_METRICS)))
    for j, spec in enumerate(CELL_METRICS):
        m = metric_mask(df, spec)
        if not m.any():
            continue
        v = flag_values(df[m], spec.flag).astype(float)
        num[:, j] = np.bincount(codes[m], weights=v, minlength=k)
        den[:, j] = np.bincount(codes[m], minlength=k)
    return num, den


def _entry(value: float, lo: float, hi: float, n: int, n_boot_used: Optional[int] = None) -> dict[str, Any]:
    j = _stats.jsonable
    out = {"value": j(value), "ci95": [j(lo), j(hi)], "n": int(n)}
    if n_boot_used is not None:
        out["n_boot_used"] = int(n_boot_used)
    return out


def pool_formulations(values: Sequence[float], dens: Sequence[float]) -> float:
    """The paper's pooling (PROTOCOL §6): the unweighted mean of the per-formulation rates whose
    denominator is non-empty; NaN when none is."""
    v, d = np.asarray(values, dtype=float), np.asarray(dens, dtype=float)
    use = d > 0
    return float(v[use].mean()) if use.any() else float("nan")


class PooledInterval(NamedTuple):
    """The pooled rate of :func:`pooled_interval`: value, interval ends, ``n`` (units of the
    formulations used), ``n_boot_used`` (replicates in which every one of them is defined) and
    ``n_formulations`` (those with a non-empty denominator)."""
    value: float
    lo: float
    hi: float
    n: float
    n_boot_used: int
    n_formulations: int


def pooled_interval(points: Sequence[float], reps: np.ndarray, dens: Sequence[float],
                    alpha: float = 0.05) -> PooledInterval:
    """The paper's pooled rate and its question-cluster interval (the one estimator of
    :func:`summarize_group` and ``intervals.rate_intervals``): ``points`` (F,) the formulation
    rates, ``reps`` (F, B) their bootstrap replicates on the SAME resampled questions, ``dens`` (F,)
    their denominators. Value: :func:`pool_formulations`; a replicate is the mean of the used
    formulations' replicates, undefined (dropped, counted out of ``n_boot_used``) when any of them
    is; percentile interval by ``stats.percentile_ci``."""
    d = np.asarray(dens, dtype=float)
    use = d > 0
    r = np.asarray(reps, dtype=float)[use]
    rj = np.where(np.all(np.isfinite(r), 0), r.mean(0), np.nan)
    lo, hi = _stats.percentile_ci(rj, alpha)
    return PooledInterval(pool_formulations(points, d), lo, hi, d[use].sum(), int(np.isfinite(rj).sum()),
                          int(use.sum()))


def pooled_point_metrics(df: pd.DataFrame, formulation_col: str = "formulation") -> dict[str, Any]:
    """Point values only (no bootstrap): ``{form: arm_metrics(...), "pooled": {metric: value}}``
    with the pooled values from :func:`pool_formulations`, the same rule :func:`summarize_group`
    uses."""
    check_columns(df, tuple(REQUIRED_COLUMNS) + (formulation_col,))
    forms = [f for f in FORMULATIONS if f in set(df[formulation_col])]
    forms += sorted(set(df[formulation_col]) - set(forms), key=str)
    out: dict[str, Any] = {str(f): arm_metrics(df[df[formulation_col] == f]) for f in forms}
    dens = {spec.name: [float(metric_mask(df[df[formulation_col] == f], spec).sum()) for f in forms]
            for spec in CELL_METRICS}
    out["pooled"] = {spec.name: pool_formulations([out[str(f)][spec.name] for f in forms], dens[spec.name])
                     for spec in CELL_METRICS}
    return out


def formulation_spread(per_formulation: dict[str, Any]) -> float:
    """Spread of a rate across formulations (max - min over the formulations where it is defined;
    NaN when none is): the robustness reading of §5.3 ("retention moves by 7-15 points between
    formulations"). ``per_formulation``: {formulation: value}."""
    vals = [float(v) for v in per_formulation.values() if v is not None and not math.isnan(float(v))]
    return max(vals) - min(vals) if vals else float("nan")


def summarize_group(df: pd.DataFrame, formulation_col: str = "formulation", n_boot: int = _stats.DEFAULT_N_BOOT,
                    seed: int = 0, alpha: float = 0.05) -> dict[str, Any]:
    """Metrics of one (model, arm) over its formulations: per formulation and pooled.

    Per formulation: point value and a question-cluster bootstrap CI. Pooled: the unweighted mean
    of the formulations that have a non-empty denominator, CI from the SAME resampled qkeys applied
    to every formulation (a replicate where one of them is empty is dropped). One (B x K) draw
    serves every metric, formulation and the pooled value.

    Every interval reports ``n_boot_used``: the replicates in which the rate is defined. A
    replicate that draws no question of a small cell leaves that formulation's rate, and so the
    pooled mean, undefined; such replicates are not silently dropped but counted out here."""
    check_columns(df, tuple(REQUIRED_COLUMNS) + (formulation_col,))
    codes, qkeys = pd.factorize(df["qkey"], sort=True)
    k = len(qkeys)
    forms = [f for f in FORMULATIONS if f in set(df[formulation_col])]
    forms += sorted(set(df[formulation_col]) - set(forms), key=str)
    w = _stats.resample_weights(k, n_boot, seed=seed)
    out: dict[str, Any] = {}
    points, reps, dens = [], [], []
    for f in forms:
        mask = (df[formulation_col] == f).to_numpy()
        sub = df[mask]
        num, den = _num_den(sub, codes[mask], k)
        with np.errstate(invalid="ignore", divide="ignore"):
            point = num.sum(0) / den.sum(0)
        r = _stats.ratio_replicates(num, den, w)
        ci = _stats.percentile_ci(r, alpha)
        used = np.isfinite(r).sum(0)
        block = {spec.name: _entry(point[j], ci[0, j], ci[1, j], den[:, j].sum(), used[j] if den[:, j].sum() else 0)
                 for j, spec in enumerate(CELL_METRICS)}
        block.update(_sizes(sub))
        out[str(f)] = block
        points.append(point)
        reps.append(r)
        dens.append(den.sum(0))
    points_a, reps_a, dens_a = np.array(points), np.array(reps), np.array(dens)   # (F,M) (F,B,M) (F,M)
    pooled: dict[str, Any] = {}
    for j, spec in enumerate(CELL_METRICS):
        use = dens_a[:, j] > 0
        if not use.any():
            pooled[spec.name] = _entry(np.nan, np.nan, np.nan, 0, 0)
            pooled[spec.name]["n_formulations"] = 0
            continue
        p = pooled_interval(points_a[:, j], reps_a[:, :, j], dens_a[:, j], alpha)
        pooled[spec.name] = _entry(p.value, p.lo, p.hi, p.n, p.n_boot_used)
        pooled[spec.name]["n_formulations"] = p.n_formulations
    for s in SIZE_NAMES:
        pooled[s] = int(sum(out[str(f)][s] for f in forms))
    pooled["n_questions"] = int(k)
    out["pooled"] = pooled
    return out


def summarize(df: pd.DataFrame, by: Sequence[str] = ("model", "arm", "formulation"), n_boot: int = _stats.DEFAULT_N_BOOT,
              seed: int = 0, alpha: float = 0.05) -> dict[str, Any]:
    """Every metric with a CI, per group, per formulation and pooled.

    ``by`` must contain "formulation"; the other columns nest the result in their order, e.g.
    ``out[model][arm]["reference" | "paraphrase_a" | "paraphrase_b" | "pooled"]["retention"]
    = {"value", "ci95": [lo, hi], "n"}`` (pooled entries add ``n_formulations``). Cell sizes are
    plain ints beside the metrics (pooled: summed over formulations). JSON-serialisable: plain
    floats, NaN -> None."""
    by = list(by)
    if "formulation" not in by:
        raise DataError(f"summarize: by={by} must include 'formulation' (pooling is over formulations)")
    check_columns(df, tuple(REQUIRED_COLUMNS) + tuple(by))
    outer = [c for c in by if c != "formulation"]
    if not outer:
        return summarize_group(df, n_boot=n_boot, seed=seed, alpha=alpha)
    result: dict[str, Any] = {}
    for key, g in df.groupby(outer, sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        node = result
        for part in key[:-1]:
            node = node.setdefault(str(part), {})
        node[str(key[-1])] = summarize_group(g, n_boot=n_boot, seed=seed, alpha=alpha)
    return result


def synthetic_arm(n_questions: int = 542, seed: int = 0, formulations: Sequence[str] = FORMULATIONS,
                  model: str = "synthetic", arm: str = "untreated") -> pd.DataFrame:
    """A random scored arm (4 core conditions x formulations) with plausible cell rates, for
    benchmarks and tests. Not benchmark data."""
    rng = np.random.default_rng(seed)
    rows = []
    conds = CORE_CONDITIONS
    tool_correct = {"tool_right": True, "tool_wrong": False, "tool_error": False, "no_tool": None}
    for f in formulations:
        mem_absent = rng.random(n_questions) < 0.05
        mem_correct = rng.random(n_questions) < 0.35
        for q in range(n_questions):
            for c in conds:
                cell = assign_cell(None if mem_absent[q] else bool(mem_correct[q]), bool(mem_absent[q]),
                                   tool_correct[c])
                if c == "tool_error":
                    ft, km = False, bool(rng.random() < 0.1)
                elif c == "no_tool":
                    ft, km = False, not mem_absent[q]
                else:
                    ft = bool(rng.random() < 0.8)
                    km = bool(rng.random() < 0.2) and not mem_absent[q]
                fc = (ft and c == "tool_right") or (km and bool(mem_correct[q]))
                outcome = "both" if ft and km else "followed_tool" if ft else "kept_memory" if km else "neither"
                rows.append({"model": model, "arm": arm, "formulation": f, "qkey": f"q{q:04d}",
                             "condition": c, "cell": cell, "followed_tool": ft, "kept_memory": km,
                             "outcome": outcome, "final_correct": bool(fc),
                             "abstain": bool(c == "tool_error" and rng.random() < 0.7)})
    return pd.DataFrame(rows)
