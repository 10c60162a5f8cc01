"""Evaluation stage: with-tool generation, scoring, cells, and every analysis of notebook 03.

Entry point::

    df = evaluate(generator, model_label, episodes, memory, run_dir, matcher="paper")

generates every episode's reply through the generation cache, scores it against gold / tool value /
the model's closed-book span, assigns the source-correctness cell and returns one row per episode.
The pure analysis functions below take such scored frames (one or more models) and return plain
dicts / DataFrames; :func:`evaluation_summary` assembles them into ``summaries/evaluation.json``.

Files written by :func:`evaluate`::

    generations/<model>/<arm_key>.jsonl                 the cache (never deleted); no_tool episodes
                                                        use generations/<model>/closed_book_forced__<formulation>.jsonl,
                                                        the elicitation cache (same prompt: never regenerated)
    scored/<model>/<arm_key>.jsonl                      one scored row per episode

``summaries/evaluation.json`` — structure (stable; claims cite it by JSON pointer)
-----------------------------------------------------------------------------------
Every estimate is an *interval object* ``{"value": float|null, "ci95": [lo, hi]|null, "n": int}``
(rates in [0, 1]; ``n`` = the denominator; ``value`` is null when ``n`` is 0). A *contrast object* is
``{"delta", "ci95", "p", "p_holm", "n_units", "n_clusters", "treatment", "baseline"}`` — a paired
difference treatment − baseline on common support, units (qkey, formulation), clustered by qkey
(question-cluster bootstrap CI, sign-flip permutation p, Holm within the family named in the
section). ``<form>`` is a formulation name (reference, paraphrase_a, paraphrase_b) or ``pooled``
(unweighted mean over formulations, the paper's rule). ::

    /schema_version                                 1
    /run_name, /matcher, /n_boot, /n_perm, /alpha, /seed, /formulations
    /metrics                                        {metric: one-line definition}
    /models/<model>/n_questions                     {"headline": int, "extra": int}
    /models/<model>/headline/<form>/<metric>        interval object; metrics retention, tool_follow,
                                                    wrong_follow, err_abstain (the four headline
                                                    ones), cra_arb, cra_conflict, agree_acc, nc_acc
                                                    (secondary); untreated arm, schema frame, the
                                                    default error payload
    /models/<model>/cells/<form>/<cell>             int: tool_wrong episodes per cell (agree, arb,
                                                    tool_gold, both_wrong, mem_absent)
    /models/<model>/source_matrix/<form>/<cell>     {"n", "follow_rate", "correct_rate"} for the four
                                                    cells (memory correct/incorrect × tool correct/
                                                    incorrect; tool_right + tool_wrong episodes)
    /models/<model>/prompting/<arm>/<form>/<metric> interval object (arms warn, prior, flag and
                                                    untreated on the extra subset)
    /models/<model>/prompting/<arm>/contrasts/<metric>  contrast object vs untreated (family
                                                    "prompting/<metric>": the three arms)
    /models/<model>/prompting/<arm>/success         {"success": bool, ...} the asymmetric criterion:
                                                    retention up significantly (Holm) and no
                                                    significant drop in tool_follow
    /models/<model>/protocol/...                    the no_protocol_sentence ablation, same layout as
                                                    one prompting arm (family "protocol/<metric>")
    /models/<model>/frames/<frame>/<form>/<metric>  interval objects; frames schema, no_schema,
                                                    passage; metrics correct_value_follow (tool_right,
                                                    all episodes), incorrect_value_follow (tool_wrong,
                                                    all episodes), tool_follow, wrong_follow
    /models/<model>/frames/<frame>/contrasts/<metric>   contrast vs schema (family "frames/<metric>")
    /models/<model>/far/<near|far>/<form>/<metric>  interval objects, retention and wrong_follow on
                                                    the common support (questions with a far value)
    /models/<model>/far/contrasts/<metric>          contrast far − near (family "far")
    /models/<model>/far/n_common                    int: common-support questions
    /models/<model>/payloads/<kind>/<form>/err_abstain  interval object per error payload kind
    /models/<model>/payloads/contrasts/<kind>       contrast of err_abstain vs service_unavailable
    /models/<model>/noop/<noop|no_tool>/<form>/<metric>  accuracy (final_correct) and abstain over
                                                    all episodes of the condition
    /models/<model>/noop/contrasts/<metric>         contrast noop − no_tool (family "noop")
    /models/<model>/matcher_sensitivity/<form>/<metric>  {"paper", "strict", "delta"}: headline
                                                    metric values re-scored with matcher="strict"
                                                    on the same replies
    /ranking_stability/<metric>                     {"pooled_order": [models...], "stable": bool,
                                                    "per_formulation": {form: [models...]}, ...}

Sections whose episodes are absent from the run (an extra arm turned off) are omitted.
"""
from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

from .config import FORMULATIONS, DataError, MemtocError
from .records import Episode, dumps

SCHEMA_VERSION = 1

HEADLINE_METRICS = ("retention", "tool_follow", "wrong_follow", "err_abstain")
SECONDARY_METRICS = ("cra_arb", "cra_conflict", "agree_acc", "nc_acc")
CELLS = ("agree", "arb", "tool_gold", "both_wrong", "mem_absent")
FOUR_CELLS = ("agree", "arb", "tool_gold", "both_wrong")
PROMPTING_ARMS = ("warn", "prior", "flag")
PAYLOAD_DEFAULT = "service_unavailable"

# Per-episode metric definitions (PROTOCOL.md §6): metric -> (condition, cells or None = all, flag).
# ``flag`` is a column of the scored frame, or "kept_strict" = outcome == "kept_memory" (both excluded).
METRIC_UNITS: dict[str, tuple[str, tuple[str, ...] | None, str]] = {
    "retention": ("tool_wrong", ("arb",), "kept_strict"),
    "tool_follow": ("tool_right", ("tool_gold",), "followed_tool"),
    "wrong_follow": ("tool_wrong", ("both_wrong",), "followed_tool"),
    "err_abstain": ("tool_error", None, "abstain"),
    "cra_arb": ("tool_wrong", ("arb",), "final_correct"),
    "cra_conflict": ("tool_wrong", ("arb", "tool_gold"), "final_correct"),
    "agree_acc": ("tool_right", ("agree",), "final_correct"),
    "nc_acc": ("tool_right", ("tool_gold",), "final_correct"),
    # condition-level rates (no cell filter) used by the frames and noop analyses
    "correct_value_follow": ("tool_right", None, "followed_tool"),
    "incorrect_value_follow": ("tool_wrong", None, "followed_tool"),
    "accuracy": ("*", None, "final_correct"),
    "abstain": ("*", None, "abstain"),
}

METRIC_DOC = {
    "retention": "tool_wrong, arb cell (memory correct, tool incorrect): outcome kept_memory (ties 'both' excluded)",
    "tool_follow": "tool_right, tool_gold cell (memory incorrect, tool correct): followed the tool value",
    "wrong_follow": "tool_wrong, both_wrong cell (memory and tool incorrect): followed the incorrect tool value",
    "err_abstain": "tool_error, all episodes (mem_absent included): the final answer abstains",
    "cra_arb": "tool_wrong, arb cell: final answer correct",
    "cra_conflict": "tool_wrong, arb + tool_gold cells: final answer correct",
    "agree_acc": "tool_right, agree cell: final answer correct",
    "nc_acc": "tool_right, tool_gold cell: final answer correct (no-conflict accuracy)",
    "correct_value_follow": "tool_right, all episodes: followed the (correct) tool value",
    "incorrect_value_follow": "tool_wrong (or tool_far), all episodes: followed the (incorrect) tool value",
    "accuracy": "all episodes of the condition: final answer correct",
    "abstain": "all episodes of the condition: the final answer abstains",
}


class EvaluationError(MemtocError):
    """Inputs of the evaluation stage are inconsistent (memory missing for episodes, etc.)."""


# ==================================================================================================
# generation + scoring


def closed_book_cache_stem(formulation: str, variant: str = "forced") -> str:
    """Cache file stem of the closed-book elicitation (shared with memtoc.elicitation)."""
    return f"closed_book_{variant}__{formulation}"


def cache_stem(ep: Episode) -> str:
    """Which generations/<model>/<stem>.jsonl an episode's reply lives in.

    no_tool episodes carry the forced closed-book prompt, so they are served from the elicitation
    cache file; every other episode uses its ``arm_key``.
    """
    if ep.condition == "no_tool":
        return closed_book_cache_stem(ep.formulation, "forced")
    return ep.arm_key


def group_episodes(episodes: Sequence[Episode]) -> "OrderedDict[str, list[int]]":
    """Episode indices grouped by cache stem (first-seen order)."""
    groups: OrderedDict[str, list[int]] = OrderedDict()
    for i, ep in enumerate(episodes):
        groups.setdefault(cache_stem(ep), []).append(i)
    return groups


def _memory_table(memory: pd.DataFrame) -> pd.DataFrame:
    need = {"formulation", "qkey", "response"}
    if memory is None or not isinstance(memory, pd.DataFrame):
        raise EvaluationError("evaluate: `memory` must be the elicitation DataFrame (elicitation.load_memory)")
    missing = need - set(memory.columns)
    if missing:
        raise EvaluationError(f"evaluate: the memory frame lacks column(s) {sorted(missing)}; pass the "
                              "DataFrame returned by elicitation.elicit / load_memory")
    if "variant" in memory.columns and memory["variant"].nunique() > 1:
        raise EvaluationError("evaluate: the memory frame mixes closed-book variants "
                              f"{sorted(memory['variant'].unique())}; pass one variant (the forced one is primary)")
    dup = memory.duplicated(["formulation", "qkey"])
    if dup.any():
        raise EvaluationError(f"evaluate: the memory frame has {int(dup.sum())} duplicate (formulation, qkey) rows")
    return memory.set_index(["formulation", "qkey"])


def score_episodes(episodes: Sequence[Episode] | pd.DataFrame, responses: Sequence[str],
                   memory: pd.DataFrame, matcher: str = "paper", model_label: str | None = None) -> pd.DataFrame:
    """Score replies: one row per episode with decision fields, memory status and cell.

    ``memory`` supplies the raw closed-book reply per (formulation, qkey); its span / mem_absent /
    memory_correct are recomputed here with the same ``matcher`` (so a strict re-score is strict on
    both sides). Pure: no files.
    """
    from . import metrics, scoring

    if isinstance(episodes, pd.DataFrame):
        rows = episodes.to_dict("records")
    else:
        rows = [e.to_dict() for e in episodes]
    responses = list(responses)
    if len(rows) != len(responses):
        raise EvaluationError(f"score_episodes: {len(rows)} episodes but {len(responses)} responses")
    mem = _memory_table(memory)
    status_cache: dict[tuple[str, str], tuple[str, bool, Any]] = {}
    missing: list[tuple[str, str]] = []
    out = []
    for row, resp in zip(rows, responses):
        key = (row["formulation"], row["qkey"])
        if key not in status_cache:
            if key not in mem.index:
                missing.append(key)
                continue
            cb = mem.loc[key, "response"]
            span, absent, correct = scoring.memory_status(cb if isinstance(cb, str) else "", row["gold"], matcher=matcher)
            status_cache[key] = (span, bool(absent), None if absent else (None if correct is None else bool(correct)))
        span, absent, correct = status_cache[key]
        dec = scoring.score_reply(resp if isinstance(resp, str) else "", row["gold"], row.get("tool_value"),
                                  "" if absent else span, matcher=matcher)
        r = dict(row)
        if model_label is not None:
            r["model"] = model_label
        r.update(dec)
        r["response"] = resp
        r["memory_span"] = span
        r["mem_absent"] = absent
        r["memory_correct"] = correct
        r["cell"] = metrics.assign_cell(correct, absent, row.get("tool_correct"))
        r["matcher"] = matcher
        out.append(r)
    if missing:
        ex = ", ".join(f"{f}/{q}" for f, q in missing[:3])
        raise EvaluationError(f"no closed-book answer for {len(missing)} episode(s) (e.g. {ex}); run the "
                              "elicitation (notebook 02) for the same questions and formulations first")
    return pd.DataFrame(out)


def _call_generate(generator, prompts: list[str], cache_path: Path, desc: str):
    return generator.generate(prompts, cache_path=cache_path, desc=desc)


def generate_replies(generator, model_label: str, episodes: Sequence[Episode], run_dir) -> list[Any]:
    """Replies for every episode (same order), through the cache, one generate call per cache file."""
    gen_dir = Path(run_dir) / "generations" / model_label
    gen_dir.mkdir(parents=True, exist_ok=True)
    replies: list[Any] = [None] * len(episodes)
    groups = group_episodes(episodes)
    for gi, (stem, idx) in enumerate(groups.items(), 1):
        prompts = [episodes[i].prompt for i in idx]
        got = _call_generate(generator, prompts, gen_dir / f"{stem}.jsonl",
                             f"{model_label} {stem} [{gi}/{len(groups)}]")
        if len(got) != len(prompts):
            raise EvaluationError(f"generator returned {len(got)} replies for {len(prompts)} prompts ({stem})")
        for i, rep in zip(idx, got):
            replies[i] = rep
    return replies


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(_plain(r), ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def evaluate(generator, model_label: str, episodes: Sequence[Episode], memory: pd.DataFrame, run_dir,
             matcher: str = "paper") -> pd.DataFrame:
    """Generate (cached), score and cell every episode; write ``scored/<model>/<arm_key>.jsonl``.

    Returns one row per episode: the Episode fields, the decision fields of ``scoring.score_reply``
    (extracted, followed_tool, kept_memory, final_correct, abstain, outcome, neither_subtype), the
    memory status (memory_span, mem_absent, memory_correct), ``cell``, ``response``, ``model``,
    ``matcher`` and the reply's ``n_new_tokens`` / ``cached``.
    """
    episodes = list(episodes)
    if not episodes:
        raise EvaluationError("evaluate: no episodes (check n_questions and formulations)")
    replies = generate_replies(generator, model_label, episodes, run_dir)
    texts = [getattr(r, "text", r) for r in replies]
    df = score_episodes(episodes, texts, memory, matcher=matcher, model_label=model_label)
    df["n_new_tokens"] = [getattr(r, "n_new_tokens", None) for r in replies]
    df["cached"] = [getattr(r, "cached", None) for r in replies]
    out_dir = Path(run_dir) / "scored" / model_label
    for arm_key, part in df.groupby(df.apply(lambda r: Episode.from_dict(r).arm_key, axis=1), sort=False):
        _write_jsonl(out_dir / f"{arm_key}.jsonl", part.drop(columns=["schema"], errors="ignore").to_dict("records"))
    return df


def read_scored(run_dir, model_label: str | None = None) -> pd.DataFrame:
    """Read back ``scored/<model>/*.jsonl`` of a run (all models when ``model_label`` is None)."""
    base = Path(run_dir) / "scored"
    dirs = [base / model_label] if model_label else sorted(p for p in base.glob("*") if p.is_dir())
    frames = []
    for d in dirs:
        for p in sorted(d.glob("*.jsonl")):
            frames.append(pd.read_json(p, lines=True, dtype=False))
    if not frames:
        raise DataError(f"no scored files under {base}; run notebook 03_evaluation first")
    return pd.concat(frames, ignore_index=True)


# ==================================================================================================
# small helpers


def _plain(obj: Any) -> Any:
    """JSON-safe copy: numpy scalars -> Python, NaN -> None, tuples -> lists."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return [_plain(v) for v in obj.tolist()]
    if isinstance(obj, (np.bool_,)):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        f = float(obj)
        return None if math.isnan(f) else f
    if obj is pd.NA or obj is pd.NaT:
        return None
    return obj


def metric_units(df: pd.DataFrame, metric: str, condition: str | None = None) -> pd.DataFrame:
    """Per-episode 0/1 values of ``metric``: columns ``model, arm, frame, formulation, qkey, value``.

    ``condition`` overrides the metric's condition (e.g. ``tool_far`` for far retention, ``noop`` for
    accuracy). Rows outside the metric's denominator are dropped.
    """
    if metric not in METRIC_UNITS:
        raise EvaluationError(f"unknown metric {metric!r}; known: {', '.join(METRIC_UNITS)}")
    cond, cells, flag = METRIC_UNITS[metric]
    cond = condition or cond
    if cond == "*":
        raise EvaluationError(f"metric {metric!r} needs an explicit condition")
    sub = df[df["condition"] == cond]
    if cells is not None:
        sub = sub[sub["cell"].isin(cells)]
    if flag == "kept_strict":
        val = (sub["outcome"] == "kept_memory")
    else:
        val = sub[flag].fillna(False).astype(bool)
    cols = [c for c in ("model", "arm", "frame", "payload_kind", "formulation", "qkey") if c in sub.columns]
    out = sub[cols].copy()
    out["value"] = val.astype(float).to_numpy()
    return out.reset_index(drop=True)
