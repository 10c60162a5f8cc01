"""Where memtoc finds its project files and writes its outputs: the one place that decides it.

The project root holds ``params/*.yaml``, ``notebooks/NN_*.ipynb``, ``paper/claims.yaml``,
``requirements/*.lock`` and (relative output roots) ``outputs/``. It is, in this order:

1. ``$MEMTOC_HOME``, when set;
2. the clone, when memtoc runs from a source checkout (``pip install -e .``): the folder above the
   package, which holds ``pyproject.toml``, ``params/`` and ``notebooks/`` (the layout of the repository);
3. otherwise (memtoc installed from a wheel: ``pip install .``, ``pip install git+URL``, Colab): the
   nearest folder, from the working directory upwards, that holds ``params/`` and ``notebooks/``
   (a project folder made by ``memtoc init DIR``; a notebook opened in ``DIR/notebooks`` finds
   ``DIR``), and failing that the working directory itself. Never the installed package's folder.

The root is decided once, when memtoc is imported (:data:`REPO_ROOT`). A wheel carries
the project files under ``memtoc/_resources/`` (``bundled_resources``); ``memtoc init DIR``
(``memtoc.cli.init``) copies them into a project folder.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

HOME_ENV = "MEMTOC_HOME"
PACKAGE_DIR = Path(__file__).resolve().parent.parent    # memtoc/ (this file is memtoc/core/project.py)
SOURCE_ROOT = PACKAGE_DIR.parent                  # the clone, for a source checkout
RESOURCES_DIR = PACKAGE_DIR / "_resources"        # the project files inside a wheel
# what a project folder holds (relative paths; folders end in "/"), what a wheel bundles
PROJECT_FILES: tuple[str, ...] = ("notebooks/", "params/", "paper/claims.yaml", "paper/published/",
                                  "requirements/cpu.lock", "requirements/gpu.lock",
                                  "requirements/gpu-cu12.lock", "requirements/vllm-cpu.lock", "docs/departures.md")


def is_project_dir(path: Path) -> bool:
    """A folder with ``params/`` and ``notebooks/`` (a clone or a ``memtoc init`` folder)."""
    return (path / "params").is_dir() and (path / "notebooks").is_dir()


def is_source_checkout() -> bool:
    """True when the package is imported from a clone of the repository (an editable install)."""
    return (SOURCE_ROOT / "pyproject.toml").is_file() and is_project_dir(SOURCE_ROOT)


def find_project(start: Path) -> Optional[Path]:
    """The nearest folder from ``start`` upwards that is a project folder (None: none is)."""
    start = start.resolve()
    for d in (start, *start.parents):
        if is_project_dir(d):
            return d
    return None


def project_root(cwd: Optional[Path] = None) -> Path:
    """The project root (rules in the module docstring); ``cwd`` defaults to the working directory."""
    home = os.environ.get(HOME_ENV)
    if home:
        return Path(home).expanduser().resolve()
    if is_source_checkout():
        return SOURCE_ROOT
    here = Path(cwd) if cwd is not None else Path.cwd()
    return find_project(here) or here.resolve()


def bundled_resources() -> Optional[Path]:
    """Where the shipped project files are: the clone itself, or the wheel's ``memtoc/_resources/``
    (None: neither, e.g. a wheel built without them)."""
    if is_source_checkout():
        return SOURCE_ROOT
    if RESOURCES_DIR.is_dir():
        return RESOURCES_DIR
    return None


# the project root: the clone, or a `memtoc init` folder for an installed wheel
REPO_ROOT = project_root()
