"""Evaluation stage: with-tool generation and scoring (notebook 03).

Entry point::

    df = evaluate(generator, model_label, episodes, memory, run_dir, matcher="paper")

generates every episode's reply through the generation cache, scores it against gold / tool value /
the model's closed-book span, assigns the source-correctness cell and returns one row per episode.
The analyses of such scored frames (``summaries/evaluation.json``) are in :mod:`memtoc.stages.evaluation.analyses`, the
tidy tables of a summary in :mod:`memtoc.stages.evaluation.tables`.

Files written by :func:`evaluate`::

    generations/<model>/<arm_key>.jsonl                 the cache (never deleted); no_tool episodes
                                                        use generations/<model>/closed_book_forced__<formulation>.jsonl,
                                                        the elicitation cache (same prompt: never regenerated)
    scored/<model>/<arm_key>.jsonl                      one scored row per episode
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from memtoc.config.runconfig import RunConfig, RunPaths
from memtoc.core import metrics, scoring
from memtoc.core.errors import DataError, MemtocError
from memtoc.core.io import write_jsonl
from memtoc.core.records import Episode, arm_key
from memtoc.core.vocab import FORMULATIONS
from memtoc.stages import elicitation


class EvaluationError(MemtocError):
    """Inputs of the evaluation stage are inconsistent (memory missing for episodes, etc.)."""


# ==================================================================================================
# generation + scoring


def closed_book_cache_stem(formulation: str, variant: str = "forced") -> str:
    """Cache file stem of the closed-book elicitation (shared with memtoc.stages.elicitation)."""
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
            span, absent, correct = scoring.memory_status(cb if isinstance(cb, str) else "", row["gold"], matcher=matcher,
                                                          gold_kind=row.get("gold_kind"))
            status_cache[key] = (span, bool(absent), None if absent else (None if correct is None else bool(correct)))
        span, absent, correct = status_cache[key]
        dec = scoring.score_reply(resp if isinstance(resp, str) else "", row["gold"], row.get("tool_value"),
                                  "" if absent else span, matcher=matcher, gold_kind=row.get("gold_kind"))
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


def generate_replies(generator, model_label: str, episodes: Sequence[Episode], run_dir) -> list[Any]:
    """Replies for every episode (same order), through the generation cache: one
    ``generator.generate`` call with each episode's own cache file
    (``generations/<model>/<cache_stem>.jsonl``), so pending prompts of every arm are generated
    together (length-sorted batching across arms) and a no_tool episode is served by the
    elicitation's closed-book file. Generators without cache keys (no ``key()``) get one call per
    cache file."""
    paths = RunPaths(run_dir)
    paths.generations(model_label).mkdir(parents=True, exist_ok=True)
    episodes = list(episodes)
    if not (callable(getattr(generator, "key", None)) and hasattr(generator, "identity")):
        return _generate_per_file(generator, model_label, episodes, paths)
    replies = generator.generate([e.prompt for e in episodes],
                                 cache_path=[paths.generation_file(model_label, cache_stem(e)) for e in episodes],
                                 desc=f"{model_label} with-tool")
    if len(replies) != len(episodes):
        raise EvaluationError(f"generator returned {len(replies)} replies for {len(episodes)} prompts")
    return replies


def _generate_per_file(generator, model_label: str, episodes: Sequence[Episode], paths: RunPaths) -> list[Any]:
    replies: list[Any] = [None] * len(episodes)
    groups = group_episodes(episodes)
    for gi, (stem, idx) in enumerate(groups.items(), 1):
        prompts = [episodes[i].prompt for i in idx]
        got = generator.generate(prompts, cache_path=paths.generation_file(model_label, stem),
                                 desc=f"{model_label} {stem} [{gi}/{len(groups)}]")
        if len(got) != len(prompts):
            raise EvaluationError(f"generator returned {len(got)} replies for {len(prompts)} prompts ({stem})")
        for i, rep in zip(idx, got):
            replies[i] = rep
    return replies


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
    write_scored(df, run_dir, model_label)
    return df


def write_scored(df: pd.DataFrame, run_dir, model_label: str, folder: str = "scored") -> list[Path]:
    """``<folder>/<model>/<arm_key>.jsonl``: the scored rows, one file per (arm, frame, formulation)
    (the tool schema column is left out). Returns the paths written."""
    run_paths = RunPaths(run_dir)
    keys = np.array([arm_key(a, f, fo) for a, f, fo in zip(df["arm"], df["frame"], df["formulation"])])
    paths = []
    for key, part in df.groupby(keys, sort=False):
        paths.append(run_paths.scored_file(model_label, key, folder))
        write_jsonl(paths[-1], part.drop(columns=["schema"], errors="ignore").to_dict("records"))
    return paths


def read_scored(run_dir, model_label: str | None = None, folder: str = "scored",
                hint: str = "run notebook 03_evaluation first") -> pd.DataFrame:
    """Read back ``<folder>/<model>/*.jsonl`` of a run (all models when ``model_label`` is None);
    ``hint`` ends the error when there is nothing to read."""
    paths = RunPaths(run_dir)
    base = paths.scored_dir(folder)
    dirs = [paths.scored(model_label, folder)] if model_label else sorted(p for p in base.glob("*") if p.is_dir())
    frames = []
    for d in dirs:
        for p in sorted(d.glob("*.jsonl")):
            if p.name.startswith("closed_book_"):  # the elicitation's files share the folder
                continue
            frames.append(pd.read_json(p, lines=True, dtype=False))
    if not frames:
        raise DataError(f"no scored files under {base}; {hint}")
    return pd.concat(frames, ignore_index=True)


# ==================================================================================================
# notebook helpers (thin glue; I/O at the edge)


def memory_rows(mem: pd.DataFrame, need: set) -> pd.DataFrame:
    """The rows of a closed-book memory frame whose (formulation, qkey) is in ``need``, in order."""
    keep = [(f, q) in need for f, q in zip(mem["formulation"], mem["qkey"])]
    return mem[keep].reset_index(drop=True)


def ensure_memory(generator, model_label: str, benchmark, episodes: Sequence[Episode],
                  cfg: RunConfig) -> pd.DataFrame:
    """The closed-book memory frame covering every (formulation, qkey) of ``episodes``.

    Reads what notebook 02 wrote (``elicitation.load_memory``); if it is missing or does not cover
    the episodes, runs the elicitation for the episodes' questions (served from the generation
    cache where 02 already generated them). ``cfg``: the run's configuration; variant:
    ``cfg.closed_book_variant``.
    """
    variant = cfg.closed_book_variant
    need = {(e.formulation, e.qkey) for e in episodes}
    try:
        mem = elicitation.load_memory(cfg.run_dir, model_label, variant)
        have = set(zip(mem["formulation"], mem["qkey"]))
        if need <= have:
            return memory_rows(mem, need)
        print(f"{model_label}: the closed-book answers of notebook 02 miss {len(need - have)} "
              "(formulation, question) pairs; eliciting them now")
    except DataError:
        print(f"{model_label}: no closed-book answers yet (notebook 02 not run); eliciting them now")
    by_qkey = benchmark.by_qkey
    qkeys = list(dict.fromkeys(e.qkey for e in episodes))
    forms = [f for f in FORMULATIONS if any(e.formulation == f for e in episodes)]
    return elicitation.elicit(generator, model_label, [by_qkey[q] for q in qkeys], forms, variant,
                              cfg.run_dir, matcher=cfg.matcher)


def episode_counts(episodes: Sequence[Episode]) -> pd.DataFrame:
    """Episodes per (condition, arm, frame, payload kind) × formulation, with questions."""
    d = pd.DataFrame([{"condition": e.condition, "arm": e.arm, "frame": e.frame,
                       "payload": e.payload_kind or "", "formulation": e.formulation, "qkey": e.qkey}
                      for e in episodes])
    t = d.pivot_table(index=["condition", "arm", "frame", "payload"], columns="formulation", values="qkey",
                      aggfunc="count", fill_value=0)
    t["questions"] = d.groupby(["condition", "arm", "frame", "payload"])["qkey"].nunique()
    return t
