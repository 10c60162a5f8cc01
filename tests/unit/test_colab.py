"""The Colab set-up's logic (memtoc/run/colab.py) in a mocked Colab environment."""
from __future__ import annotations

import json
import sys
import tomllib
import types

import pytest
from packaging.requirements import Requirement

from memtoc.config import locks as lock
from memtoc.core.project import REPO_ROOT
from memtoc.run import colab
from test_backends_hf import tiny_model_dir  # noqa: F401  (fixture)


def test_the_kernel_packages_and_torch_are_never_installed():
    lock = ["# comment", "ipykernel==6.30.0", "IPython==9.0.0", "torch==2.13.0", "nvidia-cublas-cu12==12.8.4.1",
            "transformers==5.24.0  # pinned", "trl==1.16.0", "peft==0.21.2", "tornado==6.5"]
    plan = colab.install_plan(lock, installed={"peft": "0.21.2", "transformers": "4.57.0"})
    assert plan == ["transformers==5.24.0", "trl==1.16.0"]        # peft already there at the pin
    real = colab.install_plan((REPO_ROOT / "requirements" / "cpu.lock").read_text().splitlines(), {})
    assert not any(p.split("==")[0] in ("torch", "ipykernel", "jupyter-client", "tornado") for p in real)
    assert any(p.startswith("trl==") for p in real) and any(p.startswith("papermill==") for p in real)


@pytest.mark.parametrize("mounted,root", [(True, "/content/drive/MyDrive/memtoc"), (False, "/content/memtoc")])
def test_outputs_and_models_go_to_drive_when_mounted(mounted, root):
    lay = colab.layout(mounted)
    env = lay.environment()
    assert env["MEMTOC_HOME"] == root and env["MEMTOC_MODEL_CACHE"] == root + "/models"
    assert env["MEMTOC_DATA_DIR"] == root + "/release" and lay.on_drive is mounted


def test_the_hub_token_comes_from_the_secret_or_is_absent():
    assert colab.hub_token(lambda k: {"HF_TOKEN": "hf_x"}[k]) == "hf_x"

    class SecretNotFoundError(Exception):
        pass

    def missing(k):
        raise SecretNotFoundError(k)
    assert colab.hub_token(missing) is None and colab.hub_token(lambda k: "") is None


def test_setup_off_colab_does_nothing(monkeypatch):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    ran = []
    assert colab.setup(run=ran.append, log=lambda s: None) is None and ran == []


def test_setup_on_a_mocked_colab(monkeypatch):
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(colab, "installed_versions", lambda: {"trl": "1.16.0"})
    for k in ("MEMTOC_HOME", "MEMTOC_MODEL_CACHE", "MEMTOC_DATA_DIR"):
        monkeypatch.setenv(k, "unset")   # recorded, so the values setup() writes are undone after the test
    ran, logins, said = [], [], []
    lay = colab.setup(run=ran.append, get_secret=lambda k: "hf_secret", drive_mounted=True, login=logins.append,
                      check=list, log=said.append, driver=None)     # a CPU runtime: the CPU lock on Colab's torch
    pip, init, fetch = ran
    assert pip[1:5] == ["-m", "pip", "install", "-q"] and "--no-deps" in pip
    assert not any(p.startswith(("torch==", "ipykernel==", "trl==")) for p in pip)
    assert init[3:5] == ["init", "/content/drive/MyDrive/memtoc"] and fetch[-2:] == ["data", "fetch"]
    assert init[5:] == ["--data-dir", "release", "--model-cache", "models"]     # recorded in the project folder
    assert (lay.project / "release", lay.project / "models") == (lay.data, lay.model_cache)
    assert logins == ["hf_secret"] and lay.on_drive
    import os
    assert os.environ["MEMTOC_HOME"] == "/content/drive/MyDrive/memtoc"


@pytest.mark.parametrize("mounted", [True, False])
def test_the_hub_cache_goes_to_drive_when_asked(monkeypatch, mounted):
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(colab, "installed_versions", lambda: {})
    for k in ("MEMTOC_HOME", "MEMTOC_MODEL_CACHE", "MEMTOC_DATA_DIR"):
        monkeypatch.setenv(k, "unset")
    ran, said = [], []
    colab.setup(run=ran.append, drive_mounted=mounted, log=said.append, driver=None, hub_cache_on_drive=True,
                check=list)
    init = next(cmd for cmd in ran if "init" in cmd)
    assert ("--hub-cache" in init) == mounted
    if mounted:
        assert init[-2:] == ["--hub-cache", colab.HUB_FOLDER]
    else:
        assert any("Drive is not mounted" in s for s in said)


@pytest.mark.parametrize("driver, lock, keep_torch", [
    (None, "requirements/cpu.lock", True),               # a CPU runtime
    ("550.54.15", "requirements/gpu-cu12.lock", False),  # Colab's CUDA 12 driver
    ("580.82.07", "requirements/gpu.lock", False),       # a CUDA 13 driver
])
def test_colab_picks_the_lock_for_its_driver(driver, lock, keep_torch):
    name, keep, why = colab.colab_lock(driver, python="3.12")            # Colab's Python
    assert (name, keep) == (lock, keep_torch) and why and (REPO_ROOT / name).is_file()


def test_a_python_the_cuda12_lock_was_not_resolved_for_gets_the_cpu_lock_and_the_reason():
    name, keep, why = colab.colab_lock("550.54.15", python="3.11")
    assert (name, keep) == ("requirements/cpu.lock", True) and "not 3.11" in why


def test_setup_on_a_mocked_colab_gpu_installs_the_cuda12_lock_with_its_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(colab, "installed_versions", lambda: {"torch": "2.11.0+cu128", "ipykernel": "6.17.1"})
    for k in ("MEMTOC_HOME", "MEMTOC_MODEL_CACHE", "MEMTOC_DATA_DIR"):
        monkeypatch.setenv(k, "unset")
    lock_for = colab.colab_lock
    monkeypatch.setattr(colab, "colab_lock", lambda driver: lock_for(driver, python="3.12"))   # Colab's Python
    ran, said = [], []
    colab.setup(run=ran.append, drive_mounted=False, log=said.append, driver="550.54.15", check=list)
    pip = ran[0]
    assert "torch==2.10.0" in pip and "vllm==0.19.1" in pip and "nvidia-cublas-cu12==12.8.4.1" in pip
    assert not any(p.startswith(("ipykernel==", "jupyter-client==", "tornado==")) for p in pip)
    assert any("gpu-cu12.lock" in s for s in said) and any("restart the session" in s for s in said)


def test_the_setup_says_what_it_replaced_and_what_pip_check_then_reports(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(colab, "installed_versions", lambda: {"numpy": "2.0.2", "pandas": "2.2.2", "trl": "1.16.0"})
    monkeypatch.setattr(colab, "DRIVE_ROOT", tmp_path)
    for k in ("MEMTOC_HOME", "MEMTOC_MODEL_CACHE", "MEMTOC_DATA_DIR"):
        monkeypatch.setenv(k, "unset")
    (tmp_path / "memtoc").mkdir()                                   # the folder memtoc init makes
    said = []
    monkeypatch.setattr(colab, "installed_versions", lambda: {"numpy": "2.0.2", "pandas": "2.2.2", "trl": "1.16.0",
                                                              "torchao": "0.10.0"})
    colab.setup(run=lambda cmd: None, drive_mounted=True, log=said.append, driver=None,
                check=lambda: ["cudf 24.4.1 has requirement pandas<2.2.3, but you have pandas 3.1.1.",
                               "papermill 2.7.0 has requirement tornado>=6.5, but you have tornado 6.4.2."])
    lock = (REPO_ROOT / "requirements" / "cpu.lock").read_text()
    want = dict(line.split("==") for line in lock.splitlines() if line and not line.startswith("#") and "==" in line)
    line = next(s for s in said if s.startswith("replacing"))
    assert f"numpy 2.0.2 -> {want['numpy']}" in line and f"pandas 2.2.2 -> {want['pandas']}" in line
    assert "trl" not in line                                        # already at the lock's version
    assert any("pip check reports 1 broken requirement(s) of the image's own" in s and "cudf" in s for s in said)
    assert any("of packages the lock installed" in s and "papermill" in s for s in said)
    record = json.loads((tmp_path / "memtoc" / colab.INSTALL_RECORD).read_text())
    assert record["reason"] == colab.colab_lock(None)[2]                    # not torchao's (removed above)
    assert ["numpy", "2.0.2", want["numpy"]] in record["replaced"] and len(record["pip_check"]) == 2


def test_the_cuda12_lock_is_a_cuda12_build():
    pins = (REPO_ROOT / "requirements" / "gpu-cu12.lock").read_text()
    assert "torch==2.10.0" in pins and "vllm==0.19.1" in pins
    assert "-cu12==" in pins and "-cu13==" not in pins and "nvidia-cublas==" not in pins



def test_the_cuda12_lock_pins_inside_pyproject_ranges():
    pins = lock.read_lock(REPO_ROOT / "requirements" / "gpu-cu12.lock")
    proj = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(x) for x in proj["dependencies"] + proj["optional-dependencies"]["gpu"]]
    for r in reqs:
        name = lock.canonical(r.name)
        assert name in pins and r.specifier.contains(pins[name]), f"gpu-cu12.lock {name} outside {r}"


def test_the_setup_notebook_installs_only_on_colab():
    nb = json.loads((REPO_ROOT / "notebooks" / "colab_setup.ipynb").read_text())
    code = "".join(nb["cells"][1]["source"])
    assert 'if "google.colab" in sys.modules:' in code and "--no-deps" in code and "setup(" in code
    assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")


def test_setup_leaves_no_environment_behind():
    """The previous test's MEMTOC_HOME must not reach later tests (their project root would move)."""
    import os
    assert "/content/" not in os.environ.get("MEMTOC_HOME", "")



def _fake_torchao(monkeypatch, version: str):
    """torchao ``version`` as peft sees it (import spec and distribution metadata), without installing it."""
    import importlib.metadata as md
    import importlib.util as iu
    real_spec, real_version = iu.find_spec, md.version
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: object() if name == "torchao" else real_spec(name, *a))
    monkeypatch.setattr(md, "version", lambda name: version if name == "torchao" else real_version(name))
    _forget_torchao()


def _forget_torchao():
    """peft caches its torchao check for the process (lru_cache): an earlier LoRA in this process decided it."""
    from peft import import_utils
    clear = getattr(import_utils.is_torchao_available, "cache_clear", None)
    if clear is not None:
        clear()


def _lora(model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_colabs_torchao_breaks_every_lora_and_the_setup_removes_it(tiny_model_dir, monkeypatch):  # noqa: F811
    """Colab's image carries torchao 0.10.0: the installed peft then refuses to create any LoRA layer. The
    set-up finds it (and only a version below peft's floor) and uninstalls it before installing the lock;
    without it the LoRA layer is created."""
    _fake_torchao(monkeypatch, "0.10.0")
    with pytest.raises(ImportError, match="incompatible version of torchao"):
        _lora(tiny_model_dir)
    assert [n for n, _, _ in colab.incompatible({"torchao": "0.10.0", "peft": "0.21.2"})] == ["torchao"]
    assert colab.incompatible({"torchao": "0.16.0"}) == [] and colab.incompatible({}) == []
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(colab, "installed_versions", lambda: {"torchao": "0.10.0", "trl": "1.16.0"})
    for k in ("MEMTOC_HOME", "MEMTOC_MODEL_CACHE", "MEMTOC_DATA_DIR"):
        monkeypatch.setenv(k, "unset")
    ran, said = [], []
    colab.setup(run=ran.append, drive_mounted=False, log=said.append, driver=None, check=list)
    assert ran[0][-5:] == ["pip", "uninstall", "-q", "-y", "torchao"] and "install" in ran[1]
    assert any("removing torchao 0.10.0" in s for s in said)
    monkeypatch.undo()                     # torchao gone: the same LoRA layer is created
    _forget_torchao()
    assert _lora(tiny_model_dir).peft_config["default"].r == 4
