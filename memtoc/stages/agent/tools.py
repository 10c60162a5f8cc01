"""The fixture tool of the agent loop: its schemas (the episode's, and memtoc's typed variant), the
OpenAI function envelope, argument validation (``jsonschema``), execution and the oracle call.

Schemas
    ``release``  the question's own schema: ToolHop's when the release carries it (official
                 layout), else memtoc's synthesized one (``memtoc.core.prompts.synthesize_schema``: one
                 required string argument). Recorded as ``schema_kind`` toolhop | synthesized.
    ``typed``    **memtoc's own** variant (not the paper's, not ToolHop's): the synthesized schema
                 plus typed *optional* arguments in the style of ToolHop's tools (booleans, a
                 bounded integer, a string enum; :data:`TYPED_COMMON`, :data:`TYPED_BY_KIND`).
                 With one string argument a call cannot carry a type error, so mechanism T1
                 (argument type coercion, e.g. ``"true"`` for a boolean) can only show under this
                 variant or ToolHop's real schemas. Recorded as ``schema_kind`` typed_memtoc.

Execution (PROTOCOL §8, ``FixtureToolAdapter``): no network. The tool returns the episode's frozen
observation whatever the arguments (the override of the tool return); its content is canonical
JSON (sorted keys, compact separators); status ``recoverable_error`` for an ``{"error": ...}``
payload, else ``ok``. Arguments are validated *before* execution: the name must be the tool's, the
arguments a JSON object valid under the schema's ``parameters`` (``jsonschema``, Draft 2020-12).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Optional

import jsonschema

from memtoc.core.prompts import synthesize_schema
from memtoc.core.vocab import SCHEMA_VARIANTS
from memtoc.generation.cache import canonical_json, sha256_text

TYPED_KIND = "typed_memtoc"

#: memtoc's typed optional arguments, shared by every tool of the typed variant.
TYPED_COMMON: dict[str, dict[str, Any]] = {
    "exact_match": {"type": "boolean",
                    "description": "Whether to require an exact match of the looked-up name. Defaults to false."},
    "max_results": {"type": "integer", "minimum": 1, "maximum": 5,
                    "description": "Maximum number of candidate answers to return (1-5). Defaults to 1."},
}
#: ... and per answer type (the ``gold_kind`` of the question).
TYPED_BY_KIND: dict[str, dict[str, dict[str, Any]]] = {
    "person": {"include_full_name": {"type": "boolean",
                                     "description": "Return the full name including middle names. Defaults to true."}},
    "place": {"include_country": {"type": "boolean",
                                  "description": "Append the country to the place name. Defaults to false."}},
    "organization": {"include_abbreviation": {"type": "boolean",
                                              "description": "Also return the abbreviation. Defaults to false."}},
    "work": {"include_year": {"type": "boolean",
                              "description": "Append the release or publication year. Defaults to false."}},
    "date": {"date_format": {"type": "string", "enum": ["iso", "day_month_year", "month_day_year"],
                             "description": "How to write the date. Defaults to iso."}},
    "year": {"calendar": {"type": "string", "enum": ["gregorian", "julian"],
                          "description": "Calendar of the returned year. Defaults to gregorian."}},
    "timezone": {"include_utc_offset": {"type": "boolean",
                                        "description": "Also return the UTC offset. Defaults to false."}},
    "other_string": {"language": {"type": "string", "enum": ["en", "de", "fr", "es"],
                                  "description": "Language of the answer. Defaults to en."}},
}


def typed_schema(question) -> dict[str, Any]:
    """memtoc's typed variant of the synthesized schema (see the module docstring): the same name,
    description and required string argument, plus typed optional arguments. Deterministic."""
    base = synthesize_schema(question)
    props = dict(base["parameters"]["properties"])
    props.update(copy.deepcopy(TYPED_COMMON))
    props.update(copy.deepcopy(TYPED_BY_KIND.get(question.gold_kind, {})))
    return {"name": base["name"],
            "description": base["description"] + " Optional arguments are typed; omit them to use their defaults.",
            "parameters": {"type": "object", "properties": props,
                           "required": list(base["parameters"]["required"])}}


def episode_schema(question, variant: str) -> tuple[dict[str, Any], str]:
    """(schema, schema_kind) of a question under a schema variant (:data:`SCHEMA_VARIANTS`)."""
    if variant == "release":
        if getattr(question, "schema", None):
            return copy.deepcopy(question.schema), "toolhop"
        return synthesize_schema(question), "synthesized"
    if variant == "typed":
        return typed_schema(question), TYPED_KIND
    raise ValueError(f"unknown schema variant {variant!r}; valid: {', '.join(SCHEMA_VARIANTS)}")


def function_tool(schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI ``tools`` entry of a schema (``{"type": "function", "function": schema}``); a schema
    already in that envelope is returned as is."""
    if schema.get("type") == "function" and isinstance(schema.get("function"), dict):
        return schema
    return {"type": "function", "function": schema}


def parameters_of(schema: dict[str, Any]) -> dict[str, Any]:
    fn = function_tool(schema)["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return params


def name_of(schema: dict[str, Any]) -> str:
    return function_tool(schema)["function"]["name"]


# ------------------------------------------------------------------------------------------------
# validation

@dataclass
class CallCheck:
    """The validation of one call before execution."""
    ok: bool
    kind: str                       # ok | wrong_name | not_object | schema
    errors: list[str] = field(default_factory=list)
    type_errors: int = 0            # jsonschema errors of the "type" keyword (T1's raw count)
    coercible: int = 0              # of those, strings that read as the expected type ("true", "3")

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "kind": self.kind, "errors": self.errors, "type_errors": self.type_errors,
                "coercible": self.coercible}


def _coercible(value: Any, expected: Any) -> bool:
    """A string that is the JSON text of the expected type (booleans / numbers serialised as strings)."""
    if not isinstance(value, str):
        return False
    kinds = expected if isinstance(expected, list) else [expected]
    s = value.strip()
    for k in kinds:
        if k == "boolean" and s.lower() in ("true", "false"):
            return True
        if k in ("integer", "number"):
            try:
                float(s) if k == "number" else int(s)
                return True
            except ValueError:
                pass
        if k in ("object", "array"):
            try:
                return isinstance(json.loads(s), dict if k == "object" else list)
            except ValueError:
                pass
    return False


def validate_call(name: Optional[str], arguments: Any, schema: dict[str, Any]) -> CallCheck:
    """Check a call against the tool's schema: the name, the arguments (a JSON object, or its JSON
    text), then ``jsonschema`` on the schema's ``parameters``. Type errors are counted (and those
    whose value is a string of the expected type: coercion, mechanism T1)."""
    want = name_of(schema)
    if name != want:
        return CallCheck(False, "wrong_name", [f"called {name!r}, the tool is {want!r}"])
    args = arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            return CallCheck(False, "not_object", [f"arguments are not JSON ({e})"])
    if not isinstance(args, dict):
        return CallCheck(False, "not_object", [f"arguments must be a JSON object, got {type(args).__name__}"])
    validator_cls = jsonschema.validators.validator_for(parameters_of(schema), default=jsonschema.Draft202012Validator)
    validator = validator_cls(parameters_of(schema))
    errs = sorted(validator.iter_errors(args), key=lambda e: list(e.absolute_path))
    if not errs:
        return CallCheck(True, "ok")
    types = [e for e in errs if e.validator == "type"]
    coerc = sum(_coercible(e.instance, e.validator_value) for e in types)
    msgs = [f"{'/'.join(map(str, e.absolute_path)) or '<arguments>'}: {e.message}" for e in errs]
    return CallCheck(False, "schema", msgs, len(types), coerc)


# ------------------------------------------------------------------------------------------------
# execution

@dataclass(frozen=True)
class ToolResult:
    content: str                    # canonical JSON sent back in the tool message
    status: str                     # ok | recoverable_error
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"content": self.content, "status": self.status, "sha256": self.sha256}


class FixtureTool:
    """The episode's tool: returns the frozen observation whatever the arguments (no network)."""

    def __init__(self, schema: dict[str, Any], observation: Any):
        self.schema = schema
        self.name = name_of(schema)
        self.observation = observation

    def execute(self, arguments: Any = None) -> ToolResult:
        obs = self.observation
        if obs is None:
            obs = {"error": {"type": "tool_unavailable", "message": "the tool has no output for this episode"}}
        content = canonical_json(obs) if not isinstance(obs, str) else obs
        status = "recoverable_error" if isinstance(obs, dict) and "error" in obs else "ok"
        return ToolResult(content, status, sha256_text(content))


# ------------------------------------------------------------------------------------------------
# the oracle call (PROTOCOL §8, arm o1)

def oracle_value(prop: dict[str, Any], question_text: str) -> Any:
    """A value built from a property schema: an enum gives its first value, a string the question
    text, an array [], a boolean False, a number 0, an object its required properties (recursively)."""
    if "enum" in prop and prop["enum"]:
        return prop["enum"][0]
    t = prop.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), t[0] if t else None)
    if t == "string":
        return question_text
    if t == "array":
        return []
    if t == "boolean":
        return False
    if t in ("number", "integer"):
        return 0
    if t == "object" or "properties" in prop:
        props = prop.get("properties") or {}
        return {k: oracle_value(props.get(k, {}), question_text) for k in prop.get("required", [])}
    return question_text


def oracle_arguments(schema: dict[str, Any], question_text: str) -> dict[str, Any]:
    """The synthetic call's arguments: the schema's required properties filled by :func:`oracle_value`."""
    return oracle_value(dict(parameters_of(schema), type="object"), question_text)
