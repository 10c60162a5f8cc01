"""The runtime interface: requests, responses, what each protocol needs, :class:`Runtime`."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from memtoc.core.errors import MemtocError
from memtoc.stages.agent.parsers import ToolCall
from memtoc.stages.agent.tools import name_of

NAMED = "named"
CONSTRAINED = "constrained"
#: what each protocol needs from a runtime
PROTOCOL_NEEDS: dict[str, tuple[str, ...]] = {"guided": (NAMED,), "auto": (), "two_stage": (NAMED,),
                                              "oracle": (), "auto_constrained": (CONSTRAINED,)}


class AgentRuntimeError(MemtocError):
    """The runtime cannot serve a request as configured."""


class ProtocolUnsupported(AgentRuntimeError):
    """A protocol needs a capability this runtime does not have (it would silently degrade)."""


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: Optional[list[dict[str, Any]]] = None        # OpenAI function tools
    tool_choice: Any = "auto"                           # auto | none | required | {"type": "function", ...}
    max_tokens: int = 64
    constrained: bool = False                           # decode a call's arguments under the schema grammar


@dataclass
class ChatResponse:
    text: str                        # the reply as generated (call text included)
    content: str                     # text outside calls
    calls: list[ToolCall] = field(default_factory=list)
    parse_error: Optional[str] = None
    opened: bool = False             # a call region was opened (parsed or not)
    n_prompt_tokens: int = 0
    n_new_tokens: int = 0
    finish: str = ""
    cached: bool = False
    seconds: float = 0.0
    prompt_sha256: Optional[str] = None
    constrained_tokens: int = 0      # tokens decoded under the grammar
    call_text_ignored: bool = False  # tool_choice "none": the reply looked like a call, kept as text

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["calls"] = [c.to_dict() for c in self.calls]
        return d


def named_choice(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def forced_name(tool_choice: Any, tools: Optional[list[dict]]) -> Optional[str]:
    """The tool a ``tool_choice`` forces (named, or ``required`` with one tool), else None."""
    if isinstance(tool_choice, dict):
        return tool_choice.get("function", {}).get("name")
    if tool_choice == "required" and tools and len(tools) == 1:
        return name_of(tools[0])
    return None


def call_id(n: int) -> str:
    """Tool-call ids of 9 alphanumeric characters (Mistral's template requires exactly that)."""
    return f"call{n:05d}"


def assistant_call_message(content: str, calls: Sequence[ToolCall], raw: Optional[str], first_id: int = 0) -> dict:
    """The assistant message of a turn that made calls (OpenAI shape; ``raw`` keeps the model's own
    text for text formats)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content or "",
                           "tool_calls": [{"id": call_id(first_id + i), "type": "function",
                                           "function": {"name": c.name,
                                                        "arguments": c.arguments if isinstance(c.arguments, str)
                                                        else json.dumps(c.arguments, ensure_ascii=False)}}
                                          for i, c in enumerate(calls)]}
    if raw is not None:
        msg["raw"] = raw
    return msg


def args_dict(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


class Runtime:
    """``chat(messages, tools, tool_choice)`` -> :class:`ChatResponse`; ``chat_many`` batches."""

    kind = "base"
    named_tool_choice = False       # a named tool_choice is honoured (the call is forced)
    constrained = False             # call arguments can be decoded under the schema grammar
    enforces_none = False           # tool_choice "none" is honoured

    def chat(self, messages: list[dict], tools: Optional[list[dict]] = None, tool_choice: Any = "auto",
             max_tokens: int = 64, constrained: bool = False) -> ChatResponse:
        return self.chat_many([ChatRequest(messages, tools, tool_choice, max_tokens, constrained)])[0]

    def chat_many(self, requests: Sequence[ChatRequest]) -> list[ChatResponse]:
        raise NotImplementedError

    def capabilities(self) -> dict[str, bool]:
        return {NAMED: self.named_tool_choice, CONSTRAINED: self.constrained, "enforces_none": self.enforces_none}

    def why_not(self, need: str) -> str:
        return f"the {self.kind} runtime has no {need} capability"

    def check_protocols(self, protocols: Sequence[str]) -> None:
        """Raise :class:`ProtocolUnsupported` naming every protocol this runtime cannot run faithfully."""
        caps = self.capabilities()
        bad = []
        for p in protocols:
            if p not in PROTOCOL_NEEDS:
                raise AgentRuntimeError(f"unknown protocol {p!r}; valid: {', '.join(PROTOCOL_NEEDS)}")
            missing = [n for n in PROTOCOL_NEEDS[p] if not caps.get(n)]
            if missing:
                bad.append(f"{p} (needs {' and '.join(missing)}: {self.why_not(missing[0])})")
        if bad:
            raise ProtocolUnsupported(
                "refusing to run " + "; ".join(bad) + ". memtoc will not silently run a different protocol. "
                "Drop these from agent.protocols, or use the in-process runtime (agent.runtime: transformers), "
                "or a server that honours a named tool_choice (vllm serve MODEL --enable-auto-tool-choice "
                "--tool-call-parser <family>, with agent.runtime_options.server: vllm)")

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "capabilities": self.capabilities()}

    def close(self) -> None:
        pass

