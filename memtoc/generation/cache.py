"""Append-only JSONL generation cache.

One file per (model, arm): ``generations/<model_label>/<arm_key>.jsonl``. Each line is one reply:

    {"key": ..., "prompt_sha256": ..., "text": ..., "n_prompt_tokens": ..., "n_new_tokens": ...,
     "seconds": ..., "finish": ..., "identity_sha256": ..., "time": ...}

``key`` = sha256 of (generator identity, prompt, decoding settings) — see :func:`request_key`. The
generator looks every request up by key before generating, and appends each finished batch at once
(write + flush + fsync), so a killed run loses at most the batch in flight and a rerun skips the
rest. A truncated last line (a kill in the middle of a write) is ignored with a warning when
reading and cut off before the next append; a damaged line elsewhere is moved to
``<file>.rejected`` and dropped (its reply is generated again), the other lines stay. Warnings
start with "memtoc cache:" so that ``memtoc run`` can repeat them outside the notebook.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Iterable

from memtoc.core.errors import MemtocError
from memtoc.core.io import sha256_text


class CacheError(MemtocError):
    """A cache file is corrupt beyond a truncated last line."""


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def identity_hash(identity: dict) -> str:
    return sha256_text(canonical_json(identity))


def request_key(identity: dict, prompt: str | list[dict]) -> str:
    """Cache key of one request: sha256 over the generator identity (model, weights hash, adapter
    hash, decoding settings, backend) and the prompt (a user-turn string or a message list)."""
    return sha256_text(canonical_json({"identity": identity, "prompt": prompt}))


def _check_record(path: Path, lineno: int, r: Any) -> None:
    """A parsed line must be a record with a string ``key`` and ``text``; else a CacheError naming
    the file and line (valid JSON of the wrong shape is an edit, not a torn write)."""
    if not isinstance(r, dict):
        raise CacheError(f"{path}:{lineno}: a cache line must be a JSON object, got {type(r).__name__}; "
                         "delete that line to regenerate its reply")
    for field in ("key", "text"):
        if not isinstance(r.get(field), str):
            raise CacheError(f"{path}:{lineno}: cache record has no {field!r} (a string) — "
                             f"got {r.get(field)!r}; the file was edited or written by another tool. "
                             "Delete that line to regenerate its reply")


def _scan(path: Path) -> tuple[list[dict], int, list[tuple[int, bytes]]]:
    """Parse a cache file. Returns (records, byte offset of the end of the last complete line,
    damaged lines [(line number, bytes)] that are not the last line)."""
    data = path.read_bytes()
    records: list[dict] = []
    damaged: list[tuple[int, bytes]] = []
    good_end = 0
    pos = 0
    n = len(data)
    lineno = 0
    while pos < n:
        nl = data.find(b"\n", pos)
        lineno += 1
        if nl == -1:  # no newline: the last write was cut off
            tail = data[pos:]
            try:
                r = json.loads(tail)  # complete JSON, just missing its newline
            except ValueError:
                warnings.warn(f"memtoc cache: {path}: ignoring a truncated last line ({len(tail)} bytes; "
                              "a run was killed while writing); it is removed on the next append",
                              stacklevel=3)
                break
            _check_record(path, lineno, r)
            records.append(r)
            good_end = n
            warnings.warn(f"memtoc cache: {path}: last line has no newline; kept it (it parses)", stacklevel=3)
            break
        line = data[pos:nl].strip()
        if line:
            try:
                r = json.loads(line)
            except ValueError:
                if data[nl + 1:].strip():
                    damaged.append((lineno, data[pos:nl + 1]))
                else:
                    warnings.warn(f"memtoc cache: {path}: ignoring a truncated last line {lineno}", stacklevel=3)
                    break
            else:
                _check_record(path, lineno, r)
                records.append(r)
        pos = nl + 1
        good_end = pos
    return records, good_end, damaged


def rejected_path(path: Path) -> Path:
    return path.with_name(path.name + ".rejected")


def _drop_damaged(path: Path, damaged: list[tuple[int, bytes]]) -> None:
    """Move damaged lines to ``<file>.rejected`` (appended) and rewrite the file without them
    (atomically: temp file + rename). The other lines stay; only the damaged replies regenerate."""
    bad = {ln for ln, _ in damaged}
    lines = path.read_bytes().split(b"\n")
    keep = b"\n".join(x for i, x in enumerate(lines, 1) if i not in bad)
    rej = rejected_path(path)
    with open(rej, "ab") as f:
        f.write(b"".join(raw if raw.endswith(b"\n") else raw + b"\n" for _, raw in damaged))
        f.flush()
        os.fsync(f.fileno())
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    warnings.warn(f"memtoc cache: {path}: dropped {len(damaged)} damaged line(s) (line "
                  + ", ".join(str(ln) for ln, _ in damaged[:5]) + (" …" if len(damaged) > 5 else "")
                  + f"; not valid JSON) into {rej.name}; their replies are generated again", stacklevel=3)


def read_cache(path: str | os.PathLike) -> dict[str, dict]:
    """All complete records of a cache file by key (later lines win). Missing file: empty dict.

    A damaged line in the middle (not valid JSON) is moved to ``<file>.rejected`` and dropped from
    the file with a warning; a record of the wrong shape (no ``key`` or ``text``) is a CacheError."""
    path = Path(path)
    if not path.exists():
        return {}
    records, _, damaged = _scan(path)
    if damaged:
        _drop_damaged(path, damaged)
    return {r["key"]: r for r in records}


def append_records(path: str | os.PathLike, records: Iterable[dict]) -> None:
    """Append records as JSON lines and fsync. Repairs a truncated tail first."""
    path = Path(path)
    records = list(records)
    if not records:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    size = path.stat().st_size if path.exists() else 0
    if size:
        _repair_tail(path, size)
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    with open(path, "ab") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def _repair_tail(path: Path, size: int) -> None:
    """Make the file end with a complete line: a cut-off last line is removed (if it does not
    parse) or terminated (if it does). Reads only the tail, so appends stay cheap."""
    with open(path, "r+b") as f:
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return
        block = 1 << 16
        start = size
        tail = b""
        while start > 0:  # find the last newline
            step = min(block, start)
            start -= step
            f.seek(start)
            tail = f.read(step) + tail
            nl = tail.rfind(b"\n")
            if nl != -1:
                cut = start + nl + 1
                break
        else:
            cut = 0
        f.seek(cut)
        last = f.read()
        try:
            json.loads(last)
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
        except ValueError:
            f.truncate(cut)
        f.flush()
        os.fsync(f.fileno())


def sibling_lookup(path: str | os.PathLike) -> dict[str, dict]:
    """Records of every ``*.jsonl`` cache in the same folder (one model), by key.

    Used so that an identical request cached under another arm file (e.g. the no_tool episodes,
    whose prompt is the forced closed-book prompt) is reused instead of regenerated.
    """
    path = Path(path)
    out: dict[str, dict] = {}
    if not path.parent.is_dir():
        return out
    for p in sorted(path.parent.glob("*.jsonl")):
        if p == path:
            continue
        try:
            out.update(read_cache(p))
        except CacheError as e:
            warnings.warn(f"memtoc cache: skipping unreadable sibling cache: {e}", stacklevel=2)
    out.update(read_cache(path))
    return out
