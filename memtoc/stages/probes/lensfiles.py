"""Published Jacobian lenses named in ``probes.lens_files``: a local file, a URL, a Hugging Face
file ``hf://<owner>/<repo>[@<revision>]/<path>`` (``<HF_ENDPOINT>/<owner>/<repo>/resolve/<revision or
main>/<path>``; ``HF_ENDPOINT`` defaults to https://huggingface.co), or ``published``: the model's own
published lens (``models.ModelSpec.jacobian_lens``, Neuronpedia's release of the wikitext-fitted
lenses for Llama-3.1-8B-Instruct, Qwen2.5-7B-Instruct and gemma-2-9b-it).

A URL is downloaded once into ``<model cache>/lenses/<key>/<file name>`` (key: sha256 of the URL,
first 16 hex digits) beside a record ``source.json`` = ``{url, sha256, bytes}``; later runs reuse the
file after checking its sha256 against the record, so a file changed or truncated in the cache is an
error, not a silent different lens. An entry may pin the hash itself: ``{url: ..., sha256: ...}`` (a
download or a cached copy with another hash is an error). The record goes into
``summaries/probes.json`` (``models/<model>/lens_fit``).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from memtoc.core.io import sha256_file
from memtoc.generation.models import REGISTRY
from memtoc.stages.probes.lens import LensError

RECORD = "source.json"
HF_PREFIX = "hf://"
TIMEOUT_S = 60


@dataclass(frozen=True)
class LensSource:
    """Where a lens file came from: ``path`` on disk, ``url`` (None for a local file), ``sha256``."""

    path: Path
    url: Optional[str]
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"file": str(self.path), "url": self.url, "sha256": self.sha256}


def entry_url(entry: Any, where: str) -> tuple[str, Optional[str]]:
    """(name, pinned sha256 or None) of one ``lens_files`` value: a string, or ``{url, sha256}``."""
    if isinstance(entry, str) and entry:
        return entry, None
    if isinstance(entry, dict) and isinstance(entry.get("url"), str):
        pin = entry.get("sha256")
        if pin is not None and not (isinstance(pin, str) and len(pin) == 64):
            raise LensError(f"{where}.sha256: {pin!r} is not a 64-digit hex sha256")
        return entry["url"], pin.lower() if pin else None
    raise LensError(f"{where}: {entry!r}; give a path, a URL, hf://<owner>/<repo>/<path>, or {{url, sha256}}")


def published(spec, where: str) -> str:
    """The published lens of the model ``spec`` (``lens_files: published``)."""
    if not spec.jacobian_lens:
        have = sorted(s.name for s in REGISTRY.values() if s.jacobian_lens)
        raise LensError(f"{where}: {spec.name} has no published Jacobian lens (the registry has one for "
                        f"{', '.join(have)}); give a path, a URL or hf:// name, or leave it out to fit one")
    return spec.jacobian_lens


def to_url(name: str) -> Optional[str]:
    """The download URL of ``name``, None for a local path."""
    if name.startswith(HF_PREFIX):
        owner, repo, *rest = name[len(HF_PREFIX):].split("/")
        if not rest:
            raise LensError(f"{name}: expected hf://<owner>/<repo>[@<revision>]/<path in the repository>")
        repo, _, rev = repo.partition("@")
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        return f"{endpoint}/{owner}/{repo}/resolve/{rev or 'main'}/{'/'.join(rest)}"
    if name.startswith(("http://", "https://")):
        return name
    return None


def resolve(entry: Any, cache_root: Path, where: str) -> LensSource:
    """The local file of a ``lens_files`` entry, downloaded into ``cache_root/lenses`` when it is a URL
    and not cached yet; its sha256 checked against the cache record and any pinned hash."""
    name, pin = entry_url(entry, where)
    url = to_url(name)
    if url is None:
        path = Path(name).expanduser()
        if not path.is_file():
            raise LensError(f"{where}: lens file {path} does not exist; give an existing file or a URL")
        return _checked(LensSource(path, None, sha256_file(path)), pin, where)
    folder = cache_root / "lenses" / hashlib.sha256(url.encode()).hexdigest()[:16]
    path = folder / (url.rstrip("/").rsplit("/", 1)[-1].split("?")[0] or "lens.pt")
    record = folder / RECORD
    if path.is_file() and record.is_file():
        want = json.loads(record.read_text())["sha256"]
        got = sha256_file(path)
        if got != want:
            raise LensError(f"{where}: cached lens {path} has sha256 {got}, but {record} recorded {want} when it "
                            f"was downloaded from {url}; delete {folder} to download it again")
        return _checked(LensSource(path, url, got), pin, where)
    return _checked(download(url, path, where), pin, where)


def fetch(url: str, path: Path) -> str:
    """``url`` into ``path`` through a temporary file, then one rename; its sha256. Raises OSError
    (urllib's HTTPError for a missing file) and leaves no partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    sha = sha256_file(tmp)
    os.replace(tmp, path)
    return sha


def download(url: str, path: Path, where: str) -> LensSource:
    """``url`` into ``path`` and its record beside it."""
    try:
        sha = fetch(url, path)
    except OSError as e:
        raise LensError(f"{where}: downloading {url} failed ({e}); check the address or give a local file") from None
    (path.parent / RECORD).write_text(json.dumps({"url": url, "sha256": sha, "bytes": path.stat().st_size}, indent=1))
    return LensSource(path, url, sha)


def _checked(src: LensSource, pin: Optional[str], where: str) -> LensSource:
    if pin and src.sha256 != pin:
        raise LensError(f"{where}.sha256: {src.path} has sha256 {src.sha256}, the params pin {pin}; "
                        "fix the pin or the file")
    return src
