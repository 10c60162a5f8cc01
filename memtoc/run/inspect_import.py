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
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pandas as pd
from inspect_ai.log import read_eval_log

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
from memtoc.run.inspect_task import CLOSED_BOOK_KEY, TASK_NAME, task_episodes
from memtoc.run.pipeline import provenance
from memtoc.stages import construction, elicitation
from memtoc.stages.evaluation import score_episodes, write_scored
from memtoc.stages.evaluation.analyses.headline import headline_metrics
from memtoc.stages.evaluation.analyses.summary import evaluation_summary
from memtoc.stages.evaluation.analyses.summary import write_summary as write_evaluation_summary



@dataclass(frozen=True)
class Imported:
    """What :func:`import_log` wrote."""
    run_dir: Path
    model: str
    episodes: int
    questions: int
    report: Path


def model_label(inspect_model: str) -> str:
    """A folder-safe model label from Inspect's ``provider/model`` name: ``inspect-`` and the part after the
    last ``/`` (the prefix keeps a paper model run through Inspect's tool-message frame apart from the
    registry's name, so 08 does not set it beside the paper's numbers as if it were the paper's frame)."""
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", inspect_model.rsplit("/", 1)[-1]).strip("-.")
    if not label:
        raise ConfigError(f"cannot make a model label from {inspect_model!r}; give one with --label")
    return f"inspect-{label}"


def _read(log_path: Path):
    if not log_path.is_file():
        raise DataError(f"{log_path}: no such Inspect log; give the .eval (or .json) file that `inspect eval "
                        "memtoc/memtoc` wrote under ./logs")
    log = read_eval_log(str(log_path))
    task = str(log.eval.task)
    if not task.split("/")[-1].split("@")[-1].endswith(TASK_NAME):
        raise DataError(f"{log_path}: field eval.task is {task!r}, not memtoc's task; import a log of "
                        "`inspect eval memtoc/memtoc`")
    if log.status != "success":
        raise DataError(f"{log_path}: field status is {log.status!r}; run the task to the end in one `inspect eval` "
                        "(a retry generates the closed-book answers of the unfinished questions again)")
    bad = [s.id for s in (log.samples or []) if s.error is not None]
    if bad or not log.samples:
        raise DataError(f"{log_path}: {len(bad)} sample(s) ended in an error (e.g. {bad[:3]}) or the log has no "
                        "samples; run the task again in one `inspect eval`")
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
                                "replies (a retry generates them again); rerun the task in one `inspect eval`")
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
    """Stop when the log's pooled headline values differ from memtoc's re-scoring of its replies (a value
    undefined on one side only is a difference too)."""
    recorded = {}
    for s in (log.results.scores if log.results else []):
        for name, m in s.metrics.items():
            recorded[name] = m.value
    pooled = (headline_metrics(df, n_boot=n_boot) or {}).get("pooled", {})
    for name in HEADLINE_METRICS:
        if name not in recorded:
            continue
        mine = (pooled.get(name) or {}).get("value")
        mine = float("nan") if mine is None else float(mine)
        theirs = float(recorded[name])
        if math.isnan(mine) != math.isnan(theirs) or (not math.isnan(mine) and not math.isclose(mine, theirs,
                                                                                                 abs_tol=1e-9)):
            raise DataError(f"{where}: metric {name} is {theirs} in the log but {mine} when memtoc scores the "
                            "log's replies; the log was scored by another memtoc version: rerun the task")


def _check_complete(log, episodes: list[Episode], args: dict[str, Any], where: Path) -> None:
    """One epoch, and every episode of the task's options once: a log of ``--epochs``, ``--limit`` or
    ``--sample-id`` is refused (its metrics and its cells would not be the task's)."""
    epochs = getattr(log.eval.config, "epochs", None) or 1
    if epochs != 1 or any(getattr(s, "epoch", 1) != 1 for s in log.samples):
        raise DataError(f"{where}: field eval.config.epochs is {epochs}; memtoc's task decodes at temperature 0 and "
                        "is imported with one epoch: rerun it without --epochs")
    ids = [e.episode_id for e in episodes]
    want = {e.episode_id for e in task_episodes(**{k: args[k] for k in ("release", "n_questions", "seed",
                                                                        "formulations", "conditions", "arms")
                                                   if k in args})}
    if len(set(ids)) != len(ids) or set(ids) != want:
        raise DataError(f"{where}: the log holds {len(set(ids))} of the {len(want)} episodes of its task options "
                        f"(eval.task_args); a run with --limit or --sample-id is a part of the task: rerun it without "
                        "them (a smaller n_questions gives a smaller complete task)")


def import_log(log_path: str | Path, run_dir: str | Path, label: Optional[str] = None, force: bool = False,
               release: Optional[str] = None) -> Imported:
    """Write ``run_dir`` from the Inspect log ``log_path`` (module docstring); ``label`` names the model's
    folders (default ``inspect-`` and the log's model, so that no run of the paper's frame is taken for it).
    Everything is checked and scored first, then written into a staging folder that replaces ``run_dir``
    whole: a refused log writes nothing, and ``force`` replaces a non-empty ``run_dir`` instead of mixing
    old files into the new run."""
    log_path, run_dir = Path(log_path), Path(run_dir).resolve()
    if run_dir.exists() and any(run_dir.iterdir()) and not force:
        raise ConfigError(f"{run_dir} exists and is not empty; give another RUN_DIR or --force to replace it")
    log = _read(log_path)
    args = dict(log.eval.task_args or {})
    if release:
        args["release"] = release
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
    _check_complete(log, episodes, args, log_path)
    forms = [f for f in FORMULATIONS if any(e.formulation == f for e in episodes)]
    matcher = str(args.get("matcher") or "paper")
    n_q = len({e.qkey for e in episodes})
    staging = run_dir.parent / f".{run_dir.name}.importing-{os.getpid()}" / run_dir.name
    cfg = RunConfig.of({"run_name": run_dir.name, "output_root": str(run_dir.parent), "run_dir": staging,
                        "release_dir": args.get("release"), "models": [label], "backend": "openai",
                        "formulations": forms, "n_questions": n_q, "n_questions_extra": n_q,
                        "seed": int(args.get("seed", PAPER_SEED)),
                        "matcher": matcher, "max_new_tokens": int(getattr(log.eval.model_generate_config,
                                                                          "max_tokens", None)
                                                                  or args.get("max_tokens") or 128),
                        "extra_arms": _extra_arms(episodes), "elicit_permissive": False,
                        "closed_book_variant": "forced"}, source=str(log_path))
    cfg = cfg.with_release_resolved()

    # score everything before writing anything: 02's memory (the task's matcher), 03's rows, the log's metrics
    mem_rows = _memory_rows(samples, label)
    for r in mem_rows:
        span, absent, correct = memory_status(r["response"], r["gold"], matcher=matcher, gold_kind=r["gold_kind"])
        r.update(span=span, mem_absent=bool(absent), memory_correct=correct)
    memory = pd.DataFrame(mem_rows, columns=elicitation.COLUMNS + elicitation.EXTRA_COLUMNS)
    df = score_episodes(episodes, [reply for _, reply, _, _ in samples], memory, matcher=matcher, model_label=label)
    df["n_new_tokens"] = [tokens for *_, tokens in samples]
    df["cached"] = False
    _compare_headline(log, df, int(cfg.n_boot), log_path)
    bench = load_benchmark(cfg.release_dir)

    shutil.rmtree(staging.parent, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _write(staging, cfg, log, log_path, args, episodes, forms, bench, mem_rows, memory, df, label, matcher, n_q)
        from memtoc.stages.report import build_report       # 08: the report, so that `memtoc verify` runs
        build_report(staging)
        if run_dir.exists():
            shutil.rmtree(run_dir)
        staging.rename(run_dir)
    finally:
        shutil.rmtree(staging.parent, ignore_errors=True)
    return Imported(run_dir=run_dir, model=label, episodes=len(episodes), questions=n_q,
                    report=RunPaths(run_dir).paper / "report.md")


def _write(root: Path, cfg: RunConfig, log, log_path: Path, args: dict[str, Any], episodes: list[Episode],
           forms: list[str], bench, mem_rows: list[dict[str, Any]], memory: pd.DataFrame, df: pd.DataFrame,
           label: str, matcher: str, n_q: int) -> None:
    """The files of notebooks 01-03 and config.json under ``root``."""
    paths = RunPaths(root)
    for form in forms:
        write_episodes([e for e in episodes if e.formulation == form], paths.episodes(form))
    paths.write_summary("construction", construction.construction_summary(bench, episodes))
    write_jsonl(elicitation.scored_path(root, label, "forced"), mem_rows, convert=False)
    paths.write_summary("elicitation", elicitation.summary(memory, alpha=cfg.alpha, extra={
        "run_name": cfg.run_name, "matcher": matcher, "n_questions": n_q, "formulations": forms,
        "primary_variant": "forced", "variants": ["forced"], "backend": f"inspect:{log.eval.model}"}))
    write_scored(df, root, label)
    write_evaluation_summary(evaluation_summary({label: df}, {label: memory}, cfg), root)
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    write_json(paths.config_json, plain({
        "params": cfg.as_params(with_run_dir=False), "provenance": provenance(cfg), "status": "ok",
        "started": str(log.eval.created), "finished": now,
        "source": {"inspect_log": str(log_path.resolve()), "eval_id": log.eval.eval_id, "task": log.eval.task,
                   "task_args": args, "model": str(log.eval.model), "inspect_ai": log.eval.packages.get("inspect_ai")
                   if log.eval.packages else None,
                   "delivery": "the tool return as a tool call and tool message (memtoc.run.inspect_task)"}}))


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
