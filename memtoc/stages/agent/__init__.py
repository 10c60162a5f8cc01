"""The agent loop (notebook 07, paper App. G): tool-choice protocols in an executed agent loop.

Modules
    ``tools``      the fixture tool, its schemas (the release's / memtoc's typed variant), argument
                   validation (``jsonschema``), execution, the oracle call
    ``parsers``    tool-call formats per model family (Hermes/Qwen, Llama-3 JSON, Mistral, the
                   documented SmolLM2 ``<tools>`` / ``<tool_call>`` text format)
    ``runtime``    one ``chat(messages, tools, tool_choice)`` interface: in-process transformers
                   (schema-constrained calls with llguidance) and OpenAI-compatible servers (a package:
                   base, render, constrained, inprocess, server, caching)
    ``protocols``  guided / auto / two_stage / oracle / auto_constrained as episode state machines,
                   terminations and mechanisms, the round-based loop
    ``traces``     resumable JSONL traces (one event per line, message hashes)
    ``metrics``    agreement, execution, their gap, terminations, mechanisms, the protocol contrasts and
                   the repair delta
    ``contrasts``  the paper's percentile bootstrap beside memtoc's cluster bootstrap; paired contrasts
    ``core``       episodes, specs, runtimes, the summary's blocks, the figure (the ``agent:`` block:
                   ``memtoc.config.blocks.AgentConfig``)
    ``stage``      ``run(cfg)``: every condition, the adapter and sampling arms, ``summaries/agent.json``
"""
from __future__ import annotations

from memtoc.stages.agent.contrasts import PROTOCOL_CONTRASTS, percentile_bootstrap
from memtoc.stages.agent.core import (
    AgentConfig,
    AgentError,
    build_specs,
    episodes,
    formulations_of,
    plot,
    published_block,
    read_summary,
)
from memtoc.stages.agent.metrics import (
    METRIC_DOC,
    SLICES,
    contrast_table,
    episodes_frame,
    published_table,
    repair_table,
    summary_table,
)
from memtoc.stages.agent.parsers import FORMATS, Parsed, ToolCall, ToolFormat, format_for, get_format
from memtoc.stages.agent.protocols import (
    AGENT_SYSTEM,
    MECHANISMS,
    PROTOCOLS,
    TERMINATIONS,
    EpisodeRun,
    EpisodeSpec,
    parse_decision,
    run_episodes,
    system_prompt,
)
from memtoc.stages.agent.runtime import (
    AgentRuntimeError,
    ChatRequest,
    ChatResponse,
    OpenAIRuntime,
    ProtocolUnsupported,
    Runtime,
    TransformersRuntime,
    detect_server,
    make_runtime,
    render_messages,
)
from memtoc.stages.agent.stage import run
from memtoc.stages.agent.tools import (
    SCHEMA_VARIANTS,
    FixtureTool,
    episode_schema,
    oracle_arguments,
    typed_schema,
    validate_call,
)
from memtoc.stages.agent.traces import Trace

__all__ = ["AgentConfig", "AgentError", "build_specs", "episodes", "formulations_of",
           "plot", "published_block", "read_summary", "run", "METRIC_DOC", "SLICES", "contrast_table", "episodes_frame",
           "PROTOCOL_CONTRASTS", "percentile_bootstrap",
           "published_table", "repair_table", "summary_table", "FORMATS", "Parsed", "ToolCall", "ToolFormat",
           "format_for", "get_format", "AGENT_SYSTEM", "MECHANISMS", "PROTOCOLS", "TERMINATIONS",
           "EpisodeRun", "EpisodeSpec", "parse_decision", "run_episodes", "system_prompt",
           "AgentRuntimeError", "ChatRequest", "ChatResponse", "OpenAIRuntime", "ProtocolUnsupported",
           "Runtime", "TransformersRuntime", "detect_server", "make_runtime", "render_messages",
           "SCHEMA_VARIANTS", "FixtureTool", "episode_schema", "oracle_arguments", "typed_schema",
           "validate_call", "Trace"]
