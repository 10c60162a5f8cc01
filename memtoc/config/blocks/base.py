"""What every stage block shares: the mapping view, the defaults as a dict, reading the block from
the params file and the one error form (``<file>: field '<block>.<key>': <what is wrong and the fix>``)."""
from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any, Callable, Iterator, NoReturn

from memtoc.config.params import section_params
from memtoc.core.errors import ConfigError

Fail = Callable[[str, str], NoReturn]


class Block(Mapping):
    """Mixin of the frozen block dataclasses. ``to_dict()`` is the resolved block as the stage
    summaries record it (lists, not tuples); the mapping view (``block["key"]``, ``dict(block)``)
    reads the same values, for callers that index the block like the params file."""

    BLOCK = ""                      # the params key of the block (``finetune``, ...)
    SEE = "params/default.yaml"     # the params file that documents the block (named in its errors)

    @classmethod
    def resolve(cls, run: Mapping[str, Any], source: str = "<params>", **context: Any) -> "Block":
        """The block of the validated run parameters ``run``, resolved and checked: the defaults overlaid
        with the params file's block (unknown keys refused), every ``bool`` field checked, then the
        block's own ``check`` (``context``: what it needs beyond ``run``, e.g. notebook 04's models for
        ``transfer``). Errors name the file, the field (``<block>.<key>``) and the fix."""
        values = cls.section(run, source, see=cls.SEE)
        fail = cls.failer(source)
        for f in fields(cls):
            if f.type in ("bool", bool) and not isinstance(values[f.name], bool):
                fail(f.name, f"must be true or false, got {values[f.name]!r}")
        cls.check(values, run, fail, **context)
        return cls.build(values)

    @classmethod
    def check(cls, values: dict[str, Any], run: Mapping[str, Any], fail: Fail, **context: Any) -> None:
        """The block's own checks: fill its run-dependent defaults in ``values`` and ``fail(key, fix)``
        on a bad value. The base block has none."""

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every key of the block with its default, in the order of the params files."""
        out = {}
        for f in fields(cls):
            out[f.name] = f.default if f.default is not MISSING else f.default_factory()
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @classmethod
    def section(cls, params: Mapping[str, Any], source: str, see: str = "params/default.yaml") -> dict[str, Any]:
        """The defaults overlaid with the params file's block (unknown keys refused)."""
        return section_params(dict(params), cls.BLOCK, cls.defaults(), source, see=see)

    @classmethod
    def failer(cls, source: str) -> Fail:
        def fail(key: str, msg: str) -> NoReturn:
            raise ConfigError(f"{source}: field '{cls.BLOCK}.{key}': {msg}")
        return fail

    @classmethod
    def build(cls, values: dict[str, Any]) -> "Block":
        """The dataclass from resolved values (lists stored as tuples)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return copy.deepcopy({k: list(v) if isinstance(v, tuple) else v for k, v in out.items()})

    def __getitem__(self, key: str) -> Any:
        if key not in self._names():
            raise KeyError(key)
        v = getattr(self, key)
        return list(v) if isinstance(v, tuple) else v

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def _names(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self))


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def as_list(v: Any) -> Any:
    """A single name as a one-element list; anything else unchanged."""
    return [v] if isinstance(v, str) else v
