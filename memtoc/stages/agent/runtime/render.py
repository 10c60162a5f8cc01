"""Rendering messages to the text a model continues, and reading its reply (calls or content)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from memtoc.stages.agent.parsers import RAW_ROLES, Parsed, ToolFormat
from memtoc.stages.agent.runtime.base import args_dict
from memtoc.stages.agent.tools import function_tool


def text_messages(messages: Sequence[dict], tools: Optional[list[dict]], fmt: ToolFormat) -> list[dict]:
    """Messages for a template that ignores ``tools``: the tool prompt appended to the system turn
    (or a system turn of its own), the model's calls as its raw text, tool results as a user turn
    ``<tool_response>...</tool_response>``."""
    out: list[dict] = []
    tool_prompt = fmt.tool_prompt(tools) if tools and hasattr(fmt, "tool_prompt") else ""
    for m in messages:
        role = m["role"]
        if role == "system":
            out.append({"role": "system", "content": m["content"] + ("\n\n" + tool_prompt if tool_prompt else "")})
            tool_prompt = ""
        elif role == "assistant":
            text = m.get("raw")
            if text is None:
                text = (m.get("content") or "")
                for tc in m.get("tool_calls") or []:
                    fn = tc["function"]
                    text = (text + ("\n" if text else "")
                            + fmt.render_call(fn["name"], args_dict(fn["arguments"])))
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": role, "content": m["content"]})
    if tool_prompt:
        out.insert(0, {"role": "system", "content": tool_prompt})
    return out


def raw_transcript(messages: Sequence[dict], tools: Optional[list[dict]], fmt: ToolFormat) -> str:
    """A base model's prompt (no chat template; memtoc's own layout): the system text, then
    ``User: ...`` / ``Assistant: ...`` lines, ending with ``Assistant:`` for the model to continue."""
    parts: list[str] = []
    for m in text_messages(messages, tools, fmt):
        if m["role"] == "system":
            parts.append(m["content"].rstrip() + "\n")
        else:
            parts.append(RAW_ROLES[m["role"]] + m["content"].strip())
    return "\n".join(parts) + "\nAssistant:"


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """Messages for a template that renders tools (arguments as objects, ``raw`` dropped)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "raw"}
        if m.get("tool_calls"):
            m["tool_calls"] = [{**tc, "function": {**tc["function"], "arguments": args_dict(tc["function"]["arguments"])}}
                               for tc in m["tool_calls"]]
        out.append(m)
    return out


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template shows ``tools`` (rendering with and without a tool differs)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    msgs = [{"role": "user", "content": "x"}]
    probe = [function_tool({"name": "memtoc_probe_tool", "description": "d",
                            "parameters": {"type": "object", "properties": {}}})]
    try:
        a = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        b = tokenizer.apply_chat_template(msgs, tools=probe, tokenize=False, add_generation_prompt=True)
    except Exception:
        return False
    return a != b and "memtoc_probe_tool" in b


def render_messages(tokenizer, chat: bool, fmt: ToolFormat, messages: Sequence[dict],
                    tools: Optional[list[dict]]) -> str:
    """The text a model continues for ``messages`` (see the module docstring)."""
    if not chat or not getattr(tokenizer, "chat_template", None):
        return raw_transcript(messages, tools, fmt)
    if fmt.native:
        return tokenizer.apply_chat_template(template_messages(messages), tools=tools or None, tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.apply_chat_template(text_messages(messages, tools, fmt), tokenize=False,
                                         add_generation_prompt=True)


def parse_reply(fmt: ToolFormat, text: str, tool_choice: Any) -> Parsed:
    """Calls of a reply; with ``tool_choice="none"`` nothing is a call (the text stays content)."""
    if tool_choice == "none":
        return Parsed(text.strip())
    return fmt.parse(text)

