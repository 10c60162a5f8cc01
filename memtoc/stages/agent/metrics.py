"""Agent-loop metrics: per model × slice × schema variant × protocol, per formulation and pooled.

Rates are means over episodes with bootstrap intervals (``agent.bootstrap``: the paper's percentile
bootstrap, or memtoc's question-cluster bootstrap; :mod:`memtoc.stages.agent.contrasts`); the protocol
contrasts (guided -> auto, guided -> two_stage, auto -> two_stage) and the repair delta
``auto_constrained − auto`` are paired by question on common support, with an interval from the same
bootstrap and a sign-flip p.

Slices: ``memory_right`` (the paper's: questions whose forced closed-book answer is correct, per
model and formulation) and ``all`` (every question of the run's agent selection).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import pandas as pd

from memtoc.core.vocab import SLICES
from memtoc.stages.agent.contrasts import PROTOCOL_CONTRASTS, contrast_name, paired, rates
from memtoc.stages.agent.protocols import MECHANISMS, PROTOCOLS, TERMINATIONS

RATES = ("answer_agreement", "tool_execution_rate", "agreement_minus_execution", "kept_memory", "final_correct")
METRIC_DOC: dict[str, str] = {
    "answer_agreement": "the final answer matches the executed tool return's value (the gold on tool_right, the "
                        "paper's return; the near distractor on tool_wrong); 0 when the episode ended without a "
                        "final answer",
    "tool_execution_rate": "the tool was executed (a valid call was made, or the oracle's synthetic call ran)",
    "agreement_minus_execution": "answer_agreement - tool_execution_rate on the same episodes (an episode that "
                                 "never calls the tool can still agree: the paper's metric caveat)",
    "kept_memory": "the final answer matches the model's own forced closed-book answer",
    "final_correct": "the final answer matches the gold answer",
    "terminations": "share of episodes per termination: " + ", ".join(TERMINATIONS),
    "mechanisms": "share of episodes per mechanism: T1 argument type coercion, T2 unparseable call, T3 two-stage "
                  "decision parse failure, T4 no call where one was expected, other_invalid",
    "type_errors": "jsonschema type errors per validated call (T1's raw count; coercible = strings of the "
                   "expected type, e.g. booleans serialized as strings)",
    "repair": "auto_constrained - auto, paired by question: the schema-constrained decoder's delta",
    "contrasts": "treatment - baseline protocol, paired by question (guided_to_auto = auto - guided, the paper's "
                 "Section 5.4 contrast; guided_to_two_stage; auto_to_two_stage), for agreement and execution",
}
_FLAGS = ("agreement", "executed", "kept_memory", "final_correct")


def episodes_frame(records: Iterable[dict]) -> pd.DataFrame:
    """One row per episode (the termination records), mechanisms as boolean columns."""
    rows = []
    for r in records:
        row = {k: v for k, v in r.items() if k not in ("mechanisms", "type_errors")}
        for m in MECHANISMS:
            row[m] = bool((r.get("mechanisms") or {}).get(m, False))
        row["type_errors"] = list(r.get("type_errors") or [])
        rows.append(row)
    df = pd.DataFrame(rows)
    if len(df):
        for c in _FLAGS:
            df[c] = df[c].astype(bool)
    return df


def in_slice(df: pd.DataFrame, slice_name: str) -> pd.DataFrame:
    if slice_name == "all":
        return df
    if slice_name == "memory_right":
        mc = df["memory_correct"].map(lambda v: v is True or v == 1.0)
        return df[mc & ~df["mem_absent"].astype(bool)]
    raise ValueError(f"unknown slice {slice_name!r}; valid: {', '.join(SLICES)}")


def _units(df: pd.DataFrame, values: pd.Series) -> pd.DataFrame:
    return pd.DataFrame({"formulation": df["formulation"].to_numpy(), "qkey": df["qkey"].to_numpy(),
                         "value": values.astype(float).to_numpy()})


def rate_units(df: pd.DataFrame, name: str) -> pd.DataFrame:
    """(formulation, qkey, value) units of a rate of :data:`RATES`."""
    if name == "answer_agreement":
        return _units(df, df["agreement"])
    if name == "tool_execution_rate":
        return _units(df, df["executed"])
    if name == "agreement_minus_execution":
        return _units(df, df["agreement"].astype(float) - df["executed"].astype(float))
    return _units(df, df[name])


def protocol_block(df: pd.DataFrame, formulations: Sequence[str], n_boot: int = 1000, seed: int = 0,
                   bootstrap: str = "percentile") -> dict[str, Any]:
    """Metrics of one protocol's episodes (see :data:`METRIC_DOC`)."""
    n = len(df)
    out: dict[str, Any] = {"n_episodes": n, "n_questions": int(df["qkey"].nunique()) if n else 0}
    for name in RATES:
        out[name] = rates(rate_units(df, name), formulations, bootstrap, n_boot, seed) if n else {}
    out["terminations"] = {t: {"count": int((df["termination"] == t).sum()) if n else 0,
                               "rate": float((df["termination"] == t).mean()) if n else None} for t in TERMINATIONS}
    out["mechanisms"] = {m: {"count": int(df[m].sum()) if n else 0,
                             "rate": float(df[m].mean()) if n else None} for m in MECHANISMS}
    per_call = [x for lst in (df["type_errors"] if n else []) for x in lst]
    out["type_errors"] = {"total": int(sum(per_call)), "calls_validated": len(per_call),
                          "per_call_mean": (sum(per_call) / len(per_call)) if per_call else None,
                          "max_per_call": max(per_call) if per_call else None,
                          "coercible": int(df["coercible"].sum()) if n else 0,
                          "calls_with_type_errors": sum(1 for x in per_call if x)}
    out["tokens_mean"] = float(df["tokens"].mean()) if n else None
    return out


def pair_block(df: pd.DataFrame, treatment: str, baseline: str, n_boot: int = 1000, n_perm: int = 10000,
               seed: int = 0, bootstrap: str = "percentile") -> dict[str, Any]:
    """``treatment − baseline`` (protocols) paired by question, for agreement and execution ({} when
    either protocol has no episode)."""
    t = df[df["protocol"] == treatment]
    b = df[df["protocol"] == baseline]
    if not len(t) or not len(b):
        return {}
    return {name: paired(rate_units(t, name), rate_units(b, name), bootstrap, n_boot, n_perm, seed,
                         treatment=treatment, baseline=baseline)
            for name in ("answer_agreement", "tool_execution_rate")}


def repair_block(df: pd.DataFrame, n_boot: int = 1000, n_perm: int = 10000, seed: int = 0,
                 bootstrap: str = "percentile") -> dict[str, Any]:
    """``auto_constrained − auto`` on common support, for agreement and execution."""
    return pair_block(df, "auto_constrained", "auto", n_boot, n_perm, seed, bootstrap)


def contrasts_block(df: pd.DataFrame, n_boot: int = 1000, n_perm: int = 10000, seed: int = 0,
                    bootstrap: str = "percentile") -> dict[str, Any]:
    """The protocol contrasts of :data:`~memtoc.stages.agent.contrasts.PROTOCOL_CONTRASTS` that the run has."""
    out = {contrast_name(t, b): pair_block(df, t, b, n_boot, n_perm, seed, bootstrap) for t, b in PROTOCOL_CONTRASTS}
    return {k: v for k, v in out.items() if v}


def summarize_model(df: pd.DataFrame, formulations: Sequence[str], slices: Sequence[str] = SLICES,
                    protocols: Sequence[str] = PROTOCOLS, n_boot: int = 1000, n_perm: int = 10000,
                    seed: int = 0, bootstrap: str = "percentile") -> dict[str, Any]:
    """``{slice: {schema_variant: {"n_questions", "protocols": {protocol: block}, "contrasts": {...},
    "repair": {...}}}}``."""
    out: dict[str, Any] = {}
    for sl in slices:
        sdf = in_slice(df, sl) if len(df) else df
        node: dict[str, Any] = {}
        for variant in (sorted(df["schema_variant"].unique()) if len(df) else []):
            vdf = sdf[sdf["schema_variant"] == variant]
            node[variant] = {
                "n_questions": int(vdf["qkey"].nunique()) if len(vdf) else 0,
                "questions_by_formulation": {f: int(vdf.loc[vdf["formulation"] == f, "qkey"].nunique())
                                             for f in formulations},
                "protocols": {p: protocol_block(vdf[vdf["protocol"] == p], formulations, n_boot, seed, bootstrap)
                              for p in protocols if p in set(vdf["protocol"])},   # those with episodes here
                "contrasts": contrasts_block(vdf, n_boot, n_perm, seed, bootstrap),
                "repair": repair_block(vdf, n_boot, n_perm, seed, bootstrap)}
        out[sl] = node
    return out


def summary_table(summary: dict, slice_name: str = "memory_right", form: str = "pooled") -> pd.DataFrame:
    """Tidy rows (model, schema_variant, protocol, agreement, lo, hi, execution, lo, hi, n, terminations,
    mechanisms) of a summary, for the notebook and the report."""
    rows = []
    for model, ms in (summary.get("models") or {}).items():
        for variant, v in ((ms.get("slices") or {}).get(slice_name) or {}).items():
            for p, b in v["protocols"].items():
                ag = b["answer_agreement"].get(form) or {}
                ex = b["tool_execution_rate"].get(form) or {}
                rows.append({
                    "model": model, "schema": variant, "protocol": p, "n": ag.get("n", 0),
                    "agreement": ag.get("value"), "agr_lo": (ag.get("ci95") or [None, None])[0],
                    "agr_hi": (ag.get("ci95") or [None, None])[1],
                    "execution": ex.get("value"), "exe_lo": (ex.get("ci95") or [None, None])[0],
                    "exe_hi": (ex.get("ci95") or [None, None])[1],
                    **{f"term_{t}": b["terminations"][t]["count"] for t in TERMINATIONS},
                    **{m: b["mechanisms"][m]["count"] for m in MECHANISMS},
                    "type_errors": b["type_errors"]["total"]})
    return pd.DataFrame(rows)


def repair_table(summary: dict, slice_name: str = "memory_right") -> pd.DataFrame:
    """The repair delta (auto_constrained − auto) per model × schema × metric."""
    return contrast_table(summary, slice_name, only="repair")


def contrast_table(summary: dict, slice_name: str = "memory_right", only: Optional[str] = None) -> pd.DataFrame:
    """Every paired contrast (the protocol contrasts and the repair) per model × schema × metric."""
    rows = []
    for model, ms in (summary.get("models") or {}).items():
        for variant, v in ((ms.get("slices") or {}).get(slice_name) or {}).items():
            pairs = dict(v.get("contrasts") or {}, repair=v.get("repair") or {})
            for cname, block in pairs.items():
                if only is not None and cname != only:
                    continue
                for name, c in block.items():
                    ci = c.get("ci95") or [None, None]
                    rows.append({"model": model, "schema": variant, "contrast": cname, "metric": name,
                                 "delta": c.get("delta"), "lo": ci[0], "hi": ci[1], "p": c.get("p"),
                                 "n_units": c.get("n_units")})
    return pd.DataFrame(rows)


def published_table(published: Optional[dict]) -> pd.DataFrame:
    """Table 7 (the paper's agreement per model × protocol; Llama-3.1-8B / Qwen / Mistral / Hermes on vLLM)."""
    if not published:
        return pd.DataFrame()
    rows = [{"model": r["model"], "guided": r["guided"], "auto": r["auto"], "two_stage": r["two_stage"], "n": r["n"],
             "dagger": ", ".join(r.get("dagger") or [])} for r in published.get("rows", [])]
    return pd.DataFrame(rows)
