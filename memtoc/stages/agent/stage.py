"""Notebook 07's run: every model's episodes on every condition, then the extra arms - 04's adapters
in the loop (``agent.adapters``) and the sampling rerun (``agent.sampling``) - and
``summaries/agent.json`` (layout: :mod:`memtoc.stages.agent.core`).

Adapter arm: each ``{objective, fold}`` loads ``adapters/<model>/<objective>/fold<k>/`` (notebook 04;
absent: skipped with a notice in ``/models/<model>/notices``) on the in-process runtime and runs the
reported condition on the questions of the *other* fold (the adapter never saw them in training;
the two folds together cover every question once). The closed-book answers, hence the memory-right
slice, stay the base model's: the arm changes only the weights in the loop (the paper's
preference-fine-tuned Llama: auto 0.328 -> 0.360, 444 type errors remaining). Per objective: the
folds' episodes pooled (``slices``) and ``versus_base`` (adapter − base per protocol, paired by question).

Sampling rerun: per seed of ``agent.sampling.seeds``, the reported condition at
``agent.sampling.temperature`` (the paper: T = 0.7, three seeds; closed-book answers held greedy, so
the slice is fixed) through the server runtime's per-request seed.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import pandas as pd

from memtoc.config.runconfig import RunConfig, expect_config
from memtoc.core import progress
from memtoc.core.io import write_json
from memtoc.data.benchmark import load_benchmark
from memtoc.generation import models
from memtoc.stages.agent.contrasts import paired
from memtoc.stages.agent.core import (
    build_specs,
    formulations_of,
    memory_for,
    model_block,
    published_block,
    questions_for,
    runtime_for,
    runtime_key,
    slices_of,
    summary_head,
)
from memtoc.stages.agent.metrics import episodes_frame, in_slice, rate_units
from memtoc.stages.agent.protocols import EpisodeSpec, run_episodes
from memtoc.stages.agent.runtime import JSON_OPTIONS, Runtime, constrained_library
from memtoc.stages.agent.serving import served
from memtoc.stages.agent.traces import Trace

Log = Callable[[str], Any]
ADAPTER_FILES = ("adapter_config.json",)
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def run(cfg: RunConfig, show_progress: bool = True, log: Log = print) -> dict[str, Any]:
    """Notebook 07's work; returns the summary written to ``summaries/agent.json``. ``cfg``: the run
    configuration (a dict is refused)."""
    cfg = expect_config(cfg, "agent.run")
    a = cfg.agent
    bench = load_benchmark(cfg.release_dir)
    summary = summary_head(a)
    costs: dict[str, Any] = {}
    for model in a.models:
        with served(cfg, model, log) as mcfg:     # a vLLM server of its own where runtime_options.launch asks
            block, timing, cost = run_model_arms(mcfg, model, bench, show_progress, log)
        summary["models"][model] = block
        summary["timing"][model] = timing
        if cost:
            costs[model] = cost
    if a.runtime == "transformers":
        summary["constrained_decoding"] = dict(constrained_library(), json_options=JSON_OPTIONS)
        summary["timing"]["constrained_decoding"] = costs       # measured cost per model (machine-dependent)
    summary["published"] = published_block(cfg.release_dir)
    write_json(cfg.paths.summary("agent"), summary)
    return summary


def run_model_arms(cfg: RunConfig, model: str, bench, show_progress: bool, log: Log
                   ) -> tuple[dict[str, Any], dict[str, float], Optional[dict]]:
    """One model: its closed-book answers, every condition, the extra arms; (block, timing, grammar cost)."""
    a = cfg.agent
    t0 = time.time()
    forms = formulations_of(cfg, model)
    questions = questions_for(cfg, model, bench, forms)
    memory = memory_for(cfg, model, questions, forms)
    t_mem = time.time()
    rt = runtime_for(cfg, model)
    try:
        specs = [s for c in a.conditions
                 for s in build_specs(model, questions, memory, a, forms, runtime_key(rt), cfg.matcher, c)]
        res = run_model(rt, specs, cfg.paths.agent_traces(model), model, show_progress)
        desc = {k: v for k, v in rt.describe().items() if k != "constrained_cost"}
        cost = getattr(rt, "constrained_stats", None)
        log(f"{model}: {len(specs)} episodes ({res['ran']} run now, {res['resume']['finished']} finished before) "
            f"in {time.time() - t0:.1f} s")
    finally:
        rt.close()
    recs = res["records"]
    first = [r for r in recs if r["condition"] == a.conditions[0]]
    block = model_block(first, a, forms, len(questions), desc, dict(res["resume"], ran=res["ran"]), cfg.n_perm)
    block["conditions"] = {c: {"slices": slices_of([r for r in recs if r["condition"] == c], a, forms, cfg.n_perm)}
                           for c in a.conditions[1:]}
    block["notices"] = []
    arm = {"cfg": cfg, "model": model, "questions": questions, "memory": memory, "forms": forms,
           "show_progress": show_progress}
    block["adapters"] = adapter_arms(arm, first, block["notices"], log)
    block["sampling"] = sampling_arm(arm)
    t_end = time.time()
    return block, {"closed_book": round(t_mem - t0, 1), "episodes": round(t_end - t_mem, 1),
                   "total": round(t_end - t0, 1)}, cost


def run_model(rt: Runtime, specs: list[EpisodeSpec], trace_path: Path, model: str,
              show_progress: bool = True) -> dict[str, Any]:
    """The episodes of one model through its runtime, logged to (and resumed from) ``trace_path``."""
    started = time.time()

    def report(done: int, total: int) -> None:
        if show_progress:
            progress.report(f"{model} agent episodes", done, total, started, unit="episodes")

    return run_episodes(rt, specs, Trace(trace_path), progress=report)


def _run_arm(arm: dict[str, Any], questions: Sequence, name: str, adapter: Optional[Path] = None,
             seed: Optional[int] = None) -> list[dict]:
    """The reported condition's episodes of ``questions`` on a runtime with an adapter or a seed."""
    cfg, model = arm["cfg"], arm["model"]
    rt = runtime_for(cfg, model, adapter=adapter, seed=seed)
    try:
        specs = build_specs(model, questions, arm["memory"], cfg.agent, arm["forms"], runtime_key(rt), cfg.matcher)
        return run_model(rt, specs, cfg.paths.agent_arm_traces(model, name), f"{model} {name}",
                         arm["show_progress"])["records"]
    finally:
        rt.close()


def adapter_present(path: Path) -> bool:
    """Whether ``path`` holds a finished peft adapter (its config and its weights)."""
    return all((path / f).is_file() for f in ADAPTER_FILES) and any((path / f).is_file() for f in ADAPTER_WEIGHTS)


def adapter_arms(arm: dict[str, Any], base_records: list[dict], notices: list[str], log: Log) -> dict[str, Any]:
    """``/models/<model>/adapters/<objective>`` (see the module docstring); absent adapters add a notice."""
    cfg, model = arm["cfg"], arm["model"]
    a = cfg.agent
    label = models.get_model(model).label
    pooled: dict[str, dict[str, Any]] = {}
    for ad in a.adapters:
        obj, fold = ad["objective"], ad["fold"]
        path = cfg.paths.adapter(label, obj, fold)
        held = [q for q in arm["questions"] if q.fold is not None and q.fold != fold]
        why = (f"{path} holds no finished adapter (run notebook 04 with finetune.objectives including {obj} and "
               f"fold {fold})" if not adapter_present(path) else
               None if held else f"no agent question lies outside training fold {fold}")
        if why:
            notices.append(f"adapter {obj} fold {fold} skipped: {why}")
            log(f"{model}: {notices[-1]}")
            continue
        recs = _run_arm(arm, held, f"{obj}-fold{fold}", adapter=path)
        d = pooled.setdefault(obj, {"folds": [], "records": []})
        d["folds"].append({"fold": fold, "path": str(path), "questions": len(held), "episodes": len(recs)})
        d["records"] += recs
    return {obj: {"folds": d["folds"], "slices": slices_of(d["records"], a, arm["forms"], cfg.n_perm),
                  "versus_base": versus_base(d["records"], base_records, cfg)}
            for obj, d in pooled.items()}


def versus_base(arm_records: list[dict], base_records: list[dict], cfg: RunConfig) -> dict[str, Any]:
    """``{slice: {schema_variant: {protocol: {metric: contrast}}}}``: arm − base, paired by question."""
    a = cfg.agent
    arm_df, base_df = episodes_frame(arm_records), episodes_frame(base_records)
    out: dict[str, Any] = {}
    for sl in a.slices:
        adf, bdf = in_slice(arm_df, sl), in_slice(base_df, sl)
        out[sl] = {v: {p: _pair(adf[(adf["schema_variant"] == v) & (adf["protocol"] == p)],
                                bdf[(bdf["schema_variant"] == v) & (bdf["protocol"] == p)], cfg)
                       for p in a.protocols}
                   for v in a.schema_variants}
    return out


def _pair(t: pd.DataFrame, b: pd.DataFrame, cfg: RunConfig) -> dict[str, Any]:
    if not len(t) or not len(b):
        return {}
    a = cfg.agent
    return {name: paired(rate_units(t, name), rate_units(b, name), a.bootstrap, a.n_boot, cfg.n_perm, 0,
                         treatment="adapter", baseline="base")
            for name in ("answer_agreement", "tool_execution_rate")}


def sampling_arm(arm: dict[str, Any]) -> Optional[dict[str, Any]]:
    """``/models/<model>/sampling``: per seed, the reported condition sampled at the temperature."""
    cfg = arm["cfg"]
    sm = cfg.agent.sampling
    if not sm:
        return None
    seeds = {}
    for seed in sm["seeds"]:
        recs = _run_arm(arm, arm["questions"], f"T{sm['temperature']:g}-seed{seed}", seed=seed)
        seeds[str(seed)] = {"episodes": len(recs), "slices": slices_of(recs, cfg.agent, arm["forms"], cfg.n_perm)}
    return {"temperature": sm["temperature"], "closed_book": "greedy (the slice is fixed)", "seeds": seeds}
