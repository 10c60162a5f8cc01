"""Tables and figures of notebook 05 from ``summaries/probes.json``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from memtoc.core.errors import MemtocError
from memtoc.core.figures import save
from memtoc.generation.models import get_model

SPLIT_STYLE = {"followed_tool": "tab:red", "kept_memory": "tab:blue", "control": "tab:gray"}


def lens_table(summary: dict[str, Any]) -> pd.DataFrame:
    rows = []
    for model, ms in summary["models"].items():
        for st, sd in ms["lens"].items():
            for r in ("jacobian", "logit"):
                row = {"model": model, "set": st, "readout": r, "n_episodes": sd["n_episodes"]}
                for sp in ("followed_tool", "kept_memory", "control"):
                    c = sd[r][sp]
                    row[f"{sp}.median"] = c["median_rank"]
                    row[f"{sp}.top20"] = f"{c['top20']}/{c['n']}"
                rows.append(row)
    return pd.DataFrame(rows)


def quality_table(summary: dict[str, Any]) -> pd.DataFrame:
    rows = []
    for model, ms in summary["models"].items():
        for r, per in ms["lens_quality"].items():
            for l, q in per.items():
                rows.append({"model": model, "readout": r, "layer": int(l), "top1_agreement": q["top1"], "n": q["n"]})
    return pd.DataFrame(rows)


def sae_table(summary: dict[str, Any]) -> pd.DataFrame:
    rows = []
    for model, ms in summary["models"].items():
        for l, m in ms["sae"]["layers"].items():
            rows.append({"model": model, "layer": int(l), "fvu_heldout": m["fvu"], "passes_gate": m["passes_gate"],
                         "l0": m["l0"], "dead_fraction": m["dead_fraction_train"],
                         "spliced_loss_increase": m["spliced_loss"]["increase"], "n_train_tokens": m["n_train_tokens"],
                         "source": m["source"]})
    return pd.DataFrame(rows)


def _arm_cells(ld: dict):
    for d, dd in ld.items():
        if d == "layers" or not isinstance(dd, dict) or "skipped" in dd:
            continue
        for pos, pd_ in dd.items():
            if pos in ("n", "baseline"):
                continue
            for s, c in pd_.items():
                if s != "0":
                    yield d, pos, float(s), c


def _cells(summary: dict[str, Any]):
    """(model, edit, direction, position, strength, cell): ``edit`` is ``L<layer>`` for a single-layer
    edit, the arm's name (``L23-26@last``) for a multi-layer arm."""
    for model, ms in summary["models"].items():
        st = ms["sae"].get("steer", {})
        arms = [(f"L{l}", ld) for l, ld in st.items() if l not in ("bar", "arms", "skipped")]
        arms += list((st.get("arms") or {}).items())
        for name, ld in arms:
            if isinstance(ld, dict) and "skipped" not in ld:
                for d, pos, s, c in _arm_cells(ld):
                    yield model, name, d, pos, s, c


def steer_table(summary: dict[str, Any]) -> pd.DataFrame:
    rows = []
    for model, edit, d, pos, s, c in _cells(summary):
        fr = c["flip_rate"]
        rows.append({"model": model, "edit": edit, "direction": d, "position": pos, "strength": s, "n": c["n"],
                     "flip": fr["value"], "flip_ci95": fr["ci95"], "d_followed_tool": c["delta_followed_tool"],
                     "d_kept_memory": c["delta_kept_memory"], "neither": c["lands_on_neither"]["value"],
                     "degenerate": c["degeneration"]["value"], "clears_bar": c["clears_bar"]})
    return pd.DataFrame(rows)


def plot_lens(summary: dict[str, Any], path: Path, set_name: str = "own_answer") -> Path:
    """Median rank per source layer (log scale) for the two splits and the control, Jacobian lens
    (solid) vs logit lens (dashed), one panel per model."""
    models = list(summary["models"])
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(5.5 * max(1, len(models)), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        sd = summary["models"][model]["lens"][set_name]
        for r, ls in (("jacobian", "-"), ("logit", "--")):
            for sp, col in SPLIT_STYLE.items():
                pl = sd[r]["per_layer"][sp]
                xs = [int(l) for l, v in pl.items() if v is not None]
                ys = [v for v in pl.values() if v is not None]
                if xs:
                    ax.plot(xs, ys, ls, color=col, marker="o", ms=3, label=f"{sp} ({r})")
        ax.set_yscale("log")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("source layer")
        ax.set_ylabel("median rank of the closed-book answer")
        ax.set_title(f"{model}: {set_name} (n={sd['n_episodes']})", fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.suptitle(f"Jacobian lens (solid) vs logit lens (dashed); {lens_provenance(summary)}", fontsize=9)
    return save(fig, path)


def lens_provenance(summary: dict[str, Any]) -> str:
    """What the lens panel shows, from the summary: the kind of models (embedded tiny ones, models of
    the registry) and where each lens came from (given, or fitted on the offline or a named corpus)."""
    tiny = [_embedded(m) for m in summary["models"]]
    who = "tiny model" if all(tiny) else "tiny and registry models" if any(tiny) else "registry models"
    lenses = []
    for m in summary["models"].values():
        fit = m.get("lens_fit") or {}
        corpus = fit.get("corpus") or {}
        lenses.append("given lens" if fit.get("source") == "given" else "offline fit corpus"
                      if corpus.get("source") == "builtin" else f"lens fitted on {corpus.get('name', '?')}")
    return f"{who}, {', '.join(dict.fromkeys(lenses))}"


def _embedded(model: str) -> bool:
    try:
        return get_model(model).source == "embedded"
    except MemtocError:
        return False


def plot_steering(summary: dict[str, Any], path: Path) -> Path:
    """Flip rate vs strength per direction (and position), one panel per model."""
    df = steer_table(summary)
    models = list(summary["models"])
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(5 * max(1, len(models)), 3.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        sub = df[df["model"] == model] if len(df) else df
        for (d, pos, edit), g in (sub.groupby(["direction", "position", "edit"]) if len(sub) else []):
            g = g.sort_values("strength")
            ax.plot([0] + list(g["strength"]), [0] + list(g["flip"].fillna(0)), marker="o",
                    label=f"{d} @ {pos} ({edit.split('@')[0]})")
        bar = summary["models"][model]["sae"].get("steer", {}).get("bar", {})
        if bar.get("bar") is not None:
            what = "the dev flip" if bar.get("kind") == "dev_flip" else "the change toward the target"
            ax.axhline(bar["bar"], color="gray", ls=":", label=f"stopping bar: 1/2 prompting effect (on {what})")
        ax.set_xlabel("strength")
        ax.set_ylabel("flip rate")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(model if len(sub) else f"{model}: no steering cell", fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    return save(fig, path)
