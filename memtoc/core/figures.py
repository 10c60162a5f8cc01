"""Seaborn figures for the notebooks and the report. Each function saves a PNG and returns its path.

* :func:`save` — save any matplotlib figure (creates folders, closes the figure); reuse it.
* :func:`source_matrix` — the four-cell source-correctness matrix per model: memory correct /
  incorrect × tool correct / incorrect, with episode counts and the tool-follow and memory-keep
  rates in each cell.
* :func:`headline` — headline metrics with 95% intervals, per formulation and pooled, per model.
* :func:`prompting_tradeoffs` — per prompting arm, the paired change vs untreated in retention
  (gain), correct-tool following (loss) and error abstention, with 95% intervals.
* :func:`replication_intervals` — this run's intervals beside the paper's printed values
  (notebook 08's "This run and the paper").

Inputs are tidy DataFrames (see :func:`memtoc.stages.evaluation.tables.headline_table` and
:func:`memtoc.stages.evaluation.tables.contrast_table`) or a scored frame, so figures never recompute statistics.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.rcParams.setdefault("figure.dpi", 100)

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from memtoc.core.errors import MemtocError
from memtoc.core.metrics import metric_spec
from memtoc.core.vocab import BASELINE_ARM, CONFLICT_CONDITIONS, DEFAULT_FRAME, FOUR_CELLS, HEADLINE_METRICS

METRIC_LABELS = {
    "retention": "Retention\n(arb, tool wrong)",
    "tool_follow": "Correct-tool\nfollowing",
    "wrong_follow": "Incorrect-tool\nfollowing",
    "err_abstain": "Error\nabstention",
    "cra_arb": "Accuracy (arb)",
    "cra_conflict": "Conflict\naccuracy",
    "agree_acc": "Agreement\naccuracy",
    "nc_acc": "No-conflict accuracy\n(= correct-tool following\nunder greedy decoding)",
}


def metric_label(name: str) -> str:
    """A metric's axis label: the two-line form above, else the registry's ``MetricSpec.label``."""
    if name in METRIC_LABELS:
        return METRIC_LABELS[name]
    try:
        return metric_spec(name).label
    except (KeyError, MemtocError):
        return name


FORM_ORDER = ("reference", "paraphrase_a", "paraphrase_b", "pooled")


class FigureError(MemtocError):
    """The data handed to a figure function cannot be drawn (empty, missing columns)."""


def save(fig, path) -> Path:
    """Save ``fig`` as PNG at ``path`` (folders created), close it, return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path


def _need(df: pd.DataFrame, cols: Sequence[str], what: str) -> None:
    if df is None or len(df) == 0:
        raise FigureError(f"{what}: nothing to draw (empty table)")
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise FigureError(f"{what}: the table lacks column(s) {missing}")


def source_matrix_counts(scored: pd.DataFrame) -> pd.DataFrame:
    """Tidy counts behind :func:`source_matrix`: one row per (model, memory, tool) cell with
    ``n``, ``follow_rate`` (followed the tool value) and ``keep_rate`` (kept the memory answer).

    Uses the untreated, schema-frame tool_right and tool_wrong episodes whose memory was elicited
    (mem_absent excluded), pooled over formulations.
    """
    _need(scored, ["model", "condition", "cell", "followed_tool", "kept_memory"], "source_matrix")
    d = scored[scored["condition"].isin(CONFLICT_CONDITIONS)]
    if "arm" in d.columns:
        d = d[d["arm"] == BASELINE_ARM]
    if "frame" in d.columns:
        d = d[d["frame"] == DEFAULT_FRAME]
    d = d[d["cell"].isin(FOUR_CELLS)]
    mem = {"agree": "memory correct", "arb": "memory correct", "tool_gold": "memory incorrect",
           "both_wrong": "memory incorrect"}
    tool = {"agree": "tool correct", "arb": "tool incorrect", "tool_gold": "tool correct",
            "both_wrong": "tool incorrect"}
    rows = []
    for model in sorted(scored["model"].unique()):
        dm = d[d["model"] == model]
        for cell in FOUR_CELLS:
            dc = dm[dm["cell"] == cell]
            n = len(dc)
            rows.append({"model": model, "cell": cell, "memory": mem[cell], "tool": tool[cell], "n": n,
                         "follow_rate": float(dc["followed_tool"].mean()) if n else np.nan,
                         "keep_rate": float(dc["kept_memory"].mean()) if n else np.nan})
    return pd.DataFrame(rows)


def source_matrix(scored: pd.DataFrame, path) -> Path:
    """Four-cell matrix per model (one panel each); colour = tool-follow rate."""
    t = source_matrix_counts(scored)
    models = list(dict.fromkeys(t["model"]))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models) + 0.8, 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        tm = t[t["model"] == model]
        rate = tm.pivot(index="memory", columns="tool", values="follow_rate")
        rate = rate.reindex(index=["memory correct", "memory incorrect"], columns=["tool correct", "tool incorrect"])
        ann = rate.copy().astype(object)
        for _, r in tm.iterrows():
            fr = "–" if np.isnan(r["follow_rate"]) else f"{100 * r['follow_rate']:.0f}%"
            kr = "–" if np.isnan(r["keep_rate"]) else f"{100 * r['keep_rate']:.0f}%"
            ann.loc[r["memory"], r["tool"]] = f"{r['cell']}\nn={r['n']}\nfollow tool {fr}\nkeep memory {kr}"
        sns.heatmap(rate.astype(float), ax=ax, annot=ann.values, fmt="", vmin=0, vmax=1, cmap="rocket_r",
                    cbar=ax is axes[0][-1], cbar_kws={"label": "tool-follow rate"}, annot_kws={"fontsize": 8})
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("")
        ax.set_ylabel("")
    fig.suptitle("Source-correctness cells (tool_right + tool_wrong, pooled over formulations)", fontsize=10)
    fig.tight_layout()
    return save(fig, path)


def headline(table: pd.DataFrame, path, metrics: Sequence[str] = HEADLINE_METRICS) -> Path:
    """Point estimates with 95% intervals per metric, one colour per formulation (+ pooled),
    one panel per model. ``table`` columns: model, formulation, metric, value, lo, hi, n."""
    _need(table, ["model", "formulation", "metric", "value", "lo", "hi"], "headline")
    t = table[table["metric"].isin(metrics)].copy()
    if t.empty:
        raise FigureError(f"headline: none of the metrics {list(metrics)} are in the table")
    models = list(dict.fromkeys(t["model"]))
    forms = [f for f in FORM_ORDER if f in set(t["formulation"])] + sorted(set(t["formulation"]) - set(FORM_ORDER))
    mets = [m for m in metrics if m in set(t["metric"])]
    palette = dict(zip(forms, sns.color_palette("deep", len(forms))))
    if "pooled" in palette:
        palette["pooled"] = (0.1, 0.1, 0.1)
    fig, axes = plt.subplots(1, len(models), figsize=(max(5.0, 1.5 * len(mets) + 2) * len(models), 3.8),
                             squeeze=False, sharey=True)
    width = 0.8 / len(forms)
    for ax, model in zip(axes[0], models):
        tm = t[t["model"] == model]
        for j, f in enumerate(forms):
            tf = tm[tm["formulation"] == f].set_index("metric").reindex(mets)
            x = np.arange(len(mets)) - 0.4 + width * (j + 0.5)
            v = tf["value"].to_numpy(float)
            lo = tf["lo"].to_numpy(float)
            hi = tf["hi"].to_numpy(float)
            err = np.vstack([np.where(np.isnan(lo), 0, v - lo), np.where(np.isnan(hi), 0, hi - v)])
            ax.errorbar(x, v, yerr=err, fmt="o" if f != "pooled" else "D", color=palette[f], label=f,
                        capsize=3, ms=5 if f != "pooled" else 6, lw=1.2)
        ax.set_xticks(np.arange(len(mets)))
        ax.set_xticklabels([metric_label(m) for m in mets], fontsize=8)
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(model, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("rate (95% CI, question-clustered)")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    return save(fig, path)


def prompting_tradeoffs(contrasts: pd.DataFrame, path,
                        metrics: Sequence[str] = ("retention", "tool_follow", "err_abstain")) -> Path:
    """Paired change vs untreated (pooled over formulations) per prompting arm: retention gain,
    correct-tool loss, error-abstention change, with 95% intervals; one panel per model.
    ``contrasts`` columns: model, arm, metric, delta, lo, hi (see tables.contrast_table)."""
    _need(contrasts, ["model", "arm", "metric", "delta", "lo", "hi"], "prompting_tradeoffs")
    t = contrasts[contrasts["metric"].isin(metrics)].copy()
    if t.empty:
        raise FigureError("prompting_tradeoffs: no contrasts for the requested metrics")
    models = list(dict.fromkeys(t["model"]))
    arms = list(dict.fromkeys(t["arm"]))
    mets = [m for m in metrics if m in set(t["metric"])]
    palette = dict(zip(mets, sns.color_palette("colorblind", len(mets))))
    fig, axes = plt.subplots(1, len(models), figsize=(max(4.5, 1.6 * len(arms) + 2) * len(models), 3.6),
                             squeeze=False, sharey=True)
    width = 0.8 / len(mets)
    for ax, model in zip(axes[0], models):
        tm = t[t["model"] == model]
        for j, m in enumerate(mets):
            tmm = tm[tm["metric"] == m].set_index("arm").reindex(arms)
            x = np.arange(len(arms)) - 0.4 + width * (j + 0.5)
            v = tmm["delta"].to_numpy(float)
            lo = tmm["lo"].to_numpy(float)
            hi = tmm["hi"].to_numpy(float)
            ax.bar(x, np.nan_to_num(v), width=width * 0.9, color=palette[m],
                   label=metric_label(m).replace("\n", " "))
            err = np.vstack([np.where(np.isnan(lo), 0, v - lo), np.where(np.isnan(hi), 0, hi - v)])
            ax.errorbar(x, np.nan_to_num(v), yerr=np.nan_to_num(err), fmt="none", ecolor="k", capsize=3, lw=1)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xticks(np.arange(len(arms)))
        ax.set_xticklabels(arms)
        ax.set_title(model, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("change vs untreated (pooled, 95% CI)")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    return save(fig, path)


def replication_intervals(rows: pd.DataFrame, path) -> Path:
    """This run beside the paper: per compared number, the run's value with its 95% interval
    (a bar) and the paper's printed value (a point: filled inside the interval, a cross outside).
    ``rows`` columns: label, run, lo, hi, paper, inside (see memtoc.stages.report.replication.build); rates and
    changes as fractions, drawn in percent."""
    _need(rows, ["label", "run", "lo", "hi", "paper", "inside"], "replication_intervals")
    if rows.empty:
        raise FigureError("replication_intervals: no interval to draw")
    y = np.arange(len(rows))[::-1]
    run, lo, hi, paper = (100 * rows[c].to_numpy(float) for c in ("run", "lo", "hi", "paper"))
    inside = rows["inside"].to_numpy(bool)
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.32 * len(rows)))
    ax.hlines(y, lo, hi, color="0.45", lw=3, label="this run: 95% interval")
    ax.plot(run, y, "|", color="k", ms=10, label="this run: value")
    ax.plot(paper[inside], y[inside], "o", color="tab:green", label="paper: inside")
    ax.plot(paper[~inside], y[~inside], "x", color="tab:red", ms=8, mew=2, label="paper: outside")
    ax.set_yticks(y)
    ax.set_yticklabels(rows["label"], fontsize=8)
    ax.axvline(0, color="k", lw=0.6)
    ax.set_xlabel("percent (rates) / percentage points (changes)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    return save(fig, path)
