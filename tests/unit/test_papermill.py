"""A notebook run with papermill directly reads its parameters as documented in memtoc/run/notebook.py:
``-f params/X.yaml`` is exactly X (over memtoc's defaults, never smoke.yaml), ``-p params_file``,
``-p key value`` and ``-p block__key value`` work, errors name the source, and the papermill command
gets what ``memtoc run`` does around a notebook (preflight, lock, config.json stage record).
The last test runs notebook 01 both ways (~2 min on 2 busy cores)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from memtoc.config.params import load_params
from memtoc.config.runconfig import RunConfig
from memtoc.core import progress
from memtoc.core.errors import ConfigError
from memtoc.core.project import REPO_ROOT
from memtoc.run import lock as runlock, notebook as nb, pipeline

FULL = REPO_ROOT / "params" / "full.yaml"
SMOKE = REPO_ROOT / "params" / "smoke.yaml"
NB01 = REPO_ROOT / "notebooks" / "01_construction.ipynb"
_papermill_call = nb.papermill_call     # the real one (the fixture below replaces it)


@pytest.fixture(autouse=True)
def _plain_kernel(monkeypatch, tmp_path):
    """setup() as in a notebook opened by hand: no papermill parent; setup's chdir undone afterwards."""
    monkeypatch.setattr(nb, "papermill_call", lambda pid=None: None)
    monkeypatch.delenv(progress.ENV, raising=False)
    monkeypatch.chdir(tmp_path)


def _setup(**g) -> RunConfig:
    return nb.setup({"params_file": None, **g})


def _call(p_names=(), files=(), notebook=None) -> nb.PapermillCall:
    return nb.PapermillCall(("papermill",), notebook, None, tuple(files), frozenset(p_names))


def test_f_injection_without_params_file_is_exactly_that_file(tmp_path):
    keys = yaml.safe_load(FULL.read_text())
    cfg = _setup(**keys, output_root=str(tmp_path))
    want = load_params(FULL, overrides={"output_root": str(tmp_path)})
    assert cfg.max_new_tokens == want["max_new_tokens"] == 48      # smoke.yaml says 32: not read
    assert cfg.n_boot == want["n_boot"] and cfg.models == tuple(want["models"])
    got = cfg.as_params()
    assert {k: got[k] for k in want if k != "release_dir"} == {k: v for k, v in want.items() if k != "release_dir"}
    assert cfg.run_dir == tmp_path / "full"
    assert Path.cwd() == REPO_ROOT


def test_a_relative_release_is_read_from_the_start_folder(tmp_path, monkeypatch):
    from memtoc.config.params import resolve_release_dir
    release = resolve_release_dir(None)
    (tmp_path / "data").symlink_to(release, target_is_directory=True)
    monkeypatch.delenv("MEMTOC_RELEASE", raising=False)
    cfg = _setup(params_file="params/smoke.yaml", release_dir="data", output_root=str(tmp_path))
    assert Path(cfg.release_dir) == (tmp_path / "data").resolve() and Path.cwd() == REPO_ROOT
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMTOC_RELEASE", "data")
    cfg = _setup(params_file="params/smoke.yaml", output_root=str(tmp_path))
    assert Path(cfg.release_dir) == (tmp_path / "data").resolve()


def test_params_file_and_p_keys_over_it(tmp_path):
    cfg = _setup(params_file="params/smoke.yaml", n_boot=7, output_root=str(tmp_path))
    smoke = load_params(SMOKE)
    assert (cfg.n_questions, cfg.max_new_tokens, cfg.n_boot) == (smoke["n_questions"], smoke["max_new_tokens"], 7)
    assert cfg.source == "params/smoke.yaml + papermill parameters"


def test_p_keys_alone_are_over_the_defaults_and_nothing_is_smoke(tmp_path):
    cfg = _setup(n_boot=9, output_root=str(tmp_path))
    assert (cfg.run_name, cfg.n_questions, cfg.n_boot) == ("default", load_params(None)["n_questions"], 9)
    params, source = nb.resolve({"params_file": None}, tmp_path)     # nothing injected: opened by hand
    assert source == nb.INTERACTIVE_PARAMS and params == load_params(SMOKE)


def test_nested_keys_with_double_underscore(tmp_path):
    cfg = _setup(params_file=str(SMOKE), finetune__max_steps=3, finetune__learning_rate=0.5,
                 output_root=str(tmp_path))
    smoke_ft = load_params(SMOKE)["finetune"]
    assert cfg.finetune.max_steps == 3 and cfg.finetune.learning_rate == 0.5
    assert cfg.finetune.train_questions_per_fold == smoke_ft["train_questions_per_fold"]   # the rest kept
    # a whole block injected by -f, one of its keys by -p: both apply
    cfg = _setup(finetune={"enabled": False, "max_steps": 4}, finetune__max_steps=2, judge__model="smollm2-135m-instruct",
                 output_root=str(tmp_path))
    assert (cfg.finetune.enabled, cfg.finetune.max_steps) == (False, 2)
    assert cfg.judge.model == "smollm2-135m-instruct" and cfg.judge.max_new_tokens == 32


def test_errors_name_their_source(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("n_questions: -1\n")
    with pytest.raises(ConfigError, match=rf"{bad}.*n_questions"):
        _setup(params_file=str(bad))
    g = {"params_file": str(SMOKE), "n_boot": 0}
    with pytest.raises(ConfigError, match=r"^papermill -p: field 'n_boot'"):
        nb.resolve(g, tmp_path, _call(p_names={"n_boot"}))
    f = tmp_path / "mine.yaml"
    f.write_text("alpha: 2\n")
    with pytest.raises(ConfigError, match=rf"^{f}: field 'alpha'"):     # the -f file, validated as a whole
        nb.resolve({"params_file": None, "alpha": 2}, tmp_path, _call(files=[str(f)]))
    with pytest.raises(ConfigError, match=r"papermill -p: unknown parameter\(s\) \['n_question'\]"):
        nb.resolve({"params_file": None, "n_question": 3}, tmp_path, _call(p_names={"n_question"}))
    with pytest.raises(ConfigError, match=r"^papermill parameters: field 'alpha'"):
        _setup(alpha=5)


def test_papermill_command_line_is_read_from_the_parent_process(tmp_path):
    argv = ["/venv/bin/papermill", "nb/01.ipynb", "out.ipynb", "-f", "params/full.yaml", "-p", "finetune__max_steps",
            "1", "--log-output", "-r", "run_name", "x"]
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv])
    try:
        for _ in range(100):         # until the child has exec'd (before, /proc shows pytest's command line)
            if b"papermill" in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
                break
            time.sleep(0.05)
        call = _papermill_call(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert call == nb.PapermillCall(tuple(argv), "nb/01.ipynb", "out.ipynb", ("params/full.yaml",),
                                    frozenset({"finetune__max_steps", "run_name"}))
    assert _papermill_call(os.getpid()) is None          # pytest: no papermill command


def test_memtoc_run_is_recognised(tmp_path, monkeypatch):
    rd = tmp_path / "out" / "r"
    rd.mkdir(parents=True)
    assert not nb.under_memtoc_run(str(rd / "params.yaml"))
    monkeypatch.setenv(progress.ENV, str(rd / progress.PROGRESS_NAME))
    assert nb.under_memtoc_run(str(rd / "params.yaml"))
    assert not nb.under_memtoc_run(str(SMOKE))


def _bookkeeping(tmp_path, notebook: Path) -> nb._Bookkeeping:
    run = pipeline.resolve_paths(RunConfig.load(SMOKE, overrides={"output_root": str(tmp_path / "out")}))
    call = _call(notebook=str(notebook))
    bk = nb._Bookkeeping(run, call, tmp_path)
    bk.open()
    return bk


def test_papermill_bookkeeping_lock_config_and_stage_record(tmp_path):
    bk = _bookkeeping(tmp_path, NB01)
    rd = bk.rd
    try:
        assert runlock.is_held(rd)
        with pytest.raises(runlock.RunLockedError, match="papermill"):
            runlock.RunLock(rd).acquire()
        cfg = json.loads((rd / "config.json").read_text())
        assert cfg["status"] == "running" and cfg["notebooks"][0]["notebook"] == "01_construction"
    finally:
        bk.finish()
    assert not runlock.is_held(rd)
    cfg = json.loads((rd / "config.json").read_text())
    assert cfg["status"] == "ok" and cfg["notebooks"][0]["status"] == "ok"
    digest = cfg["provenance"]["release"]["digest"]
    rec = cfg["stages"]["01_construction"]
    assert rec["params_sha256"] == pipeline.stage_record(bk.run, "01", digest, rec["finished"])["params_sha256"]
    assert yaml.safe_load((rd / "params.yaml").read_text())["run_name"] == "smoke"

    # a failed cell: no stage record; notebook 02 then refuses 01's outputs made with other parameters
    rec["params_sha256"] = "0" * 64
    rec["params"]["n_questions"] = 99
    (rd / "config.json").write_text(json.dumps(cfg))
    bk2 = _bookkeeping(tmp_path, NB01)
    bk2._after_cell(type("R", (), {"error_in_exec": ValueError("boom"), "error_before_exec": None})())
    bk2.finish()
    cfg = json.loads((rd / "config.json").read_text())
    assert cfg["status"] == "failed" and "ValueError: boom" in cfg["notebooks"][0]["error"]
    assert cfg["stages"]["01_construction"]["params_sha256"] == "0" * 64 and len(cfg["history"]) == 1
    with pytest.raises(pipeline.PipelineError, match="n_questions: 99 -> 5"):
        _bookkeeping(tmp_path, REPO_ROOT / "notebooks" / "02_elicitation.ipynb")
    assert not runlock.is_held(rd)


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop(progress.ENV, None)
    return env


@pytest.mark.integration
def test_papermill_f_full_equals_memtoc_run_full(tmp_path):
    """`papermill 01 -f params/full.yaml` writes what `memtoc run params/full.yaml --only 01` writes."""
    a, b = tmp_path / "pm", tmp_path / "run"
    pm = subprocess.run([str(Path(sys.executable).parent / "papermill"), str(NB01), str(tmp_path / "out.ipynb"),
                         "-f", str(FULL), "-p", "output_root", str(a), "--no-progress-bar"],
                        cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert pm.returncode == 0, pm.stderr[-3000:]
    run = subprocess.run([sys.executable, "-m", "memtoc", "run", str(FULL), "--only", "01_construction",
                          "--set", f"output_root={b}"], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    for form in load_params(FULL)["formulations"]:
        ea, eb = (d / "full" / "episodes" / f"{form}.jsonl" for d in (a, b))
        assert ea.read_bytes() == eb.read_bytes() and ea.stat().st_size > 0
    ca, cb = (json.loads((d / "full" / "config.json").read_text()) for d in (a, b))
    sa, sb = ca["stages"]["01_construction"], cb["stages"]["01_construction"]
    assert sa["params_sha256"] == sb["params_sha256"] and sa["params"] == sb["params"]
    assert ca["status"] == "ok" and ca["notebooks"][0]["via"] == "papermill"
    assert ca["params"]["max_new_tokens"] == 48 and ca["params"]["n_boot"] == cb["params"]["n_boot"]
    assert not runlock.is_held(a / "full")
