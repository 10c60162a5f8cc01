"""The release's aggregates rebuilt as the pipeline's inputs: scored frames and paired units.

The release ships rates with their denominators, not episodes. :func:`release_frame` rebuilds a
scored frame with exactly those counts, so ``memtoc.core.metrics`` and ``memtoc.stages.evaluation.analyses`` run on it as
on a run's own episodes; :func:`release_units` rebuilds paired units with the release's net counts
for ``memtoc.core.stats.paired_contrast``.
"""
from __future__ import annotations

from typing import Any, Optional

import pandas as pd

from memtoc.core.vocab import BASELINE_ARM, DEFAULT_FRAME, DEFAULT_PAYLOAD
from memtoc.stages.report.published.result import PublishedCheckError

PV_FORMULATION = {"canonical_pv0": "reference", "canonical_pv1": "paraphrase_a", "canonical_pv2": "paraphrase_b"}
#: memtoc's arm -> the release's arm prefix
RELEASE_ARM = {BASELINE_ARM: "canonical", "warn": "control_warn", "prior": "control_prior", "flag": "control_flag"}


def count_of(rate: float, n: int, where: str) -> int:
    """The integer count behind a release rate printed to 4 decimals over ``n``."""
    k = int(round(float(rate) * n))
    if n and round(k / n, 4) != round(float(rate), 4):
        raise PublishedCheckError(f"{where}: rate {rate} is not a count over n={n}")
    return k


def release_frame(blocks: dict[str, dict[str, Any]], n_err: Optional[int] = None, where: str = "") -> pd.DataFrame:
    """A scored frame (the columns ``metrics`` reads) whose counts are the release's: ``blocks``
    maps formulation -> one release arm block (keep_strict, n_both_in_arb, CRA_arb, n_arb,
    prior_bw, tool_gold_follow, nc_CRA, n_bw, te_abstain; absent fields are skipped). Per
    formulation: ``n_arb`` tool_wrong episodes in the arb cell (kept / both / followed, CRA_arb of
    them correct), ``n_bw`` tool_wrong episodes in both_wrong (prior_bw of them follow the tool),
    ``n_bw`` tool_right episodes in tool_gold (the same questions: memory wrong; tool_gold_follow
    follow, nc_CRA correct) and ``n_err`` tool_error episodes (te_abstain abstain). Question keys
    are positional (``q0000`` ...), the same in every arm, so arms pair question by question."""
    rows: list[dict[str, Any]] = []

    def ep(form, i, cond, cell, outcome="neither", correct=False, abstain=False):
        rows.append({"formulation": form, "qkey": f"q{i:04d}", "condition": cond, "cell": cell,
                     "followed_tool": outcome in ("followed_tool", "both"),
                     "kept_memory": outcome in ("kept_memory", "both"), "outcome": outcome,
                     "final_correct": bool(correct), "abstain": bool(abstain)})

    for form, b in blocks.items():
        w = f"{where} {form}"
        n_arb = b.get("n_arb")
        if n_arb is not None and "keep_strict" in b:
            keep = count_of(b["keep_strict"], n_arb, w + " keep")
            both = int(b.get("n_both_in_arb", 0))
            cra = count_of(b["CRA_arb"], n_arb, w + " CRA_arb") if "CRA_arb" in b else 0
            for i in range(n_arb):
                out = "kept_memory" if i < keep else "both" if i < keep + both else "followed_tool"
                ep(form, i, "tool_wrong", "arb", out, correct=i < cra)
        n_bw = b.get("n_bw")
        if n_bw is not None:
            if "prior_bw" in b:
                k = count_of(b["prior_bw"], n_bw, w + " prior_bw")
                for i in range(n_bw):
                    ep(form, 5000 + i, "tool_wrong", "both_wrong", "followed_tool" if i < k else "neither")
            if "tool_gold_follow" in b:
                k = count_of(b["tool_gold_follow"], n_bw, w + " tool_gold_follow")
                c = count_of(b["nc_CRA"], n_bw, w + " nc_CRA") if "nc_CRA" in b else 0
                for i in range(n_bw):
                    ep(form, 5000 + i, "tool_right", "tool_gold", "followed_tool" if i < k else "neither",
                       correct=i < c)
        if n_err and "te_abstain" in b:
            k = count_of(b["te_abstain"], n_err, w + " te_abstain")
            for i in range(n_err):
                ep(form, i, "tool_error", "tool_error", abstain=i < k)
    return pd.DataFrame(rows)


def arm_blocks(arm_metrics: dict, model: str, arm: str, layer: str = "judged") -> dict[str, dict]:
    """``{formulation: release block}`` of one model and arm (memtoc's arm name)."""
    blocks = arm_metrics[layer][model]
    return {form: blocks[f"{RELEASE_ARM[arm]}_{pv.split('_')[1]}"] for pv, form in PV_FORMULATION.items()}


def arms_frame(arm_metrics: dict, model: str, arms: tuple[str, ...], n_err: int, layer: str = "judged") -> pd.DataFrame:
    """One model's scored frame over ``arms`` (every formulation), with the columns the section
    builders of :mod:`memtoc.stages.evaluation.analyses` select on (``arm``, ``frame``, ``payload_kind``)."""
    parts = []
    for arm in arms:
        f = release_frame(arm_blocks(arm_metrics, model, arm, layer), n_err, f"{layer} {model} {arm}")
        parts.append(f.assign(model=model, arm=arm, frame=DEFAULT_FRAME, payload_kind=DEFAULT_PAYLOAD))
    return pd.concat(parts, ignore_index=True)


def release_units(per_slice: dict[str, dict[str, Any]], where: str = "") -> pd.DataFrame:
    """Paired units (``treated``, ``untreated``, ``cluster``) whose per-slice net change is the
    release's: slice s has ``n_units`` units, round(delta x n) of them +1 (or -1), the rest 0.
    The arrangement is unknown (the release ships no units), so only the delta and the unit
    counts of ``stats.paired_contrast`` on them are the release's, not its interval or p."""
    t, u, cl = [], [], []
    for sl, c in per_slice.items():
        n = int(c["n_units"])
        net = count_of(c["delta"], n, f"{where} {sl}")
        for i in range(n):
            up = i < abs(net)
            t.append(1.0 if up and net > 0 else 0.0)
            u.append(1.0 if up and net < 0 else 0.0)
            cl.append(f"{sl}:{i}")
    return pd.DataFrame({"treated": t, "untreated": u, "cluster": cl})
