"""Colab set-up: what ``notebooks/colab_setup.ipynb`` does after it has installed memtoc itself.

On Colab only (nothing happens elsewhere):

1. installs the packages memtoc needs that the Colab image lacks into the kernel's own Python, from
   the lock that fits the runtime (:func:`colab_lock`): on a GPU runtime the GPU lock for its NVIDIA
   driver (``requirements/gpu-cu12.lock`` on Colab's CUDA 12 driver: vLLM 0.19.1 with its torch 2.10.0
   for CUDA 12.8, replacing Colab's torch), on a CPU runtime ``requirements/cpu.lock`` without torch
   (Colab's own torch is kept); *never* the packages the kernel runs on (jupyter, ipykernel, IPython,
   tornado, ...); it says which of the image's packages it replaced (old -> new version) and what ``pip
   check`` then reports broken among the image's own packages, and keeps both in
   ``<project>/colab-install.json``;
2. makes the project folder (``memtoc init``): on Google Drive when it is mounted
   (``/content/drive/MyDrive/memtoc``: outputs, the model cache and the release survive the session),
   else ``/content/memtoc`` (wiped when the runtime is recycled);
3. fetches and verifies the MemToC release into it (``memtoc data fetch``);
   and before all this removes what the image carries at a version that breaks memtoc's stack
   (:data:`INCOMPATIBLE`: torchao below 0.16, which peft refuses whenever it creates a LoRA layer);
4. logs in to the Hugging Face hub with the ``HF_TOKEN`` Colab secret when one is set (Llama, gemma
   and Mistral are gated: accept their licences on the hub first).

After a GPU lock replaced torch, restart the session (Runtime → Restart session) before importing
torch in this notebook. Neither lock has been run on Colab by this repository yet (docs/gpu.md).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from packaging.version import Version

from memtoc.core.io import write_json
from memtoc.core.project import bundled_resources
from memtoc.generation.hardware import choose_lock, driver_version

#: what the Colab kernel runs on: never installed over
KERNEL_PACKAGES = frozenset({
    "ipykernel", "ipython", "ipython-pygments-lexers", "jupyter", "jupyter-client", "jupyter-core",
    "jupyter-server", "jupyterlab", "notebook", "nbformat", "nbclient", "tornado", "traitlets", "pyzmq",
    "comm", "debugpy", "matplotlib-inline", "prompt-toolkit", "jedi", "parso", "decorator", "pexpect",
})
#: Colab's CUDA build of torch and what comes with it: kept on a CPU runtime, replaced by a GPU lock's
GPU_STACK = frozenset({"torch", "torchvision", "torchaudio", "triton", "nvidia-*"})
#: packages of the Colab image that break memtoc's stack below a version: (name, first good version, why).
#: The set-up removes them (memtoc needs none of them).
INCOMPATIBLE = (
    ("torchao", "0.16.0", "peft 0.21 raises ImportError ('Found an incompatible version of torchao') below 0.16 "
                          "whenever it creates a LoRA layer: 04 and 06 training, adapter merging, gpucheck's DPO step"),
)
DRIVE_ROOT = Path("/content/drive/MyDrive")
INSTALL_RECORD = "colab-install.json"   # what the set-up installed and replaced, and pip check's report
HUB_FOLDER = "hub"          # the project's Hugging Face hub cache when it is kept on Drive
LOCAL_ROOT = Path("/content")


@dataclass(frozen=True)
class Layout:
    """Where memtoc keeps its project, models and data on this Colab runtime."""

    project: Path
    model_cache: Path
    data: Path
    on_drive: bool

    def environment(self) -> dict[str, str]:
        return {"MEMTOC_HOME": str(self.project), "MEMTOC_MODEL_CACHE": str(self.model_cache),
                "MEMTOC_DATA_DIR": str(self.data)}


def on_colab(modules: Optional[dict] = None) -> bool:
    return "google.colab" in (sys.modules if modules is None else modules)


def _name(req: str) -> str:
    return re.split(r"[=<>!\[ ;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _among(name: str, names: Iterable[str]) -> bool:
    return any(name == k or (k.endswith("*") and name.startswith(k[:-1])) for k in names)


def install_plan(lock_lines: Iterable[str], installed: dict[str, str], keep_gpu_stack: bool = True) -> list[str]:
    """The ``name==version`` pins of the lock to install on top of the image: the kernel's packages
    left out, Colab's torch and CUDA libraries left out when ``keep_gpu_stack``, pins the image already
    satisfies left out."""
    out = []
    for line in lock_lines:
        line = line.split("#", 1)[0].strip()
        if not line or "==" not in line:
            continue
        name, version = _name(line), line.split("==", 1)[1].split(";", 1)[0].strip()
        if _among(name, KERNEL_PACKAGES) or (keep_gpu_stack and _among(name, GPU_STACK)) \
                or installed.get(name) == version:
            continue
        out.append(f"{name}=={version}")
    return out


def replacements(pins: Iterable[str], installed: dict[str, str]) -> list[tuple[str, str, str]]:
    """``(name, the image's version, the lock's version)`` of each pin that replaces a package the image
    already has (pure)."""
    out = []
    for pin in pins:
        name, want = _name(pin), pin.split("==", 1)[1]
        if name in installed and installed[name] != want:
            out.append((name, installed[name], want))
    return out


def pip_check() -> list[str]:
    """The broken requirements ``pip check`` reports for the kernel's Python (empty: none)."""
    r = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    return [] if r.returncode == 0 else [line for line in r.stdout.splitlines() if line.strip()]


def incompatible(installed: dict[str, str]) -> list[tuple[str, str, str]]:
    """``(name, installed version, why)`` of each installed package of :data:`INCOMPATIBLE` below its first
    good version (pure)."""
    out = []
    for name, good, why in INCOMPATIBLE:
        have = installed.get(name)
        if have is not None and Version(have) < Version(good):
            out.append((name, have, why))
    return out


def colab_lock(driver: Optional[str], python: Optional[str] = None) -> tuple[str, bool, str]:
    """(lock file, keep Colab's torch, why) for a runtime whose NVIDIA driver is ``driver`` (None: a
    CPU runtime) and whose Python is ``python`` (default the running one): the GPU lock
    :func:`memtoc.generation.hardware.choose_lock` picks, with its own torch; else ``requirements/cpu.lock``
    on Colab's torch."""
    choice = choose_lock(driver, python=python)
    if choice.lock is None:
        return "requirements/cpu.lock", True, choice.reason
    return choice.lock, False, choice.reason


def layout(drive_mounted: bool) -> Layout:
    root = (DRIVE_ROOT if drive_mounted else LOCAL_ROOT) / "memtoc"
    return Layout(root, root / "models", root / "release", drive_mounted)


def hub_token(get_secret: Callable[[str], Any]) -> Optional[str]:
    """The ``HF_TOKEN`` Colab secret, or None when it is not set or not shared with this notebook."""
    try:
        token = get_secret("HF_TOKEN")
    except Exception:          # google.colab.userdata raises its own SecretNotFoundError / NotebookAccessError
        return None
    return token or None


def installed_versions() -> dict[str, str]:
    return {_name(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}


def setup(run: Callable[[list[str]], Any] = None, get_secret: Optional[Callable[[str], Any]] = None,
          drive_mounted: Optional[bool] = None, login: Optional[Callable[[str], Any]] = None,
          log: Callable[[str], Any] = print, driver: Optional[str] = "ask",
          hub_cache_on_drive: bool = False, check: Callable[[], list[str]] = pip_check) -> Optional[Layout]:
    """Everything after memtoc itself is installed (see the module docstring); None off Colab.
    ``driver``: the NVIDIA driver version (default: ask ``nvidia-smi``; None: a CPU runtime).
    ``hub_cache_on_drive``: with Drive mounted, the project records ``<project>/hub`` as the Hugging Face
    hub cache, so the paper models' weights are downloaded once and kept on Drive (about 80 GB for the five
    models: more than Drive's free 15 GB); otherwise they go to the VM and are downloaded again in every
    session. What the install replaced, and what ``pip check`` then reports broken among Colab's own
    packages (``check``), is said and kept in ``<project>/colab-install.json``."""
    if not on_colab():
        log("not on Colab: nothing to set up (install with `make install` or pip, docs/gpu.md)")
        return None
    run = run or (lambda cmd: subprocess.run(cmd, check=True))
    lock_name, keep_torch, why = colab_lock(driver_version() if driver == "ask" else driver)
    log(f"{lock_name}: {why}")
    lock = (bundled_resources() / lock_name).read_text().splitlines()
    installed = installed_versions()
    for name, have, breaks in incompatible(installed):
        log(f"removing {name} {have}: {breaks}")
        run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", name])
    pins = install_plan(lock, installed, keep_gpu_stack=keep_torch)
    replaced = replacements(pins, installed)
    if replaced:
        log(f"replacing {len(replaced)} of the image's packages with the lock's versions: "
            + ", ".join(f"{n} {have} -> {want}" for n, have, want in replaced))
    if pins:
        log(f"installing {len(pins)} packages the image lacks (the kernel's own packages "
            + ("and Colab's torch left as they are)" if keep_torch else "left as they are; torch replaced by the "
               "lock's" + ("; this kernel has imported torch: restart the session (Runtime -> Restart session) "
                           "before using torch in this notebook)" if "torch" in sys.modules else
                           "; `!memtoc ...` commands run in new processes and need no restart)")))
        run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *pins])
    where = layout(DRIVE_ROOT.is_dir() if drive_mounted is None else drive_mounted)
    os.environ.update(where.environment())
    # the folder records where its release and models are (memtoc-paths.json): a restarted kernel or a
    # new session started in it finds them without the environment set here
    hub = ["--hub-cache", HUB_FOLDER] if hub_cache_on_drive and where.on_drive else []
    if hub_cache_on_drive and not where.on_drive:
        log("hub cache on Drive asked for, but Drive is not mounted: the weights go to the VM's hub cache")
    run([sys.executable, "-m", "memtoc", "init", str(where.project), "--data-dir", "release",
         "--model-cache", "models", *hub])
    broken = check() if pins else []
    ours = {_name(p) for p in pins}
    mine = [line for line in broken if _name(line) in ours]       # a package the lock just installed
    image = [line for line in broken if _name(line) not in ours]
    if image:
        log(f"after the install, pip check reports {len(image)} broken requirement(s) of the image's own packages "
            "(memtoc does not use them; a notebook that does may fail): " + "; ".join(image))
    if mine:
        log(f"after the install, pip check reports {len(mine)} broken requirement(s) of packages the lock installed "
            "(next to a package the set-up keeps, such as the kernel's): " + "; ".join(mine))
    if where.project.is_dir():
        write_json(where.project / INSTALL_RECORD, {
            "lock": lock_name, "reason": why, "installed": pins, "replaced": [list(r) for r in replaced],
            "pip_check": broken})
    run([sys.executable, "-m", "memtoc", "data", "fetch"])
    token = hub_token(get_secret) if get_secret else None
    if token and login:
        login(token)
    log(f"memtoc project: {where.project} (run memtoc from it: %cd {where.project})"
        + ("" if where.on_drive else " (not on Drive: mount it to keep outputs)")
        + ("; logged in to the hub" if token and login else "; no HF_TOKEN secret: gated models will not download"))
    return where
