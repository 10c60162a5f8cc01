"""The backend-independent part of generation: Reply, Generator (cache look-up, batching hooks).

A backend subclasses :class:`Generator` and implements ``_generate_batches(prompts, desc)``, a
generator that yields ``(indices, replies)`` per finished batch (indices into ``prompts``). The
base class turns that into ``generate(prompts, cache_path, desc)``: cached requests are skipped,
each finished batch is appended to the cache at once.

:class:`LazyGenerator` defers loading the weights to the first cache miss: it knows the generator's
cache identity from an earlier load with the same settings (recorded per load signature), so a
rerun whose replies are all cached never loads the model.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from memtoc.core import io as _io, progress
from memtoc.core.errors import ConfigError, MemtocError
from memtoc.generation import cache as _cache


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


# A completed first line: leading blank lines skipped, then a non-empty line and its newline (the
# paper's completions default for base models, stop=["\n"], without stopping on a leading newline).
_FIRST_LINE_DONE = re.compile(r"\A\s*\S[^\n]*\n")


def first_line_done(text: str) -> bool:
    """True once ``text`` holds a complete non-empty line (leading blank lines do not count)."""
    return _FIRST_LINE_DONE.match(text) is not None


def line_stop(text: str, stop_at_final: bool, stop_at_first_line: bool) -> Optional[str]:
    """The line rule that ends a reply now ("final_line" | "first_line"), or None to go on."""
    if stop_at_final and final_line_done(text):
        return "final_line"
    if stop_at_first_line and first_line_done(text):
        return "first_line"
    return None


def truncate_reply(text: str, stop_at_final: bool, stop_at_first_line: bool) -> tuple[str, Optional[str]]:
    """``text`` cut where :func:`line_stop` would have ended it token by token, and the rule."""
    cuts = []
    if stop_at_final and (m := _FINAL_DONE.search(text)):
        cuts.append((m.end(), "final_line"))
    if stop_at_first_line and (m := _FIRST_LINE_DONE.match(text)):
        cuts.append((m.end(), "first_line"))
    if not cuts:
        return text, None
    end, rule = min(cuts)
    return text[:end], rule


CachePath = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]], None]


def cache_paths(cache_path: CachePath, n: int) -> Optional[list[Path]]:
    """One cache file per prompt (None: no cache)."""
    if cache_path is None:
        return None
    if isinstance(cache_path, (str, os.PathLike)):
        return [Path(cache_path)] * n
    paths = [Path(p) for p in cache_path]
    if len(paths) != n:
        raise ValueError(f"{len(paths)} cache paths for {n} prompts")
    return paths


def lookup(paths: Optional[Sequence[Path]]) -> dict[str, dict]:
    """Every cached record of the model folders of ``paths``, by key (the prompts' own files last)."""
    known: dict[str, dict] = {}
    for p in dict.fromkeys(paths or []):
        known.update(_cache.sibling_lookup(p))
    return known


class Generator(ABC):
    """One loaded model behind one backend (abstract). Subclasses fill ``identity`` and implement the
    batch hook :meth:`_generate_batches`; :meth:`generate` (the cache, dedup, progress) is shared."""

    backend: str = "base"

    def __init__(self, identity: dict[str, Any]):
        self.identity = identity

    # -- to implement ------------------------------------------------------------------------
    @abstractmethod
    def _generate_batches(self, prompts: list[str], desc: Optional[str]) -> Iterator[tuple[list[int], list[Reply]]]:
        """Yield (indices into ``prompts``, their Replies) batch by batch, in any order."""

    # -- public --------------------------------------------------------------------------------
    def key(self, prompt: str) -> str:
        return _cache.request_key(self.identity, prompt)

    def generate(self, prompts: list[str], cache_path: CachePath = None,
                 desc: Optional[str] = None) -> list[Reply]:
        """One Reply per prompt, same order: the one caching path of memtoc.

        ``cache_path``: one cache file for every prompt, or one per prompt (a sequence as long as
        ``prompts``: e.g. the arm file of each episode). A prompt cached in any ``*.jsonl`` of the same
        model folder is reused (and copied into its own file when it is not there yet); the others are
        generated together, deduplicated, and each new reply is appended to its prompt's file(s)
        batch by batch, so an interrupted run loses at most the batch in flight."""
        prompts = list(prompts)
        keys = [self.key(p) for p in prompts]
        paths = cache_paths(cache_path, len(prompts))
        out: list[Optional[Reply]] = [None] * len(prompts)
        own: dict[Path, dict[str, dict]] = {p: _cache.read_cache(p) for p in dict.fromkeys(paths or [])}
        known = lookup(paths)
        copied: dict[Path, list[dict]] = {}
        todo: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            rec = known.get(k)
            if rec is not None:
                out[i] = _reply_from_record(rec)
                if paths and k not in own[paths[i]]:
                    own[paths[i]][k] = rec
                    copied.setdefault(paths[i], []).append(rec)
            else:
                todo.setdefault(k, []).append(i)
        for p, recs in copied.items():
            _cache.append_records(p, recs)
        if todo:
            first = [idx[0] for idx in todo.values()]
            sub = [prompts[i] for i in first]
            ident_hash = _cache.identity_hash(self.identity)
            t0, n_done = time.time(), 0
            progress.report(desc or "generating", 0, len(sub), t0)
            for sub_idx, replies in self._generate_batches(sub, desc):
                new: dict[Path, list[dict]] = {}
                for j, r in zip(sub_idx, replies):
                    i0 = first[j]
                    r.key = keys[i0]
                    r.cached = False
                    rec = {"key": r.key, "prompt_sha256": _cache.sha256_text(prompts[i0]),
                           "text": r.text, "n_prompt_tokens": r.n_prompt_tokens,
                           "n_new_tokens": r.n_new_tokens, "seconds": round(r.seconds, 6),
                           "finish": r.finish, "identity_sha256": ident_hash,
                           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
                    for i in todo[keys[i0]]:
                        out[i] = r
                        if paths and r.key not in own[paths[i]]:
                            own[paths[i]][r.key] = rec
                            new.setdefault(paths[i], []).append(rec)
                for p, recs in new.items():
                    _cache.append_records(p, recs)
                n_done += len(sub_idx)
                progress.report(desc or "generating", n_done, len(sub), t0)
        missing = [i for i, r in enumerate(out) if r is None]
        if missing:  # a backend bug, never a user error
            raise RuntimeError(f"backend {self.backend} returned no reply for {len(missing)} prompts")
        return out  # type: ignore[return-value]

    def close(self) -> None:
        """Release resources (engines, sessions). Safe to call twice."""


class IdentityChangedError(MemtocError):
    """The loaded generator's identity differs from the one recorded for its load settings."""


class LazyGenerator(Generator):
    """A generator that loads its weights on the first cache miss.

    ``factory()`` builds the real generator; ``signature`` is everything its identity can depend on
    (model, weights and adapter hashes, load arguments, backend options, versions, device, the
    source of the backend code); ``store`` is a folder where the identity seen at the last load
    with that signature is kept (one small JSON file per signature). Without a recorded identity,
    asking for ``identity`` loads the model. After a load the real identity is recorded; if it
    differs from the recorded one after cache keys were handed out, IdentityChangedError is raised
    (those keys are void; a rerun uses the new identity).
    """

    def __init__(self, factory: Callable[[], Generator], signature: dict[str, Any], store: Optional[Path],
                 backend: str = "lazy"):
        self._factory = factory
        self._real: Optional[Generator] = None
        self._keys_given = False
        self.signature = signature
        self.signature_sha256 = _cache.identity_hash(signature)
        self._store = Path(store) / f"{self.signature_sha256}.json" if store is not None else None
        self._recorded = self._read_recorded()
        self.backend = backend

    def _read_recorded(self) -> Optional[dict]:
        if self._store is None or not self._store.is_file():
            return None
        try:
            d = json.loads(self._store.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return d.get("identity") if isinstance(d, dict) and d.get("signature") == self.signature else None

    @classmethod
    def of(cls, backend_cls: type, args: tuple, kwargs: dict[str, Any], signature: dict[str, Any],
           store: Optional[Path]) -> "LazyGenerator":
        """A lazy ``backend_cls(*args, **kwargs)``; the arguments are checked against its signature
        now (an unknown backend option fails here, not at the first cache miss)."""
        try:
            inspect.signature(backend_cls).bind(*args, **kwargs)
        except TypeError as e:
            valid = [n for n in inspect.signature(backend_cls).parameters if n not in ("spec", "path")]
            raise ConfigError(f"{backend_cls.backend} backend: {e}; its options are: {', '.join(valid)}") from None
        return cls(lambda: backend_cls(*args, **kwargs), signature, store, backend_cls.backend)

    def derived(self, factory: Callable[[], Generator], **signature: Any) -> "LazyGenerator":
        """A lazy generator built on this one (e.g. an adapter on its loaded engine), whose signature is
        this one's with ``signature`` laid over it; its identity is recorded in the same store."""
        store = self._store.parent if self._store is not None else None
        return LazyGenerator(factory, {**self.signature, **signature}, store, self.backend)

    @property
    def loaded(self) -> bool:
        return self._real is not None

    @property
    def identity(self) -> dict[str, Any]:  # type: ignore[override]
        if self._real is not None:
            return self._real.identity
        if self._recorded is not None:
            return self._recorded
        return self.load().identity

    def key(self, prompt: str) -> str:
        if self._real is None:
            self._keys_given = True
        return super().key(prompt)

    def load(self) -> Generator:
        if self._real is not None:
            return self._real
        progress.report(f"loading {self.signature.get('model', 'the model')} ({self.backend})", 0, 1, time.time(),
                        unit="model")
        self._real = self._factory()
        real = self._real.identity
        if real != self._recorded and self._store is not None:
            try:
                self._store.parent.mkdir(parents=True, exist_ok=True)
                tmp = self._store.with_name(self._store.name + f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"signature": self.signature, "identity": real}, indent=1,
                                          ensure_ascii=False, default=str))
                os.replace(tmp, self._store)
            except OSError:
                pass  # only a later rerun's laziness depends on it
        if self._recorded is not None and real != self._recorded and self._keys_given:
            raise IdentityChangedError(
                "the loaded model's cache identity differs from the one recorded for the same settings "
                f"({self._store}); the cache keys computed before loading are void. Rerun the same command.")
        return self._real

    def generate(self, prompts: list[str], cache_path: CachePath = None,
                 desc: Optional[str] = None) -> list[Reply]:
        if self._real is None and not (cache_path is not None and self._all_cached(prompts, cache_path)):
            self.load()
        return super().generate(prompts, cache_path, desc)

    def _all_cached(self, prompts: list[str], cache_path: CachePath) -> bool:
        if self._recorded is None:
            return False
        known = lookup(cache_paths(cache_path, len(prompts)))
        return all(self.key(p) in known for p in prompts)

    def _generate_batches(self, prompts: list[str], desc: Optional[str]) -> Iterator[tuple[list[int], list[Reply]]]:
        return self.load()._generate_batches(prompts, desc)

    _OWN = frozenset({"_factory", "_real", "_keys_given", "signature", "signature_sha256", "_store",
                      "_recorded", "backend"})

    def __getattr__(self, name: str) -> Any:
        # anything else (tokenizer, spec, decode_stats...) is the loaded generator's
        if name.startswith("_") or name in self._OWN:
            raise AttributeError(name)
        return getattr(self.load(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:  # e.g. bench switching decode loops: a setting of the loaded generator
            setattr(self.load(), name, value)

    def close(self) -> None:
        """Close the loaded generator and forget it: its memory is handed back, and a later cache
        miss loads the weights again."""
        if self._real is not None:
            real, self._real = self._real, None
            real.close()


_SIGNATURE_PACKAGES = ("torch", "transformers", "vllm", "peft", "accelerate")


def load_signature(backend: str, model: str, weights_sha256: str, adapter_sha256: Optional[str],
                   **load_args: Any) -> dict[str, Any]:
    """Everything a loaded generator's identity can depend on, known without loading it: the model
    and its hashes, the load arguments, the package versions, the device (CUDA or not) and the
    source of memtoc's backend code (a changed backend re-records its identity on the next load)."""
    import torch

    here = Path(__file__).resolve().parent
    code = sorted(here.rglob("*.py")) + [here.parent / f for f in ("models.py", "cache.py", "templates.py", "weights.py")]
    versions = {}
    for name in _SIGNATURE_PACKAGES:
        versions[name] = _io.package_version(name)
    return json.loads(json.dumps({
        "backend": backend, "model": model, "weights_sha256": weights_sha256, "adapter_sha256": adapter_sha256,
        "load_args": load_args, "packages": versions, "cuda": bool(torch.cuda.is_available()),
        "code_sha256": _cache.sha256_text("".join(p.read_text(encoding="utf-8") for p in code if p.is_file())),
    }, sort_keys=True, default=str))


def _reply_from_record(rec: dict) -> Reply:
    return Reply(text=rec["text"], n_prompt_tokens=int(rec.get("n_prompt_tokens", 0)),
                 n_new_tokens=int(rec.get("n_new_tokens", 0)), seconds=float(rec.get("seconds", 0.0)),
                 key=rec["key"], cached=True, finish=rec.get("finish", ""))
