"""Issue 13 (items 2-10) and issue 18 (items 8, 9): run names, locking, parameter consistency between
stages, release resolution, one-line errors, validation before the first notebook, messages,
`memtoc verify` hashes, lazy model loading, the dry-run plan and progress lines.

Notebooks are not executed here (an injected executor stands in for papermill), except in the
integration-marked fault-injection test at the end."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from memtoc import cli
from memtoc.config.params import load_params, resolve_release_dir
from memtoc.config.runconfig import RunConfig
from memtoc.core import progress
from memtoc.core.errors import ConfigError, DataError
from memtoc.core.project import REPO_ROOT
from memtoc.data.benchmark import load_benchmark
from memtoc.generation import cache
from memtoc.generation.backends.base import Generator, LazyGenerator, Reply
from memtoc.run import lock as runlock, notebook as nb, pipeline
from memtoc.stages import evaluation
from memtoc.stages.report import claims

SMOKE = str(REPO_ROOT / "params" / "smoke.yaml")
RELEASE = resolve_release_dir(None)


def _nbdir(tmp_path, names=("01_a.ipynb", "02_b.ipynb", "03_c.ipynb")):
    d = tmp_path / "nbs"
    d.mkdir(exist_ok=True)
    for n in names:
        (d / n).write_text("{}")
    return d


def _params(tmp_path, **over):
    return RunConfig.load(SMOKE, overrides={"output_root": str(tmp_path / "out"), **over})


def _ok(src, dst, params_file, log_output):
    dst.write_text("{}")


def _files_under(p: Path) -> list[str]:
    return sorted(str(x.relative_to(p)) for x in p.rglob("*")) if p.exists() else []


# ------------------------------------------------------------------------------ 13.2 run names

@pytest.mark.parametrize("name", ["..", ".", "a/b", "/tmp/abs", "a\\b", "../up", ""])
def test_run_name_must_be_a_plain_name_and_nothing_is_written(tmp_path, capsys, name):
    before = _files_under(REPO_ROOT / "notebooks")
    rc = cli.main(["run", SMOKE, "--set", f"output_root={tmp_path / 'out'}", "--set", f"run_name={name}"])
    err = capsys.readouterr().err
    assert rc == 2 and "run_name" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert _files_under(REPO_ROOT / "notebooks") == before


# ------------------------------------------------------------------------------ 13.3 locking

def test_a_second_concurrent_run_gets_a_clear_error_naming_the_holder(tmp_path, capsys):
    d = _nbdir(tmp_path)
    P = _params(tmp_path)
    seen = {}

    def first(src, dst, params_file, log_output):
        dst.write_text("{}")
        if "02" in src.name:  # while the first run holds the directory, a second one starts
            seen["rc"] = cli.main(["run", SMOKE, "--set", f"output_root={tmp_path / 'out'}", "--list"])
            with pytest.raises(runlock.RunLockedError) as e:
                pipeline.run(P, None, notebook_dir=d, executor=_ok, echo=lambda m: None)
            seen["msg"] = str(e.value)

    pipeline.run(P, None, notebook_dir=d, executor=first, echo=lambda m: None)
    msg = seen["msg"]
    assert f"pid {os.getpid()}" in msg and "in use by" in msg and "\n" not in msg
    assert seen["rc"] == 0   # --list does not need the lock
    # released afterwards: a third run goes through
    pipeline.run(P, None, notebook_dir=d, executor=_ok, echo=lambda m: None)


def test_two_processes_on_one_run_directory(tmp_path):
    """A real second process holds the lock: `memtoc run` exits 2 with one line naming its pid."""
    P = _params(tmp_path)
    rd = P.run_dir
    rd.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from memtoc.run.lock import RunLock
        RunLock(__import__("pathlib").Path({str(rd)!r}), command=["holder"]).acquire()
        print("locked", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        r = subprocess.run([sys.executable, "-m", "memtoc", "run", SMOKE, "--set", f"output_root={tmp_path / 'out'}"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        line = r.stderr.strip()
        assert "\n" not in line and f"pid {holder.pid}" in line and "holder" in line and "Traceback" not in line
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path):
    d = _nbdir(tmp_path)
    P = _params(tmp_path)
    rd = P.run_dir
    rd.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (rd / runlock.LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": "h", "started": "t",
                                                    "command": ["memtoc", "run"]}))
    (rd / "config.json").write_text(json.dumps({"status": "running", "started": "t", "notebooks": []}))
    assert pipeline.effective_status(rd) == "interrupted"     # nobody holds it: not "running" forever
    said = []
    cfg = pipeline.run(P, None, notebook_dir=d, executor=_ok, echo=said.append)
    assert any("stale lock" in m and f"pid {dead.pid}" in m for m in said)
    assert cfg["history"][-1]["status"] == "interrupted"
    assert (rd / runlock.LOCK_NAME).read_text() == ""          # released


def test_sigkill_leaves_a_run_that_reads_as_interrupted(tmp_path):
    P = _params(tmp_path)
    rd = P.run_dir
    d = _nbdir(tmp_path)
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from memtoc.run import pipeline
        from memtoc.config.runconfig import RunConfig
        P = RunConfig.load({SMOKE!r}, overrides={{"output_root": {str(tmp_path / 'out')!r}}})
        def slow(src, dst, pf, lo):
            time.sleep(120)
        pipeline.run(P, None, notebook_dir=Path({str(d)!r}), executor=slow)
        """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL)
    try:
        for _ in range(1200):   # the child imports torch and checks the data first: slow on a busy machine
            if (rd / "config.json").is_file() and json.loads((rd / "config.json").read_text())["notebooks"]:
                break
            time.sleep(0.1)
        assert pipeline.effective_status(rd) == "running"
        assert runlock.is_held(rd)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert json.loads((rd / "config.json").read_text())["status"] == "running"   # what the file says...
    assert pipeline.effective_status(rd) == "interrupted"                          # ...and what it means
    cfg = json.loads((rd / "config.json").read_text())                             # ...now recorded there too
    assert cfg["status"] == "interrupted" and cfg["notebooks"][0]["status"] == "interrupted"
    r = subprocess.run([sys.executable, "-m", "memtoc", "run", SMOKE, "--set", f"output_root={tmp_path / 'out'}",
                        "--list"], capture_output=True, text=True, timeout=120)
    assert "last run interrupted" in r.stdout


def _run_ok(P, d, only=None):
    return pipeline.run(P, only, notebook_dir=d, executor=_ok, echo=lambda m: None)


def test_only_rerun_with_other_params_is_refused_not_mixed(tmp_path):
    d = _nbdir(tmp_path)
    cfg = _run_ok(_params(tmp_path, n_questions=3), d)
    st = cfg["stages"]
    assert set(st) == {"01_a", "02_b", "03_c"} and st["01_a"]["params"]["n_questions"] == 3
    assert all(len(s["params_sha256"]) == 64 for s in st.values())
    # the README's `--only 03 --set n_questions=...` pattern: 03 would read 01/02 made for 3 questions
    with pytest.raises(pipeline.PipelineError) as e:
        _run_ok(_params(tmp_path, n_questions=4), d, ["03"])
    msg = str(e.value)
    assert "01_a" in msg and "02_b" in msg and "n_questions: 3 -> 4" in msg
    # a parameter 01 and 02 do not read is fine
    cfg = _run_ok(_params(tmp_path, n_questions=3, n_boot=50), d, ["03"])
    assert cfg["stages"]["03_c"]["params"]["n_boot"] == 50 and "n_boot" not in cfg["stages"]["02_b"]["params"]
    # rerunning from the changed stage on is fine too, and config.json then says so
    cfg = _run_ok(_params(tmp_path, n_questions=4), d)
    assert {s["params"]["n_questions"] for s in cfg["stages"].values()} == {4}


def test_stale_skipped_stage_is_not_mixed_into_a_later_one(tmp_path):
    d = _nbdir(tmp_path, ["01_a.ipynb", "04_finetuning.ipynb", "08_paper.ipynb"])
    _run_ok(_params(tmp_path, n_questions=3), d)
    # finetune now off: 04 is skipped, but 08 would still read its old outputs (made for 3 questions)
    with pytest.raises(pipeline.PipelineError, match="04_finetuning"):
        _run_ok(_params(tmp_path, n_questions=4, finetune={"enabled": False}), d)


# ------------------------------------------------------------------------------ 13.4 release_dir

def test_relative_release_dir_is_resolved_once_against_the_invocation_cwd(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "rel").symlink_to(RELEASE)
    monkeypatch.chdir(work)
    d = _nbdir(tmp_path)
    got = {}

    def check(src, dst, params_file, log_output):
        got["release_dir"] = load_params(params_file)["release_dir"]
        dst.write_text("{}")

    cfg = pipeline.run(_params(tmp_path, release_dir="rel"), None, notebook_dir=d, executor=check,
                       echo=lambda m: None)
    want = str((work / "rel").resolve())
    assert got["release_dir"] == want and Path(want).is_absolute()
    assert cfg["provenance"]["release"]["path"] == want and len(cfg["provenance"]["release"]["digest"]) == 64
    # the environment variable, relative, too
    monkeypatch.setenv("MEMTOC_RELEASE", "rel")
    cfg = pipeline.run(_params(tmp_path), None, notebook_dir=d, executor=check, echo=lambda m: None)
    assert got["release_dir"] == want
    # and a notebook opened by hand (nb.setup) resolves against where it was started, not the repo root
    monkeypatch.delenv("MEMTOC_RELEASE")
    P = nb.setup({"params_file": SMOKE, "release_dir": "rel", "output_root": str(tmp_path / "o2")})
    assert P["release_dir"] == want


# ------------------------------------------------------------------------------ 13.5 memtoc score

def test_score_refuses_in_place_and_directory_output(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    body = json.dumps({"response": "FINAL: Paris", "gold": "Paris", "tool_value": None, "memory": ""}) + "\n{bad\n"
    src.write_text(body)
    assert cli.main(["score", str(src), "-o", str(src)]) == 2
    err = capsys.readouterr().err
    assert "input file" in err and "Traceback" not in err
    assert src.read_text() == body                   # untouched, the malformed line included
    assert cli.main(["score", str(src), "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and len(err.strip().splitlines()) == 1


def test_score_rereads_its_own_output_with_unicode_line_breaks(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    recs = [{"id": i, "response": f"The tool says Rome\u2028really\u0085.\nFINAL: Rome{sep}", "gold": "Rome",
             "tool_value": "Rome", "memory": "Milan"} for i, sep in enumerate(["", "\u2029", "\x1c"])]
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    out1, out2 = tmp_path / "o1.jsonl", tmp_path / "o2.jsonl"
    assert cli.main(["score", str(src), "-o", str(out1)]) == 0
    assert cli.main(["score", str(out1), "-o", str(out2)]) == 0     # re-reads its own output
    assert "0 malformed" in capsys.readouterr().err
    a = [json.loads(x) for x in out1.read_text(encoding="utf-8").split("\n") if x]
    b = [json.loads(x) for x in out2.read_text(encoding="utf-8").split("\n") if x]
    assert len(a) == len(b) == 3 and [r["response"] for r in b] == [r["response"] for r in recs]
    assert [r["outcome"] for r in a] == [r["outcome"] for r in b]


# ------------------------------------------------------------------------------ 13.6 one-line errors

def _one_line_error(capsys, argv) -> str:
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_one_line_errors_for_bad_params(tmp_path, capsys):
    out = ["--set", f"output_root={tmp_path / 'out'}"]
    assert "alpha" in _one_line_error(capsys, ["run", SMOKE, *out, "--set", "alpha=abc"])
    assert "release_dir" in _one_line_error(capsys, ["run", SMOKE, *out, "--set", "release_dir=5"])
    lst = tmp_path / "list.yaml"
    lst.write_text("- run_name: x\n- n_questions: 3\n")
    assert "mapping" in _one_line_error(capsys, ["run", str(lst)])
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("run_name: caf\xe9\n".encode("latin-1"))
    assert "UTF-8" in _one_line_error(capsys, ["run", str(bad)])
    assert not (tmp_path / "out").exists()


def test_unwritable_output_folder_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    err = _one_line_error(capsys, ["run", SMOKE, "--set", f"output_root={blocker / 'sub'}"])
    assert "output_root" in err


def test_full_disk_fails_cleanly(tmp_path):
    d = _nbdir(tmp_path)
    P = _params(tmp_path)
    rd = P.run_dir

    def full(src, dst, params_file, log_output):
        if "02" in src.name:
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        dst.write_text("{}")

    with pytest.raises(pipeline.PipelineError) as e:
        pipeline.run(P, None, notebook_dir=d, executor=full, echo=lambda m: None)
    assert "No space left" in str(e.value) and "\n" not in str(e.value)
    c = json.loads((rd / "config.json").read_text())
    assert c["status"] == "failed" and [n["status"] for n in c["notebooks"]] == ["ok", "failed"]
    assert not list(rd.rglob("*.tmp")) and not runlock.is_held(rd)


def test_full_disk_while_writing_config_leaves_no_temp_file(tmp_path, monkeypatch):
    d = _nbdir(tmp_path)
    P = _params(tmp_path)
    rd = P.run_dir
    real = Path.write_text
    calls = {"n": 0}

    def flaky(self, *a, **k):
        if self.name == "config.json.tmp":
            calls["n"] += 1
            if calls["n"] >= 3:
                real(self, "{partial")
                raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", flaky)
    with pytest.raises(pipeline.PipelineError, match="No space left"):
        pipeline.run(P, None, notebook_dir=d, executor=_ok, echo=lambda m: None)
    monkeypatch.setattr(Path, "write_text", real)
    assert not list(rd.rglob("*.tmp"))
    assert json.loads((rd / "config.json").read_text())["status"] == "failed"    # not "running"


# ------------------------------------------------------------------------------ 13.7 validation first

@pytest.mark.parametrize("over,field", [
    ({"n_boot": 0}, "n_boot"),
    ({"n_perm": 0}, "n_perm"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"backend_options": [1]}, "backend_options"),
    ({"models": ["no-such-model-xyz"]}, "models"),
    ({"finetune": {"enabeld": False}}, "enabeld"),
    ({"verify": "maybe"}, "verify"),
    ({"n_questions": 100000}, "n_questions"),
    ({"n_questions_extra": 100000}, "n_questions_extra"),
    ({"formulations": ["reference", "reference"]}, "repeated formulation"),
    ({"judge": {"model": "no-such-judge"}}, "judge.model"),
])
def test_everything_is_validated_before_the_first_notebook(tmp_path, over, field):
    d = _nbdir(tmp_path)
    ran = []
    with pytest.raises(ConfigError, match=field):
        P = RunConfig.load(SMOKE, overrides={"output_root": str(tmp_path / "out"), **over})
        pipeline.run(P, None, notebook_dir=d, executor=lambda *a: ran.append(a), echo=lambda m: None)
    assert ran == [] and not (tmp_path / "out").exists()


def test_n_questions_above_the_analysis_set_names_its_size(tmp_path):
    P = _params(tmp_path, n_questions=100000)
    n = len(load_benchmark(P["release_dir"]).analysis)
    with pytest.raises(ConfigError, match=f"more than the {n} questions"):
        pipeline.preflight(pipeline.resolve_paths(P), [])


# ------------------------------------------------------------------------------ 13.8 messages

def test_duplicate_qkey_is_caught_at_load_with_file_line_and_qkey(tmp_path):
    rel = tmp_path / "rel"
    shutil.copytree(RELEASE, rel)
    table = rel / "questions_575.jsonl"
    lines = table.read_text(encoding="utf-8").splitlines(keepends=True)
    qkey = json.loads(lines[3])["qkey"]
    table.write_text("".join(lines[:10] + [lines[3]] + lines[10:]), encoding="utf-8")
    t0 = time.perf_counter()
    with pytest.raises(DataError) as e:
        load_benchmark(rel)
    msg = str(e.value)
    assert str(table) in msg and "line 11" in msg and repr(qkey) in msg and "line 4" in msg
    assert time.perf_counter() - t0 < 30


def test_cache_repair_warnings_are_printed_by_memtoc_run(tmp_path):
    d = _nbdir(tmp_path, ["01_a.ipynb"])
    note = "memtoc cache: /x/arm.jsonl: dropped 1 damaged line(s) (line 2; not valid JSON) into arm.jsonl.rejected"

    def writes_notebook(src, dst, params_file, log_output):
        dst.write_text(json.dumps({"cells": [{"outputs": [
            {"output_type": "stream", "name": "stderr", "text": [f"/m/cache.py:140: UserWarning: {note}\n",
                                                                   "  warnings.warn(\n"]}]}]}))

    said = []
    pipeline.run(_params(tmp_path), None, notebook_dir=d, executor=writes_notebook, echo=said.append)
    assert any(note in m for m in said)


# ------------------------------------------------------------------------------ 13.9 verify

@pytest.fixture()
def built(tmp_path):
    from test_claims import make_run  # the claims tests' fake run

    from memtoc.stages import report
    run = make_run(tmp_path)
    (run / "figures").mkdir()
    (run / "figures" / "headline.png").write_bytes(b"\x89PNG fake")
    for rel in ("scored/tiny-a/untreated__reference.jsonl", "generations/tiny-a/untreated__reference.jsonl"):
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text('{"key": "k", "text": "FINAL: x"}\n')
    report.build_report(run)
    assert "../figures/headline.png" in (run / "paper" / "report.md").read_text()
    assert claims.verify(run).ok
    return run


def test_verify_records_hashes_of_every_output(built):
    doc = json.loads((built / "paper" / "claims.json").read_text())
    assert {"summaries/evaluation.json", "figures/headline.png", "scored/tiny-a/untreated__reference.jsonl",
            "generations/tiny-a/untreated__reference.jsonl"} <= set(doc["inputs"])


@pytest.mark.parametrize("damage,row", [
    (lambda r: (r / "figures" / "headline.png").unlink(), "report:figures"),
    (lambda r: (r / "scored/tiny-a/untreated__reference.jsonl").write_text('{"key": "k", "text": "FINAL: y"}\n'),
     "report:inputs"),
    (lambda r: (r / "generations/tiny-a/untreated__reference.jsonl").open("a").write('{"key": "j", "text": "z"}\n'),
     "report:inputs"),
])
def test_verify_fails_on_a_deleted_figure_or_an_edited_scored_or_generation_file(built, damage, row):
    damage(built)
    res = claims.verify(built)
    assert not res.ok and row in {r.id for r in res.failures}


# ------------------------------------------------------------------------------ 13.10 lazy loading

class Fake(Generator):
    backend = "fake"
    loads = 0

    def __init__(self):
        Fake.loads += 1
        super().__init__({"model": "fake", "decoding": {"max_new_tokens": 4}})

    def _generate_batches(self, prompts, desc):
        yield list(range(len(prompts))), [Reply(p.upper(), 1, 1, 0.0, "", False) for p in prompts]


def test_a_fully_cached_rerun_does_not_load_the_model(tmp_path):
    Fake.loads = 0
    sig, store, cp = {"model": "fake", "v": 1}, tmp_path / "ids", tmp_path / "gen" / "m" / "arm.jsonl"
    g1 = LazyGenerator(Fake, sig, store)
    assert [r.text for r in g1.generate(["a", "b"], cache_path=cp)] == ["A", "B"] and Fake.loads == 1
    g2 = LazyGenerator(Fake, sig, store)                      # a second identical run
    assert g2.identity == g1.identity and Fake.loads == 1     # known without loading
    r = g2.generate(["b", "a"], cache_path=cp)
    assert [x.text for x in r] == ["B", "A"] and all(x.cached for x in r) and not g2.loaded and Fake.loads == 1
    g2.generate(["c"], cache_path=cp)                          # the first miss loads
    assert g2.loaded and Fake.loads == 2
    g3 = LazyGenerator(Fake, {"model": "fake", "v": 2}, store)  # another signature: nothing recorded
    assert not g3.loaded
    g3.identity
    assert g3.loaded and Fake.loads == 3


def test_generate_replies_all_cached_does_not_load(tmp_path):
    from memtoc.data.benchmark import select_questions
    from memtoc.data.episodes import build_episodes
    bench = load_benchmark(RELEASE)
    eps = build_episodes(select_questions(bench.analysis, 2, 0), ["reference"], ["tool_right"])
    Fake.loads = 0
    sig, store = {"model": "fake", "v": 3}, tmp_path / "ids"
    first = evaluation.generate_replies(LazyGenerator(Fake, sig, store), "m", eps, tmp_path)
    assert Fake.loads == 1
    g = LazyGenerator(Fake, sig, store)
    again = evaluation.generate_replies(g, "m", eps, tmp_path)
    assert [r.text for r in again] == [r.text for r in first] and not g.loaded and Fake.loads == 1


def test_unknown_backend_option_fails_at_load_generator_not_at_the_first_miss():
    from memtoc.generation import models
    with pytest.raises(ConfigError, match="temprature.*its options are: adapter"):
        models.load_generator("smollm2-135m-instruct", temprature=0.5)
    g = models.load_generator("smollm2-135m-instruct", max_new_tokens=3)
    assert isinstance(g, LazyGenerator) and not g.loaded


@pytest.mark.integration
def test_real_model_second_run_does_not_load_weights(tmp_path):
    from memtoc.generation import models
    cp = tmp_path / "gen" / "m" / "arm.jsonl"
    g1 = models.load_generator("smollm2-135m-instruct", max_new_tokens=4)
    r1 = g1.generate(["Say hi."], cache_path=cp)
    g1.close()
    g2 = models.load_generator("smollm2-135m-instruct", max_new_tokens=4)
    r2 = g2.generate(["Say hi."], cache_path=cp)
    assert not g2.loaded and r2[0].cached and r2[0].text == r1[0].text
    assert g2.identity == g1.identity


# ------------------------------------------------------------------------------ 18.8 dry run

def test_dry_run_prints_the_plans_without_weights(capsys):
    assert cli.main(["run", str(REPO_ROOT / "params" / "paper.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for m in ("llama-3.1-8b-instruct", "gemma-2-9b-it", "03_evaluation", "requests per model", "GB", "total"):
        assert m in out
    assert cli.main(["run", "--dry-run", str(REPO_ROOT / "params" / "scale70b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "llama-3.3-70b-instruct-awq" in out and "80 GB GPU" in out and "vllm" in out
    import sys as _sys
    assert "vllm" not in _sys.modules        # nothing of the GPU stack was imported


def test_the_40gb_route_fits_a_40gb_gpu_where_paper_yaml_needs_80(capsys):
    """params/paper-40gb.yaml (paper.yaml plus memory settings): every engine, the judge and 05 fit 40 GB by
    the dry run's own estimates; paper.yaml needs 80 (the judge at 0.4 of the GPU, 05 in float32, which
    the "needs" line now counts); the two differ only in the documented keys."""
    from memtoc.run import dryrun
    paper, small = (RunConfig.load(REPO_ROOT / "params" / f) for f in ("paper.yaml", "paper-40gb.yaml"))
    big, fit = dryrun.dry_run_json(paper), dryrun.dry_run_json(small)
    assert big["gpu_gb"] > 40 >= fit["gpu_gb"]
    assert "at least 40 GB" in dryrun.dry_run(small) and "at least 80 GB" in dryrun.dry_run(paper)
    probes = {p["stage"]: p for p in fit["stages"]}["05_probes"]
    assert [m["model"] for m in probes["per_model"]] == ["llama-3.1-8b-instruct", "qwen2.5-7b-instruct", "gemma-2-9b-it"]
    a, b = load_params(REPO_ROOT / "params" / "paper.yaml"), load_params(REPO_ROOT / "params" / "paper-40gb.yaml")
    differ = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
    assert differ == {"run_name", "backend_options", "judge", "probes"}
    assert {k for k in {*a["probes"], *b["probes"]} if a["probes"].get(k) != b["probes"].get(k)} == {"dtype", "models"}
    assert {**a["backend_options"], "gpu_memory_utilization": 0.9} == b["backend_options"]


def test_the_dry_run_names_the_critical_stage_and_the_time_on_n_gpus():
    """One model per GPU then ``memtoc merge``: the dry run gives each model's seconds over the stages, the
    wall-clock time for 1..N GPUs (whole models, the longest first onto the least loaded GPU) and the
    stage that dominates."""
    from memtoc.run import dryrun
    assert dryrun.sharded_seconds({"a": 5.0, "b": 4.0, "c": 3.0, "d": 3.0}, 2) == 8.0    # {a, d} {b, c}
    assert dryrun.sharded_seconds({"a": 5.0, "b": 4.0}, 4) == 5.0
    assert dryrun.sharded_seconds({"a": 5.0, "b": 4.0}, 1) == 9.0
    plan = dryrun.dry_run_json(RunConfig.load(REPO_ROOT / "params" / "paper.yaml"))
    per, wall = plan["per_model_seconds"], plan["sharded_seconds"]
    assert set(per) == set(plan["models"]) and abs(sum(per.values()) - plan["total_seconds"]) < 1.0
    assert abs(wall["1"] - sum(per.values())) < 1e-6 and wall[str(len(per))] == max(per.values())
    assert all(wall[str(n)] >= wall[str(n + 1)] for n in range(1, len(per)))
    assert plan["critical_stage"] == max((s for s in plan["stages"] if s["enabled"] and s["seconds"]),
                                         key=lambda s: s["seconds"])["stage"]
    text = dryrun.dry_run(RunConfig.load(REPO_ROOT / "params" / "paper.yaml"))
    assert f"critical stage: {plan['critical_stage']}" in text and "one model per GPU" in text and "5 GPUs ~" in text


def test_the_gpu_docs_state_the_dry_runs_own_figures():
    """docs/gpu.md's table gives each params file's dry-run total and memory; a change of the formulas or the
    params that moves them fails here until the docs follow."""
    import re

    from memtoc.run import dryrun
    text = (REPO_ROOT / "docs" / "gpu.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "params/" in line and "~" in line]
    seen = set()
    for line in rows:
        name = re.search(r"`params/([\w.-]+\.yaml)`", line).group(1)
        hours = float(re.search(r"~([\d.]+) h", line).group(1))
        plan = dryrun.dry_run_json(RunConfig.load(REPO_ROOT / "params" / name))
        assert round(plan["total_seconds"] / 3600, 1) == hours, (name, line)
        need = re.search(r"needs (\d+) GB", line)
        if need:
            assert dryrun.gpu_class(plan["gpu_gb"]) == int(need.group(1)), (name, line)
        seen.add(name)
    assert seen >= {"paper.yaml", "paper-40gb.yaml"}
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    for name in ("paper.yaml", "paper-40gb.yaml"):
        hours = dryrun.dry_run_json(RunConfig.load(REPO_ROOT / "params" / name))["total_seconds"] / 3600
        assert f"~{hours:.0f} h" in readme, name


def test_dry_run_counts_the_fine_tuned_models_and_their_own_closed_book(capsys):
    from memtoc.run import dryrun
    from memtoc.stages import finetune
    P = RunConfig.load(REPO_ROOT / "params" / "paper.yaml")
    ft = P.finetune
    assert "llama-3.1-8b" in P["models"] and "llama-3.1-8b" not in ft["models"]    # the base model is not tuned
    bench = load_benchmark(P.get("release_dir"))
    fr = dryrun.finetune_requests(P, ft, bench)
    plans, _ = finetune.plan(P, bench)
    n_held = sum(len(p.eval_questions) for p in plans)
    n_forms = len(P["formulations"])
    assert fr["adapters"] == len(ft["objectives"]) * len(plans) == 4
    assert fr["adapter_closed_book"] == fr["adapters"] // len(plans) * n_held * n_forms
    assert fr["with_tool"] == n_held * len(ft["eval_conditions"]) * n_forms * (1 + len(ft["objectives"]))
    tuned = dryrun.transfer_requests(P, ft, "llama-3.1-8b-instruct", adapters_of_04=True)
    base = dryrun.transfer_requests(P, ft, "llama-3.1-8b", adapters_of_04=True)
    assert tuned["forward_arms"] == 2 and base["forward_arms"] == 0        # sft, dpo x fold 0 of 04
    assert tuned["forward"] == 3 * tuned["episodes"] and base["forward"] == base["episodes"]
    tr = RunConfig.of(P).transfer
    assert tuned["reverse_closed_book"] == min(tr.reverse_eval_questions, P["n_questions"]) * n_forms
    assert tuned["reverse_steps"] == (tr.reverse_max_steps if tr.reverse_max_steps > 0
                                      else -(-tuned["reverse_examples"] // tr.reverse_batch_size))
    assert tuned["total"] == tuned["forward"] + tuned["reverse_with_tool"] + tuned["reverse_closed_book"]
    assert cli.main(["run", str(REPO_ROOT / "params" / "paper.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    sec04 = out[out.index("04_finetuning"):out.index("05_probes")]
    assert "llama-3.1-8b-instruct" in sec04 and "llama-3.1-8b " not in sec04
    assert f"{fr['adapter_closed_book']} the adapters' own closed-book" in sec04
    sec06 = out[out.index("06_transfer"):out.index("08_paper")]
    assert f"{tuned['total']} requests" in sec06 and f"{base['total']} requests" in sec06


def test_dry_run_refuses_what_cannot_run(capsys, monkeypatch):
    from memtoc.generation import models
    big = models.ModelSpec("big-405b", "big", "hub", hub_id="x/big", params_b=405.0)
    real = models.get_model
    monkeypatch.setattr(models, "get_model", lambda n: big if n == "big-405b" else real(n))
    err = _one_line_error(capsys, ["run", str(REPO_ROOT / "params" / "paper.yaml"), "--dry-run",
                                   "--set", "models=[big-405b]"])
    assert "cannot run" in err and "big-405b" in err
    err = _one_line_error(capsys, ["run", SMOKE, "--dry-run", "--set", "n_questions=100000"])
    assert "n_questions" in err


# ------------------------------------------------------------------------------ 18.9 progress

def test_progress_lines_show_rate_and_what_is_left(tmp_path, monkeypatch):
    f = tmp_path / "p.json"
    monkeypatch.setenv(progress.ENV, str(f))
    said = []
    w = progress.Watcher(f, said.append, prefix="[2/6] 02: ", interval=0)
    t0 = time.time() - 10
    progress.report("smollm2 forced", 20, 100, t0)
    assert w.check()
    assert said[-1].startswith("[2/6] 02: smollm2 forced: 20/100 replies, 2.00/s, about 40 s left"), said
    assert w.check() is None      # unchanged: not repeated
    # the base generator reports every batch
    monkeypatch.setattr(progress, "report", lambda *a, **k: said.append(a))
    g = Fake()
    g.generate(["x", "y"], desc="fake arm")
    assert said[-1][:3] == ("fake arm", 2, 2)


# ------------------------------------------------------------------------------ fault injection

# as small as the pipeline allows: 2 questions, one formulation, no extra arms, one SFT adapter of one
# optimizer step trained on fold 1 and evaluated on the 2 questions (both in fold 0); no transfer, probes
# or agent loop (06, 05, 07: the kill points are in 02, 03 and 04; 07's own kill-and-resume is
# tests/unit/test_agent.py's, and the smoke pipeline test reruns 05-07 from their caches)
SMALL = ["--set", "n_questions=2", "--set", "n_questions_extra=0", "--set", "formulations=[reference]",
         "--set", "max_new_tokens=12",
         "--set", "extra_arms=[]", "--set", "n_boot=20", "--set", "n_perm=20",
         "--set", "finetune={enabled: true, objectives: [sft], folds: [1], train_questions_per_fold: 2, "
                  "eval_questions_per_fold: 1, max_steps: 1, batch_size: 2}",
         "--set", "transfer.enabled=false", "--set", "probes.enabled=false", "--set", "agent.enabled=false"]
VOLATILE = {"seconds", "created", "time", "started", "finished", "seconds_per_step", "elapsed", "s_per_step",
            "wall_seconds", "path", "run_dir", "tokens_per_second", "resumed", "timing"}


def _strip(o):
    if isinstance(o, dict):
        return {k: _strip(v) for k, v in o.items() if k not in VOLATILE and "second" not in k}
    if isinstance(o, list):
        return [_strip(v) for v in o]
    return o


def _differences(a, b, at: str = "") -> list[str]:
    """The JSON paths where ``a`` and ``b`` differ (with both values), for a readable failure."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in (_differences(a.get(k), b.get(k), f"{at}/{k}") if k in a and k in b
                          else [f"{at}/{k}: only in {'the first' if k in a else 'the second'}"])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{at}/{i}")]
    return [] if a == b else [f"{at}: {str(a)[:120]} != {str(b)[:120]}"]


def _memtoc_run(out_root: Path, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "memtoc", "run", SMOKE, "--set", f"output_root={out_root}", *SMALL],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def _kill_when(p: subprocess.Popen, cond, timeout=600):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if p.poll() is not None:
            raise AssertionError("the run finished before the kill point:\n" + p.stdout.read())
        if cond():
            os.killpg(p.pid, signal.SIGKILL)    # memtoc (its kernel, in its own session, exits within 1 s
            p.wait()                            # of its parent: ipykernel's parent poller)
            time.sleep(2)
            return p.stdout.read()
        time.sleep(0.2)
    raise AssertionError("kill point not reached")


def _summaries(rd: Path) -> dict:
    return {p.name: _strip(json.loads(p.read_text())) for p in sorted((rd / "summaries").glob("*.json"))}


@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_killed_damaged_and_resumed_run_gives_the_uninterrupted_summaries(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t = time.perf_counter()
    a = _memtoc_run(tmp_path / "a", env)
    log_a = a.communicate()[0]
    t_a = time.perf_counter() - t
    assert a.returncode == 0, log_a
    assert "without encryption" not in log_a
    rd = tmp_path / "b" / "smoke"
    gen = rd / "generations"

    def lines():
        return sum(len(p.read_bytes().splitlines()) for p in gen.rglob("*.jsonl")) if gen.is_dir() else 0

    def in_stage(name):
        try:
            nbs = json.loads((rd / "config.json").read_text())["notebooks"]
        except (OSError, ValueError):
            return False
        return any(n["notebook"] == name and n["status"] == "running" for n in nbs)

    t0 = time.perf_counter()
    # in 02: after its first batch (forced) is cached, before the permissive one
    _kill_when(_memtoc_run(tmp_path / "b", env), lambda: in_stage("02_elicitation") and lines() > 0)
    # in 03: once its with-tool replies are cached (it is scoring and bootstrapping)
    _kill_when(_memtoc_run(tmp_path / "b", env),
               lambda: in_stage("03_evaluation") and any(gen.rglob("untreated*.jsonl")))
    assert pipeline.effective_status(rd) == "interrupted"
    # damage the cache: a garbled line with good lines after it, and a torn last line
    files = sorted(p for p in gen.rglob("*.jsonl") if len(p.read_bytes().splitlines()) >= 2)
    assert len(files) >= 2, files
    ls = files[0].read_bytes().splitlines(keepends=True)
    files[0].write_bytes(b"{garbage\n" + b"".join(ls[1:]))
    with open(files[-1], "ab") as f:
        f.write(b'{"key": "torn", "te')
    # in 04: once its adapter folder exists
    log3 = _kill_when(_memtoc_run(tmp_path / "b", env),
                      lambda: in_stage("04_finetuning") and (rd / "adapters").exists())
    assert "memtoc cache:" in log3 and "dropped 1 damaged line" in log3   # repairs shown by memtoc run
    assert "replies" in log3                                              # and generation progress
    b = _memtoc_run(tmp_path / "b", env)
    log_b = b.communicate()[0]
    assert b.returncode == 0, log_b
    diffs = _differences(_summaries(rd), _summaries(tmp_path / "a" / "smoke"))
    assert diffs == [], "\n".join(diffs)
    cfg = json.loads((rd / "config.json").read_text())
    assert cfg["status"] == "ok" and [h["status"] for h in cfg["history"]] == ["interrupted"] * 3
    assert claims.verify(rd).ok
    assert cache.rejected_path(files[0]).read_bytes() == b"{garbage\n"
    print(f"uninterrupted run {t_a:.0f} s; killed three times, damaged and resumed {time.perf_counter() - t0:.0f} s")


def test_a_bad_set_value_names_set_and_shows_what_it_got(tmp_path, capsys):
    rc = cli.main(["run", SMOKE, "--set", f"output_root={tmp_path}", "--set", "probes.strengths=[x]", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "--set (over " in err and "field 'probes.strengths'" in err and "got ['x']" in err


def test_run_takes_the_release_on_the_command_line(tmp_path, capsys):
    rc = cli.main(["run", SMOKE, "--release", str(RELEASE), "--dry-run"])
    assert rc == 0 and f"release {RELEASE} " in capsys.readouterr().out
    rc = cli.main(["run", SMOKE, "--release", str(tmp_path / "nowhere"), "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and "nowhere" in err and err.count("\n") == 1


def test_dry_run_splits_a_model_over_tensor_parallel_gpus():
    from memtoc.generation import models
    from memtoc.run import dryrun
    spec = models.get_model("llama-3.3-70b-instruct-awq")
    one = dryrun.estimate_model(spec, "vllm", "float16", {"quantization": "awq_marlin"})
    two = dryrun.estimate_model(spec, "vllm", "float16", {"quantization": "awq_marlin", "tensor_parallel_size": 2})
    assert (one["gpus"], two["gpus"]) == (1, 2) and two["weights_gb"] == one["weights_gb"]
    assert two["gpu_gb"] == pytest.approx((one["weights_gb"] / 2 + dryrun.KV_CACHE_GB) / 0.9)
    assert two["gpu_class"] < one["gpu_class"]                      # the 70B point on two smaller GPUs
    assert "2 x " in dryrun.memory_line("x", spec, two, "vllm") and "per GPU" in dryrun.memory_line("x", spec, two, "vllm")
    bf16 = models.get_model("llama-3.1-8b-instruct")
    assert dryrun.estimate_model(bf16, "transformers", "bfloat16", {"tensor_parallel_size": 4})["gpus"] == 1
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        dryrun.estimate_model(spec, "vllm", "float16", {"tensor_parallel_size": 0})
    P = RunConfig.load(REPO_ROOT / "params" / "scale70b.yaml", overrides={"backend_options": {"tensor_parallel_size": 2}})
    assert P.backend_options["tensor_parallel_size"] == 2 and P.backend_options["quantization"]   # merged over the file's
    assert dryrun.dry_run_json(P, source="scale70b+tp2")["gpus_per_model"] == 2
