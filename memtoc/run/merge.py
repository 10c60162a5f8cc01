"""``memtoc merge OUT RUN_A RUN_B ...``: one report from runs that each ran some of the models.

With several GPUs, run one model per GPU in parallel, each its own process and run directory::

    CUDA_VISIBLE_DEVICES=0 memtoc run params/paper.yaml --set models=[MODEL_A] --set run_name=paper_a &
    CUDA_VISIBLE_DEVICES=1 memtoc run params/paper.yaml --set models=[MODEL_B] --set run_name=paper_b &
    wait
    memtoc merge outputs/paper outputs/paper_a outputs/paper_b

The shards must agree on everything but the model list (same result parameters, same release digest,
same memtoc commit); otherwise the merge stops with one line naming the shard's ``config.json`` and
the field. The merge copies each model's folders (generations, scored rows, adapters, probes,
transfer rows, agent traces: the per-model paths of :class:`~memtoc.config.runconfig.RunPaths`) and the
shared episodes and construction summary, then *recomputes* the summaries that pool or compare
models from the merged files: ``summaries/elicitation.json`` (02), ``summaries/evaluation.json``
(03: Holm families, ranking stability and cross-model tests over every model) and its figures, and
the report (08) when no later stage ran. The summaries of 04–07 are not merged: run
``memtoc run OUT/params.yaml --only 04 05 06 07 08 09`` on the merged directory (it reuses the
copied caches and adapters) to write them.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from memtoc.config.runconfig import RunConfig, RunPaths
from memtoc.core import figures
from memtoc.core.errors import ConfigError, DataError
from memtoc.core.io import plain, sha256_file, write_json
from memtoc.run.pipeline import NON_RESULT_KEYS, stage_record
from memtoc.stages import elicitation, evaluation, report
from memtoc.stages.evaluation import analyses, tables

#: parameters that may differ between shards (besides the non-result ones: where files go)
SHARD_KEYS: tuple[str, ...] = ("models",)
#: per-model folders of a run directory, as RunPaths names them
MODEL_DIRS = ("generations", "scored", "scored_judged", "adapters", "probes", "transfer", "agent")
#: stages whose summaries the merge recomputes, and those it leaves to `memtoc run --only`
RECOMPUTED = ("01_construction", "02_elicitation", "03_evaluation")
LATER = ("04_finetuning", "05_probes", "06_transfer", "07_agent_loop")


def _model_dir(paths: RunPaths, folder: str, model: str) -> Path:
    return {"generations": paths.generations, "scored": paths.scored, "adapters": paths.adapters,
            "probes": paths.probes, "agent": paths.agent,
            "scored_judged": lambda m: paths.scored(m, "scored_judged"),
            "transfer": lambda m: paths.transfer_scored(m, "x").parent}[folder](model)


def read_shard(run_dir: Path) -> dict[str, Any]:
    """A shard's ``config.json`` (checked: a finished run with params, provenance and stages)."""
    path = RunPaths(run_dir).config_json
    if not path.is_file():
        raise DataError(f"{path} does not exist: {run_dir} is not a finished `memtoc run` directory")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise DataError(f"{path}: not valid JSON ({e}); rerun that shard") from None
    for field in ("params", "provenance", "stages"):
        if not isinstance(cfg.get(field), dict):
            raise DataError(f"{path}: field '{field}' is missing; rerun that shard with `memtoc run`")
    if cfg.get("status") != "ok":
        raise DataError(f"{path}: field 'status' is {cfg.get('status')!r}, not 'ok'; finish that shard "
                        "(rerun the same `memtoc run` command) before merging")
    return cfg


def _fact(cfg: dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def check_compatible(shards: Sequence[Path], configs: Sequence[dict[str, Any]]) -> None:
    """Raise a one-line ConfigError unless every shard matches the first on the result parameters
    (the model list apart), the release digest and the commit, with no model in two shards."""
    first, ref = shards[0], configs[0]
    skip = set(SHARD_KEYS) | set(NON_RESULT_KEYS)
    seen: dict[str, Path] = {}
    for shard, cfg in zip(shards, configs):
        where = RunPaths(shard).config_json
        keys = sorted((set(ref["params"]) | set(cfg["params"])) - skip)
        for k in keys:
            if plain(cfg["params"].get(k)) != plain(ref["params"].get(k)):
                raise ConfigError(f"{where}: field 'params.{k}' is {cfg['params'].get(k)!r}, but "
                                  f"{ref['params'].get(k)!r} in {RunPaths(first).config_json}; merge only "
                                  "shards run with the same parameters apart from 'models'")
        for dotted, what in (("provenance.release.digest", "release"), ("provenance.git.commit", "commit")):
            if _fact(cfg, dotted) != _fact(ref, dotted):
                raise ConfigError(f"{where}: field '{dotted}' is {_fact(cfg, dotted)!r}, but "
                                  f"{_fact(ref, dotted)!r} in {RunPaths(first).config_json}; merge only "
                                  f"shards run on the same {what}")
        for m in cfg["params"].get("models") or []:
            if m in seen:
                raise ConfigError(f"{where}: field 'params.models' repeats {m!r}, also in "
                                  f"{RunPaths(seen[m]).config_json}; give each model to one shard")
            seen[m] = shard
    if ref["params"].get("judge") is not None:
        raise ConfigError(f"{RunPaths(first).config_json}: field 'params.judge' is set; the merge does not "
                          "recompute the judged layer: run the models in one run, or set judge: null")


def _copy_tree(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=False)


def copy_files(out: Path, shards: Sequence[Path], configs: Sequence[dict[str, Any]]) -> None:
    """Each model's folders from its shard; the episodes from the first shard (every shard's episode
    files must be byte-identical: they depend on no model)."""
    dst = RunPaths(out)
    first = RunPaths(shards[0])
    episodes = first.episodes("x").parent          # the episodes folder (RunPaths names its files)
    for shard, cfg in zip(shards, configs):
        src = RunPaths(shard)
        for a in sorted(episodes.glob("*.jsonl")):
            b = src.episodes(a.stem)
            if not b.is_file() or sha256_file(a) != sha256_file(b):
                raise DataError(f"{b}: differs from {a}; the shards built different episodes "
                                "(rerun them from the same commit and parameters)")
        for m in cfg["params"]["models"]:
            for folder in MODEL_DIRS:
                _copy_tree(_model_dir(src, folder, m), _model_dir(dst, folder, m))
    _copy_tree(episodes, dst.episodes("x").parent)
    if first.summary("construction").is_file():
        dst.summaries.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(first.summary("construction"), dst.summary("construction"))


def merged_params(out: Path, configs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    params = dict(configs[0]["params"])
    params["models"] = [m for c in configs for m in c["params"]["models"]]
    params["run_name"] = out.name
    params["output_root"] = str(out.parent)
    return params


def recompute_elicitation(cfg: RunConfig, first_summary: dict[str, Any]) -> Path:
    """``summaries/elicitation.json`` from the merged closed-book files (notebook 02's summary)."""
    frames = [elicitation.load_memory(cfg.run_dir, m, v) for m in cfg.models for v in cfg.closed_book_variants]
    extra = {k: v for k, v in first_summary.items() if k not in ("schema_version", "alpha", "models")}
    extra["run_name"] = cfg.run_name
    summary = elicitation.summary(pd.concat(frames, ignore_index=True), alpha=cfg.alpha, extra=extra)
    return cfg.paths.write_summary("elicitation", summary)


def recompute_evaluation(cfg: RunConfig) -> Path:
    """``summaries/evaluation.json`` and its figures from the merged scored files (notebook 03)."""
    scored, memory = {}, {}
    for m in cfg.models:
        scored[m] = evaluation.read_scored(cfg.run_dir, m)
        mem = elicitation.load_memory(cfg.run_dir, m, cfg.closed_book_variant)
        memory[m] = evaluation.memory_rows(mem, set(zip(scored[m]["formulation"], scored[m]["qkey"])))
    summary = analyses.evaluation_summary(scored, memory, cfg)
    path = analyses.write_summary(summary, cfg.run_dir)
    figures.source_matrix(pd.concat(scored.values(), ignore_index=True), cfg.paths.figure("source_matrix"))
    figures.headline(tables.headline_table(summary), cfg.paths.figure("headline"))
    return path


def _ran(configs: Sequence[dict[str, Any]], stage: str) -> bool:
    """Whether every shard finished ``stage`` (a mix is refused: the shards ran different plans)."""
    have = [stage in c["stages"] for c in configs]
    if any(have) and not all(have):
        raise ConfigError(f"field 'stages.{stage}' is in some shards' config.json and not in others; "
                          "run the same stages in every shard before merging")
    return all(have)


def write_record(out: Path, shards: Sequence[Path], configs: Sequence[dict[str, Any]],
                 cfg: RunConfig, done: Sequence[str]) -> None:
    """``params.yaml`` and ``config.json`` of the merged run: the first shard's provenance, the stage
    records of the stages recomputed here (so `memtoc run OUT/params.yaml --only ...` accepts them)."""
    paths = RunPaths(out)
    digest = _fact(configs[0], "provenance.release.digest")
    params = cfg.as_params(with_run_dir=False)
    paths.write_params(params, "`memtoc merge`; every notebook reads this file.")
    finished = max(str(c.get("finished") or "") for c in configs)
    stages = {s: stage_record(cfg, s[:2], digest, finished) for s in done}
    write_json(paths.config_json, {
        "run_name": params["run_name"], "run_dir": str(out), "params_file": str(paths.params_yaml),
        "params": params, "provenance": configs[0]["provenance"], "status": "ok", "finished": finished,
        "merged_from": [{"run_dir": str(s), "models": c["params"]["models"],
                         "stages": sorted(c["stages"])} for s, c in zip(shards, configs)],
        "notebooks": [], "stages": stages})


def merge(out: str | Path, shards: Sequence[str | Path]) -> dict[str, Any]:
    """Merge the shard run directories into ``out`` (which must not exist yet); returns what was done:
    ``{"models", "recomputed": [stage...], "left": [stage...], "report": path or None}``."""
    out, shard_dirs = Path(out).resolve(), [Path(s).resolve() for s in shards]
    if len(shard_dirs) < 2:
        raise ConfigError("memtoc merge needs at least two shard run directories")
    if out.exists():
        raise ConfigError(f"{out} exists; give a new directory for the merged run")
    configs = [read_shard(s) for s in shard_dirs]
    check_compatible(shard_dirs, configs)
    done = [s for s in RECOMPUTED if _ran(configs, s)]
    left = [s for s in LATER if _ran(configs, s)]
    cfg = RunConfig.of({**merged_params(out, configs), "run_dir": out}, str(RunPaths(out).params_yaml))
    out.mkdir(parents=True)
    try:
        rep = _build(out, shard_dirs, configs, cfg, done, left)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)      # no half-merged run left behind
        raise
    return {"models": list(cfg.models), "recomputed": done, "left": left, "report": rep}


def _build(out: Path, shard_dirs: Sequence[Path], configs: Sequence[dict[str, Any]], cfg: RunConfig,
           done: Sequence[str], left: Sequence[str]) -> Path | None:
    copy_files(out, shard_dirs, configs)
    write_record(out, shard_dirs, configs, cfg, done)
    cfg.paths.figures.mkdir(parents=True, exist_ok=True)
    if "02_elicitation" in done:
        path = RunPaths(shard_dirs[0]).summary("elicitation")
        if not path.is_file():
            raise DataError(f"{path} does not exist, though the shard's config.json records stage 02; "
                            "rerun that shard's 02_elicitation")
        recompute_elicitation(cfg, json.loads(path.read_text(encoding="utf-8")))
    if "03_evaluation" in done:
        recompute_evaluation(cfg)
    return None if left else report.build_report(out)[0]


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="memtoc merge", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the merged run directory (new), e.g. outputs/paper")
    ap.add_argument("shards", nargs="+", help="the shard run directories, e.g. outputs/paper_a outputs/paper_b")
    a = ap.parse_args(argv)
    r = merge(a.out, a.shards)
    print(f"merged {len(a.shards)} runs into {a.out}: models {r['models']}; recomputed "
          f"{', '.join(r['recomputed']) or 'nothing'}" + (f"; report {r['report']}" if r["report"] else ""))
    if r["left"]:
        print(f"summaries of {', '.join(r['left'])} not merged: run `memtoc run {Path(a.out) / 'params.yaml'} "
              f"--only {' '.join(s[:2] for s in r['left'])} 08 09` (it reuses the copied caches and adapters)")
    return 0
