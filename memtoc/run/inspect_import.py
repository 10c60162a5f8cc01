"""``memtoc import-inspect LOG RUN_DIR``: an Inspect log of the ``memtoc`` task as a memtoc run directory.

The log's samples are memtoc's episodes (:mod:`memtoc.run.inspect_task`); the import writes what notebooks
01-03 would have written for them, with memtoc's own code, then 08's report:

    episodes/<formulation>.jsonl                   the episodes of the log (their ids, tool returns, gold)
    scored/<model>/closed_book_forced.jsonl        the closed-book replies scored (the model's memory)
    scored/<model>/<arm_key>.jsonl                 every episode's reply scored (decision fields, cell)
    summaries/construction.json, elicitation.json, evaluation.json   (notebooks 01-03's summaries)
    config.json                                    the run's parameters and provenance, and the log it came from
    paper/report.md, paper/claims.json             (notebook 08), so that ``memtoc verify RUN_DIR`` runs

The replies are scored again here from their text (the log's scores are not trusted blindly) and the
pooled headline metrics are compared with the ones the log recorded; a difference stops the import.
``memtoc export RUN_DIR OUT`` then publishes them as a dataset.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from memtoc.config.runconfig import RunConfig, RunPaths
from memtoc.core.errors import ConfigError, DataError
from memtoc.core.io import plain, write_json, write_jsonl
from memtoc.core.records import Episode
from memtoc.core.scoring import memory_status
from memtoc.config.params import PAPER_SEED
from memtoc.core.vocab import (
    BASELINE_ARM,
    DEFAULT_FRAME,
    DEFAULT_PAYLOAD,
    EXTRA_ARM_SPECS,
    FORMULATIONS,
    HEADLINE_METRICS,
)
from memtoc.data.benchmark import load_benchmark
from memtoc.data.episodes import write_episodes
from memtoc.run.pipeline import provenance
from memtoc.stages import construction, elicitation
from memtoc.stages.evaluation import score_episodes, write_scored
from memtoc.stages.evaluation.analyses.headline import headline_metrics
from memtoc.stages.evaluation.analyses.summary import evaluation_summary
from memtoc.stages.evaluation.analyses.summary import write_summary as write_evaluation_summary

TASK_SUFFIX = "memtoc"          # the task's registered name ends with it (memtoc/memtoc, inspect_task.py@memtoc)
CLOSED_BOOK_KEY = "memtoc_closed_book"


@dataclass(frozen=True)
class Imported:
    """What :func:`import_log` wrote."""
    run_dir: Path
    model: str
    episodes: int
    questions: int
    report: Path


def model_label(inspect_model: str) -> str:
    """A folder-safe model label from Inspect's ``provider/model`` name (the part after the last ``/``)."""
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", inspect_model.rsplit("/", 1)[-1]).strip("-.")
    if not label:
        raise ConfigError(f"cannot make a model label from {inspect_model!r}; give one with --label")
    return label


def _read(log_path: Path):
    from inspect_ai.log import read_eval_log       # the optional extra: imported when used
    if not log_path.is_file():
        raise DataError(f"{log_path}: no such Inspect log; give the .eval (or .json) file that `inspect eval "
                        "memtoc/memtoc` wrote under ./logs")
    log = read_eval_log(str(log_path))
    task = str(log.eval.task)
    if not task.split("/")[-1].split("@")[-1].endswith(TASK_SUFFIX):
        raise DataError(f"{log_path}: field eval.task is {task!r}, not memtoc's task; import a log of "
                        "`inspect eval memtoc/memtoc`")
    if log.status != "success":
        raise DataError(f"{log_path}: field status is {log.status!r}; finish the run first (`inspect eval-retry "
                        f"{log_path}` reruns only the unfinished samples)")
    bad = [s.id for s in (log.samples or []) if s.error is not None]
    if bad or not log.samples:
        raise DataError(f"{log_path}: {len(bad)} sample(s) ended in an error (e.g. {bad[:3]}) or the log has no "
                        "samples; `inspect eval-retry` the log, then import it")
    return log


def _memory_rows(samples, label: str) -> list[dict[str, Any]]:
    """One closed-book row per (formulation, question) in elicitation's row format (the memory status is
    added by the caller with the task's matcher); the episodes of one question must share their reply."""
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for ep, _reply, closed, _tokens in samples:
        key = (ep.formulation, ep.qkey)
        if key in seen:
            if seen[key]["response"] != closed:
                raise DataError(f"episodes of question {ep.qkey!r} ({ep.formulation}) carry different closed-book "
                                "replies; the log was not written by memtoc's task")
            continue
        seen[key] = {"model": label, "formulation": ep.formulation, "variant": "forced", "question_id": ep.question_id,
                     "qkey": ep.qkey, "instance_id": ep.instance_id, "response": closed, "gold": ep.gold,
                     "gold_kind": ep.gold_kind, "fold": ep.fold, "n_new_tokens": None, "cached": False}
    return list(seen.values())


def _extra_arms(episodes: list[Episode]) -> list[str]:
    """The ``extra_arms`` whose episodes the log holds (so that 03's sections for them are computed): an
    arm other than untreated, or a condition (tool_far, noop) outside the core four. The task delivers the
    schema frame and the paper's error payload only, so ``frames`` and ``payloads`` never apply."""
    arms = {e.arm for e in episodes} - {BASELINE_ARM}
    conditions = {e.condition for e in episodes}
    out = []
    for spec in EXTRA_ARM_SPECS:
        if spec.frames != (DEFAULT_FRAME,) or spec.payload_kinds != (DEFAULT_PAYLOAD,):
            continue
        if (arms & set(spec.arms)) if spec.arms != (BASELINE_ARM,) else (conditions & set(spec.conditions)):
            out.append(spec.name)
    return out


def _compare_headline(log, df: pd.DataFrame, n_boot: int, where: Path) -> None:
    """Stop when the log's pooled headline values differ from memtoc's re-scoring of its replies."""
    recorded = {}
    for s in (log.results.scores if log.results else []):
        for name, m in s.metrics.items():
            recorded[name] = m.value
    pooled = (headline_metrics(df, n_boot=n_boot) or {}).get("pooled", {})
    for name in HEADLINE_METRICS:
        if name not in recorded:
            continue
        mine = (pooled.get(name) or {}).get("value")
        theirs = recorded[name]
        both_nan = (mine is None or (isinstance(mine, float) and math.isnan(mine))) and math.isnan(float(theirs))
        if not both_nan and (mine is None or abs(float(mine) - float(theirs)) > 1e-9):
            raise DataError(f"{where}: metric {name} is {theirs} in the log but {mine} when memtoc scores the "
                            "log's replies; the log was scored by another memtoc version: rerun the task")


def import_log(log_path: str | Path, run_dir: str | Path, label: Optional[str] = None, force: bool = False,
               release: Optional[str] = None) -> Imported:
    """Write ``run_dir`` from the Inspect log ``log_path`` (module docstring); ``label`` names the model's
    folders (default from the log's model). An existing non-empty ``run_dir`` is refused unless ``force``."""
    log_path, run_dir = Path(log_path), Path(run_dir).resolve()
    if run_dir.exists() and any(run_dir.iterdir()) and not force:
        raise ConfigError(f"{run_dir} exists and is not empty; give another RUN_DIR or --force to write over it")
    log = _read(log_path)
    args = dict(log.eval.task_args or {})
    label = label or model_label(str(log.eval.model))
    samples = []
    for s in log.samples:
        meta = (s.metadata or {}).get("episode")
        closed = (s.store or {}).get(CLOSED_BOOK_KEY)
        if not isinstance(meta, dict) or closed is None:
            raise DataError(f"{log_path}: sample {s.id!r} lacks field metadata.episode or store.{CLOSED_BOOK_KEY}; "
                            "the log was not written by memtoc's task")
        usage = s.output.usage if s.output is not None else None
        samples.append((Episode.from_dict(meta), s.output.completion if s.output else "", closed,
                        usage.output_tokens if usage is not None else None))
    episodes = [ep for ep, *_ in samples]
    forms = [f for f in FORMULATIONS if any(e.formulation == f for e in episodes)]
    matcher = str(args.get("matcher") or "paper")
    n_q = len({e.qkey for e in episodes})
    cfg = RunConfig.of({"run_name": run_dir.name, "output_root": str(run_dir.parent), "run_dir": run_dir,
                        "release_dir": release or args.get("release"), "models": [label], "backend": "openai",
                        "formulations": forms, "n_questions": n_q, "n_questions_extra": n_q,
                        "seed": int(args.get("seed", PAPER_SEED)),
                        "matcher": matcher, "max_new_tokens": int(args.get("max_tokens") or 128),
                        "extra_arms": _extra_arms(episodes), "elicit_permissive": False,
                        "closed_book_variant": "forced"}, source=str(log_path))
    cfg = cfg.with_release_resolved()
    paths = RunPaths(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    # 01: the episodes and the construction summary
    for form in forms:
        write_episodes([e for e in episodes if e.formulation == form], paths.episodes(form))
    bench = load_benchmark(cfg.release_dir)
    paths.write_summary("construction", construction.construction_summary(bench, episodes))

    # 02: the closed-book replies, scored with the task's matcher
    mem_rows = _memory_rows(samples, label)
    for r in mem_rows:
        span, absent, correct = memory_status(r["response"], r["gold"], matcher=matcher, gold_kind=r["gold_kind"])
        r.update(span=span, mem_absent=bool(absent), memory_correct=correct)
    memory = pd.DataFrame(mem_rows, columns=elicitation.COLUMNS + elicitation.EXTRA_COLUMNS)
    write_jsonl(elicitation.scored_path(run_dir, label, "forced"), mem_rows, convert=False)
    paths.write_summary("elicitation", elicitation.summary(memory, alpha=cfg.alpha, extra={
        "run_name": cfg.run_name, "matcher": matcher, "n_questions": n_q, "formulations": forms,
        "primary_variant": "forced", "variants": ["forced"], "backend": f"inspect:{log.eval.model}"}))

    # 03: every reply scored, the evaluation summary
    df = score_episodes(episodes, [reply for _, reply, _, _ in samples], memory, matcher=matcher, model_label=label)
    df["n_new_tokens"] = [tokens for *_, tokens in samples]
    df["cached"] = False
    write_scored(df, run_dir, label)
    _compare_headline(log, df, int(cfg.n_boot), log_path)
    write_evaluation_summary(evaluation_summary({label: df}, {label: memory}, cfg), run_dir)

    # config.json: what `memtoc run` records, plus the log the replies came from
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    write_json(paths.config_json, plain({
        "params": cfg.as_params(with_run_dir=False), "provenance": provenance(cfg), "status": "ok",
        "started": str(log.eval.created), "finished": now,
        "source": {"inspect_log": str(log_path.resolve()), "eval_id": log.eval.eval_id, "task": log.eval.task,
                   "task_args": args, "model": str(log.eval.model), "inspect_ai": log.eval.packages.get("inspect_ai")
                   if log.eval.packages else None,
                   "delivery": "the tool return as a tool call and tool message (memtoc.run.inspect_task)"}}))

    # 08: the report, so that `memtoc verify RUN_DIR` runs
    from memtoc.stages.report import build_report
    report, _claims, _ = build_report(run_dir)
    return Imported(run_dir=run_dir, model=label, episodes=len(episodes), questions=n_q, report=report)


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="memtoc import-inspect", description=
                                 "Turn an Inspect log of `inspect eval memtoc/memtoc` into a memtoc run directory "
                                 "(episodes, scored replies, summaries of notebooks 01-03, the report).")
    ap.add_argument("log", help="the .eval or .json log file Inspect wrote (./logs by default)")
    ap.add_argument("run_dir", help="the run directory to write, e.g. outputs/gpt-4o-mini")
    ap.add_argument("--label", default=None, help="the model's folder name (default: the log's model after its provider)")
    ap.add_argument("--release", default=None, help="the MemToC release folder (default: the task's, then "
                    "memtoc's resolution order)")
    ap.add_argument("--force", action="store_true", help="write over a non-empty RUN_DIR")
    a = ap.parse_args(argv)
    out = import_log(a.log, a.run_dir, label=a.label, force=a.force, release=a.release)
    print(f"{out.run_dir}: model {out.model}, {out.episodes} episodes on {out.questions} questions; report "
          f"{out.report}\nnext: memtoc verify {out.run_dir}")
    return 0
