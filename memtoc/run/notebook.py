"""Notebook glue: every numbered notebook starts with

    # parameters            (cell tagged "parameters")
    params_file = None

    from memtoc.run import notebook
    cfg = notebook.setup(globals())

``setup`` builds the run's parameters from what the notebook was given, validates them, moves the
working directory to the project root (``memtoc.core.project``; relative paths in params work the same
under papermill and Jupyter), creates the run directory and returns the run's
``memtoc.config.runconfig.RunConfig`` (``cfg.models``, ``cfg.paths.summary("evaluation")``, ``cfg.run_dir``;
``cfg.release_dir`` absolute, resolved against the starting working directory; it also reads like
the flat dict, ``cfg["models"]``). Where the parameters come from:

* ``params_file`` set (``papermill -p params_file params/X.yaml``; ``memtoc run`` passes its resolved
  ``<run_dir>/params.yaml``): that file, with any injected keys laid over it;
* ``params_file`` None and keys injected (``papermill NB OUT -f params/X.yaml``, ``-p n_boot 200``):
  the injected keys over ``memtoc.config.params.DEFAULTS``, exactly as ``memtoc run params/X.yaml`` reads X;
* nothing injected (the notebook opened in Jupyter): ``params/smoke.yaml`` (``INTERACTIVE_PARAMS``).

Keys of a mapping (``finetune``, ``probes``, ...) are injected one at a time as ``<key>__<sub>``
(papermill parameters are Python names: ``-p finetune.max_steps 1`` fails in papermill's own
injected cell with a NameError), e.g. ``papermill NB OUT -f params/full.yaml -p finetune__max_steps 1``.
Errors name the file the bad value came from, or ``papermill -p``.

Under the ``papermill`` command (not inside ``memtoc run``, which does this itself) ``setup`` also does
what ``memtoc run`` does for the notebook: the preflight checks, the refusal to read outputs made
with other parameters, the run lock for the notebook's duration, and ``config.json`` (provenance,
the notebook's entry, and, when it ends without an error, its ``stages`` record).
"""
from __future__ import annotations

import atexit
import copy
import dataclasses
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from IPython import get_ipython
from papermill.cli import papermill as pm_command

from memtoc.config.params import DEFAULTS, _merge, load_params, validate_params
from memtoc.config.runconfig import RunConfig, RunPaths
from memtoc.core import progress
from memtoc.core.errors import ConfigError
from memtoc.core.io import write_json
from memtoc.core.project import REPO_ROOT
from memtoc.run import lock as runlock, pipeline

INTERACTIVE_PARAMS = "params/smoke.yaml"   # a notebook run by hand, nothing injected
NESTED_SEP = "__"                          # finetune__max_steps = 1  ->  finetune: {max_steps: 1}
P_SOURCE = "papermill -p"
_OTHER_NAMES = ("params_file", "PAPERMILL_INPUT_PATH", "PAPERMILL_OUTPUT_PATH")


@dataclass(frozen=True)
class PapermillCall:
    """The ``papermill`` command line that started this kernel (parsed with papermill's own options)."""
    argv: tuple[str, ...]
    notebook: Optional[str]
    output: Optional[str]
    files: tuple[str, ...]          # -f
    p_names: frozenset[str]         # -p / -r names


@dataclass
class Injection:
    params_file: Optional[str]
    values: dict[str, Any] = field(default_factory=dict)     # DEFAULTS keys, nested ones merged
    names: dict[str, str] = field(default_factory=dict)      # top-level key -> the injected name(s)


def papermill_call(pid: Optional[int] = None) -> Optional[PapermillCall]:
    """The papermill command line of the parent process (Linux ``/proc``); None when the kernel was
    not started by the ``papermill`` command (Jupyter, ``memtoc run``, papermill as a library)."""
    try:
        raw = Path(f"/proc/{pid or os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    argv = [a for a in raw.decode("utf-8", "replace").split("\0") if a]
    for i, a in enumerate(argv):
        if Path(a).name == "papermill" or (a == "papermill" and i > 0 and argv[i - 1] == "-m"):
            break
    else:
        return None
    try:
        p = pm_command.make_context("papermill", argv[i + 1:], resilient_parsing=True).params
    except Exception:       # an argument list papermill itself would refuse: nothing to learn from it
        return None
    names = frozenset(n for n, _ in tuple(p.get("parameters") or ()) + tuple(p.get("parameters_raw") or ()))
    return PapermillCall(tuple(argv[i:]), p.get("notebook_path"), p.get("output_path"),
                         tuple(p.get("parameters_file") or ()), names)


def injected(g: dict[str, Any], call: Optional[PapermillCall] = None) -> Injection:
    """``params_file`` and the parameters present in the notebook's globals (``<key>__<sub>`` names
    become nested keys). With the papermill command line known, a ``-p`` name that is no parameter
    is an error (a typo would otherwise be ignored)."""
    inj = Injection(g.get("params_file"))
    for k in DEFAULTS:
        if k in g:
            inj.values[k] = copy.deepcopy(g[k])
            inj.names[k] = k
    for name in sorted(g):
        head, sep, rest = name.partition(NESTED_SEP)
        if not sep or head not in DEFAULTS or not rest:
            continue
        keys = rest.split(NESTED_SEP)
        if not isinstance(inj.values.get(head), dict):
            inj.values[head] = {}
        node = inj.values[head]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{P_SOURCE}: {name}: '{k}' is not a mapping in {head}")
        node[keys[-1]] = g[name]
        inj.names[head] = ", ".join(filter(None, (inj.names.get(head), name)))
    if call is not None:
        unknown = sorted(n for n in call.p_names if n not in _OTHER_NAMES and n not in DEFAULTS
                         and n.partition(NESTED_SEP)[0] not in DEFAULTS)
        if unknown:
            raise ConfigError(f"{P_SOURCE}: unknown parameter(s) {unknown}; valid parameters are params_file and: "
                              f"{', '.join(DEFAULTS)} (a key inside a mapping as <key>{NESTED_SEP}<sub>, e.g. "
                              f"finetune{NESTED_SEP}max_steps)")
    return inj


def params_path(params_file: str | os.PathLike, cwd: Path) -> Path:
    """``params_file`` as given (absolute), relative to the working directory, else to the project root."""
    p = Path(params_file).expanduser()
    if p.is_absolute():
        return p
    return cwd / p if (cwd / p).is_file() else REPO_ROOT / p


def resolve(g: dict[str, Any], cwd: Path, call: Optional[PapermillCall] = None) -> tuple[dict[str, Any], str]:
    """The validated flat parameters and their source (for messages). Each layer is validated on
    its own, so an error names the file (or ``papermill -p``) its value came from."""
    inj = injected(g, call)
    if inj.params_file:
        path = params_path(inj.params_file, cwd)
        params, source = load_params(path), str(inj.params_file)
    elif inj.values:
        params, source = load_params(None), "memtoc defaults"
    else:
        params, source = load_params(REPO_ROOT / INTERACTIVE_PARAMS), INTERACTIVE_PARAMS
    if not inj.values:
        return params, source
    for f in (call.files if call else ()):
        load_params(params_path(f, cwd))     # the whole file, as `memtoc run` reads it (unknown keys too)
    p_keys = {k for k, n in inj.names.items() if call and any(x.strip() in call.p_names for x in n.split(","))}
    layers = [(label, {k: v for k, v in inj.values.items() if (k in p_keys) == is_p})
              for label, is_p in ((_file_label(call), False), (P_SOURCE, True))]
    for label, values in layers:
        if values:
            params = validate_params(_merge(params, values), label)
            source = label if source == "memtoc defaults" else f"{source} + {label}"
    return params, source


def _file_label(call: Optional[PapermillCall]) -> str:
    if call is None:
        return "papermill parameters"
    return (", ".join(call.files) + " (papermill -f)") if call.files else "papermill -y/-b"


def under_memtoc_run(params_file: Any) -> bool:
    """True inside ``memtoc run`` (it passes ``<run_dir>/params.yaml`` and names the run's progress file)."""
    prog = os.environ.get(progress.ENV)
    if not prog or not params_file:
        return False
    return Path(params_file).resolve() == Path(prog).resolve().parent / "params.yaml"


def setup(g: dict[str, Any]) -> RunConfig:
    """The run's configuration for a notebook (module docstring); ``g`` is the notebook's ``globals()``."""
    start = Path.cwd()
    call = None if under_memtoc_run(g.get("params_file")) else papermill_call()
    if call is None and g.get("PAPERMILL_INPUT_PATH") and not under_memtoc_run(g.get("params_file")):
        call = PapermillCall((), str(g["PAPERMILL_INPUT_PATH"]), g.get("PAPERMILL_OUTPUT_PATH"), (), frozenset())
    params, source = resolve(g, start, call)
    # a relative release_dir / $MEMTOC_RELEASE means the working directory the notebook was started
    # from (`memtoc run` passes an absolute one): made absolute before moving to the project root,
    # where every other relative path of the params file (local model folders, corpus files) is read
    rel = pipeline.release_path(params.get("release_dir"), start)
    params = {**params, "release_dir": None if rel is None else str(rel)}
    os.chdir(REPO_ROOT)
    cfg = pipeline.resolve_paths(RunConfig.of(params, source))
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    if call is not None:
        _Bookkeeping.start(cfg, call, start)
    return cfg


class _Bookkeeping:
    """What ``memtoc run`` does around one notebook (``memtoc.run.pipeline``), for a notebook started by
    the papermill command: preflight, lock, ``config.json``; finished when the kernel exits."""

    active: Optional["_Bookkeeping"] = None

    def __init__(self, run: RunConfig, call: PapermillCall, cwd: Path):
        self.run, self.source, self.call = run, run.source, call
        self.notebook = (cwd / call.notebook).resolve() if call.notebook else None
        self.rd = run.run_dir
        self.command = list(call.argv) or ["papermill", str(self.notebook or "?")]
        self.lock = runlock.RunLock(self.rd, command=self.command)
        self.error: Optional[str] = None
        self.step: Optional[pipeline.Step] = None
        self.cfg: dict[str, Any] = {}

    @classmethod
    def start(cls, run: RunConfig, call: PapermillCall, cwd: Path) -> None:
        if cls.active is not None:
            if cls.active.rd == run.run_dir:
                return              # setup ran again in the same kernel: same run, same record
            cls.active.finish()
        bk = cls(run, call, cwd)
        bk.open()
        cls.active = bk

    def _find_step(self) -> Optional[pipeline.Step]:
        if self.notebook is None:
            return None
        found = pipeline.discover_notebooks(self.notebook.parent)
        number = next((n for n, p in found.items() if p.name == self.notebook.name), None)
        if number is None:
            return None             # not a numbered notebook: no stage record
        return dataclasses.replace(pipeline.plan(self.run, [number], self.notebook.parent)[0], run=True)

    def open(self) -> None:
        self.step = self._find_step()
        pipeline.preflight(self.run, [self.step] if self.step else [], self.source)
        self.rd.mkdir(parents=True, exist_ok=True)
        self.lock.acquire()
        try:
            self._write_start()
        except BaseException:
            self.lock.release()
            raise
        ip = get_ipython()
        if ip is not None:
            ip.events.register("post_run_cell", self._after_cell)
        atexit.register(self.finish)

    def _write_start(self) -> None:
        cfg_path = RunPaths(self.rd).config_json
        try:
            old = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except (OSError, ValueError):
            old = {}
        prov = pipeline.provenance(self.run)
        prov["command"] = self.command
        self.digest = prov["release"].get("digest")
        stages = dict(old.get("stages") or {})
        stale = pipeline.stale_inputs([self.step], stages, self.run, self.digest) if self.step else []
        if stale:
            raise pipeline.PipelineError(
                f"{self.notebook.name} would read outputs computed with other parameters: " + " | ".join(stale)
                + "; run the earlier notebooks with these parameters first (or `memtoc run`), or use another run_name")
        params = self.run.as_params(with_run_dir=False)
        params_file = RunPaths(self.rd).write_params(params, "memtoc.run.notebook.setup (papermill).")
        self.entry = {"notebook": self.step.name if self.step else self.notebook and self.notebook.stem,
                      "source": str(self.notebook) if self.notebook else None, "executed": self.call.output,
                      "started": pipeline._now(), "status": "running", "via": "papermill"}
        self.t0 = time.perf_counter()
        self.cfg = {"run_name": self.run.run_name, "run_dir": str(self.rd), "params_file": str(params_file),
                    "params": params, "params_source": self.source, "only": [self.entry["notebook"]],
                    "provenance": prov, "started": self.entry["started"], "finished": None, "status": "running",
                    "pid": os.getpid(), "host": platform.node(), "notebooks": [self.entry], "stages": stages}
        if old:
            pipeline.carry_history(old, self.cfg)
        write_json(cfg_path, self.cfg)

    def _after_cell(self, result: Any) -> None:
        err = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
        if err is not None and self.error is None:
            self.error = f"{type(err).__name__}: {err}"

    def finish(self) -> None:
        """Record the notebook's end (ok, or failed with the first error) and release the lock."""
        if self.lock.fd is None:
            return
        now, status = pipeline._now(), ("failed" if self.error else "ok")
        secs = round(time.perf_counter() - self.t0, 1)
        self.entry.update(status=status, finished=now, seconds=secs, **({"error": self.error} if self.error else {}))
        if status == "ok" and self.step is not None:
            self.cfg["stages"][self.step.name] = pipeline.stage_record(self.run, self.step.number, self.digest, now)
        self.cfg.update(status=status, finished=now, seconds=secs)
        try:
            write_json(RunPaths(self.rd).config_json, self.cfg)
        finally:
            self.lock.release()
            if _Bookkeeping.active is self:
                _Bookkeeping.active = None
