"""``memtoc init DIR [--force]``: make a project folder for an installed memtoc.

Copies the shipped ``notebooks/``, ``params/``, ``paper/claims.yaml``, ``paper/published/`` and
``requirements/*.lock`` (``memtoc.core.project.PROJECT_FILES``) into ``DIR``. Run memtoc from ``DIR`` (or
set ``MEMTOC_HOME=DIR``): params, notebooks and ``outputs/`` are then ``DIR``'s, never the installed
package's folder::

    pip install git+https://github.com/<owner>/memtoc     # or: pip install .
    memtoc init memtoc-work && cd memtoc-work
    memtoc run params/smoke.yaml

Existing files are kept when identical; a differing one stops the copy (``--force`` overwrites).
``--data-dir DIR`` / ``--model-cache DIR`` / ``--hub-cache DIR`` record where the folder's release copies,
prepared models and Hugging Face hub downloads live (``memtoc-paths.json``; a relative path is taken from
the project folder), so that memtoc finds them from the folder without ``MEMTOC_DATA_DIR`` /
``MEMTOC_MODEL_CACHE`` / ``HF_HUB_CACHE`` (Colab: after a restart or in a new session).
"""
from __future__ import annotations

import argparse
import filecmp
import shutil
from pathlib import Path

from memtoc.core.errors import ConfigError
from memtoc.core.project import PROJECT_FILES, bundled_resources, project_paths, write_project_paths

_SKIP_PARTS = (".ipynb_checkpoints", "__pycache__")


def project_files(src: Path) -> list[str]:
    """The relative paths of the files to copy from ``src`` (a clone or ``memtoc/_resources``)."""
    out: list[str] = []
    for rel in PROJECT_FILES:
        p = src / rel
        if rel.endswith("/") and p.is_dir():
            out += sorted(str(f.relative_to(src)) for f in p.rglob("*")
                          if f.is_file() and not any(s in f.parts for s in _SKIP_PARTS) and f.suffix != ".pyc")
        elif p.is_file():
            out.append(rel)
    return out


def init_project(dest: Path, force: bool = False) -> list[str]:
    """Copy the project files into ``dest``; returns the relative paths written."""
    src = bundled_resources()
    if src is None:
        raise ConfigError("this memtoc installation carries no project files (memtoc/_resources is missing); "
                          "reinstall it from a wheel built by `pip wheel .` or `pip install git+URL`, or clone "
                          "the repository")
    dest = Path(dest).expanduser().resolve()
    if dest == src.resolve():
        raise ConfigError(f"{dest} is where the project files come from; choose another folder")
    if dest.exists() and not dest.is_dir():
        raise ConfigError(f"{dest} exists and is not a folder; choose a new or existing folder")
    files = project_files(src)
    differ = [f for f in files if (dest / f).is_file() and not filecmp.cmp(src / f, dest / f, shallow=False)]
    if differ and not force:
        raise ConfigError(f"{dest}: {len(differ)} file(s) differ from the shipped ones ({', '.join(differ[:5])}"
                          + (" …" if len(differ) > 5 else "") + "); keep your edits (choose another folder) "
                          "or overwrite them with `memtoc init --force`")
    written = []
    for f in files:
        if (dest / f).is_file() and f not in differ:
            continue
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / f, dest / f)
        written.append(f)
    (dest / "outputs").mkdir(parents=True, exist_ok=True)
    return written


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="memtoc init", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="the project folder to create or fill, e.g. memtoc-work")
    ap.add_argument("--force", action="store_true", help="overwrite files that differ from the shipped ones")
    ap.add_argument("--data-dir", default=None, help="record where this project's release copies live "
                    "(memtoc-paths.json; relative to the project folder)")
    ap.add_argument("--model-cache", default=None, help="record where this project's prepared models live")
    ap.add_argument("--hub-cache", default=None, help="record where this project's Hugging Face hub downloads "
                    "(the paper models' weights) go, e.g. a folder on Google Drive")
    a = ap.parse_args(argv)
    written = init_project(Path(a.dir), force=a.force)
    dest = Path(a.dir).expanduser().resolve()
    if a.data_dir or a.model_cache or a.hub_cache:
        f = write_project_paths(dest, data_dir=a.data_dir, model_cache=a.model_cache, hub_cache=a.hub_cache)
        print(f"memtoc init: {f} records " + ", ".join(f"{k} {v}" for k, v in project_paths(dest).items()))
    print(f"memtoc init: {len(written)} file(s) written to {dest}; next: cd {dest} && memtoc run params/smoke.yaml "
          f"(or set MEMTOC_HOME={dest})")
    return 0
