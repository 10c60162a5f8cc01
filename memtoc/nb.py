"""Notebook glue: every numbered notebook starts with

    # parameters            (cell tagged "parameters")
    params_file = "params/smoke.yaml"

    import memtoc.nb
    P = memtoc.nb.setup(globals())

papermill may inject ``params_file`` and/or any key of ``memtoc.config.DEFAULTS``; injected keys
override the file. ``setup`` validates the result, moves the working directory to the repository
root (so relative paths in params work the same under papermill and Jupyter), creates the run
directory and returns the resolved parameter dict (with ``P["run_dir"]`` added as a Path and
``P["release_dir"]`` made absolute, resolved against the starting working directory).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .config import DEFAULTS, REPO_ROOT, load_params, resolve_release_dir, run_dir


def setup(g: dict[str, Any]) -> dict[str, Any]:
    injected = {k: g[k] for k in DEFAULTS if k in g}
    params_file = g.get("params_file")
    if params_file and not Path(params_file).is_absolute():
        params_file = REPO_ROOT / params_file
    P = load_params(params_file, overrides=injected)
    # a relative release_dir / $MEMTOC_RELEASE means the working directory the notebook was started
    # from (`memtoc run` passes an absolute one): resolve it before moving to the repository root
    P["release_dir"] = str(resolve_release_dir(P.get("release_dir")))
    os.chdir(REPO_ROOT)
    rd = run_dir(P)
    rd.mkdir(parents=True, exist_ok=True)
    P["run_dir"] = rd
    return P
