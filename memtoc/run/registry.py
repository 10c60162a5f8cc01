"""The stage registry: every notebook stage declared once.

The pipeline (``memtoc run``: the plan, the skip rules, the GPU and server checks, the preflight, the
per-stage parameter records in ``config.json`` and the refusal to mix outputs of different
parameters), papermill runs (``memtoc.run.notebook``) and the dry run (``memtoc run --dry-run [--json]``) all
iterate :data:`STAGES`. Adding a notebook is one entry here plus its module (docs/architecture.md,
"Add a notebook").

A stage's *parameters* are the result parameters it reads itself (``keys``) plus those of every stage
whose outputs it reads (``reads``, followed transitively): its record in ``config.json`` hashes
exactly those, so changing an agent setting leaves 04–06 valid, and changing a fine-tuning setting
makes 04 and 06 (which reads 04's adapters) stale, not 02 or 07.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:      # annotations only: the registry sits below the run configuration
    from memtoc.config.runconfig import RunConfig

#: parameters that cannot change a result (where files go; batch_size: a reply never depends on its
#: batch; verify: whether 09 raises)
NON_RESULT_KEYS: tuple[str, ...] = ("run_name", "output_root", "release_dir", "model_cache_dir",
                                    "batch_size", "verify")


@dataclass(frozen=True)
class Stage:
    """One notebook stage.

    ``block``: the params block whose ``enabled`` switches the stage (None: always on).
    ``keys``: the result parameters it reads itself (``release`` = the data's digest).
    ``reads``: the stages whose outputs it reads. ``generates``: it loads models (the GPU and server
    checks apply). ``preflight`` / ``estimate``: ``"module:function"`` hooks, resolved on use:
    ``preflight(cfg, source, facts)`` raises a ConfigError for what cannot run;
    ``estimate(ctx, stage)`` returns the dry run's ``memtoc.run.dryrun.StagePlan``."""

    number: str
    notebook: str
    summary: Optional[str] = None
    block: Optional[str] = None
    keys: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    generates: bool = False
    preflight: Optional[str] = None
    estimate: Optional[str] = None

    def enabled(self, cfg: RunConfig) -> tuple[bool, str]:
        """(whether the run's configuration switches the stage on, why not); ``block`` is a typed
        block of ``cfg`` (``cfg.probes``) or, for a block without one yet, its mapping."""
        if self.block is None:
            return True, ""
        blk = getattr(cfg, self.block)
        on = bool(blk.get("enabled", True) if isinstance(blk, dict) else blk.enabled)
        return on, "" if on else f"{self.block}.enabled is false"


STAGES: list[Stage] = [
    Stage("01", "01_construction", "construction",
          keys=("release", "seed", "formulations", "n_questions", "n_questions_extra", "extra_arms")),
    Stage("02", "02_elicitation", "elicitation", generates=True, reads=("01",),
          keys=("models", "backend", "backend_options", "dtype", "max_new_tokens", "matcher",
                "closed_book_variant", "elicit_permissive", "base_formulations", "alpha"),
          estimate="memtoc.run.dryrun:estimate_elicitation"),
    Stage("03", "03_evaluation", "evaluation", generates=True, reads=("02",), keys=("n_boot", "n_perm", "judge"),
          estimate="memtoc.run.dryrun:estimate_evaluation"),
    Stage("04", "04_finetuning", "finetuning", block="finetune", generates=True, reads=("03",), keys=("finetune",),
          estimate="memtoc.run.dryrun:estimate_finetuning"),
    Stage("05", "05_probes", "probes", block="probes", generates=True, reads=("03",), keys=("probes",),
          estimate="memtoc.run.dryrun:estimate_probes"),
    Stage("06", "06_transfer", "transfer", block="transfer", generates=True, reads=("03", "04"), keys=("transfer",),
          estimate="memtoc.run.dryrun:estimate_transfer"),
    Stage("07", "07_agent_loop", "agent", block="agent", generates=True, reads=("02",),
          keys=("agent", "n_boot", "n_perm"), estimate="memtoc.run.dryrun:estimate_agent"),
    Stage("08", "08_paper", None, reads=("01", "02", "03", "04", "05", "06", "07")),
    Stage("09", "09_verify", None, reads=("08",)),
]


def by_number() -> dict[str, Stage]:
    return {s.number: s for s in STAGES}


def stage(number: str) -> Optional[Stage]:
    return by_number().get(number)


def upstream(number: str) -> set[str]:
    """Every stage whose outputs stage ``number`` reads, directly or through another stage."""
    table, out, todo = by_number(), set(), [number]
    while todo:
        s = table.get(todo.pop())
        for r in (s.reads if s else ()):
            if r not in out:
                out.add(r)
                todo.append(r)
    return out


def stage_keys(number: str) -> Optional[tuple[str, ...]]:
    """The result parameters stage ``number`` depends on (its own and its upstream stages'), in a
    stable order; None for a notebook the registry does not know (it depends on everything)."""
    table = by_number()
    if number not in table:
        return None
    keys: list[str] = []
    for n in sorted(upstream(number) | {number}):
        for k in table[n].keys if n in table else ():
            if k not in keys:
                keys.append(k)
    return tuple(keys)


def hook(path: Optional[str]) -> Optional[Callable[..., Any]]:
    """The function a ``"module:function"`` hook names (None: no hook)."""
    if not path:
        return None
    module, _, name = path.partition(":")
    return getattr(import_module(module), name)
