"""Colab set-up: what ``notebooks/colab_setup.ipynb`` does after it has installed memtoc itself.

On Colab only (nothing happens elsewhere):

1. installs the packages memtoc needs that the Colab image lacks, from the lock memtoc ships
   (``requirements/cpu.lock``), into the kernel's own Python, *never* replacing the packages the
   kernel runs on (jupyter, ipykernel, IPython, tornado, ...) or Colab's CUDA build of torch;
2. makes the project folder (``memtoc init``): on Google Drive when it is mounted
   (``/content/drive/MyDrive/memtoc``: outputs, the model cache and the release survive the session),
   else ``/content/memtoc`` (wiped when the runtime is recycled);
3. fetches and verifies the MemToC release into it (``memtoc data fetch``);
4. logs in to the Hugging Face hub with the ``HF_TOKEN`` Colab secret when one is set (Llama, gemma
   and Mistral are gated: accept their licences on the hub first).

Colab's GPU image has a CUDA 12 driver and its own torch; vLLM's locked build needs CUDA 13, so on
Colab memtoc runs the paper's models with ``backend: transformers`` (docs/gpu.md).
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

from .project import bundled_resources

#: what the Colab kernel runs on, or what Colab ships for its GPU: never installed over
KERNEL_PACKAGES = frozenset({
    "ipykernel", "ipython", "ipython-pygments-lexers", "jupyter", "jupyter-client", "jupyter-core",
    "jupyter-server", "jupyterlab", "notebook", "nbformat", "nbclient", "tornado", "traitlets", "pyzmq",
    "comm", "debugpy", "matplotlib-inline", "prompt-toolkit", "jedi", "parso", "decorator", "pexpect",
    "torch", "torchvision", "torchaudio", "triton", "nvidia-*",
})
DRIVE_ROOT = Path("/content/drive/MyDrive")
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


def _kernel(name: str) -> bool:
    return any(name == k or (k.endswith("*") and name.startswith(k[:-1])) for k in KERNEL_PACKAGES)


def install_plan(lock_lines: Iterable[str], installed: dict[str, str]) -> list[str]:
    """The ``name==version`` pins of the lock to install on top of the image: kernel and GPU packages
    left out, pins the image already satisfies left out."""
    out = []
    for line in lock_lines:
        line = line.split("#", 1)[0].strip()
        if not line or "==" not in line:
            continue
        name, version = _name(line), line.split("==", 1)[1].split(";", 1)[0].strip()
        if _kernel(name) or installed.get(name) == version:
            continue
        out.append(f"{name}=={version}")
    return out


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
          log: Callable[[str], Any] = print) -> Optional[Layout]:
    """Everything after memtoc itself is installed (see the module docstring); None off Colab."""
    if not on_colab():
        log("not on Colab: nothing to set up (install with `make install` or pip, docs/gpu.md)")
        return None
    run = run or (lambda cmd: subprocess.run(cmd, check=True))
    lock = (bundled_resources() / "requirements" / "cpu.lock").read_text().splitlines()
    pins = install_plan(lock, installed_versions())
    if pins:
        log(f"installing {len(pins)} packages the image lacks (the kernel's own packages and torch left as they are)")
        run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *pins])
    where = layout(DRIVE_ROOT.is_dir() if drive_mounted is None else drive_mounted)
    os.environ.update(where.environment())
    run([sys.executable, "-m", "memtoc", "init", str(where.project)])
    run([sys.executable, "-m", "memtoc", "data", "fetch"])
    token = hub_token(get_secret) if get_secret else None
    if token and login:
        login(token)
    log(f"memtoc project: {where.project}" + ("" if where.on_drive else " (not on Drive: mount it to keep outputs)")
        + ("; logged in to the hub" if token and login else "; no HF_TOKEN secret: gated models will not download"))
    return where
