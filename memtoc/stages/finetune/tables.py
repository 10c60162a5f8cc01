"""Tables and figures of the fine-tuning summary (for the notebook)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from memtoc.core.vocab import FORMULATIONS
from memtoc.stages.finetune.common import METRICS, OBJECTIVES


def delta_table(summary: dict[str, Any]):
    """Long DataFrame: model, objective, metric, formulation, delta, ci_lo, ci_hi, p, p_holm,
    n_units, n_treated_only, n_untreated_only, treated, untreated."""
    rows = []
    for model, ms in summary.get("models", {}).items():
        for obj, os_ in ms.get("objectives", {}).items():
            for metric, by_form in os_.get("deltas", {}).items():
                for form, c in by_form.items():
                    ci = c.get("ci95") or [None, None]
                    rows.append({"model": model, "objective": obj, "metric": metric, "formulation": form,
                                 "delta": c.get("delta"), "ci_lo": ci[0], "ci_hi": ci[1], "p": c.get("p"),
                                 "p_holm": c.get("p_holm"), "n_units": c.get("n_units"),
                                 "n_treated_only": c.get("n_treated_only"),
                                 "n_untreated_only": c.get("n_untreated_only"),
                                 "treated": c.get("treated"), "untreated": c.get("untreated")})
    return pd.DataFrame(rows)


def closed_book_table(summary: dict[str, Any]):
    """One row per adapter and formulation (+ ``all``): its own forced closed-book counts beside the
    untreated model's on the same questions, and how many answers changed status."""
    rows = []
    for model, ms in summary.get("models", {}).items():
        for obj, by_fold in ms.get("adapters", {}).items():
            for fold, a in by_fold.items():
                for form, c in (a.get("closed_book") or {}).items():
                    rows.append({"model": model, "objective": obj, "fold": fold, "formulation": form, **c})
    return pd.DataFrame(rows)


def criterion_table(summary: dict[str, Any]):
    """DataFrame: model, objective, formulation (pooled + each), passed, retention/tool deltas, reason."""
    rows = []
    for model, ms in summary.get("models", {}).items():
        for obj, os_ in ms.get("objectives", {}).items():
            items = [("pooled", os_.get("criterion"))] + list((os_.get("criterion_by_formulation") or {}).items())
            for form, c in items:
                if c:
                    rows.append({"model": model, "objective": obj, "formulation": form, "passed": c["passed"],
                                 "retention_delta": c["retention_delta"], "retention_p": c["retention_p"],
                                 "tool_delta": c["tool_delta"], "tool_p": c["tool_p"], "reason": c["reason"]})
    return pd.DataFrame(rows)


def adapters_table(summary: dict[str, Any]):
    """One row per adapter: model, objective, fold, steps, examples, seconds, s/step, first/final loss, resumed."""
    rows = []
    for model, ms in summary.get("models", {}).items():
        for obj, by_fold in ms.get("adapters", {}).items():
            for fold, a in by_fold.items():
                rows.append({"model": model, "objective": obj, "fold": fold,
                             **{k: a.get(k) for k in ("steps", "examples", "seconds", "seconds_per_step",
                                                      "first_loss", "final_loss", "resumed")}})
    return pd.DataFrame(rows)


def plot_deltas(summary: dict[str, Any], path) -> Path:
    """Paired deltas (adapter − untreated) with 95% CIs: one panel per metric, objectives as colours,
    formulations (and pooled) on the x axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    t = delta_table(summary).dropna(subset=["delta"])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metrics = [m for m in METRICS if m in set(t["metric"])] or list(METRICS)
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.3 * len(metrics), 3.4), sharey=True, squeeze=False)
    pal = dict(zip(OBJECTIVES, sns.color_palette("deep", len(OBJECTIVES))))
    for ax, m in zip(axes[0], metrics):
        d = t[t["metric"] == m]
        forms = [f for f in list(FORMULATIONS) + ["pooled"] if f in set(d["formulation"])]
        objs = [o for o in OBJECTIVES if o in set(d["objective"])]
        for j, o in enumerate(objs):
            for i, f in enumerate(forms):
                r = d[(d["objective"] == o) & (d["formulation"] == f)]
                if r.empty:
                    continue
                r = r.iloc[0]
                x = i + (j - (len(objs) - 1) / 2) * 0.25
                lo = r["delta"] - r["ci_lo"] if r["ci_lo"] is not None and not np.isnan(r["ci_lo"]) else 0
                hi = r["ci_hi"] - r["delta"] if r["ci_hi"] is not None and not np.isnan(r["ci_hi"]) else 0
                ax.errorbar(x, r["delta"], yerr=[[lo], [hi]], fmt="o", color=pal[o], capsize=3,
                            label=o.upper() if i == 0 else None)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(forms)))
        ax.set_xticklabels(forms, rotation=30, ha="right")
        ax.set_title(m)
    axes[0][0].set_ylabel("adapter − untreated")
    axes[0][0].legend(frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss_curve(curve: Sequence[dict], path, title: str = "") -> Path:
    """Seaborn line plot of the training loss per step (``path``: .png)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    if curve:
        sns.lineplot(data=pd.DataFrame(curve), x="step", y="loss", marker="o", ax=ax)
    ax.set_title(title or "training loss")
    ax.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
