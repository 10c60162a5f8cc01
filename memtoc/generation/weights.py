"""Where prepared models live and the hashes that identify their weights (every cache key carries them).

``weights_hash(path)`` is the sha256 over a model directory's weight files, computed once and stored as
``weights.sha256.json`` beside the weights (or under ``<model cache>/_hashes/``); ``adapter_hash`` the
same for a peft LoRA directory. Used by memtoc.generation.models (preparation, ``load_generator``) and the backends.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from memtoc.core.errors import MemtocError
from memtoc.core.io import sha256_file
from memtoc.core.project import project_paths

HASH_FILE = "weights.sha256.json"


class ModelError(MemtocError):
    """Unknown model, missing weights or a model that cannot be prepared."""


def model_cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("MEMTOC_MODEL_CACHE"):
        return Path(os.environ["MEMTOC_MODEL_CACHE"]).expanduser()
    return project_paths().get("model_cache") or Path("~/.cache/memtoc/models").expanduser()


def hub_cache_dir() -> Optional[Path]:
    """Where hub downloads of the paper models go: None (the hub's own choice) when ``$HF_HUB_CACHE`` or
    ``$HF_HOME`` is set, else the project's recorded ``hub_cache`` (``memtoc-paths.json``), else None."""
    if os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME"):
        return None
    return project_paths().get("hub_cache")


def weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    return files


def hash_dir_files(files: list[Path]) -> dict[str, Any]:
    per = {f.name: sha256_file(f) for f in files}
    total = hashlib.sha256("".join(f"{k}:{v}\n" for k, v in sorted(per.items())).encode()).hexdigest()
    return {"weights_sha256": total, "files": per}


def weights_hash(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """sha256 over the weight files of a model directory, computed once and stored.

    Stored as ``weights.sha256.json`` beside the weights when the folder is writable, else under
    ``<model cache>/_hashes/``. For a Hugging Face hub snapshot the blob names (the LFS sha256 of
    each file) are used, so nothing is re-read.
    """
    path = Path(path)
    files = weight_files(path)
    if not files:
        raise ModelError(f"{path}: no *.safetensors (or *.bin) weight files; run "
                         "`memtoc model prepare NAME` or point at a complete model directory")
    if all(f.is_symlink() and re.fullmatch(r"[0-9a-f]{64}", Path(os.readlink(f)).name) for f in files):
        per = {f.name: Path(os.readlink(f)).name for f in files}
        return hashlib.sha256("".join(f"{k}:{v}\n" for k, v in sorted(per.items())).encode()).hexdigest()
    stamp = {f.name: [f.stat().st_size, int(f.stat().st_mtime)] for f in files}
    candidates = [path / HASH_FILE,
                  model_cache_root(cache_dir) / "_hashes" /
                  (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32] + ".json")]
    for c in candidates:
        if c.is_file():
            try:
                d = json.loads(c.read_text())
                if d.get("stamp") in (None, stamp) and set(d.get("files", {})) == set(stamp):
                    return d["weights_sha256"]
            except (ValueError, KeyError):
                pass
    d = hash_dir_files(files)
    d["stamp"] = stamp
    for c in candidates:
        try:
            c.parent.mkdir(parents=True, exist_ok=True)
            tmp = c.with_suffix(".tmp%d" % os.getpid())
            tmp.write_text(json.dumps(d, indent=1))
            os.replace(tmp, c)
            break
        except OSError:
            continue
    return d["weights_sha256"]


def adapter_hash(adapter: str | os.PathLike) -> str:
    p = Path(adapter)
    files = sorted([*p.glob("adapter_model.safetensors"), *p.glob("adapter_model.bin"),
                    *p.glob("adapter_config.json")])
    if not files:
        raise ModelError(f"adapter {p}: no adapter_model.safetensors/adapter_config.json; an adapter "
                         "must be a peft LoRA directory (as written by memtoc.stages.finetune)")
    return hash_dir_files(files)["weights_sha256"]
