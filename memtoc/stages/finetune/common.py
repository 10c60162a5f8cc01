"""Shared pieces of the fine-tuning stage: its error, constants, the adapter layout and the
summary files (both from :class:`memtoc.config.runconfig.RunPaths`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memtoc.config.blocks import EVAL_CONDITIONS, OBJECTIVES
from memtoc.config.runconfig import RunPaths
from memtoc.core.errors import MemtocError
from memtoc.core.vocab import CONFLICT_CONDITIONS, HEADLINE_METRICS

SCHEMA_VERSION = 2
TRAIN_CONDITIONS = CONFLICT_CONDITIONS            # the DPO/SFT pairs: tool_right, tool_wrong
METRICS = HEADLINE_METRICS

#: Generator options that mean the same on every backend (carried from a vLLM / openai run's
#: backend_options to 04's transformers generators).
SHARED_BACKEND_OPTIONS = ("stop_at_final",)

__all__ = ["EVAL_CONDITIONS", "METRICS", "OBJECTIVES", "SCHEMA_VERSION", "SHARED_BACKEND_OPTIONS",
           "TRAIN_CONDITIONS", "FinetuneError", "adapter_dir", "close_generator", "read_stage_summary",
           "read_summary", "write_stage_summary", "write_summary"]


class FinetuneError(MemtocError):
    """Fine-tuning inputs are inconsistent (a leaking plan, no training data, a bad adapter dir)."""


def adapter_dir(run_dir, model_label: str, objective: str, fold: int) -> Path:
    """``adapters/<model>/<objective>/fold<k>/`` of the run ``run_dir`` (``RunPaths.adapter``)."""
    return RunPaths(run_dir).adapter(model_label, objective, fold)


def close_generator(gen) -> None:
    """Release a generator that holds resources (``close()``, when it has one)."""
    close = getattr(gen, "close", None)
    if callable(close):
        close()


def write_stage_summary(summary: dict[str, Any], run_dir, stage: str) -> Path:
    """Write ``summaries/<stage>.json`` atomically (``RunPaths.write_summary``)."""
    return RunPaths(run_dir).write_summary(stage, summary)


def read_stage_summary(run_dir, stage: str, notebook: str, error: type[MemtocError] = None) -> dict[str, Any]:
    """``summaries/<stage>.json``; ``error`` (default :class:`FinetuneError`) names ``notebook`` when it is absent."""
    path = RunPaths(run_dir).summary(stage)
    if not path.is_file():
        raise (error or FinetuneError)(f"{path} does not exist; run notebook {notebook} first")
    return json.loads(path.read_text())


def write_summary(summary: dict[str, Any], run_dir) -> Path:
    return write_stage_summary(summary, run_dir, "finetuning")


def read_summary(run_dir) -> dict[str, Any]:
    return read_stage_summary(run_dir, "finetuning", "04_finetuning")
