"""Tables and the figure of ``summaries/transfer.json`` (for notebook 06)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from memtoc.stages import finetune
from memtoc.stages.transfer.core import REVERSE_OBJECTIVE, TABLE6_METRICS


def published_table(summary: dict[str, Any]) -> pd.DataFrame:
    """The paper's Table 6 (deltas with intervals) and reverse-transfer rows."""
    pub = summary.get("published") or {}
    rows = []
    for a in pub.get("arms") or []:
        for col in ("value_frame", "passage_frame", "abstention"):
            c = a.get(col) or {}
            rows.append({"source": "paper (different model and data)", "model": a["model"], "arm": a["method"],
                         "metric": col, "delta": c.get("delta"), "ci95": c.get("ci95")})
        rows.append({"source": "paper (different model and data)", "model": a["model"], "arm": a["method"],
                     "metric": "closed_book_change", "delta": a.get("closed_book_retention_change"), "ci95": None})
    for m, r in (pub.get("reverse_transfer") or {}).items():
        if isinstance(r, dict) and "delta" in r:
            rows.append({"source": "paper (different model and data)", "model": m, "arm": "reverse DPO",
                         "metric": "MemToC retention", "delta": r["delta"], "ci95": r.get("ci95")})
    return pd.DataFrame(rows)


def _pooled_rows(summary: dict[str, Any], section: str, entries: str, columns: tuple[str, ...]) -> pd.DataFrame:
    """One row per model × arm × metric: the pooled entry of ``models.<model>.<section>.<arm>.<entries>
    .<metric>``, its ``columns`` in order (``ci_lo`` and ``ci_hi``: the ends of its ``ci95``)."""
    rows = []
    for model, ms in summary.get("models", {}).items():
        for arm, a in ms.get(section, {}).items():
            for m, by in a[entries].items():
                r = by.get("pooled") or {}
                ci = r.get("ci95") or [None, None]
                ends = {"ci_lo": ci[0], "ci_hi": ci[1]}
                rows.append({"model": model, "arm": arm, "metric": m,
                             **{c: ends[c] if c in ends else r.get(c) for c in columns}})
    return pd.DataFrame(rows)


def rates_table(summary: dict[str, Any]) -> pd.DataFrame:
    """Pooled rate of every metric per model × arm, with interval and n."""
    return _pooled_rows(summary, "arms", "rates", ("value", "ci_lo", "ci_hi", "n"))


def forward_table(summary: dict[str, Any]) -> pd.DataFrame:
    """Pooled forward deltas (adapter − untreated) per model × arm × metric."""
    return _pooled_rows(summary, "forward", "deltas",
                        ("untreated", "treated", "delta", "ci_lo", "ci_hi", "p", "p_holm", "n_units"))


def reverse_table(summary: dict[str, Any]) -> pd.DataFrame:
    """Reverse-transfer deltas on MemToC (finetune.delta_table layout)."""
    wrapped = {"models": {m: {"objectives": {REVERSE_OBJECTIVE: ms["reverse"]}}
                          for m, ms in summary.get("models", {}).items() if ms.get("reverse")}}
    return finetune.delta_table(wrapped)


def plot(summary: dict[str, Any], path) -> Path:
    """Forward deltas (Table 6 metrics + closed-book change) and reverse deltas (MemToC pooled
    headline metrics), 95% intervals."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fw = forward_table(summary)
    rv = reverse_table(summary)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, t, title, xcol in ((axes[0], fw[fw["metric"].isin(list(TABLE6_METRICS) + ["closed_book_acc"])] if len(fw) else fw,
                                "forward: 04's adapters on the external set", "metric"),
                               (axes[1], rv[rv["formulation"] == "pooled"] if len(rv) else rv,
                                "reverse: external-set DPO on MemToC", "metric")):
        if len(t):
            groups = list(dict.fromkeys(t[xcol]))
            arms = list(dict.fromkeys(t["arm"] if "arm" in t else t["objective"]))
            for j, arm in enumerate(arms):
                d = t[(t["arm"] if "arm" in t else t["objective"]) == arm]
                for i, g in enumerate(groups):
                    r = d[d[xcol] == g]
                    if r.empty or r.iloc[0]["delta"] is None or pd.isna(r.iloc[0]["delta"]):
                        continue
                    r = r.iloc[0]
                    x = i + (j - (len(arms) - 1) / 2) * 0.2
                    lo = r["delta"] - r["ci_lo"] if pd.notna(r["ci_lo"]) else 0
                    hi = r["ci_hi"] - r["delta"] if pd.notna(r["ci_hi"]) else 0
                    first = arm not in ax.get_legend_handles_labels()[1]
                    ax.errorbar(x, r["delta"], yerr=[[lo], [hi]], fmt="o", capsize=3, color=f"C{j}",
                                label=arm if first else None)
            ax.set_xticks(range(len(groups)))
            ax.set_xticklabels(groups, rotation=25, ha="right")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(frameon=False, fontsize=8)
        else:
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_title(title, fontsize=10)
    axes[0].set_ylabel("adapter − untreated")
    note = "built-in plumbing set: not a replication" if (summary.get("dataset") or {}).get("plumbing") else ""
    fig.suptitle(f"Transfer (06){' — ' + note if note else ''}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
