"""The typed stage blocks of the params file, each with its defaults and validation in one place:
``finetune`` (:class:`FinetuneConfig`), ``transfer`` (:class:`TransferConfig`), ``probes``
(:class:`ProbesConfig`), ``agent`` (:class:`AgentConfig`) and ``judge`` (:class:`JudgeConfig`).

``memtoc.config.runconfig.RunConfig`` resolves them once (``cfg.finetune.max_steps``); ``to_dict()`` is a
block as the stage summaries record it. Errors name the file, the field (``<block>.<key>``) and the
fix; an unknown key is refused with the list of valid keys.
"""
from __future__ import annotations

from typing import Any, Mapping

from memtoc.config.blocks.agent import AgentConfig
from memtoc.config.blocks.base import Block
from memtoc.config.blocks.finetune import EVAL_CONDITIONS, OBJECTIVES, FinetuneConfig, is_chat
from memtoc.config.blocks.probes import ProbesConfig, model_entry
from memtoc.config.blocks.transfer import CLOSED_BOOK_BAND, TransferConfig
from memtoc.config.judge import JudgeConfig

#: The params keys of the stage blocks, each with its class.
BLOCKS = {"finetune": FinetuneConfig, "transfer": TransferConfig, "probes": ProbesConfig, "agent": AgentConfig}


def resolve_blocks(run: Mapping[str, Any], source: str = "<params>") -> dict[str, Block]:
    """The typed stage blocks of the validated run parameters ``run`` (``config.validate_params``)."""
    ft = FinetuneConfig.resolve(run, source)
    return {"finetune": ft, "transfer": TransferConfig.resolve(run, source, finetune_models=ft.models),
            "probes": ProbesConfig.resolve(run, source), "agent": AgentConfig.resolve(run, source)}


__all__ = ["AgentConfig", "Block", "BLOCKS", "CLOSED_BOOK_BAND", "EVAL_CONDITIONS", "FinetuneConfig", "JudgeConfig",
           "OBJECTIVES", "ProbesConfig", "TransferConfig", "is_chat", "model_entry", "resolve_blocks"]
