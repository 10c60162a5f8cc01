"""Notebook 06's forward adapters (``transfer.forward_pool``): notebook 04's fold adapters
(``fold``), or, as the paper's Table 6 ("MemToC adapters trained leakage-free over the full
575-question pool"), one adapter per forward objective trained here on every question of the
construction pool, both folds and the excluded questions included (``full``).

A full-pool adapter has seen every MemToC question, so it is only ever scored on the external set;
it is trained by ``finetune.train_adapter`` with the run's ``finetune`` settings on the paper's
training pairs (``finetune.training_examples``), written under
``adapters/<model>/<objective>/full/`` (``RunPaths.full_pool_adapter``) and resumed when finished
with the same configuration hash. The arm is named by its objective (``sft``, ``dpo``), as Table 6's rows.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from memtoc.config.runconfig import RunConfig
from memtoc.generation import models
from memtoc.stages import finetune


def full_pool_examples(cfg: RunConfig, bench) -> list[finetune.TrainExample]:
    """The training pairs of every pool question (``bench.questions``: the 575, both folds, excluded
    ones too) in ``finetune.train_formulations``."""
    return finetune.training_examples(bench.questions, cfg.finetune.train_formulations)


def train_full_pool(cfg: RunConfig, model: str, bench, progress: bool = True) -> tuple[dict[str, Path], dict[str, Any]]:
    """({objective: adapter dir}, {objective: training record}) of ``model``'s full-pool adapters,
    one per ``transfer.forward_objectives`` (trained, or resumed when finished)."""
    examples = full_pool_examples(cfg, bench)
    spec = models.get_model(model)
    base = models.prepare_model(model, cache_dir=cfg.model_cache_dir)
    paths: dict[str, Path] = {}
    records: dict[str, Any] = {}
    for obj in cfg.transfer.forward_objectives:
        path = cfg.paths.full_pool_adapter(model, obj)      # keyed by the model name, as 04's adapters
        if progress:
            print(f"[transfer] {model} {obj} on the full pool: {len(examples)} examples "
                  f"({len({e.question_id for e in examples})} questions) -> {path}")
        rec = finetune.train_adapter(base, spec, examples, obj, cfg.finetune, path, progress=progress)
        paths[obj] = path
        records[obj] = {"path": str(path), "questions": len({e.question_id for e in examples}),
                        "folds": sorted({e.fold for e in examples if e.fold is not None}),
                        **{k: rec.get(k) for k in ("config_hash", "resumed", "steps", "examples", "seconds",
                                                   "final_loss")}}
    return paths, records
