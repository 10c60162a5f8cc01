"""Shared fixtures and fake generators for the test suite (no model is loaded by anything here).

* ``bench``: the benchmark release, loaded once per session.
* :class:`ScriptedGenerator`: a ``memtoc.generation.backends.base.Generator`` with the real cache logic whose
  replies come from a script (a callable ``prompt -> text`` or a mapping ``substring -> text``); it
  records every prompt it was asked to generate (``seen``) and can yield in batches.
* :class:`PlainGenerator`: the bare ``generate(prompts, cache_path, desc)`` protocol with no cache
  keys (``evaluation.generate_replies`` then makes one call per cache file); it records
  ``calls = [(cache file name, number of prompts), ...]``.

Import the classes with ``from conftest import ScriptedGenerator, PlainGenerator``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Optional, Union

import pytest

from memtoc.generation.hardware import passive_openmp_waits

passive_openmp_waits()   # as memtoc's entry points do, before anything imports torch

from memtoc.data.benchmark import load_benchmark  # noqa: E402
from memtoc.generation.backends.base import Generator, Reply  # noqa: E402

Script = Union[Callable[[str], str], Mapping[str, str]]


def _answer(script: Script, prompt: str) -> str:
    if callable(script):
        return script(prompt)
    for key, text in script.items():
        if key in prompt:
            return text
    raise KeyError(f"the script has no answer for the prompt {prompt[:80]!r}")


class ScriptedGenerator(Generator):
    """A fake backend with the base class's cache logic; ``batch`` prompts per yielded batch (None:
    all at once)."""

    backend = "fake"

    def __init__(self, script: Script, name: str = "fake", identity: Optional[dict] = None,
                 batch: Optional[int] = None, n_prompt_tokens: int = 10, n_new_tokens: int = 3):
        super().__init__(identity if identity is not None else {"model": name})
        self.script, self.batch = script, batch
        self.n_prompt_tokens, self.n_new_tokens = n_prompt_tokens, n_new_tokens
        self.seen: list[str] = []

    @property
    def n_generated(self) -> int:
        return len(self.seen)

    def _generate_batches(self, prompts, desc):
        step = self.batch or max(1, len(prompts))
        for k in range(0, len(prompts), step):
            idx = list(range(k, min(k + step, len(prompts))))
            self.seen += [prompts[i] for i in idx]
            yield idx, [Reply(_answer(self.script, prompts[i]), self.n_prompt_tokens, self.n_new_tokens, 0.0, "", False)
                        for i in idx]


class PlainReply:
    def __init__(self, text: str):
        self.text, self.n_new_tokens, self.cached = text, 3, False


class PlainGenerator:
    """Only ``generate``: no ``key`` / ``identity``, so no cache keys."""

    def __init__(self, script: Script):
        self.script = script
        self.calls: list[tuple[Optional[str], int]] = []

    def generate(self, prompts, cache_path=None, desc=None):
        self.calls.append((Path(cache_path).name if cache_path else None, len(prompts)))
        return [PlainReply(_answer(self.script, p)) for p in prompts]

    def close(self) -> None:
        pass


@pytest.fixture(scope="session")
def bench():
    """The benchmark release (``$MEMTOC_RELEASE`` or ../shared/memtoc-release), loaded once."""
    return load_benchmark()


INTEGRATION_DIR = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(config, items):
    """Every test under tests/integration/ carries the ``integration`` marker (``-m "not integration"``
    runs tests/unit/ without the real-model tests there)."""
    for item in items:
        if INTEGRATION_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)
