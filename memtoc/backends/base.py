"""The backend-independent part of generation: Reply, Generator (cache look-up, batching hooks).

A backend subclasses :class:`Generator` and implements ``_generate_batches(prompts, desc)``, a
generator that yields ``(indices, replies)`` per finished batch (indices into ``prompts``). The
base class turns that into ``generate(prompts, cache_path, desc)``: cached requests are skipped,
each finished batch is appended to the cache at once.
"""
from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from .. import cache as _cache


@dataclass
class Reply:
    text: str
    n_prompt_tokens: int
    n_new_tokens: int
    seconds: float          # wall time of the request (a batch's time shared by its members)
    key: str                # the cache key
    cached: bool            # True when read from the cache, not generated in this call
    finish: str = ""        # eos | final_line | length | stop (backend-reported where known)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# A completed FINAL line: a marker not preceded by a quote char (the scorer ignores quoted
# mentions), then a non-empty line that is not the bare placeholder, then a newline.
_FINAL_DONE = re.compile(r"(?<!['\"\u2018\u2019\u201c\u201d`])final\s*:(?!\s*<answer>[ \t]*\n)"
                         r"\s*[^\n]*\S[^\n]*\n", re.IGNORECASE)


def final_line_done(text: str) -> bool:
    """True once ``text`` holds a FINAL marker followed by a complete non-empty answer line."""
    return _FINAL_DONE.search(text) is not None


def truncate_after_final(text: str) -> str:
    """Cut the text after the first completed FINAL line (keeps its newline)."""
    m = _FINAL_DONE.search(text)
    return text[: m.end()] if m else text


class Generator:
    """One loaded model behind one backend. Subclasses fill ``identity`` and the batch hook."""

    backend: str = "base"

    def __init__(self, identity: dict[str, Any]):
        self.identity = identity

    # -- to implement ------------------------------------------------------------------------
    def _generate_batches(self, prompts: list[str], desc: Optional[str]) -> Iterator[tuple[list[int], list[Reply]]]:
        raise NotImplementedError

    # -- public --------------------------------------------------------------------------------
    def key(self, prompt: str) -> str:
        return _cache.request_key(self.identity, prompt)

    def generate(self, prompts: list[str], cache_path: str | Path | None = None,
                 desc: Optional[str] = None) -> list[Reply]:
        """One Reply per prompt, same order. With ``cache_path``, cached replies (in that file or a
        sibling file of the same model folder) are reused and new ones appended batch by batch."""
        prompts = list(prompts)
        keys = [self.key(p) for p in prompts]
        out: list[Optional[Reply]] = [None] * len(prompts)
        own: dict[str, dict] = {}
        known: dict[str, dict] = {}
        if cache_path is not None:
            cache_path = Path(cache_path)
            own = _cache.read_cache(cache_path)
            known = _cache.sibling_lookup(cache_path)
        copied: list[dict] = []
        todo: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            rec = known.get(k)
            if rec is not None:
                out[i] = _reply_from_record(rec)
                if k not in own:
                    own[k] = rec
                    copied.append(rec)
            else:
                todo.setdefault(k, []).append(i)
        if copied and cache_path is not None:
            _cache.append_records(cache_path, copied)
        if todo:
            first = [idx[0] for idx in todo.values()]
            sub = [prompts[i] for i in first]
            ident_hash = _cache.identity_hash(self.identity)
            for sub_idx, replies in self._generate_batches(sub, desc):
                recs = []
                for j, r in zip(sub_idx, replies):
                    i0 = first[j]
                    r.key = keys[i0]
                    r.cached = False
                    for i in todo[keys[i0]]:
                        out[i] = r
                    recs.append({"key": r.key, "prompt_sha256": _cache.sha256_text(prompts[i0]),
                                 "text": r.text, "n_prompt_tokens": r.n_prompt_tokens,
                                 "n_new_tokens": r.n_new_tokens, "seconds": round(r.seconds, 6),
                                 "finish": r.finish, "identity_sha256": ident_hash,
                                 "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
                if cache_path is not None:
                    _cache.append_records(cache_path, recs)
        missing = [i for i, r in enumerate(out) if r is None]
        if missing:  # a backend bug, never a user error
            raise RuntimeError(f"backend {self.backend} returned no reply for {len(missing)} prompts")
        return out  # type: ignore[return-value]

    def close(self) -> None:
        """Release resources (engines, sessions). Safe to call twice."""


def _reply_from_record(rec: dict) -> Reply:
    return Reply(text=rec["text"], n_prompt_tokens=int(rec.get("n_prompt_tokens", 0)),
                 n_new_tokens=int(rec.get("n_new_tokens", 0)), seconds=float(rec.get("seconds", 0.0)),
                 key=rec["key"], cached=True, finish=rec.get("finish", ""))
