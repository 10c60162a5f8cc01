"""Tidy and display tables of a ``summaries/evaluation.json`` dict (notebook 03, the report)."""
from __future__ import annotations

import math
from typing import Sequence

import pandas as pd

from memtoc.core.vocab import FORMULATIONS, POOLED


def headline_table(summary: dict, section: str = "headline") -> pd.DataFrame:
    """Tidy rows (model, formulation, metric, value, lo, hi, n) of ``models/<m>/<section>``."""
    rows = []
    for model, s in summary["models"].items():
        for form, mets in (s.get(section) or {}).items():
            if not isinstance(mets, dict):
                continue
            for metric, iv in mets.items():
                if isinstance(iv, dict) and "value" in iv:
                    ci = iv.get("ci95") or [None, None]
                    rows.append({"model": model, "formulation": form, "metric": metric, "value": iv["value"],
                                 "lo": ci[0], "hi": ci[1], "n": iv["n"]})
    return pd.DataFrame(rows, columns=["model", "formulation", "metric", "value", "lo", "hi", "n"])


def arms_table(summary: dict, section: str) -> pd.DataFrame:
    """Tidy rows (model, arm, formulation, metric, value, lo, hi, n) of an arm-style section
    (prompting, protocol, frames, far, payloads, noop)."""
    rows = []
    for model, s in summary["models"].items():
        for arm, body in (s.get(section) or {}).items():
            if not isinstance(body, dict) or arm == "contrasts":
                continue
            for form, mets in body.items():
                if form in ("contrasts", "success") or not isinstance(mets, dict):
                    continue
                for metric, iv in mets.items():
                    if isinstance(iv, dict) and "value" in iv:
                        ci = iv.get("ci95") or [None, None]
                        rows.append({"model": model, "arm": arm, "formulation": form, "metric": metric,
                                     "value": iv["value"], "lo": ci[0], "hi": ci[1], "n": iv["n"]})
    return pd.DataFrame(rows, columns=["model", "arm", "formulation", "metric", "value", "lo", "hi", "n"])


def contrast_table(summary: dict, section: str = "prompting") -> pd.DataFrame:
    """Tidy rows (model, arm, metric, delta, lo, hi, p, p_holm, n_units, n_clusters) of the
    contrasts in a section."""
    rows = []

    def add(model, arm, metric, c):
        ci = c.get("ci95") or [None, None]
        rows.append({"model": model, "arm": arm, "metric": metric, "delta": c.get("delta"), "lo": ci[0],
                     "hi": ci[1], "p": c.get("p"), "p_holm": c.get("p_holm"),
                     "n_units": c.get("n_units"), "n_clusters": c.get("n_clusters")})

    for model, s in summary["models"].items():
        sec = s.get(section) or {}
        for arm, body in sec.items():
            if not isinstance(body, dict):
                continue
            if arm == "contrasts":  # far / payloads / noop: contrasts at section level
                for metric, c in body.items():
                    add(model, section, metric, c)
            elif "contrasts" in body:
                for metric, c in body["contrasts"].items():
                    add(model, arm, metric, c)
    return pd.DataFrame(rows, columns=["model", "arm", "metric", "delta", "lo", "hi", "p", "p_holm",
                                       "n_units", "n_clusters"])


def success_table(summary: dict) -> pd.DataFrame:
    rows = []
    for model, s in summary["models"].items():
        for arm, body in (s.get("prompting") or {}).items():
            if isinstance(body, dict) and body.get("success"):
                rows.append({"model": model, "arm": arm, **body["success"]})
    return pd.DataFrame(rows)


def _fmt(v, lo, hi, n) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return f"– (n={int(n)})" if n == n and n is not None else "–"
    s = f"{100 * v:.1f}"
    if lo is not None and hi is not None and not (isinstance(lo, float) and math.isnan(lo)):
        s += f" [{100 * lo:.1f}, {100 * hi:.1f}]"
    return s + f" n={int(n)}"


def format_table(t: pd.DataFrame, index: Sequence[str], columns: str) -> pd.DataFrame:
    """Pivot a tidy interval table into "value [lo, hi] n=…" strings (percent) for display."""
    if t.empty:
        return t
    t = t.assign(cell=[_fmt(v, lo, hi, n) for v, lo, hi, n in zip(t["value"], t["lo"], t["hi"], t["n"])])
    out = t.pivot_table(index=list(index), columns=columns, values="cell", aggfunc="first")
    if columns == "formulation":
        out = out[[c for c in list(FORMULATIONS) + [POOLED] if c in out.columns]]
    return out


def matcher_table(summary: dict) -> pd.DataFrame:
    """Rows (model, formulation, metric, paper, strict, delta) of the matcher sensitivity."""
    rows = []
    for model, s in summary["models"].items():
        ms = s.get("matcher_sensitivity") or {}
        for form, mets in ms.items():
            if form in ("changed_decisions", "n_episodes") or not isinstance(mets, dict):
                continue
            for metric, v in mets.items():
                rows.append({"model": model, "formulation": form, "metric": metric, **v})
    return pd.DataFrame(rows)


def ranking_table(summary: dict) -> pd.DataFrame:
    """One row per headline metric: the full orderings (pooled and per formulation) and whether the
    full ordering holds everywhere (the paper's rule); the pairwise reading is a separate, labelled
    column; a base model appears only in the Reference ordering."""
    rows = []
    for metric, r in (summary.get("ranking_stability") or {}).items():
        orders = r.get("orders", {})
        rows.append({"metric": metric, "pooled_order": " < ".join(orders.get(POOLED, [])),
                     **{f"order_{f}": " < ".join(o) for f, o in orders.items() if f != POOLED},
                     "full_order_stable (paper's rule)": r.get("full_order_stable"),
                     "reference_order (incl. base)": " < ".join(r.get("reference_order", [])),
                     "pairwise reading (not the paper's rule)": ", ".join(r.get("stable_pairs", []))})
    return pd.DataFrame(rows)


def family_table(summary: dict) -> pd.DataFrame:
    """One row per Holm family member and slice: ``family, metric, slice, member, p_holm`` (the
    families as ``stats.apply_families`` wrote them under ``holm_families``)."""
    rows = [{"family": f, "metric": v.get("metric"), "test": v.get("test"), "slice": s, "member": k, "p_holm": p}
            for f, v in (summary.get("holm_families") or {}).items()
            for s, members in (v.get("members") or {}).items() if isinstance(members, dict)
            for k, p in members.items()]
    return pd.DataFrame(rows, columns=["family", "metric", "test", "slice", "member", "p_holm"])

