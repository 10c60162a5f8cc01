"""`memtoc run PARAMS.yaml`: execute the numbered notebooks in order with papermill.

    memtoc run params/default.yaml
    memtoc run params/smoke.yaml --only 03_evaluation --set output_root=/tmp/out --set n_boot=100
    memtoc run params/default.yaml --set finetune.enabled=false --list

What a run does, in order:

1. Reads and validates the parameter file into a ``RunConfig`` (``RunConfig.load``); ``--set key=value`` overrides
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

Before the first notebook: ``release_dir`` is resolved once against the working directory of the
invocation (``resolve_paths``; the notebooks get the absolute path), and model names, the
``finetune`` block and the question counts are checked (``preflight``). During the run the run
directory is locked (``runlock``: a second run stops with one line naming the holder; a stale lock
of a killed run is taken over). config.json's ``stages`` records, per stage, the parameters its
outputs were computed from (``stage_params``); a run that would feed a stage outputs computed with
other parameters is refused (``stale_inputs``). ``--dry-run`` prints the plan with request counts
and estimates (``memtoc.run.dryrun``) without loading weights; the kernel reports generation progress
to ``memtoc run`` through ``memtoc.core.progress``.

Nothing here deletes anything under the run directory: the generation cache
(``generations/``) survives interruptions, and a rerun is served from it.
"""
from __future__ import annotations

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
from pathlib import Path
from typing import Any

import yaml

from memtoc.config.params import resolve_release, resolve_release_dir
from memtoc.config.runconfig import RunConfig, RunPaths, expect_config
from memtoc.core import progress
from memtoc.core.errors import ConfigError, MemtocError
from memtoc.core.io import package_version, plain, sha256_file, sha256_json, write_json
from memtoc.core.project import REPO_ROOT
from memtoc.data.benchmark import load_benchmark
from memtoc.generation import models
from memtoc.generation.hardware import check_gpu, cpu_kind
from memtoc.run import lock as runlock, registry as stages_mod
from memtoc.run.servers import check_servers

NOTEBOOK_DIR = REPO_ROOT / "notebooks"

# The stages the pipeline knows about (memtoc/run/registry.py; a missing notebook is skipped with a notice).
# Notebooks present in notebooks/ with other numbers run too, in numeric order.
KNOWN_STAGES: tuple[str, ...] = tuple(s.number for s in stages_mod.STAGES)

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


# --------------------------------------------------------------------------------------------------
# plan


def discover_notebooks(notebook_dir: Path | None = None) -> dict[str, Path]:
    """Numbered notebooks in ``notebook_dir`` (default ``NOTEBOOK_DIR``): ``{"01": Path(.../01_construction.ipynb), ...}``."""
    notebook_dir = notebook_dir or NOTEBOOK_DIR
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


def plan(cfg: RunConfig, only: list[str] | None = None,
         notebook_dir: Path | None = None) -> list[Step]:
    """The ordered list of notebooks a run would execute (pure apart from listing the folder)."""
    cfg = expect_config(cfg, "pipeline.plan")
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
    registry = stages_mod.by_number()
    for n in numbers:
        if wanted is not None and n not in wanted:
            continue
        p = found.get(n)
        on, why = registry[n].enabled(cfg) if n in registry else (True, "")
        if p is None:
            steps.append(Step(n, n, None, False, "no notebook for this stage in notebooks/ yet"))
        elif not on:
            steps.append(Step(n, p.stem, p, False, why))
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
    """Each package's installed version (None: not installed); vLLM's under either distribution name."""
    return {n: package_version(n) for n in names}


def release_hashes(release_dir: Path) -> dict[str, str]:
    """sha256 of every file under the release directory (relative path -> hex digest)."""
    return {str(p.relative_to(release_dir)): sha256_file(p)
            for p in sorted(release_dir.rglob("*")) if p.is_file()}


def provenance(cfg: RunConfig) -> dict[str, Any]:
    try:
        rel = resolve_release_dir(cfg.release_dir)
        files = release_hashes(rel)
        rel_info: dict[str, Any] = {"path": str(rel), "sha256": files,
                                    "digest": hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()}
    except MemtocError as e:  # the construction notebook reports this properly; record it here
        rel_info = {"path": None, "error": str(e), "digest": None}
    return {
        "git": git_info(),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_kind(),
        "hostname_hash": hashlib.sha256(platform.node().encode()).hexdigest()[:12],
        "release": rel_info,
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "cwd": os.getcwd(),
    }


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------------
# resolution and validation before anything runs


def resolve_paths(cfg: RunConfig, cwd: Path | None = None) -> RunConfig:
    """``cfg`` with ``release_dir`` (or ``$MEMTOC_RELEASE``) resolved once, against the working
    directory of the ``memtoc`` invocation, to an absolute path: the notebooks receive that path and
    never resolve it again (they run with the repository root as working directory)."""
    return cfg.replace(release_dir=str(resolve_release_dir(release_path(cfg.release_dir, cwd))))


def release_path(given: str | None, cwd: Path | None = None) -> Path | None:
    """``given`` (else ``$MEMTOC_RELEASE``) as an absolute path against ``cwd``; None when neither is
    set (the release is then looked up in the default places)."""
    given = given or os.environ.get("MEMTOC_RELEASE") or None
    if not given:
        return None
    path = Path(given).expanduser()
    return path if path.is_absolute() else (cwd or Path.cwd()) / path


def preflight(cfg: RunConfig, steps: list[Step], source: str = "<params>") -> dict[str, Any]:
    """Checks that need the model registry or the data, done before the first notebook starts: model
    names, every stage block (through the typed run configuration), the question counts against the
    analysis set, then each running stage's own ``preflight`` hook (memtoc/run/registry.py). Returns facts
    for the plan."""
    cfg = expect_config(cfg, "pipeline.preflight")
    for m in cfg.models:
        if cfg.backend != "openai":
            try:
                models.get_model(m)
            except models.ModelError as e:
                raise ConfigError(f"{source}: field 'models': {e}") from None
    j = cfg.judge
    if j is not None and j.backend != "openai":
        try:
            models.get_model(j.model)
        except models.ModelError as e:
            raise ConfigError(f"{source}: field 'judge.model': {e}") from None
    bench = load_benchmark(cfg.release_dir)
    n = len(bench.analysis)
    for field in ("n_questions", "n_questions_extra"):
        if getattr(cfg, field) > n:
            raise ConfigError(f"{source}: field {field!r}: {getattr(cfg, field)} is more than the {n} questions of "
                              f"the analysis set; use at most {n}")
    facts = {"bench": bench, "n_analysis": n, "finetune": cfg.finetune, "config": cfg}
    registry = stages_mod.by_number()
    for s in steps:
        spec = registry.get(s.number)
        check = stages_mod.hook(spec.preflight) if s.run and spec else None
        if check is not None:
            check(cfg, source, facts)
    return facts


NON_RESULT_KEYS = stages_mod.NON_RESULT_KEYS


def stage_params(cfg: RunConfig, number: str, release_digest: str | None) -> dict[str, Any]:
    """The parameters stage ``number`` computes its outputs from (``release`` = the data's digest):
    its own and those of the stages it reads (memtoc/run/registry.py); a notebook the registry does not
    know depends on every result parameter."""
    every = {k: v for k, v in cfg.as_params(with_run_dir=False).items() if k not in NON_RESULT_KEYS}
    every["release"] = release_digest
    keys = stages_mod.stage_keys(number)
    return plain({k: every[k] for k in (keys or sorted(every)) if k in every})


def params_sha256(d: dict[str, Any]) -> str:
    return sha256_json(plain(d))


def stage_record(cfg: RunConfig, number: str, release_digest: str | None, finished: str) -> dict[str, Any]:
    """config.json's ``stages`` entry of a stage that finished: the parameters its outputs came from."""
    sp = stage_params(cfg, number, release_digest)
    return {"number": number, "params_sha256": params_sha256(sp), "params": sp, "finished": finished}


def carry_history(old: dict[str, Any], cfg: dict[str, Any]) -> None:
    """Move the earlier invocation recorded in ``old`` (a previous config.json) into ``cfg["history"]``."""
    hist = old.pop("history", [])
    entry = {k: old.get(k) for k in ("started", "finished", "status", "only", "notebooks")}
    if entry["status"] == "running":   # we hold the lock: that run died without saying so
        entry["status"] = "interrupted"
    cfg["history"] = (hist + [entry])[-20:]


def stale_inputs(steps: list[Step], stages: dict[str, Any], cfg: RunConfig,
                 release_digest: str | None) -> list[str]:
    """One message per earlier stage, not run now, whose recorded outputs were computed with other
    parameters than the ones a stage of this run would compute with."""
    running = {s.number for s in steps if s.run}
    reads = {r: stages_mod.upstream(r) if stages_mod.stage(r) else {n for n in KNOWN_STAGES if n < r}
             for r in running}
    out = []
    for name, rec in sorted(stages.items()):
        num = str(rec.get("number") or name[:2])
        if num in running or not any(num in reads[r] for r in running):
            continue  # rebuilt by this run, or read by no stage of it
        now = stage_params(cfg, num, release_digest)
        if rec.get("params_sha256") == params_sha256(now):
            continue
        was, new = _flat(rec.get("params") or {}), _flat(now)
        diff = [f"{k}: {was.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}" for k in sorted(set(was) | set(new))
                if was.get(k, "(unset)") != new.get(k, "(unset)")]
        out.append(f"{name} (outputs of {rec.get('finished', '?')}) was computed with other parameters ("
                   + "; ".join(diff[:4]) + (" …" if len(diff) > 4 else "") + ")")
    return out


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"agent": {"max_calls": 1}}`` -> ``{"agent.max_calls": 1}`` (a refusal names the settings that
    differ, not whole blocks)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def effective_status(run_dir_: Path, cfg: dict[str, Any] | None = None) -> str | None:
    """config.json's status, except that a "running" run whose lock nobody holds is "interrupted".
    Read from the file, such a run (killed without a chance to say so) is also recorded as
    interrupted there, with the running notebook."""
    path = RunPaths(run_dir_).config_json
    from_file = cfg is None
    if cfg is None:
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
    st = cfg.get("status")
    if st == "running" and not runlock.is_held(Path(run_dir_)):
        if from_file:
            mark_interrupted(path, cfg)
        return "interrupted"
    return st


def mark_interrupted(path: Path, cfg: dict[str, Any]) -> None:
    """Record in config.json that a run stopped without finishing (its process was killed)."""
    now = _now()
    cfg.update(status="interrupted", interrupted_seen=now)
    for entry in cfg.get("notebooks", []):
        if entry.get("status") == "running":
            entry.update(status="interrupted")
    try:
        write_json(path, cfg)
    except OSError:
        pass  # a read-only run directory: the status is still reported as interrupted


# --------------------------------------------------------------------------------------------------
# execution


def _execute(src: Path, dst: Path, params_file: Path, log_output: bool) -> None:
    import papermill as pm  # imported lazily: `memtoc run --list` stays fast

    # --log-level=ERROR: the kernel's "running over TCP without encryption" warning, once per notebook
    pm.execute_notebook(str(src), str(dst), parameters={"params_file": str(params_file)},
                        cwd=str(REPO_ROOT), progress_bar=False, log_output=log_output,
                        kernel_name="python3", extra_arguments=["--log-level=ERROR"])


def _error_summary(exc: BaseException) -> str:
    ename = getattr(exc, "ename", None)
    evalue = getattr(exc, "evalue", None)
    if ename:
        return f"{ename}: {evalue}"
    return f"{type(exc).__name__}: {exc}"


def notebook_notices(executed: Path, marker: str = "memtoc cache:") -> list[str]:
    """Lines of the executed notebook's stderr that carry ``marker`` (the cache's repair warnings),
    so that ``memtoc run`` shows them too, not only the notebook."""
    try:
        nb = json.loads(executed.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    out = []
    for cell in nb.get("cells", []):
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream" and o.get("name") == "stderr":
                text = "".join(o.get("text", []))
                out += [ln.strip() for ln in text.splitlines() if marker in ln]
    return list(dict.fromkeys(out))


def run(cfg: RunConfig, only: list[str] | None = None, log_output: bool = False,
        notebook_dir: Path | None = None, executor=None, echo=None, source: str = "<params>") -> dict[str, Any]:
    """Execute a run; returns the config dict written to ``<run_dir>/config.json``.

    ``executor(src, dst, params_file, log_output)`` defaults to papermill (tests may inject one).
    Everything is validated before the first notebook starts; the run directory is locked for the
    duration (a second run on it stops with an error naming the holder). Raises PipelineError
    naming the failed notebook and its executed copy.
    """
    executor = executor or _execute
    echo = echo or (lambda msg: print(msg, flush=True))
    cfg = expect_config(cfg, "pipeline.run")
    found_by = resolve_release(params={"release_dir": cfg.release_dir})[1]   # the rule that found the data
    cfg = resolve_paths(cfg)
    steps = plan(cfg, only, notebook_dir)
    registry = stages_mod.by_number()
    if any(s.run and (s.number not in registry or registry[s.number].generates) for s in steps):
        check_gpu(cfg, source)   # one line, before any notebook, when a stage needs a GPU that is not here
        check_servers(cfg, source)   # every configured OpenAI-compatible server answers, or one line
    preflight(cfg, steps, source)
    rd = cfg.run_dir
    try:
        rd.mkdir(parents=True, exist_ok=True)
        lock = runlock.RunLock(rd, warn=echo)
        lock.acquire()
    except OSError as e:
        raise PipelineError(f"cannot create or lock the run directory {rd}: {e.strerror or e}; choose a "
                            "writable output_root (e.g. --set output_root=/tmp/memtoc-out)") from None
    cfg_path = RunPaths(rd).config_json
    record: dict[str, Any] = {"release": {"dir": cfg.release_dir, "found_by": found_by}}
    saved_env = os.environ.get(progress.ENV)
    try:
        return _run_locked(cfg, only, log_output, steps, record, executor, echo)
    except OSError as e:
        # no space left, a folder made read-only mid-run...: record it if we still can, one line out
        if record.get("status") == "running":
            record.update(status="failed", finished=_now(), error=f"{type(e).__name__}: {e}")
            for entry in record.get("notebooks", []):
                if entry.get("status") == "running":
                    entry.update(status="failed", finished=_now())
            try:
                write_json(cfg_path, record)
            except OSError:  # no room for a temp file: rewrite in place (truncating frees its blocks)
                try:
                    cfg_path.write_text(json.dumps(plain(record), indent=2, ensure_ascii=False) + "\n")
                except OSError:
                    pass  # effective_status() still reads it as "interrupted" once the lock is gone
        raise PipelineError(f"cannot write under {rd}: {e.strerror or e}"
                            + (f" ({e.filename})" if getattr(e, "filename", None) else "")
                            + "; free some space or choose another output_root, then rerun the same "
                            "command to resume") from None
    finally:
        lock.release()
        if saved_env is None:
            os.environ.pop(progress.ENV, None)
        else:
            os.environ[progress.ENV] = saved_env


def _start_record(cfg: RunConfig, only, steps, record: dict[str, Any]) -> tuple[Path, str | None]:
    """Refuse stale inputs, write params.yaml and the running config.json; (params file, data digest)."""
    paths, rd = cfg.paths, cfg.run_dir
    cfg_path = paths.config_json
    old: dict[str, Any] = {}
    if cfg_path.is_file():
        try:
            old = json.loads(cfg_path.read_text())
        except (OSError, ValueError):
            old = {}
    prov = provenance(cfg)
    digest = prov["release"].get("digest")
    stages: dict[str, Any] = dict(old.get("stages") or {})
    stale = stale_inputs(steps, stages, cfg, digest)
    if stale:
        raise PipelineError(
            "this run would mix outputs computed with different parameters: " + " | ".join(stale)
            + ". Rerun the whole pipeline (without --only), or from that stage on, with these parameters; "
            "or use another run_name")
    paths.notebooks.mkdir(parents=True, exist_ok=True)
    params = cfg.as_params(with_run_dir=False)
    params_file = paths.write_params(params, "`memtoc run`; every notebook reads this file.")
    # the kernel spec runs `python` from PATH: make it this interpreter (the venv's)
    bindir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    record.update({
        "run_name": cfg.run_name, "run_dir": str(rd), "params_file": str(params_file), "params": params,
        "only": only, "provenance": prov, "started": _now(), "finished": None, "status": "running",
        "pid": os.getpid(), "host": platform.node(), "notebooks": [],
        # per stage: the parameters its current outputs were computed from (carried over between
        # invocations); `memtoc run` refuses to run a stage on inputs made with other parameters
        "stages": stages,
    })
    if old:   # keep the history of earlier invocations of the same run (resumes, --only reruns)
        carry_history(old, record)
    write_json(cfg_path, record)
    return params_file, digest


def _execute_step(s: Step, label: str, rd: Path, record: dict[str, Any], params_file: Path, executor, echo,
                  log_output: bool, t_run: float) -> dict[str, Any]:
    """Run one notebook, recording it in config.json; returns its entry (status ok) or raises."""
    paths = RunPaths(rd)
    cfg_path, progress_file = paths.config_json, paths.progress_file
    dst = paths.notebook(s.path.name)
    entry: dict[str, Any] = {"notebook": s.name, "source": str(s.path), "executed": str(dst), "started": _now(),
                             "status": "running"}
    record["notebooks"].append(entry)
    write_json(cfg_path, record)
    echo(f"  {label} ...")
    t0 = time.perf_counter()
    progress_file.unlink(missing_ok=True)
    watcher = progress.Watcher(progress_file, echo, prefix=f"      {label}: ")
    watcher.start()
    try:
        executor(s.path, dst, params_file, log_output)
    except KeyboardInterrupt:
        entry.update(status="interrupted", seconds=round(time.perf_counter() - t0, 1), finished=_now())
        record.update(status="interrupted", finished=_now())
        write_json(cfg_path, record)
        echo(f"  interrupted during {s.name}; rerun the same command to resume from the cache")
        raise
    except OSError:
        raise
    except Exception as e:  # papermill raises PapermillExecutionError; anything else is a failure too
        secs = round(time.perf_counter() - t0, 1)
        for line in notebook_notices(dst):
            echo(f"      {line}")
        entry.update(status="failed", seconds=secs, finished=_now(), error=_error_summary(e))
        record.update(status="failed", finished=_now(), seconds=round(time.perf_counter() - t_run, 1))
        write_json(cfg_path, record)
        raise PipelineError(f"notebook {s.name} failed after {secs:.0f} s ({_error_summary(e)}); "
                            f"see the executed copy {dst}") from None
    finally:
        watcher.stop()
        progress_file.unlink(missing_ok=True)
    secs = round(time.perf_counter() - t0, 1)
    for line in notebook_notices(dst):
        echo(f"      {line}")
    entry.update(status="ok", seconds=secs, finished=_now())
    echo(f"      {s.name} done in {secs:.1f} s")
    return entry


def _run_locked(cfg: RunConfig, only, log_output, steps, record: dict[str, Any], executor, echo) -> dict[str, Any]:
    rd, cfg_path = cfg.run_dir, cfg.paths.config_json
    params_file, digest = _start_record(cfg, only, steps, record)
    to_run = [s for s in steps if s.run]
    echo(f"memtoc run: {cfg.run_name} -> {rd}  ({len(to_run)} notebook(s))")
    t_run = time.perf_counter()
    os.environ[progress.ENV] = str(cfg.paths.progress_file)
    k = 0
    for s in steps:
        if not s.run:
            record["notebooks"].append({"notebook": s.name, "source": str(s.path) if s.path else None,
                                     "status": "skipped", "reason": s.reason})
            echo(f"  - {s.name}: skipped ({s.reason})")
            write_json(cfg_path, record)
            continue
        k += 1
        entry = _execute_step(s, f"[{k}/{len(to_run)}] {s.name}", rd, record, params_file, executor, echo,
                              log_output, t_run)
        record["stages"][s.name] = stage_record(cfg, s.number, digest, entry["finished"])
        write_json(cfg_path, record)
    record.update(status="ok", finished=_now(), seconds=round(time.perf_counter() - t_run, 1))
    write_json(cfg_path, record)
    echo(f"memtoc run: done in {record['seconds']:.1f} s; config: {cfg_path}")
    return record
