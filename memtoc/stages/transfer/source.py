"""Where notebook 06's external set comes from (the ``transfer.dataset`` key).

- ``builtin``: the shipped plumbing set (``memtoc/data/transfer_builtin.jsonl``): checks the code
  path, measures nothing about FaithEval;
- ``hub``: the paper's set, FaithEval counterfactual + unanswerable v1.0 joined to ARC-Challenge
  (``memtoc.stages.transfer.hub``), imported once from the Hugging Face Hub into the transfer cache
  (``$MEMTOC_TRANSFER_DIR``, else ``~/.cache/memtoc/transfer``) and reused from there; the import's
  provenance (dataset commits, fingerprints, the serialization filter's counts) sits beside it in
  ``faitheval_arc.jsonl.meta.json`` and is copied into 06's summary;
- a path: a validated JSONL in the format of ``memtoc.stages.transfer.data`` (``memtoc transfer validate``).

Before the hub set is imported, the dry run plans with the dataset cards' sizes (:data:`CARD_ROWS`,
rows before the serialization filter: an upper bound) and says so.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from memtoc.core.vocab import BUILTIN, HUB
from memtoc.stages.transfer.data import TransferItem, builtin_path, load_items
from memtoc.stages.transfer.hub import Loader, hub_loader, import_hub, meta_path

HUB_FILE = "faitheval_arc.jsonl"
#: rows of each dataset on its Hub card (FaithEval counterfactual v1.0 "1k rows", unanswerable v1.0
#: "2.49k"): the plan's bound before the import, never a measurement
CARD_ROWS = {"counterfactual": 1000, "unanswerable": 2490}


def transfer_cache_root() -> Path:
    """``$MEMTOC_TRANSFER_DIR``, else ``~/.cache/memtoc/transfer``."""
    return Path(os.environ.get("MEMTOC_TRANSFER_DIR") or Path.home() / ".cache" / "memtoc" / "transfer").expanduser()


def hub_file() -> Path:
    """Where ``transfer.dataset: hub`` keeps its imported set."""
    return transfer_cache_root() / HUB_FILE


def dataset_file(dataset: str) -> Path:
    """The JSONL file ``dataset`` names (it may not exist yet for ``hub``)."""
    if dataset == BUILTIN:
        return builtin_path()
    if dataset == HUB:
        return hub_file()
    return Path(dataset)


def describe(dataset: str) -> str:
    """One line for plans and captions."""
    if dataset == BUILTIN:
        return "builtin (the plumbing set)"
    if dataset == HUB:
        state = "imported" if hub_file().is_file() else "imported at the start of 06"
        return f"hub: FaithEval counterfactual + unanswerable v1.0 joined to ARC-Challenge ({state}, {hub_file()})"
    return str(dataset)


def load(dataset: str, loader: Optional[Loader] = None, progress: bool = True) -> tuple[list[TransferItem], dict[str, Any]]:
    """Items of ``dataset`` and their description (``load_items``'s); ``hub`` is imported first
    when the cache has no copy (``loader``: default :func:`memtoc.stages.transfer.hub.hub_loader`)."""
    if dataset != HUB:
        return load_items(dataset)
    path = hub_file()
    if not path.is_file():
        if progress:
            print(f"06: importing FaithEval x ARC-Challenge from the Hugging Face Hub into {path} (once)")
        import_hub(path, loader or hub_loader())
    items, info = load_items(str(path))
    info["dataset"] = HUB
    meta = meta_path(path)
    info["import"] = json.loads(meta.read_text(encoding="utf-8")) if meta.is_file() else None
    return items, info


def planned_counts(dataset: str) -> Optional[dict[str, int]]:
    """For a plan: None when the set's file exists (count its items), else the card sizes of ``hub``."""
    if dataset == HUB and not hub_file().is_file():
        return dict(CARD_ROWS)
    return None


def planned_episodes(counts: dict[str, int], n_cf: Optional[int], n_un: Optional[int],
                     formulations: Sequence[str], frames: Sequence[str]) -> tuple[int, int]:
    """(episodes, reverse training examples) that ``build_episodes`` / ``reverse_examples`` would make
    from ``counts`` items, cut to ``n_cf`` / ``n_un`` (None: all)."""
    cf = counts["counterfactual"] if n_cf is None else min(n_cf, counts["counterfactual"])
    un = counts["unanswerable"] if n_un is None else min(n_un, counts["unanswerable"])
    forms = len(formulations)
    return forms * (cf * (1 + len(frames)) + un), forms * cf * len(frames)
