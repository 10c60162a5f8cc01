"""The analyses of notebook 03: scored frames in, JSON-ready dicts out (``summaries/evaluation.json``).

Pure functions over the scored frames of :func:`memtoc.evaluation.evaluate` (one or more models);
:func:`evaluation_summary` assembles them, :func:`write_summary` writes the file.

``summaries/evaluation.json`` — structure (stable; claims cite it by JSON pointer)
-----------------------------------------------------------------------------------
An *interval object* is ``{"value": float|null, "ci95": [lo, hi]|null, "n": int}`` (rates in [0, 1];
``n`` = the denominator in episodes; ``value`` null when ``n`` is 0; pooled headline entries add
``n_formulations``; pooled intervals add ``n_boot_used``, the bootstrap replicates in which every
formulation drew a unit: the interval rests on those). A *contrast object* is ``{"delta", "ci95",
"p", "p_holm", "family", "n_units", "n_clusters", "n_treated_only", "n_untreated_only",
"treatment", "baseline"}``: the paired difference treatment − baseline on common support, units
(formulation, qkey) clustered by qkey, question-cluster bootstrap CI and sign-flip permutation p
(``stats.paired_contrast``), ``p_holm`` Holm-adjusted within the paper's family
(``stats.FAMILIES``, listed under ``/holm_families``; null for the diagnostics, which the paper
leaves uncorrected), ``n_treated_only`` / ``n_untreated_only`` the units outside the common support. ``<form>`` is a formulation (reference, paraphrase_a,
paraphrase_b) or ``pooled`` = the unweighted mean over formulations (the paper's pooling; CI from
question clusters resampled jointly across formulations). ::

    /schema_version                                  1
    /run_name /matcher /n_boot /n_perm /alpha /seed /formulations
    /metrics/<metric>                                one-line definition of every metric named here
    /models/<model>/n_questions                      {"headline": int, "extra": int}
    /models/<model>/n_episodes                       int
    /models/<model>/headline/<form>/<metric>         interval object, from metrics.summarize_group on
                                                     the untreated arm, schema frame, default error
                                                     payload: retention, tool_follow, wrong_follow,
                                                     err_abstain (the four headline metrics), cra_arb,
                                                     cra_conflict, agree_acc, nc_acc, keep_flag, bw_gold
    /models/<model>/headline/<form>/n_<cell>         int cell sizes: n_arb, n_tool_gold, n_both_wrong,
                                                     n_agree, n_mem_absent, n_err, n_both_in_arb
                                                     (+ /headline/pooled/n_questions)
    /models/<model>/cells/<form>/<cell>              int: tool_wrong episodes per cell (agree, arb,
                                                     tool_gold, both_wrong, mem_absent)
    /models/<model>/source_matrix/<form>/<cell>      {"n", "follow_rate", "keep_rate", "correct_rate"}
                                                     for agree / arb / tool_gold / both_wrong (tool_right
                                                     + tool_wrong episodes; pooled sums episodes)
    /models/<model>/prompting/n_questions            int (the extra-arm questions)
    /models/<model>/prompting/untreated/<form>/<metric>   interval object on the same questions
    /models/<model>/prompting/<arm>/<form>/<metric>  interval object; arms warn, prior, flag; metrics
                                                     retention, tool_follow, wrong_follow, err_abstain
    /models/<model>/prompting/<arm>/contrasts/<metric>    contrast object vs untreated (pooled slice);
                                                     retention in prompting_retention, tool_follow in
                                                     prompting_tool_follow (instruction-tuned models ×
                                                     strategies), the other metrics uncorrected
    /models/<model>/prompting/<arm>/contrasts_by_formulation/<form>/<metric>   the same contrast on
                                                     one formulation (the families' other slices)
    /models/<model>/prompting/<arm>/success          stats.success_criterion: {"passed": bool,
                                                     "retention_up", "tool_drop", "retention_delta",
                                                     "retention_p", "tool_delta", "tool_p", "alpha",
                                                     "reason"} (retention up significantly after Holm
                                                     and no significant drop in tool_follow after Holm)
    /models/<model>/protocol/...                     the no_protocol_sentence ablation, laid out like
                                                     prompting (arm no_protocol_sentence, no success)
    /models/<model>/frames/n_questions               int
    /models/<model>/frames/<frame>/<form>/<metric>   interval object; frames schema (baseline on the
                                                     same questions), no_schema, passage; metrics
                                                     correct_value_follow (tool_right, all episodes),
                                                     incorrect_value_follow (tool_wrong, all episodes),
                                                     retention, tool_follow, wrong_follow (cell-restricted)
    /models/<model>/frames/<frame>/contrasts/<metric>     contrast vs schema (retention too); retention
                                                     in frames_retention (models × frames)
    /models/<model>/frames/<frame>/contrasts_by_formulation/<form>/<metric>   per formulation
    /models/<model>/far/n_common                     int: questions with both a far and a near episode
    /models/<model>/far/<near|far>/<form>/<metric>   interval object: retention, wrong_follow,
                                                     incorrect_value_follow on the common support
    /models/<model>/far/contrasts/<metric>           contrast far − near, pooled (uncorrected)
    /models/<model>/payloads/n_questions             int
    /models/<model>/payloads/<kind>/<form>/err_abstain    interval object; kinds service_unavailable
                                                     (the paper's), timeout, permission_denied
    /models/<model>/payloads/contrasts/<kind>        contrast of err_abstain vs service_unavailable;
                                                     family = the two other kinds
    /models/<model>/noop/n_questions                 int
    /models/<model>/noop/<noop|no_tool>/<form>/<metric>   interval object: accuracy (final_correct),
                                                     abstain, over all episodes of the condition
    /models/<model>/noop/contrasts/<metric>          contrast noop − no_tool; family {accuracy, abstain}
    /models/<model>/matcher_sensitivity/<form>/<metric>   {"paper", "strict", "delta"} point values of
                                                     retention, tool_follow, wrong_follow, err_abstain,
                                                     cra_conflict after re-scoring the same replies
                                                     (and closed-book answers) with matcher="strict";
                                                     delta = strict − paper
    /models/<model>/matcher_sensitivity/changed_decisions/<field>   share of headline episodes whose
                                                     followed_tool / kept_memory / final_correct / cell
                                                     changes
    /models/<model>/formulation_spread/<metric>      max − min of the headline rate over formulations
                                                     (metrics.formulation_spread; the paper's §5.3)
    /models/<model>/far/contrasts_reference/<metric> far − near on the Reference formulation alone;
                                                     retention in far_retention (every model)
    /models/<model>/protocol/no_protocol_sentence/contrasts_reference/<metric>   likewise
    /models/<model>/closed_book                      {"final_line_with_tool": {"n", "rate"},
                                                     "final_line_closed_book", "forced_vs_permissive":
                                                     {<form>|pooled: {"n", "both_answered",
                                                     "same_correctness", "permissive_abstained"}}} (App. D)
    /holm_families/<family>                          every evaluation family of stats.FAMILIES:
                                                     {"metric", "axes", "models", "slices", "test",
                                                     "description", "members": {slice: {member:
                                                     p_holm}}} (slices without members left out)
    /ranking_stability/<metric>                      stats.ranking_stability over the models, for the
                                                     four headline metrics: {"rule", "orders":
                                                     {"pooled": [...], <form>: [...]},
                                                     "full_order_stable" (the paper's rule: the full
                                                     ordering everywhere), "reference_order" (with a
                                                     base model, Reference only), "pairwise_note",
                                                     "pairs", "stable_pairs" (a weaker pairwise reading)}
    /cross_model/<metric>                            {"formulation": "reference", "all_pairs": {"a|b":
                                                     two-proportion z-test + p_holm}, "base_vs_instruct":
                                                     {"base|instruct": z-test}} (App. E; retention and
                                                     wrong_follow; families cross_model_ztest_<metric>,
                                                     base_vs_instruct_ztest_<metric>)
    /cross_model/retention/base_vs_instruct_paired/<base|instruct>   contrast object base − instruct,
                                                     paired by question on the Reference formulation,
                                                     family base_vs_instruct_paired_retention (App. E C)

Sections whose episodes are absent from the run (an extra arm turned off) are omitted.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import pandas as pd

from . import metrics, models, stats
from .config import DataError, MemtocError
from .elicitation import load_memory
from .evaluation import score_episodes
from .io import plain, write_json
from .metrics import metric_units, paired_units
from .runconfig import RunConfig
from .scoring import has_final_line
from .vocab import (ALT_FRAMES, BASELINE_ARM, CELLS, CONFLICT_CONDITIONS, CORE_CONDITIONS, DEFAULT_FRAME, DEFAULT_PAYLOAD,
                    FORMULATIONS, FOUR_CELLS, HEADLINE_METRICS, POOLED, PROMPTING_ARMS, PROTOCOL_ARM,
                    REFERENCE_FORMULATION)

SCHEMA_VERSION = 1


# ==================================================================================================
# statistics primitives (delegating to memtoc.metrics / memtoc.stats)


def interval_obj(value, ci, n) -> dict:
    ci = None if ci is None else [None if c is None or (isinstance(c, float) and math.isnan(c)) else float(c) for c in ci]
    v = None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)
    return {"value": v if n else None, "ci95": ci if n else None, "n": int(n)}


def rate_intervals(units: pd.DataFrame, formulations: Sequence[str], n_boot: int = 1000, seed: int = 0,
                   alpha: float = 0.05) -> dict:
    """``{form: interval, ..., "pooled": interval}`` for per-episode 0/1 ``units`` (columns
    formulation, qkey, value).

    Per formulation: the rate with a question-cluster percentile bootstrap CI
    (``stats.cluster_bootstrap``). Pooled: the unweighted mean of the formulation rates (the paper's
    pooling); its CI resamples question clusters jointly across formulations (one draw of questions
    per replicate, applied to every formulation, since the same question appears in each), and
    ``n`` is the total number of units, ``n_boot_used`` the replicates in which every formulation
    drew at least one unit (the pooled interval rests on those). Formulations without units are
    omitted; pooled uses those present.
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
        u = units[units["formulation"].isin(present)]
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
        w = stats.resample_weights(k, n_boot, seed=seed)
        r = stats.ratio_replicates(num, den, w)                      # (B, F)
        reps = np.where(np.all(np.isfinite(r), 1), r.mean(1) if r.size else np.nan, np.nan)
        lo, hi = stats.percentile_ci(reps, alpha) if n_boot else (None, None)
        value = float(np.mean(num.sum(0) / den.sum(0)))
        out[POOLED] = interval_obj(value, [lo, hi], int(den.sum()))
        # replicates that drew no question of some formulation leave the pooled mean undefined:
        # report how many replicates the interval rests on (issue 12 item 10)
        out[POOLED]["n_boot_used"] = int(np.isfinite(reps).sum())
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


# ==================================================================================================
# analysis sections


def _forms(df: pd.DataFrame, formulations: Sequence[str] | None) -> list[str]:
    present = set(df["formulation"].unique()) if len(df) else set()
    order = list(formulations or FORMULATIONS)
    return [f for f in order if f in present]


def select_arm(df: pd.DataFrame, arm: str = BASELINE_ARM, frame: str = DEFAULT_FRAME,
               payload_kind: str | None = DEFAULT_PAYLOAD, conditions: Sequence[str] | None = None) -> pd.DataFrame:
    """Episodes of one arm and frame; tool_error episodes only of ``payload_kind`` (None: all)."""
    m = (df["arm"] == arm) & (df["frame"] == frame)
    if payload_kind is not None:
        m &= (df["condition"] != "tool_error") | (df["payload_kind"].fillna(DEFAULT_PAYLOAD) == payload_kind)
    if conditions is not None:
        m &= df["condition"].isin(conditions)
    return df[m]


def _restrict(df: pd.DataFrame, qkeys: Iterable[str]) -> pd.DataFrame:
    return df[df["qkey"].isin(set(qkeys))]


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
            for f in _forms(d, formulations)}


def source_matrix(scored: pd.DataFrame, formulations: Sequence[str] | None = None) -> dict:
    """``{form|pooled: {cell: {n, follow_rate, keep_rate, correct_rate}}}`` over the four cells
    (tool_right + tool_wrong, untreated, schema). Pooled sums the episodes of all formulations."""
    d = select_arm(scored, conditions=CONFLICT_CONDITIONS)
    forms = _forms(d, formulations)
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


def arm_comparison(scored: pd.DataFrame, arms: Sequence[str], metric_names: Sequence[str],
                   family: str, formulations: Sequence[str] | None = None, n_boot: int = stats.DEFAULT_N_BOOT,
                   n_perm: int = 10000, seed: int = 0) -> dict:
    """Arms vs untreated on the arms' common support (the questions the arms were run on).

    ``{arm: {form|pooled: {metric: interval}, "contrasts": {metric: contrast}}, "untreated": {...},
    "n_questions": int}``; Holm within each metric's family across ``arms``."""
    present = [a for a in arms if (scored["arm"] == a).any()]
    if not present:
        return {}
    qk = set(scored.loc[scored["arm"].isin(present), "qkey"])
    base = _restrict(select_arm(scored), qk)
    forms = _forms(base, formulations)
    out: dict[str, Any] = {"n_questions": len(qk), "family": family}
    out.update(_variants_vs_base(base, BASELINE_ARM, {a: select_arm(scored, arm=a) for a in present},
                                 metric_names, forms, n_boot, n_perm, seed))
    return out


def _variants_vs_base(base: pd.DataFrame, base_name: str, variants: dict[str, pd.DataFrame],
                      metric_names: Sequence[str], forms: Sequence[str], n_boot: int, n_perm: int,
                      seed: int) -> dict[str, Any]:
    """``{base_name: {form|pooled: {metric: interval}}, variant: {..., "contrasts": {metric: contrast}}}``
    with each variant's rates, its paired contrast vs the base, and Holm across the variants per metric."""
    out: dict[str, Any] = {base_name: {}}
    base_units = {m: metric_units(base, m) for m in metric_names}
    for m in metric_names:
        add_rates(out[base_name], m, base_units[m], forms, n_boot, seed)
    for name, d in variants.items():
        out[name] = {"contrasts": {}, "contrasts_by_formulation": {}}
        for m in metric_names:
            u = metric_units(d, m)
            add_rates(out[name], m, u, forms, n_boot, seed)
            out[name]["contrasts"][m] = contrast(u, base_units[m], n_boot, n_perm, seed, name, base_name)
            b = base_units[m]
            for f in forms:      # the preregistered families are corrected in every slice
                out[name]["contrasts_by_formulation"].setdefault(f, {})[m] = contrast(
                    u[u["formulation"] == f], b[b["formulation"] == f], n_boot, n_perm, seed, name, base_name)
    return out


def add_reference_contrasts(section: dict, scored: pd.DataFrame, arm: str, metric_names: Sequence[str],
                            n_boot: int, n_perm: int, seed: int) -> dict:
    """Add ``contrasts_reference`` (the arm vs untreated on the Reference formulation alone, as the
    paper reports the protocol-sentence ablation) beside the pooled ``contrasts`` (in place)."""
    if arm not in section:
        return section
    qk = set(scored.loc[scored["arm"] == arm, "qkey"])
    base = _restrict(select_arm(scored), qk)
    base, treat = (d[d["formulation"] == REFERENCE_FORMULATION] for d in (base, select_arm(scored, arm=arm)))
    if treat.empty:
        return section
    section[arm]["contrasts_reference"] = {
        m: contrast(metric_units(treat, m), metric_units(base, m), n_boot, n_perm, seed, arm, BASELINE_ARM)
        for m in metric_names}
    return section


def add_success(section: dict, alpha: float = 0.05) -> dict:
    """Add the asymmetric success criterion to each arm of a prompting section (in place):
    retention up significantly after Holm AND no significant drop in correct-tool following."""
    for a, v in section.items():
        if not isinstance(v, dict) or "contrasts" not in v:
            continue
        ret = v["contrasts"].get("retention", {})
        tf = v["contrasts"].get("tool_follow", {})
        v["success"] = plain(stats.success_criterion(ret, tf, alpha=alpha)) if ret and tf else None
    return section


def frames_comparison(scored: pd.DataFrame, formulations: Sequence[str] | None = None,
                      n_boot: int = stats.DEFAULT_N_BOOT, n_perm: int = 10000, seed: int = 0) -> dict:
    """Presentation frames (schema / no_schema / passage), untreated arm: correct-value following
    (tool_right) and incorrect-value following (tool_wrong) separately, all episodes and
    cell-restricted; contrasts vs schema on common support (Holm across the two frames)."""
    frames = [f for f in ALT_FRAMES if (scored["frame"] == f).any()]
    if not frames:
        return {}
    mets = ("retention", "correct_value_follow", "incorrect_value_follow", "tool_follow", "wrong_follow")
    qk = set(scored.loc[scored["frame"].isin(frames), "qkey"])
    base = _restrict(select_arm(scored, conditions=CONFLICT_CONDITIONS), qk)
    forms = _forms(base, formulations)
    out: dict[str, Any] = {"n_questions": len(qk)}
    out.update(_variants_vs_base(base, DEFAULT_FRAME, {fr: select_arm(scored, frame=fr) for fr in frames},
                                 mets, forms, n_boot, n_perm, seed))
    return out


def far_comparison(scored: pd.DataFrame, formulations: Sequence[str] | None = None,
                   n_boot: int = stats.DEFAULT_N_BOOT, n_perm: int = 10000, seed: int = 0) -> dict:
    """Far vs near incorrect values on common support ((formulation, qkey) with both): retention
    and incorrect-tool following; contrasts far − near, Holm over the two metrics."""
    far = select_arm(scored, conditions=["tool_far"])
    if far.empty:
        return {}
    near = select_arm(scored, conditions=["tool_wrong"])
    common = pd.merge(far[["formulation", "qkey"]].drop_duplicates(), near[["formulation", "qkey"]].drop_duplicates())
    keep = set(map(tuple, common.to_numpy()))

    def cs(d):
        return d[[(f, q) in keep for f, q in zip(d["formulation"], d["qkey"])]]

    far, near = cs(far), cs(near)
    forms = _forms(near, formulations)
    out: dict[str, Any] = {"n_common": int(common["qkey"].nunique()), "near": {}, "far": {}, "contrasts": {}}
    for m in ("retention", "wrong_follow", "incorrect_value_follow"):
        un = metric_units(near, m, condition="tool_wrong")
        uf = metric_units(far, m, condition="tool_far")
        add_rates(out["near"], m, un, forms, n_boot, seed)
        add_rates(out["far"], m, uf, forms, n_boot, seed)
        out["contrasts"][m] = contrast(uf, un, n_boot, n_perm, seed, "far", "near")
        ref = REFERENCE_FORMULATION
        if ref in forms:     # the paper reports far vs near on the Reference formulation (pv0)
            out.setdefault("contrasts_reference", {})[m] = contrast(
                uf[uf["formulation"] == ref], un[un["formulation"] == ref], n_boot, n_perm, seed, "far", "near")
    return out


def payload_comparison(scored: pd.DataFrame, formulations: Sequence[str] | None = None,
                       n_boot: int = stats.DEFAULT_N_BOOT, n_perm: int = 10000, seed: int = 0) -> dict:
    """Error-abstention per tool_error payload kind; contrasts vs the paper's default payload
    (service_unavailable) on common support, Holm across the other kinds."""
    d = select_arm(scored, payload_kind=None, conditions=["tool_error"])
    kinds = [k for k in d["payload_kind"].fillna(DEFAULT_PAYLOAD).unique() if k != DEFAULT_PAYLOAD]
    if not kinds:
        return {}
    d = d.assign(payload_kind=d["payload_kind"].fillna(DEFAULT_PAYLOAD))
    qk = set(d.loc[d["payload_kind"].isin(kinds), "qkey"])
    d = _restrict(d, qk)
    forms = _forms(d, formulations)
    out: dict[str, Any] = {"n_questions": len(qk), "contrasts": {}}
    units = {k: metric_units(d[d["payload_kind"] == k], "err_abstain") for k in [DEFAULT_PAYLOAD] + sorted(kinds)}
    for k, u in units.items():
        out[k] = {f: {"err_abstain": v} for f, v in rate_intervals(u, forms, n_boot, seed).items()}
    for k in sorted(kinds):
        out["contrasts"][k] = contrast(units[k], units[DEFAULT_PAYLOAD], n_boot, n_perm, seed, k, DEFAULT_PAYLOAD)
    apply_holm(out["contrasts"])
    return out


def noop_comparison(scored: pd.DataFrame, formulations: Sequence[str] | None = None,
                    n_boot: int = stats.DEFAULT_N_BOOT, n_perm: int = 10000, seed: int = 0) -> dict:
    """NoopTool control vs no_tool (the closed-book answer): answer accuracy and abstention over
    all episodes, on common support; contrasts noop − no_tool, Holm over the two metrics."""
    noop = select_arm(scored, conditions=["noop"])
    if noop.empty:
        return {}
    nt = _restrict(select_arm(scored, conditions=["no_tool"]), set(noop["qkey"]))
    forms = _forms(noop, formulations)
    out: dict[str, Any] = {"n_questions": int(noop["qkey"].nunique()), "noop": {}, "no_tool": {}, "contrasts": {}}
    for m in ("accuracy", "abstain"):
        un = metric_units(noop, m, condition="noop")
        ut = metric_units(nt, m, condition="no_tool")
        add_rates(out["noop"], m, un, forms, n_boot, seed)
        add_rates(out["no_tool"], m, ut, forms, n_boot, seed)
        out["contrasts"][m] = contrast(un, ut, n_boot, n_perm, seed, "noop", "no_tool")
    apply_holm(out["contrasts"])
    return out


def point_metrics(scored: pd.DataFrame, formulations: Sequence[str] | None = None,
                  metric_names: Sequence[str] = HEADLINE_METRICS) -> dict:
    """``{form|pooled: {metric: value|None}}`` without intervals (untreated, schema, default payload)."""
    d = select_arm(scored)
    forms = _forms(d, formulations)
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


# ==================================================================================================
# the whole summary


def model_summary(scored: pd.DataFrame, memory: pd.DataFrame | None = None,
                  formulations: Sequence[str] | None = None, n_boot: int = stats.DEFAULT_N_BOOT, n_perm: int = 10000,
                  seed: int = 0, alpha: float = 0.05) -> dict:
    """Every analysis of one model's scored frame (see the module docstring for the layout)."""
    kw = dict(formulations=formulations, n_boot=n_boot, n_perm=n_perm, seed=seed)
    head = select_arm(scored)
    extra_q = set(scored.loc[(scored["arm"] != BASELINE_ARM) | (scored["frame"] != DEFAULT_FRAME)
                             | ~scored["condition"].isin(CORE_CONDITIONS)
                             | (scored["payload_kind"].fillna(DEFAULT_PAYLOAD) != DEFAULT_PAYLOAD), "qkey"])
    out: dict[str, Any] = {
        "n_questions": {"headline": int(head["qkey"].nunique()), "extra": len(extra_q)},
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


# --------------------------------------------------------------------------------------------------
# Holm families: declared and applied by stats (stats.FAMILIES, stats.apply_families), once every
# model's contrasts exist


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


def apply_finetune_families(summary: dict, alpha: float = 0.05) -> dict[str, dict]:
    """The fine-tuning families on a ``summaries/finetuning.json`` dict (in place,
    ``stats.apply_families``): retention and correct-tool following, each over models x objectives
    and corrected separately in every slice (each formulation, and pooled); the other metrics
    (diagnostics) keep ``p_holm`` None. Recomputes ``criterion`` / ``criterion_by_formulation`` with
    the adjusted p values and records the families under ``/holm_families``. Returns ``{family:
    {slice: {member: p_holm}}}``."""
    models = summary.get("models") or {}
    for ms in models.values():
        for os_ in (ms.get("objectives") or {}).values():
            for by_slice in (os_.get("deltas") or {}).values():
                for c in by_slice.values():
                    c["p_holm"], c["family"] = None, None
    applied = stats.apply_families(models, "finetune", (), alpha)
    for ms in models.values():
        for os_ in (ms.get("objectives") or {}).values():
            d = os_.get("deltas") or {}
            if "retention" not in d or "tool_follow" not in d:
                continue
            crit = {sl: plain(stats.success_criterion(d["retention"][sl], d["tool_follow"][sl], alpha=alpha))
                    for sl in d["retention"] if sl in d["tool_follow"]}
            if POOLED in crit:
                os_["criterion"] = crit.pop(POOLED)
            os_["criterion_by_formulation"] = crit
    summary["holm_families"] = stats.families_summary("finetune", applied)
    return applied


def ranking_section(model_summaries: dict[str, dict], metric_names: Sequence[str] = HEADLINE_METRICS) -> dict:
    """Ranking stability of the models on each headline metric (``stats.ranking_stability``): the
    paper's rule is the FULL ordering, pooled and under every formulation (``full_order_stable``);
    ``pairs`` / ``stable_pairs`` are a weaker pairwise reading, labelled as such. A base model is
    compared on the Reference formulation only (``reference_order``)."""
    reference_only = base_models(model_summaries)
    out = {}
    for m in metric_names:
        pooled = {mod: s["headline"].get(POOLED, {}).get(m, {}).get("value") for mod, s in model_summaries.items()}
        forms = sorted({f for s in model_summaries.values() for f in s["headline"] if f != POOLED},
                       key=lambda f: FORMULATIONS.index(f) if f in FORMULATIONS else 99)
        per = {f: {mod: s["headline"].get(f, {}).get(m, {}).get("value") for mod, s in model_summaries.items()}
               for f in forms}
        out[m] = plain(stats.ranking_stability(per, pooled, reference_only=reference_only))
    return out


def base_models(names: Iterable[str]) -> list[str]:
    """The base (non-chat) models among ``names`` (memtoc.models registry; unknown names are taken
    as instruction-tuned). The paper compares the base model on the Reference formulation only."""
    out = []
    for n in names:
        try:
            if not models.get_model(n).chat:
                out.append(n)
        except MemtocError:
            pass
    return out


def final_line_compliance(responses: Iterable[Optional[str]]) -> dict:
    """Share of replies that carry a ``FINAL:`` line (``scoring.has_final_line``), App. D."""
    flags = [has_final_line(r) for r in responses]
    return {"n": len(flags), "rate": float(np.mean(flags)) if flags else None}


def closed_book_agreement(forced: pd.DataFrame, permissive: pd.DataFrame) -> dict:
    """Forced vs permissive closed-book passes of one model (App. D), per formulation and pooled
    over (question, formulation): ``n`` pairs, ``both_answered`` (neither pass abstains),
    ``same_correctness`` (share of the both-answered pairs whose memory_correct agrees),
    ``permissive_abstained`` (share of pairs where only the permissive pass abstains: the
    memories the forced pass adds)."""
    on = ["formulation", "qkey"]
    m = forced[on + ["mem_absent", "memory_correct"]].merge(
        permissive[on + ["mem_absent", "memory_correct"]], on=on, suffixes=("_f", "_p"))
    out: dict[str, Any] = {}
    for f in [x for x in FORMULATIONS if x in set(m["formulation"])] + [POOLED]:
        d = m if f == POOLED else m[m["formulation"] == f]
        fa, pa = d["mem_absent_f"].astype(bool), d["mem_absent_p"].astype(bool)
        both = d[~fa & ~pa]
        out[f] = {"n": int(len(d)), "both_answered": int(len(both)),
                  "same_correctness": float((both["memory_correct_f"].astype(bool)
                                             == both["memory_correct_p"].astype(bool)).mean()) if len(both) else None,
                  "permissive_abstained": float((pa & ~fa).mean()) if len(d) else None}
    return out


def closed_book_section(scored: pd.DataFrame, memory: pd.DataFrame | None, run_dir, model_label: str) -> dict:
    """FINAL-line compliance of the with-tool replies and of the forced closed-book replies, and the
    forced-vs-permissive agreement when the run elicited the permissive pass (App. D)."""
    out: dict[str, Any] = {}
    if "response" in scored.columns:
        out["final_line_with_tool"] = final_line_compliance(scored["response"].tolist())
    if memory is not None and "response" in memory.columns:
        out["final_line_closed_book"] = final_line_compliance(memory["response"].tolist())
    if memory is not None and run_dir is not None:
        try:
            perm = load_memory(run_dir, model_label, "permissive")
        except DataError:
            perm = None
        if perm is not None:
            out["forced_vs_permissive"] = closed_book_agreement(memory, perm)
    return plain(out)


def cross_model_section(model_summaries: dict[str, dict], metric_names: Sequence[str] = ("retention", "wrong_follow"),
                        alpha: float = 0.05) -> dict:
    """Unpaired cross-model contrasts (App. E): per metric, two-proportion z-tests on the Reference
    formulation's counts (the base model is reported there only), Holm over every model pair
    (``cross_model_ztest_<metric>``) and over the planned base-vs-instruct pairs (base minus each
    instruct, ``base_vs_instruct_ztest_<metric>``) when the run has a base model.
    ``{metric: {"formulation", "all_pairs": {"a|b": {...}}, "base_vs_instruct": {...}}}``."""
    out: dict[str, Any] = {}
    names = list(model_summaries)
    if len(names) < 2:
        return out
    bases = base_models(names)
    for m in metric_names:
        counts = {}
        for mod, s in model_summaries.items():
            iv = (s["headline"].get(REFERENCE_FORMULATION) or {}).get(m) or {}
            if iv.get("value") is not None and iv.get("n"):
                counts[mod] = (int(round(iv["value"] * iv["n"])), int(iv["n"]))
        if len(counts) < 2:
            continue
        sec = {"formulation": REFERENCE_FORMULATION,
               "all_pairs": stats.two_proportion_holm(counts, f"cross_model_ztest_{m}", alpha=alpha)}
        fam = stats.declared_family(f"base_vs_instruct_ztest_{m}")
        pairs = stats.family_models(fam, list(counts), bases)
        if pairs:
            sec["base_vs_instruct"] = stats.two_proportion_holm(counts, fam.name, pairs, alpha)
        out[m] = plain(sec)
    return out


def paired_base_vs_instruct(scored_by_model: dict[str, pd.DataFrame], n_boot: int = stats.DEFAULT_N_BOOT,
                            n_perm: int = 10000, seed: int = 0, alpha: float = 0.05) -> dict:
    """The question-paired base-vs-instruct families (App. E family C; ``stats.FAMILIES`` entries
    with ``models == "base_vs_instruct"`` and the sign-flip test): per family, base minus each
    instruction-tuned model on the untreated, schema-frame episodes of each slice (the Reference
    formulation), paired on common (formulation, qkey) support and clustered by question, Holm over
    the pairs. ``{metric: {"base|instruct": contrast object}}``."""
    out: dict[str, Any] = {}
    bases = base_models(scored_by_model)
    for fam in stats.FAMILIES.values():
        if fam.models != "base_vs_instruct" or fam.test != "sign-flip":
            continue
        for sl in fam.slices:
            members = {}
            for b, i in stats.family_models(fam, list(scored_by_model), bases):
                ub, ui = (metric_units(select_arm(scored_by_model[x]), fam.metric) for x in (b, i))
                if sl != POOLED:
                    ub, ui = ub[ub["formulation"] == sl], ui[ui["formulation"] == sl]
                members[fam.key(b, i)] = contrast(ub, ui, n_boot, n_perm, seed, b, i)
            if members:
                stats.correct_members(fam, members, alpha)
                out.setdefault(fam.metric, {}).update(members)
    return plain(out)


def cross_model_families(cross: dict) -> dict[str, dict]:
    """``{family: {slice: {member: p_holm}}}`` of the cross-model families in a ``/cross_model``
    section (every member carries its ``family``; the slice is the section's formulation)."""
    out: dict[str, dict] = {}
    for sec in cross.values():
        for part in ("all_pairs", "base_vs_instruct", "base_vs_instruct_paired"):
            for k, c in (sec.get(part) or {}).items():
                out.setdefault(c["family"], {}).setdefault(sec["formulation"], {})[k] = c["p_holm"]
    return out


def run_dir_of(P) -> Optional[Path]:
    """The run directory of a RunConfig, or of a parameter dict that names one (None otherwise: the
    closed-book section then skips the permissive pass)."""
    return P.run_dir if isinstance(P, RunConfig) else P.get("run_dir")


def evaluation_summary(scored_by_model: dict[str, pd.DataFrame], memory_by_model: dict[str, pd.DataFrame] | None,
                       P) -> dict:
    """The content of ``summaries/evaluation.json`` for a run (``P``: its RunConfig or parameter dict)."""
    cfg = RunConfig.of(P)
    forms = list(cfg.formulations)
    kw = dict(formulations=forms, n_boot=cfg.n_boot, n_perm=cfg.n_perm, seed=0, alpha=float(cfg.alpha))
    models = {m: model_summary(df, (memory_by_model or {}).get(m), **kw) for m, df in scored_by_model.items()}
    for m, df in scored_by_model.items():
        cb = closed_book_section(df, (memory_by_model or {}).get(m), run_dir_of(P), m)
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
    return write_json(Path(run_dir) / "summaries" / "evaluation.json", summary, indent=2)
