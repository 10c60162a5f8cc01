"""The agent runtime: one ``chat(messages, tools, tool_choice)`` interface, two implementations.

``TransformersRuntime``  in-process transformers (CPU by default, GPU when there is one). Messages
    are rendered to text here (:func:`render_messages`: the model's chat template with
    ``tools=...`` when the template renders tools, else the documented ``smollm2`` text format in the
    system turn; a raw transcript for base models), generated greedily in batches through
    memtoc's transformers backend (``backends.hf.TransformersGenerator``: shared prefixes,
    batch-invariant float32 replies on CPU, the generation cache ``agent/<model>/cache/generations.jsonl``)
    and parsed with the family's :class:`~memtoc.stages.agent.parsers.ToolFormat`.
    A *named* ``tool_choice`` (the guided protocol) is honoured the way vLLM honours it: the call's
    fixed text (``format.begin(name)``) is inserted and its arguments are decoded under the JSON
    schema of the tool's parameters; ``constrained=True`` with ``tool_choice="auto"`` (the
    ``auto_constrained`` repair arm) generates exactly as ``auto`` and, where the free reply opens a
    call (the format's trigger), replaces the call's text by the same schema-constrained decoding
    (a *lazy* grammar, like llama.cpp's grammar triggers or xgrammar's structural tags): same
    weights, same prompt, only the arguments are constrained. Constrained decoding is batch-1
    greedy with ``llguidance`` (a maintained Rust grammar engine with CPU wheels) masking the
    logits at every step; its cost per token is measured (:attr:`TransformersRuntime.constrained_stats`).
    ``tool_choice="none"`` leaves the tools in the prompt (as vLLM does) and parses no call.

``OpenAIRuntime``  any OpenAI-compatible ``/v1/chat/completions`` server (``vllm serve MODEL
    --enable-auto-tool-choice --tool-call-parser <family>`` is the paper's stack). Native formats
    send ``tools`` / ``tool_choice`` and read ``tool_calls``; text formats (SmolLM2, base models)
    are rendered and parsed by memtoc. A server that does not honour ``tool_choice`` (``transformers
    serve`` ignores it, it only logs "Ignoring unsupported fields") gets none, and the protocols that
    need it (guided, two_stage: a named call; auto_constrained: a grammar) are **refused** with
    :class:`ProtocolUnsupported` before any request, never silently degraded. The server kind is
    detected from its OpenAPI paths (``server="auto"``) or given (``vllm`` | ``transformers`` |
    ``other``); ``honors_tool_choice=True`` vouches for another server.

Requirements per protocol (checked by :meth:`Runtime.check_protocols`): guided and two_stage need a
named tool choice; auto_constrained needs in-process constrained decoding; auto and oracle run
anywhere (after the call they ask for ``tool_choice="none"``; a runtime that does not enforce it may

Modules (as ``memtoc/generation/backends/``)
    ``base``         requests, responses, :class:`Runtime`, what each protocol needs
    ``render``       messages -> the text a model continues; replies -> calls
    ``constrained``  llguidance schema-constrained decoding of a call's arguments
    ``inprocess``    :class:`TransformersRuntime`
    ``server``       :class:`OpenAIRuntime`, :func:`detect_server`
    ``caching``      :class:`ReplyCache`: the one look-up path of the runtimes' reply caches
"""
from __future__ import annotations

import inspect
from typing import Any

from memtoc.stages.agent.runtime.base import (
    CONSTRAINED,
    NAMED,
    PROTOCOL_NEEDS,
    AgentRuntimeError,
    ChatRequest,
    ChatResponse,
    ProtocolUnsupported,
    Runtime,
    args_dict,
    assistant_call_message,
    call_id,
    forced_name,
    named_choice,
)
from memtoc.stages.agent.runtime.caching import ReplyCache, constrained_key, server_key
from memtoc.stages.agent.runtime.constrained import (
    JSON_OPTIONS,
    TIE_MARGIN,
    ConstrainedDecoder,
    ConstrainedJob,
    constrained_library,
    strict_schema,
)
from memtoc.stages.agent.runtime.inprocess import TransformersRuntime
from memtoc.stages.agent.runtime.render import (
    parse_reply,
    raw_transcript,
    render_messages,
    template_messages,
    template_renders_tools,
    text_messages,
)
from memtoc.stages.agent.runtime.server import SERVERS, OpenAIRuntime, detect_server

RUNTIMES = {"transformers": TransformersRuntime, "openai": OpenAIRuntime}

__all__ = ["CONSTRAINED", "NAMED", "PROTOCOL_NEEDS", "AgentRuntimeError", "ChatRequest", "ChatResponse",
           "ProtocolUnsupported", "Runtime", "args_dict", "assistant_call_message", "call_id", "forced_name",
           "named_choice", "ReplyCache", "constrained_key", "server_key", "JSON_OPTIONS", "TIE_MARGIN",
           "ConstrainedDecoder", "ConstrainedJob", "constrained_library", "strict_schema", "TransformersRuntime",
           "parse_reply", "raw_transcript", "render_messages", "template_messages", "template_renders_tools",
           "text_messages", "SERVERS", "OpenAIRuntime", "detect_server", "RUNTIMES", "make_runtime"]


def make_runtime(kind: str, model: str, max_tokens_per_call: int, cache_dir=None, **options: Any) -> Runtime:
    """A runtime by kind (``transformers`` | ``openai``); options are the runtime's keyword arguments."""
    if kind not in RUNTIMES:
        raise AgentRuntimeError(f"unknown agent runtime {kind!r}; valid: {', '.join(RUNTIMES)}")
    cls = RUNTIMES[kind]
    valid = [n for n in inspect.signature(cls).parameters if n not in ("model", "max_tokens_per_call", "cache_dir")]
    bad = [k for k in options if k not in valid and cls is OpenAIRuntime]
    if bad:
        raise AgentRuntimeError(f"unknown {kind} agent runtime option(s) {bad}; valid: {', '.join(valid)}")
    return cls(model, max_tokens_per_call=max_tokens_per_call, cache_dir=cache_dir, **options)
