"""The sections of the extra arms (``vocab.EXTRA_ARM_SPECS``), each against the untreated schema
baseline on the questions the arm was run on: prompting strategies and the protocol-sentence
ablation (:func:`arm_comparison`), presentation frames, far vs near incorrect values, tool-error
payload kinds and the NoopTool control. Rates and contrasts through :mod:`memtoc.core.intervals`."""
from __future__ import annotations

from typing import Any, Sequence

import pandas as pd

from memtoc.core import intervals, stats
from memtoc.core.io import plain
from memtoc.core.metrics import metric_units
from memtoc.core.vocab import (
    ALT_FRAMES,
    BASELINE_ARM,
    CONFLICT_CONDITIONS,
    DEFAULT_FRAME,
    DEFAULT_PAYLOAD,
    REFERENCE_FORMULATION,
)
from memtoc.stages.evaluation.analyses.subsets import present_formulations, restrict_questions, select_arm


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
    base = restrict_questions(select_arm(scored), qk)
    forms = present_formulations(base, formulations)
    out: dict[str, Any] = {"n_questions": len(qk), "family": family}
    out.update(_variants_vs_base(base, BASELINE_ARM, {a: select_arm(scored, arm=a) for a in present},
                                 metric_names, forms, n_boot, n_perm, seed))
    return out


def _variants_vs_base(base: pd.DataFrame, base_name: str, variants: dict[str, pd.DataFrame],
                     metric_names: Sequence[str], forms: Sequence[str], n_boot: int, n_perm: int,
                     seed: int) -> dict[str, Any]:
    """``{base_name: {form|pooled: {metric: interval}}, variant: {..., "contrasts": {metric: contrast}}}``
    with each variant's rates, its paired contrast vs the base, pooled and per formulation."""
    out: dict[str, Any] = {base_name: {}}
    base_units = {m: metric_units(base, m) for m in metric_names}
    for m in metric_names:
        intervals.add_rates(out[base_name], m, base_units[m], forms, n_boot, seed)
    for name, d in variants.items():
        out[name] = {"contrasts": {}, "contrasts_by_formulation": {}}
        for m in metric_names:
            u = metric_units(d, m)
            intervals.add_rates(out[name], m, u, forms, n_boot, seed)
            out[name]["contrasts"][m] = intervals.contrast(u, base_units[m], n_boot, n_perm, seed, name, base_name)
            b = base_units[m]
            for f in forms:      # the preregistered families are corrected in every slice
                out[name]["contrasts_by_formulation"].setdefault(f, {})[m] = intervals.contrast(
                    u[u["formulation"] == f], b[b["formulation"] == f], n_boot, n_perm, seed, name, base_name)
    return out


def add_reference_contrasts(section: dict, scored: pd.DataFrame, arm: str, metric_names: Sequence[str],
                            n_boot: int, n_perm: int, seed: int) -> dict:
    """Add ``contrasts_reference`` (the arm vs untreated on the Reference formulation alone, as the
    paper reports the protocol-sentence ablation) beside the pooled ``contrasts`` (in place)."""
    if arm not in section:
        return section
    qk = set(scored.loc[scored["arm"] == arm, "qkey"])
    base = restrict_questions(select_arm(scored), qk)
    base, treat = (d[d["formulation"] == REFERENCE_FORMULATION] for d in (base, select_arm(scored, arm=arm)))
    if treat.empty:
        return section
    section[arm]["contrasts_reference"] = {
        m: intervals.contrast(metric_units(treat, m), metric_units(base, m), n_boot, n_perm, seed, arm, BASELINE_ARM)
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
    base = restrict_questions(select_arm(scored, conditions=CONFLICT_CONDITIONS), qk)
    forms = present_formulations(base, formulations)
    out: dict[str, Any] = {"n_questions": len(qk)}
    out.update(_variants_vs_base(base, DEFAULT_FRAME, {fr: select_arm(scored, frame=fr) for fr in frames},
                                 mets, forms, n_boot, n_perm, seed))
    return out


def _on_common_support(far: pd.DataFrame, near: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """The far and near episodes of the (formulation, qkey) pairs holding both, and the number of
    questions among them."""
    common = pd.merge(far[["formulation", "qkey"]].drop_duplicates(), near[["formulation", "qkey"]].drop_duplicates())
    keep = set(map(tuple, common.to_numpy()))

    def cs(d):
        return d[[(f, q) in keep for f, q in zip(d["formulation"], d["qkey"])]]

    return cs(far), cs(near), int(common["qkey"].nunique())


def far_comparison(scored: pd.DataFrame, formulations: Sequence[str] | None = None,
                   n_boot: int = stats.DEFAULT_N_BOOT, n_perm: int = 10000, seed: int = 0) -> dict:
    """Far vs near incorrect values on common support ((formulation, qkey) with both): retention
    and incorrect-tool following; contrasts far − near, Holm over the two metrics."""
    far = select_arm(scored, conditions=["tool_far"])
    if far.empty:
        return {}
    far, near, n_common = _on_common_support(far, select_arm(scored, conditions=["tool_wrong"]))
    forms = present_formulations(near, formulations)
    out: dict[str, Any] = {"n_common": n_common, "near": {}, "far": {}, "contrasts": {}}
    for m in ("retention", "wrong_follow", "incorrect_value_follow"):
        un = metric_units(near, m, condition="tool_wrong")
        uf = metric_units(far, m, condition="tool_far")
        intervals.add_rates(out["near"], m, un, forms, n_boot, seed)
        intervals.add_rates(out["far"], m, uf, forms, n_boot, seed)
        out["contrasts"][m] = intervals.contrast(uf, un, n_boot, n_perm, seed, "far", "near")
        ref = REFERENCE_FORMULATION
        if ref in forms:     # the paper reports far vs near on the Reference formulation (pv0)
            out.setdefault("contrasts_reference", {})[m] = intervals.contrast(
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
    d = restrict_questions(d, qk)
    forms = present_formulations(d, formulations)
    out: dict[str, Any] = {"n_questions": len(qk), "contrasts": {}}
    units = {k: metric_units(d[d["payload_kind"] == k], "err_abstain") for k in [DEFAULT_PAYLOAD] + sorted(kinds)}
    for k, u in units.items():
        out[k] = {f: {"err_abstain": v} for f, v in intervals.rate_intervals(u, forms, n_boot, seed).items()}
    for k in sorted(kinds):
        out["contrasts"][k] = intervals.contrast(units[k], units[DEFAULT_PAYLOAD], n_boot, n_perm, seed, k,
                                                 DEFAULT_PAYLOAD)
    intervals.apply_holm(out["contrasts"])
    return out


def noop_comparison(scored: pd.DataFrame, formulations: Sequence[str] | None = None,
                    n_boot: int = stats.DEFAULT_N_BOOT, n_perm: int = 10000, seed: int = 0) -> dict:
    """NoopTool control vs no_tool (the closed-book answer): answer accuracy and abstention over
    all episodes, on common support; contrasts noop − no_tool, Holm over the two metrics."""
    noop = select_arm(scored, conditions=["noop"])
    if noop.empty:
        return {}
    nt = restrict_questions(select_arm(scored, conditions=["no_tool"]), set(noop["qkey"]))
    forms = present_formulations(noop, formulations)
    out: dict[str, Any] = {"n_questions": int(noop["qkey"].nunique()), "noop": {}, "no_tool": {}, "contrasts": {}}
    for m in ("accuracy", "abstain"):
        un = metric_units(noop, m, condition="noop")
        ut = metric_units(nt, m, condition="no_tool")
        intervals.add_rates(out["noop"], m, un, forms, n_boot, seed)
        intervals.add_rates(out["no_tool"], m, ut, forms, n_boot, seed)
        out["contrasts"][m] = intervals.contrast(un, ut, n_boot, n_perm, seed, "noop", "no_tool")
    intervals.apply_holm(out["contrasts"])
    return out
