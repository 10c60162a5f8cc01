"""Tool-call formats: how tools are shown to a model and how its calls are read back.

A :class:`ToolFormat` knows, for one model family, (a) whether the model's own chat template renders
the tools (``native``: ``apply_chat_template(tools=...)``) or memtoc renders them as text, (b) how a
call looks (``parse``, ``render_call``), and (c) the fixed text around a call's arguments
(``begin`` / ``end``) and the ``trigger`` that opens a call, which constrained decoding uses.

Formats
    ``hermes``       Qwen2.5 and Hermes-3 (native templates): ``<tool_call>\\n{"name": ..., "arguments":
                     {...}}\\n</tool_call>``, one block per call.
    ``llama3_json``  Llama-3.1 / 3.2 Instruct (native template, JSON tool calling): the reply is one
                     JSON object ``{"name": ..., "parameters": {...}}``, optionally after
                     ``<|python_tag|>``; several calls are separated by ``;``.
    ``mistral``      Mistral-7B-Instruct-v0.3 (native template): ``[TOOL_CALLS] [{"name": ...,
                     "arguments": {...}}]``. ``[TOOL_CALLS]`` is a control token that a decode with
                     ``skip_special_tokens`` drops, so a reply that *starts* with ``[{"name"`` is
                     read as a call too.
    ``smollm2``      the format documented for SmolLM2 (its model card, "Function calling"; the
                     template itself ignores ``tools``): the tools as JSON inside ``<tools></tools>``
                     in the system turn, a call as ``<tool_call>[{"name": ..., "arguments": {...}}]
                     </tool_call>`` (an empty list ``[]`` means no call). memtoc uses it as the text
                     format of every model whose template does not render tools (gemma-2-9b-it, the
                     embedded gemma-3-270m base model in a raw transcript, any local model without a
                     tool template). Tool results go back as a user turn ``<tool_response>...
                     </tool_response>``, the way Qwen2.5's (Hermes) template renders tool messages.

What counts as an unparseable call (mechanism T2): a call region was opened (the format's marker,
or for ``llama3_json`` / ``mistral`` a reply that starts like a call) but its text is not JSON, or not
an object / list of objects with a string ``name``. Arguments that are not a JSON object are read as
given and rejected by validation (``tools.validate_call``: ``not_object``, also T2).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

#: The documented SmolLM2 tool prompt (model card of SmolLM2-1.7B-Instruct, "Function calling"),
#: with ``{tools}`` = the JSON list of OpenAI function tools.
SMOLLM2_TOOL_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions. \n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. \n"
    "If none of the functions can be used, point it out and refuse to answer. \n"
    "If the given question lacks the parameters required by the function, also point it out.\n\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. If no function call "
    "is needed, please make the tool calls an empty list '[]'.\n"
    "<tool_call>[\n"
    "{{\"name\": \"func_name1\", \"arguments\": {{\"argument1\": \"value1\", \"argument2\": \"value2\"}}}},\n"
    "... (more tool calls as required)\n"
    "]</tool_call>")

#: Role labels of the raw transcript a base model (no chat template) continues (memtoc's own).
RAW_ROLES = {"system": "", "user": "User: ", "assistant": "Assistant: ", "tool": "User: "}
RAW_STOP = ("\nUser:", "\nAssistant:", "\nSystem:")


@dataclass(frozen=True)
class ToolCall:
    name: Optional[str]
    arguments: Any                  # a dict when it parsed, else the raw text / value as given
    raw: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "raw": self.raw}


@dataclass
class Parsed:
    content: str                    # the text outside call regions
    calls: list[ToolCall] = field(default_factory=list)
    error: Optional[str] = None     # why an opened call region did not parse (T2), else None
    opened: bool = False            # a call region was found (parsed or not)

    def to_dict(self) -> dict[str, Any]:
        return {"content": self.content, "calls": [c.to_dict() for c in self.calls], "error": self.error,
                "opened": self.opened}


def _as_call(obj: Any, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = {}
    for k in arg_keys:
        if k in obj:
            args = obj[k]
            break
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass                    # kept as text: validation rejects it (not_object)
    return ToolCall(obj["name"], args, json.dumps(obj, ensure_ascii=False))


def _calls_from_json(text: str, allow_list: bool = True) -> tuple[list[ToolCall], Optional[str]]:
    try:
        obj = json.loads(text)
    except ValueError as e:
        return [], f"call is not JSON ({e.msg} at column {e.colno})"
    items = obj if (allow_list and isinstance(obj, list)) else [obj]
    calls = []
    for it in items:
        c = _as_call(it)
        if c is None:
            return [], "a call must be a JSON object with a string 'name'"
        calls.append(c)
    return calls, None


class ToolFormat:
    name = "base"
    native = False                  # the chat template renders the tools
    trigger = re.compile(r"(?!)")   # where a call opens in free text (constrained decoding)
    stop: tuple[str, ...] = ()

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def render_call(self, name: str, arguments: Any) -> str:
        return self.begin(name) + json.dumps(arguments, ensure_ascii=False) + self.end()

    def begin(self, name: str) -> str:
        raise NotImplementedError

    def end(self) -> str:
        raise NotImplementedError


class SmolLM2Format(ToolFormat):
    name = "smollm2"
    native = False
    trigger = re.compile(re.escape("<tool_call>"))
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def tool_prompt(self, tools: list[dict]) -> str:
        return SMOLLM2_TOOL_PROMPT.format(tools=json.dumps(tools, ensure_ascii=False))

    ALLOW_LIST = True               # a block may hold a JSON list of calls

    def parse(self, text: str) -> Parsed:
        text = text or ""
        if self.OPEN not in text:
            return Parsed(text.strip())
        calls: list[ToolCall] = []
        content: list[str] = []
        pos = 0
        while True:
            i = text.find(self.OPEN, pos)
            if i < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:i])
            j = text.find(self.CLOSE, i)
            body = text[i + len(self.OPEN): j if j >= 0 else len(text)]
            got, err = _calls_from_json(body.strip(), allow_list=self.ALLOW_LIST)
            if err:
                return Parsed("".join(content).strip(), [], err + ("" if j >= 0 else "; no </tool_call>"), True)
            calls += got
            if j < 0:
                break
            pos = j + len(self.CLOSE)
        return Parsed("".join(content).strip(), calls, None, True)

    def begin(self, name: str) -> str:
        return '<tool_call>[{"name": ' + json.dumps(name) + ', "arguments": '

    def end(self) -> str:
        return "}]</tool_call>"


class HermesFormat(SmolLM2Format):
    name = "hermes"
    native = True

    ALLOW_LIST = False              # one JSON object per <tool_call> block

    def begin(self, name: str) -> str:
        return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '

    def end(self) -> str:
        return "}\n</tool_call>"


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    native = True
    TAG = "<|python_tag|>"
    trigger = re.compile(r"\A\s*(?:<\|python_tag\|>)?\s*(?=\{)")
    _CALL_START = re.compile(r'\A\s*(?:<\|python_tag\|>)?\s*\{\s*"name"')

    def parse(self, text: str) -> Parsed:
        text = text or ""
        s = text.strip()
        tagged = s.startswith(self.TAG)
        if tagged:
            s = s[len(self.TAG):].strip()
        if not s.startswith("{"):
            return Parsed(text.strip())
        parts = [p for p in s.split(";") if p.strip()] if ";" in s else [s]
        calls: list[ToolCall] = []
        for p in parts:
            try:
                obj = json.loads(p)
            except ValueError as e:
                if tagged or self._CALL_START.match(text):
                    return Parsed("", [], f"call is not JSON ({e.msg} at column {e.colno})", True)
                return Parsed(text.strip())      # a reply that merely starts with "{"
            c = _as_call(obj, ("parameters", "arguments"))
            if c is None:
                if tagged:
                    return Parsed("", [], "a call must be a JSON object with a string 'name'", True)
                return Parsed(text.strip())
            calls.append(c)
        return Parsed("", calls, None, True)

    def begin(self, name: str) -> str:
        return '{"name": ' + json.dumps(name) + ', "parameters": '

    def end(self) -> str:
        return "}"


class MistralFormat(ToolFormat):
    name = "mistral"
    native = True
    TAG = "[TOOL_CALLS]"
    trigger = re.compile(r"(?:\[TOOL_CALLS\]\s*)|(?:\A\s*(?=\[\s*\{\s*\"name\"))")

    def parse(self, text: str) -> Parsed:
        text = text or ""
        i = text.find(self.TAG)
        if i >= 0:
            head, body = text[:i], text[i + len(self.TAG):]
        elif re.match(r'\A\s*\[\s*\{\s*"name"', text):
            head, body = "", text
        else:
            return Parsed(text.strip())
        calls, err = _calls_from_json(body.strip())
        if err:
            return Parsed(head.strip(), [], err, True)
        return Parsed(head.strip(), calls, None, True)

    def begin(self, name: str) -> str:
        return '[TOOL_CALLS] [{"name": ' + json.dumps(name) + ', "arguments": '

    def end(self) -> str:
        return "}]"


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (SmolLM2Format(), HermesFormat(), Llama3JsonFormat(),
                                                       MistralFormat())}
TEXT_FORMAT = "smollm2"

# registry names / hub ids -> format (the paper's families; anything else is detected)
_FAMILY_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"qwen2(\.5)?-.*instruct|hermes-?[23]", "hermes"),
    (r"llama-3\.[123].*instruct|llamai", "llama3_json"),
    (r"mistral-7b-instruct-v0\.3|^mistral$", "mistral"),
    (r"smollm2", "smollm2"),
)


def get_format(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown tool format {name!r}; valid: {', '.join(FORMATS)}")
    return FORMATS[name]


def format_for(names: list[str], chat: bool, template: Optional[str] = None,
               template_renders_tools: Optional[bool] = None) -> ToolFormat:
    """The tool format of a model: ``smollm2`` text for base models (raw transcripts); else the
    family's native format when its name (registry name, hub id) is one of the paper's families and
    its template renders tools; else detected from the template text; else the ``smollm2`` text
    format (a template that ignores ``tools``)."""
    if not chat:
        return FORMATS[TEXT_FORMAT]
    for pat, fmt in _FAMILY_PATTERNS:
        if any(n and re.search(pat, n, re.IGNORECASE) for n in names):
            if fmt == TEXT_FORMAT or template_renders_tools is not False:
                return FORMATS[fmt]
    if template_renders_tools and template:
        if "<tool_call>" in template:
            return FORMATS["hermes"]
        if "[TOOL_CALLS]" in template:
            return FORMATS["mistral"]
        if "python_tag" in template or '"parameters"' in template or "parameters" in template:
            return FORMATS["llama3_json"]
    return FORMATS[TEXT_FORMAT]


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the first stop string (excluded), and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)
