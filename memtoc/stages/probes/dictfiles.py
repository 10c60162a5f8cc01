"""Released dictionaries named in ``probes.sae_files`` by address: a URL or
``hf://<owner>/<repo>[@<revision>]/<folder>`` of one dictionary in any layout
:func:`memtoc.stages.probes.dictionaries.load_sae` reads (GemmaScope's ``params.npz``, sae-lens's
``cfg.json`` + ``sae_weights.safetensors``, Llama Scope's ``hyperparams.json`` +
``checkpoints/final.safetensors``; the first layout whose files the address serves).

The files are downloaded once into ``<model cache>/dictionaries/<key>/`` (key: sha256 of the address,
16 hex digits) with a record ``source.json`` = ``{url, layout, files: {name: sha256}}``; a reuse checks
every file against the record, so a changed or truncated cache is an error. A local path is read as
it is (hash recorded too). The record goes into ``summaries/probes.json`` (``sae/layers/<l>``).
"""
from __future__ import annotations

import hashlib
import json
import urllib.error
from pathlib import Path
from typing import Any

from memtoc.core.io import sha256_file
from memtoc.stages.probes.dictionaries import (
    CFG_FILE,
    GEMMASCOPE_FILE,
    LLAMASCOPE_CFG,
    LLAMASCOPE_WEIGHTS,
    WEIGHTS_FILE,
    SAEError,
)
from memtoc.stages.probes.lensfiles import fetch, to_url

RECORD = "source.json"
#: the layouts in the order an address is tried, with the files each needs
LAYOUTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gemmascope", (GEMMASCOPE_FILE,)),
    ("sae-lens", (CFG_FILE, WEIGHTS_FILE)),
    ("llama-scope", (LLAMASCOPE_CFG, LLAMASCOPE_WEIGHTS)),
)


def resolve(entry: Any, cache_root: Path, where: str) -> tuple[Path, dict[str, Any]]:
    """(local folder or file to read, record) of one ``sae_files`` value."""
    if not isinstance(entry, str) or not entry:
        raise SAEError(f"{where}: {entry!r}; give a folder, a URL or hf://<owner>/<repo>[@<revision>]/<folder>")
    url = to_url(entry)
    if url is None:
        path = Path(entry).expanduser()
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
        if not files:
            raise SAEError(f"{where}: {path} does not exist; give a dictionary folder or file, or its address")
        return path, {"file": str(path), "url": None,
                      "files": {str(p.relative_to(path)) if p != path else p.name: sha256_file(p) for p in files}}
    url = url.rstrip("/")
    folder = cache_root / "dictionaries" / hashlib.sha256(url.encode()).hexdigest()[:16]
    record = folder / RECORD
    if record.is_file():
        rec = json.loads(record.read_text())
        for name, want in rec["files"].items():
            got = sha256_file(folder / name) if (folder / name).is_file() else None
            if got != want:
                raise SAEError(f"{where}: cached {folder / name} has sha256 {got}, but {record} recorded {want} when "
                               f"it was downloaded from {url}; delete {folder} to download it again")
        return folder, {"file": str(folder), **rec}
    return folder, download(url, folder, where)


def download(url: str, folder: Path, where: str) -> dict[str, Any]:
    """The first layout of :data:`LAYOUTS` whose files ``url`` serves, into ``folder``, and its record."""
    tried = []
    for layout, names in LAYOUTS:
        files: dict[str, str] = {}
        try:
            for name in names:
                files[name] = fetch(f"{url}/{name}", folder / name)
        except urllib.error.HTTPError as e:
            tried.append(f"{layout} ({names[len(files)]}: HTTP {e.code})")
            for name in files:
                (folder / name).unlink(missing_ok=True)
            continue
        except OSError as e:
            raise SAEError(f"{where}: downloading {url} failed ({e}); check the address or give a local folder") from None
        rec = {"url": url, "layout": layout, "files": files}
        (folder / RECORD).write_text(json.dumps(rec, indent=1))
        return {"file": str(folder), **rec}
    raise SAEError(f"{where}: {url} serves no dictionary layout memtoc reads; tried {', '.join(tried)}")
