"""The ``judge`` block (PROTOCOL §4b, the judged layer; ``null`` = no judge).

At the bottom layer (it imports only ``memtoc.core.vocab``): ``memtoc.config.params.validate_params`` fills the
block's defaults with it, and ``memtoc.config.blocks`` exports it beside the stage blocks."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, NoReturn, Optional

from memtoc.core.vocab import BACKENDS, Backend

EXAMPLE = "e.g. judge: {model: smollm2-135m-instruct, backend: transformers}"


@dataclass(frozen=True)
class JudgeConfig:
    """The ``judge`` block: the judge model and how it generates."""
    model: str
    backend: Backend = "transformers"
    backend_options: dict = field(default_factory=dict)
    max_new_tokens: int = 32

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def resolve(cls, j: Any, fail: Callable[[str, str], NoReturn]) -> Optional["JudgeConfig"]:
        """The block with its defaults, or None for ``null``; ``fail(field, message)`` raises."""
        if j is None:
            return None
        if not isinstance(j, dict):
            fail("judge", f"must be null (no judged layer) or a mapping with a model; {EXAMPLE}")
        unknown = sorted(set(j) - set(cls.keys()))
        if unknown:
            fail("judge", f"unknown key(s) {unknown}; valid keys are: {', '.join(cls.keys())}")
        if not isinstance(j.get("model"), str) or not j["model"]:
            fail("judge.model", f"must be a registry model name or a local HF directory; {EXAMPLE}")
        given = {k: v for k, v in j.items() if v is not None or k != "backend_options"}
        out = cls(**given)
        if out.backend not in BACKENDS:
            fail("judge.backend", f"must be one of {', '.join(BACKENDS)}, got {out.backend!r}")
        if not isinstance(out.backend_options, dict):
            fail("judge.backend_options", "must be a mapping (e.g. {base_url: ..., api_key: ...} for openai)")
        mnt = out.max_new_tokens
        if not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 1:
            fail("judge.max_new_tokens", f"must be a positive integer, got {mnt!r}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
