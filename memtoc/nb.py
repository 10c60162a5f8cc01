"""Notebook glue: every numbered notebook starts with

    # parameters            (cell tagged "parameters")
    params_file = "params/smoke.yaml"

    import memtoc.nb
    cfg = memtoc.nb.setup(globals())

papermill may inject ``params_file`` and/or any key of ``memtoc.config.DEFAULTS``; injected keys
override the file. ``setup`` validates the result, moves the working directory to the repository
root (so relative paths in params work the same under papermill and Jupyter), creates the run
directory and returns the run's ``memtoc.runconfig.RunConfig`` (attributes such as ``cfg.models``,
``cfg.paths.summary("evaluation")``; ``cfg.run_dir`` a Path and ``cfg.release_dir`` made absolute,
resolved against the starting working directory). It still reads like the flat dict (``cfg["models"]``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .config import DEFAULTS, REPO_ROOT, resolve_release_dir
from .runconfig import RunConfig


def setup(g: dict[str, Any]) -> RunConfig:
    injected = {k: g[k] for k in DEFAULTS if k in g}
    params_file = g.get("params_file")
    if params_file and not Path(params_file).is_absolute():
        params_file = REPO_ROOT / params_file
    cfg = RunConfig.load(params_file, overrides=injected)
    # a relative release_dir / $MEMTOC_RELEASE means the working directory the notebook was started
    # from (`memtoc run` passes an absolute one): resolve it before moving to the repository root
    cfg = cfg.replace(release_dir=str(resolve_release_dir(cfg.release_dir)))
    os.chdir(REPO_ROOT)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    return cfg
