"""The errors memtoc raises for a person to read (no traceback needed), and the choice checks that
raise them: the bottom of the package, imported by every layer."""
from __future__ import annotations

from typing import Any, Iterable


class MemtocError(Exception):
    """Base class for errors meant to be read by a person (no traceback needed)."""


class ConfigError(MemtocError):
    """A parameter is missing, mistyped or out of range."""


class DataError(MemtocError):
    """Benchmark data is missing or malformed."""


def check_choice(kind: str, value: Any, valid: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``valid``; otherwise raise a ConfigError listing them."""
    valid = list(valid)
    if value not in valid:
        raise ConfigError(f"unknown {kind} {value!r}; valid {kind}s are: {', '.join(map(str, valid))}")
    return value


def check_choices(kind: str, values: Iterable[Any], valid: Iterable[str]) -> list[str]:
    valid = list(valid)
    return [check_choice(kind, v, valid) for v in values]


def ordered_subset(value: Any, valid: Iterable[str]) -> list[str] | None:
    """``value`` (a name or a list of names) as a non-empty list in ``valid``'s order; None when it is
    not a non-empty list drawn from ``valid``."""
    valid = list(valid)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or any(v not in valid for v in value):
        return None
    return [v for v in valid if v in value]
