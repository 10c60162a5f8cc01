"""`memtoc run PARAMS.yaml`: execute the numbered notebooks in order with papermill.

    memtoc run params/default.yaml
    memtoc run params/smoke.yaml --only 03_evaluation --set output_root=/tmp/out --set n_boot=100
    memtoc run params/default.yaml --set finetune.enabled=false --list

What a run does, in order:

1. Reads and validates the parameter file (``config.load_params``); ``--set key=value`` overrides
   any parameter (values are parsed as YAML; dotted keys reach into mappings, e.g.
   ``finetune.enabled=false``).
2. Writes ``<run_dir>/params.yaml`` (the fully resolved parameters; every notebook reads this one
   file, so all notebooks of a run see exactly the same parameters) and ``<run_dir>/config.json``
   (resolved parameters + provenance: git commit and dirty flag, package versions, Python and
   platform, sha256 of every benchmark release file, start/end times, per-notebook status and
   timings). config.json is rewritten after every notebook, so an interrupted run still documents
   what it did.
3. Executes the numbered notebooks present in ``notebooks/`` (``NN_name.ipynb``) in order with
   papermill into ``<run_dir>/notebooks/``, passing ``params_file`` = the resolved copy. Known stages
   that are missing are skipped with a notice; ``04_*`` is skipped when ``finetune.enabled`` is false.
   ``--only`` restricts the run to some notebooks (by full stem ``03_evaluation`` or number ``03``).

Nothing here deletes anything under the run directory: the generation cache
(``generations/``) survives interruptions, and a rerun is served from it.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from .config import REPO_ROOT, ConfigError, MemtocError, load_params, resolve_release_dir, run_dir

NOTEBOOK_DIR = REPO_ROOT / "notebooks"

# The stages the pipeline knows about (a missing one is skipped with a notice). Notebooks present in
# notebooks/ with other numbers run too, in numeric order.
KNOWN_STAGES: tuple[str, ...] = ("01", "02", "03", "04", "08", "09")

PROVENANCE_PACKAGES: tuple[str, ...] = (
    "memtoc", "torch", "transformers", "trl", "peft", "accelerate", "datasets", "vllm", "papermill",
    "nbclient", "numpy", "pandas", "scipy", "statsmodels", "seaborn", "matplotlib",
)

_NB_RE = re.compile(r"^(\d\d)_[A-Za-z0-9_\-]+\.ipynb$")


class PipelineError(MemtocError):
    """A notebook failed, or the requested plan is impossible."""


@dataclass(frozen=True)
class Step:
    """One entry of a run plan: a notebook and whether it runs (and why not)."""

    number: str
    name: str                 # file stem, e.g. "03_evaluation" (the number when the file is missing)
    path: Path | None         # None: the known stage has no notebook yet
    run: bool
    reason: str = ""


# --------------------------------------------------------------------------------------------------
# parameters


def parse_set(items: list[str] | None) -> dict[str, Any]:
    """``["a=1", "finetune.enabled=false"]`` -> ``{"a": 1, "finetune": {"enabled": False}}``.

    Values are parsed as YAML scalars/flow collections (``models=[a,b]`` gives a list).
    """
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set n_questions=20")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"--set {item!r}: the key is empty")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({e})") from None
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {p!r} was already set to a non-mapping value")
        node[parts[-1]] = value
    return out


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


# --------------------------------------------------------------------------------------------------
# plan


def discover_notebooks(notebook_dir: Path = NOTEBOOK_DIR) -> dict[str, Path]:
    """Numbered notebooks in ``notebook_dir``: ``{"01": Path(.../01_construction.ipynb), ...}``."""
    found: dict[str, Path] = {}
    if not notebook_dir.is_dir():
        return found
    for p in sorted(notebook_dir.iterdir()):
        m = _NB_RE.match(p.name)
        if m:
            if m.group(1) in found:
                raise PipelineError(f"two notebooks with number {m.group(1)} in {notebook_dir}: "
                                    f"{found[m.group(1)].name} and {p.name}; keep one")
            found[m.group(1)] = p
    return found


def plan(params: dict[str, Any], only: list[str] | None = None,
         notebook_dir: Path = NOTEBOOK_DIR) -> list[Step]:
    """The ordered list of notebooks a run would execute (pure apart from listing the folder)."""
    found = discover_notebooks(notebook_dir)
    numbers = sorted(set(found) | set(KNOWN_STAGES))
    wanted: set[str] | None = None
    if only:
        wanted = set()
        for o in only:
            o = o.strip()
            o = o[:-6] if o.endswith(".ipynb") else o
            hit = [n for n in numbers if o == n or (n in found and o == found[n].stem)]
            if not hit:
                avail = ", ".join(found[n].stem for n in sorted(found)) or "(none)"
                raise ConfigError(f"--only {o!r}: no such notebook; available: {avail}")
            wanted.update(hit)
    steps: list[Step] = []
    finetune_on = bool((params.get("finetune") or {}).get("enabled", True))
    for n in numbers:
        if wanted is not None and n not in wanted:
            continue
        p = found.get(n)
        if p is None:
            steps.append(Step(n, n, None, False, "no notebook for this stage in notebooks/ yet"))
        elif n == "04" and not finetune_on:
            steps.append(Step(n, p.stem, p, False, "finetune.enabled is false"))
        else:
            steps.append(Step(n, p.stem, p, True))
    return steps


# --------------------------------------------------------------------------------------------------
# provenance


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_info() -> dict[str, Any]:
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status),
            "dirty_files": None if not status else [ln[3:] for ln in status.splitlines()][:50]}


def package_versions(names: tuple[str, ...] = PROVENANCE_PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def release_hashes(release_dir: Path) -> dict[str, str]:
    """sha256 of every file under the release directory (relative path -> hex digest)."""
    return {str(p.relative_to(release_dir)): sha256_file(p)
            for p in sorted(release_dir.rglob("*")) if p.is_file()}


def provenance(params: dict[str, Any]) -> dict[str, Any]:
    try:
        rel = resolve_release_dir(params.get("release_dir"))
        rel_info: dict[str, Any] = {"path": str(rel), "sha256": release_hashes(rel)}
    except MemtocError as e:  # the construction notebook reports this properly; record it here
        rel_info = {"path": None, "error": str(e)}
    return {
        "git": git_info(),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "hostname_hash": hashlib.sha256(platform.node().encode()).hexdigest()[:12],
        "release": rel_info,
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
    }


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(obj), indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# execution


def _execute(src: Path, dst: Path, params_file: Path, log_output: bool) -> None:
    import papermill as pm  # imported lazily: `memtoc run --list` stays fast

    pm.execute_notebook(str(src), str(dst), parameters={"params_file": str(params_file)},
                        cwd=str(REPO_ROOT), progress_bar=False, log_output=log_output,
                        kernel_name="python3")


def _error_summary(exc: BaseException) -> str:
    ename = getattr(exc, "ename", None)
    evalue = getattr(exc, "evalue", None)
    if ename:
        return f"{ename}: {evalue}"
    return f"{type(exc).__name__}: {exc}"


def run(params: dict[str, Any], only: list[str] | None = None, log_output: bool = False,
        notebook_dir: Path = NOTEBOOK_DIR, executor=None, echo=None) -> dict[str, Any]:
    """Execute a run; returns the config dict written to ``<run_dir>/config.json``.

    ``executor(src, dst, params_file, log_output)`` defaults to papermill (tests may inject one).
    Raises PipelineError naming the failed notebook and its executed copy.
    """
    executor = executor or _execute
    echo = echo or (lambda msg: print(msg, flush=True))
    rd = run_dir(params)
    steps = plan(params, only, notebook_dir)
    (rd / "notebooks").mkdir(parents=True, exist_ok=True)
    params_file = rd / "params.yaml"
    params_file.write_text(
        "# Resolved parameters of this run, written by `memtoc run`; every notebook reads this file.\n"
        + yaml.safe_dump(_jsonable(params), sort_keys=False, allow_unicode=True))

    # the kernel spec runs `python` from PATH: make it this interpreter (the venv's)
    bindir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")

    cfg: dict[str, Any] = {
        "run_name": params["run_name"],
        "run_dir": str(rd),
        "params_file": str(params_file),
        "params": params,
        "only": only,
        "provenance": provenance(params),
        "started": _now(),
        "finished": None,
        "status": "running",
        "notebooks": [],
    }
    # keep the history of earlier invocations of the same run (resumes, --only reruns)
    cfg_path = rd / "config.json"
    if cfg_path.is_file():
        try:
            old = json.loads(cfg_path.read_text())
            hist = old.pop("history", [])
            cfg["history"] = (hist + [{k: old.get(k) for k in ("started", "finished", "status", "only", "notebooks")}])[-20:]
        except (OSError, ValueError):
            pass
    _write_json(cfg_path, cfg)

    to_run = [s for s in steps if s.run]
    echo(f"memtoc run: {params['run_name']} -> {rd}  ({len(to_run)} notebook(s))")
    t_run = time.perf_counter()
    k = 0
    for s in steps:
        entry: dict[str, Any] = {"notebook": s.name, "source": str(s.path) if s.path else None}
        if not s.run:
            entry.update(status="skipped", reason=s.reason)
            echo(f"  - {s.name}: skipped ({s.reason})")
            cfg["notebooks"].append(entry)
            _write_json(cfg_path, cfg)
            continue
        k += 1
        dst = rd / "notebooks" / s.path.name
        entry.update(executed=str(dst), started=_now(), status="running")
        cfg["notebooks"].append(entry)
        _write_json(cfg_path, cfg)
        echo(f"  [{k}/{len(to_run)}] {s.name} ...")
        t0 = time.perf_counter()
        try:
            executor(s.path, dst, params_file, log_output)
        except KeyboardInterrupt:
            entry.update(status="interrupted", seconds=round(time.perf_counter() - t0, 1), finished=_now())
            cfg.update(status="interrupted", finished=_now())
            _write_json(cfg_path, cfg)
            echo(f"  interrupted during {s.name}; rerun the same command to resume from the cache")
            raise
        except Exception as e:  # papermill raises PapermillExecutionError; anything else is a failure too
            secs = round(time.perf_counter() - t0, 1)
            entry.update(status="failed", seconds=secs, finished=_now(), error=_error_summary(e))
            cfg.update(status="failed", finished=_now(), seconds=round(time.perf_counter() - t_run, 1))
            _write_json(cfg_path, cfg)
            raise PipelineError(f"notebook {s.name} failed after {secs:.0f} s ({_error_summary(e)}); "
                                f"see the executed copy {dst}") from None
        secs = round(time.perf_counter() - t0, 1)
        entry.update(status="ok", seconds=secs, finished=_now())
        _write_json(cfg_path, cfg)
        echo(f"      {s.name} done in {secs:.1f} s")
    cfg.update(status="ok", finished=_now(), seconds=round(time.perf_counter() - t_run, 1))
    _write_json(cfg_path, cfg)
    echo(f"memtoc run: done in {cfg['seconds']:.1f} s; config: {cfg_path}")
    return cfg


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="memtoc run", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("params", help="parameter file, e.g. params/default.yaml")
    ap.add_argument("--only", nargs="+", action="extend", metavar="NB",
                    help="run only these notebooks (stem like 03_evaluation, or number like 03)")
    ap.add_argument("--set", dest="sets", action="append", metavar="KEY=VALUE",
                    help="override a parameter (YAML value; dotted keys for mappings), repeatable")
    ap.add_argument("--list", action="store_true", help="print the plan and exit without running")
    ap.add_argument("--log-output", action="store_true", help="stream the notebooks' output to the terminal")
    a = ap.parse_args(argv)
    params = load_params(a.params, overrides=parse_set(a.sets))
    if a.list:
        for s in plan(params, a.only):
            print(f"{s.name:<24} {'run' if s.run else 'skip: ' + s.reason}")
        return 0
    try:
        run(params, a.only, log_output=a.log_output)
    except KeyboardInterrupt:
        return 130
    return 0
