"""Which memtoc function produced a value, recorded from the call itself.

:func:`trace` runs a function under a profile hook and notes every function of the pipeline modules
(:data:`PIPELINE_MODULES`) whose code actually ran, in the order first called; the outermost one
comes first and is the value's ``via``. Nothing is labelled by hand: a check whose value did not
pass through a pipeline function has no pipeline call recorded, and a replaced (monkeypatched)
function is recorded only if the pipeline code it calls runs.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

#: the modules whose functions count as "the pipeline" (the code notebooks 02-04 run); a package
#: (``memtoc.stages.evaluation.analyses``) counts with its modules
PIPELINE_MODULES: tuple[str, ...] = ("memtoc.core.metrics", "memtoc.core.stats", "memtoc.core.intervals", "memtoc.stages.evaluation.analyses",
                                     "memtoc.stages.evaluation")


@dataclass(frozen=True)
class Traced:
    """A value with the functions (``module.qualname``) that ran while it was computed."""
    value: Any
    calls: tuple[str, ...] = ()

    @property
    def via(self) -> str:
        """The outermost recorded function (the first one called)."""
        return self.calls[0] if self.calls else ""

    def map(self, fn: Callable[[Any], Any]) -> "Traced":
        """``fn`` of the value, with the same calls (``fn`` must not call pipeline code)."""
        return Traced(fn(self.value), self.calls)


def _dedupe(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def trace(fn: Callable[..., Any], *args: Any, modules: Sequence[str] = PIPELINE_MODULES, **kwargs: Any) -> Traced:
    """Call ``fn(*args, **kwargs)`` and record the functions of ``modules`` that ran."""
    calls: list[str] = []
    wanted = frozenset(modules)
    previous = sys.getprofile()

    def hook(frame, event, arg):
        if event == "call":
            mod = frame.f_globals.get("__name__")
            if mod in wanted or (mod and mod.rpartition(".")[0] in wanted):
                calls.append(f"{mod}.{frame.f_code.co_qualname}")
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(hook)
    try:
        value = fn(*args, **kwargs)
    finally:
        sys.setprofile(previous)
    return Traced(value, _dedupe(calls))


def joined(parts: Sequence[Traced], fn: Callable[..., Any]) -> Traced:
    """``fn(*values)`` of several traced values, with the union of their calls."""
    return Traced(fn(*(p.value for p in parts)), _dedupe(c for p in parts for c in p.calls))


def via_pipeline(calls: Iterable[str]) -> bool:
    """Whether any recorded call is a pipeline function."""
    prefixes = tuple(m + "." for m in PIPELINE_MODULES)
    return any(c.startswith(prefixes) for c in calls)
