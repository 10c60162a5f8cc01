"""The agent runtimes' reply caches: one look-up path for every kind of reply.

Free turns of the in-process runtime are cached by the generator itself
(``Generator.generate(cache_path=...)``); schema-constrained calls (``constrained.jsonl``) and server
replies (``generations_openai.jsonl``) go through :class:`ReplyCache`, which reads with the same
helper (``backends.base.lookup``: every ``*.jsonl`` of the cache folder, by key) and writes with the
same append-only writer (``cache.append_records``). Keys are ``cache.request_key(identity, prompt)``,
as before the runtimes shared this module, so cache files written earlier are still read.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterable, Optional

from memtoc.generation import cache as _cache
from memtoc.generation.backends.base import lookup

#: file names inside ``agent/<model>/cache/`` (one name per reply kind)
FREE_FILE = "generations.jsonl"
CONSTRAINED_FILE = "constrained.jsonl"
SERVER_FILE = "generations_openai.jsonl"


def constrained_key(generator_identity: dict, library: dict, json_options: dict, schema: dict, max_tokens: int,
                    tie_margin: float, text: str) -> str:
    """The cache key of a schema-constrained call: what the decoded arguments depend on."""
    ident = {"generator": generator_identity, "constrained": library, "json_options": json_options, "schema": schema,
             "max_tokens": int(max_tokens), "tie_margin": tie_margin}
    return _cache.request_key(ident, text)


def server_key(identity: dict, body: dict) -> str:
    """The cache key of a server request: the runtime's identity and the request body."""
    return _cache.request_key(identity, _cache.canonical_json(body))


class ReplyCache:
    """One cache file (``None``: no caching); thread-safe writes (the server runtime posts in threads)."""

    def __init__(self, path: Optional[Path]):
        self.path = None if path is None else Path(path)
        self._lock = threading.Lock()

    def get_many(self, keys: Iterable[str]) -> dict[str, dict]:
        """The cached records among ``keys`` (every cache file of the folder is read once)."""
        if self.path is None:
            return {}
        known = lookup([self.path])
        return {k: known[k] for k in keys if k in known}

    def get(self, key: str) -> Optional[dict]:
        return self.get_many([key]).get(key)

    def put(self, records: list[dict[str, Any]]) -> None:
        if self.path is None or not records:
            return
        with self._lock:
            _cache.append_records(self.path, records)
