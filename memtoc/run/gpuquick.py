"""``memtoc gpucheck --plan PARAMS --quick``: the whole pipeline of a GPU plan, at a tiny size, in minutes.

The first thing to run on a new GPU machine, before the hours of ``memtoc run params/paper.yaml``:
every stage the plan enables (01-09: generation on the plan's backend and dtype, the judged layer,
fine-tuning, probes on the GPU, transfer, the agent loop, the report and its verification) runs once
with the embedded SmolLM2-135M-Instruct (shipped inside a PyPI package: no download, no hub login) on
2 questions, into a temporary run directory. A failure names the notebook, as ``memtoc run`` does.
What it does not check: the paper's models themselves (their downloads, licences and memory; the dry
run sizes those) and the time of the full run.
"""
from __future__ import annotations

import copy
import datetime as _dt
import json
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from memtoc.config.params import load_params
from memtoc.config.runconfig import RunConfig, RunPaths
from memtoc.generation.hardware import check_gpu, gpu_memory_used_gib
from memtoc.generation.models import EMBEDDED

#: the tiny sizes: every stage runs, none for long (params/smoke.yaml's, smaller where it matters)
QUICK: dict[str, Any] = {
    "n_questions": 2, "n_questions_extra": 1, "n_boot": 100, "n_perm": 200, "max_new_tokens": 32,
    "finetune": {"train_questions_per_fold": 2, "eval_questions_per_fold": 1, "max_steps": 1, "batch_size": 2,
                 "grad_accum": 1, "learning_rate": 1.0e-4},
    "transfer": {"n_counterfactual": 2, "n_unanswerable": 1, "formulations": ["reference"], "forward_folds": [0],
                 "reverse_max_steps": 1, "reverse_batch_size": 2, "reverse_eval_questions": 1},
    "probes": {"lens_fit_prompts": 1, "lens_max_seq_len": 24, "lens_skip_first": 4, "heldout_texts": 1,
               "heldout_max_seq_len": 32, "lens_max_episodes": 2, "n_control": 2, "sae_steps": 20,
               "sae_prompts": 4, "sae_corpus_texts": 1, "sae_heldout_prompts": 2, "mine_per_label": 2,
               "steer_per_direction": 1, "strengths": [4], "bands": {}, "sae_layers": {}, "lens_files": {},
               "sae_files": {}},
    "agent": {"n_questions": 1, "memory_right_questions": 1, "formulations": ["reference"],
              "schema_variants": ["release"], "max_tokens_per_call": 48, "max_tokens_per_episode": 144},
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) and v else v
    return out


def _blank_models(block: dict[str, Any], quick: dict[str, Any]) -> dict[str, Any]:
    """The tiny sizes; a block that names the plan's models gets the run's (embedded) model instead."""
    out = dict(quick)
    if block.get("models"):
        out["models"] = [EMBEDDED]
    return out


def quick_overrides(plan: dict[str, Any], output_root: str) -> dict[str, Any]:
    """The overrides that turn a plan into its tiny check: the embedded model in place of the plan's
    models (and judge), the plan's backend, dtype, backend and block settings otherwise kept, every
    enabled stage still enabled, tiny sizes, a temporary output folder; 05 in float32 (the embedded model
    has no published lens to read, and a lens is fitted in float32 only)."""
    over: dict[str, Any] = {"run_name": "gpucheck-quick", "output_root": output_root, "models": [EMBEDDED]}
    for block in ("finetune", "transfer", "probes", "agent"):
        if (plan.get(block) or {}).get("enabled", True):
            over[block] = _blank_models(plan.get(block) or {}, QUICK[block])
    if "probes" in over and (plan.get("probes") or {}).get("dtype", "float32") != "float32":
        # the embedded model has no published lens, and a lens is fitted in float32 only
        over["probes"]["dtype"] = "float32"
    over.update({k: v for k, v in QUICK.items() if not isinstance(v, dict)})
    if plan.get("judge"):
        over["judge"] = dict(plan["judge"], model=EMBEDDED)
    opts = dict(plan.get("backend_options") or {})
    if plan.get("backend") == "vllm":
        opts["gpu_memory_utilization"] = min(float(opts.get("gpu_memory_utilization", 0.9)), 0.3)
        opts["max_model_len"] = min(int(opts.get("max_model_len", 2048)), 2048)
    over["backend_options"] = opts
    return over


def quick_config(plan_file: str, output_root: str, device: Optional[str] = None) -> RunConfig:
    """The tiny check of ``plan_file``, validated; on ``device`` ``cpu`` every vLLM generator of the plan
    (the run's, the judge's) runs on transformers, without the vLLM engine options."""
    cfg = RunConfig.of(load_params(plan_file, overrides=quick_overrides(load_params(plan_file), output_root)),
                       f"{plan_file} (gpucheck --quick)")
    return cpu_path(cfg) if str(device or "").startswith("cpu") else cfg


def cpu_path(cfg: RunConfig) -> RunConfig:
    """The CPU path of the same plan: a vLLM generator becomes a transformers one and drops its engine
    options (``gpu_memory_utilization``, ``max_model_len`` mean nothing to transformers)."""
    if cfg.backend == "vllm":
        cfg = cfg.replace(backend="transformers", backend_options={})
    if cfg.judge is not None and cfg.judge.backend == "vllm":
        cfg = cfg.replace(judge=dict(cfg.judge.to_dict(), backend="transformers", backend_options={}))
    return cfg


@dataclass
class StageRow:
    """One line of the check's table: a notebook of the plan (or a separate case such as the full-size
    DPO step), whether it ran, its wall time, the GPU memory in use at its peak, and the generation rate."""

    stage: str
    status: str                      # PASS | FAIL | SKIP | not run
    seconds: Optional[float] = None
    peak_gpu_gib: Optional[float] = None     # all processes on the GPU (nvidia-smi), sampled every second
    tokens_per_s: Optional[float] = None     # new tokens / generation seconds of the replies it generated
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class MemorySampler:
    """Samples ``read()`` (default: the GPU memory in use) every ``period`` seconds on a thread, with the
    time; nothing is recorded where ``read`` returns None (no GPU)."""

    def __init__(self, read: Callable[[], Optional[float]] = gpu_memory_used_gib, period: float = 1.0):
        self.read, self.period = read, period
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while True:
            value = self.read()
            if value is not None:
                self.samples.append((time.time(), value))
            if self._stop.wait(self.period):
                return

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _epoch(stamp: Optional[str]) -> Optional[float]:
    try:
        return _dt.datetime.fromisoformat(str(stamp)).timestamp()
    except ValueError:
        return None


def generated_in(run_dir: Path, start: float, end: float) -> tuple[int, float]:
    """New tokens and generation seconds of the replies the run's generation caches received between
    ``start`` and ``end`` (epoch seconds; each cache line carries the time it was written)."""
    tokens, seconds = 0, 0.0
    for path in sorted(Path(run_dir).rglob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if '"n_new_tokens"' not in line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                t = _epoch(rec.get("time"))
                if t is not None and start - 1 <= t <= end + 1 and rec.get("seconds"):
                    tokens += int(rec.get("n_new_tokens") or 0)
                    seconds += float(rec["seconds"])
    return tokens, seconds


def stage_rows(run_dir: Path, samples: list[tuple[float, float]]) -> list[StageRow]:
    """The table's rows from the run's ``config.json`` (each notebook's status, start, end, seconds), the
    memory samples taken meanwhile and the generation caches."""
    try:
        record = json.loads(RunPaths(Path(run_dir)).config_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    rows = []
    for entry in record.get("notebooks", []):
        status = {"ok": "PASS", "failed": "FAIL", "skipped": "SKIP"}.get(entry.get("status"), str(entry.get("status")))
        start, end = _epoch(entry.get("started")), _epoch(entry.get("finished"))
        row = StageRow(entry.get("notebook", "?"), status, entry.get("seconds"), note=entry.get("reason", ""))
        if start is not None and end is not None:
            peak = [gb for t, gb in samples if start - 1 <= t <= end + 1]
            row.peak_gpu_gib = max(peak) if peak else None
            tokens, secs = generated_in(run_dir, start, end)
            row.tokens_per_s = round(tokens / secs, 1) if secs > 0 else None
        rows.append(row)
    return rows


def format_table(rows: list[StageRow]) -> list[str]:
    """The rows as aligned text lines: stage, status, seconds, peak GPU GiB, tokens/s, note."""
    def cell(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)
    out = [f"{'stage':<38} {'status':<7} {'seconds':>8} {'peak GiB':>9} {'tokens/s':>9}  note"]
    for r in rows:
        out.append(f"{r.stage:<38} {r.status:<7} {cell(r.seconds, '8.1f')} {cell(r.peak_gpu_gib, '9.2f')} "
                   f"{cell(r.tokens_per_s, '9.1f')}  {r.note}".rstrip())
    return out


def run_quick(plan_file: str, device: Optional[str] = None, keep: Optional[str] = None,
              log=print) -> tuple[int, list[StageRow]]:
    """Run the check; returns (0 when every enabled notebook ran, 1 when one failed, 2 when there is no
    GPU; the table's rows, one per notebook)."""
    from memtoc.run import pipeline

    root = keep or tempfile.mkdtemp(prefix="memtoc-gpucheck-")
    cfg = quick_config(plan_file, root, device)
    if not str(device or "").startswith("cpu"):
        check_gpu(cfg, cfg.source)
    log(f"memtoc gpucheck --plan {plan_file} --quick: {EMBEDDED} through every enabled stage on "
        f"{cfg.backend}, 2 questions, outputs in {root}")
    t0 = time.time()
    rc = 0
    with MemorySampler() as sampler:
        try:
            pipeline.run(cfg, source=cfg.source)
        except pipeline.PipelineError as e:
            log(f"FAIL after {time.time() - t0:.0f} s: {e}")
            rc = 1
    if rc == 0:
        log(f"PASS in {time.time() - t0:.0f} s: every enabled notebook ran and verified ({cfg.run_dir})")
    return rc, stage_rows(cfg.run_dir, sampler.samples)
