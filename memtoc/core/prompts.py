"""Prompt assembly: the three formulations, closed-book variants, frames, arms, tool payloads.

Every prompt is a single user-turn string that ends with a newline (PROTOCOL.md §7). Tool schemas
and tool outputs are serialised with ``json.dumps(obj, ensure_ascii=False)`` (default separators
``", "`` and ``": "``).

A with-tool prompt is assembled from parts, in this order::

    header "\\n"
    [schema label + schema JSON "\\n"]        (frame "schema" only)
    output label + tool-output JSON "\\n"
    [mitigation sentence "\\n"]               (arms warn / prior / flag)
    FINAL-line instruction "\\n"
    question label + question "\\n"

With the default frame and arm this reproduces the released ``with_tool`` templates of
``formulations.json`` byte for byte (a unit test checks it against the release file).

Wording that is *not* in the release and was written here (flagged where defined):

* the forced closed-book sentence of paraphrase A and B (``FORCED_SENTENCE``);
* the passage-frame header of paraphrase A and B (``PASSAGE_HEADER``);
* the error payloads ``timeout`` and ``permission_denied`` and the noop payload.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

from memtoc.core.errors import check_choice
from memtoc.core.vocab import (
    ARMS,
    CLOSED_BOOK_VARIANTS,
    FORMULATIONS,
    FRAMES,
    PAYLOAD_KINDS,
    PROMPTING_ARMS,
    PROTOCOL_ARM,
)

# ----------------------------------------------------------------------------------------------
# Formulation parts (byte-exact to formulations.json / PROTOCOL.md §7)

# Closed-book instruction, up to (not including) the sentence that the forced variant replaces.
CLOSED_BOOK_LEAD = {
    "reference": "Answer the question using ONLY your own internal knowledge. Do not assume any external tool or document.",
    "paraphrase_a": "Relying solely on what you already know (no tools, no lookup), answer the question.",
    "paraphrase_b": "From memory only, what is the answer? Do not use any external source.",
}
# The permissive sentence (UNKNOWN allowed): the released closed-book prompt.
PERMISSIVE_SENTENCE = {
    "reference": "If you do not know, write UNKNOWN.",
    "paraphrase_a": "If unsure, say UNKNOWN.",
    "paraphrase_b": "Unknown is an acceptable answer.",
}
# The forced best-guess sentence. Reference: verbatim from formulations.json (closed_book_forced).
# Paraphrase A and B: NOT in the release; written here from its hints ("give the most likely answer
# anyway" / "always provide a concrete guess"), in the register of each paraphrase.
FORCED_SENTENCE = {
    "reference": "Even if you are not sure, commit to your single best guess — do not refuse and do not say you don't know.",
    "paraphrase_a": "If unsure, give the most likely answer anyway — do not refuse.",
    "paraphrase_b": "Always provide a concrete guess; not knowing is not an acceptable answer.",
}
FINAL_LINE = {
    "reference": "End your reply with one line that starts with 'FINAL: ' followed by your answer.",
    "paraphrase_a": "Finish with a single line that starts with 'FINAL: ' and then your answer.",
    "paraphrase_b": "Your last line must start with 'FINAL: ' followed by the answer itself.",
}
QUESTION_LABEL = {"reference": "Question: ", "paraphrase_a": "Q: ", "paraphrase_b": "Question: "}

# With-tool header = sentences; the "protocol sentence" (the no-more-calls sentence) is kept
# separately so the no_protocol_sentence ablation can drop it.
TOOL_HEADER = {
    "reference": ("You called the tool below; its output is shown.",
                  "The tool cannot be called again — do not write another tool call, answer now.",
                  "Use the output together with your judgment to answer the question."),
    "paraphrase_a": ("A tool was invoked and returned the result below.",
                     "Do not attempt another tool call; answer the question directly.",
                     ""),
    "paraphrase_b": ("Here is a tool and what it returned.",
                     "No further tool calls are possible — give the final answer to the question yourself.",
                     ""),
}
SCHEMA_LABEL = {"reference": "Tool schema: ", "paraphrase_a": "Tool: ", "paraphrase_b": "Schema: "}
OUTPUT_LABEL = {"reference": "Tool output: ", "paraphrase_a": "Result: ", "paraphrase_b": "Returned: "}

# Passage (retrieval-snippet) frame. Reference header: verbatim from formulations.json
# (with_tool_passage). Paraphrase A and B headers: NOT in the release; faithful paraphrases written
# here (same three-part structure as their tool headers). Labels: from formulations.json.
PASSAGE_HEADER = {
    "reference": ("You retrieved the snippet below from a document search; it is shown.",
                  "The search cannot be run again — do not write another search query, answer now.",
                  "Use the snippet together with your judgment to answer the question."),
    "paraphrase_a": ("A document search was run and returned the snippet below.",
                     "Do not attempt another search; answer the question directly.",
                     ""),
    "paraphrase_b": ("Here is a snippet that a document search returned.",
                     "No further searches are possible — give the final answer to the question yourself.",
                     ""),
}
PASSAGE_LABEL = {"reference": "Retrieved snippet: ", "paraphrase_a": "Snippet: ", "paraphrase_b": "Retrieved: "}

# Mitigation sentences (PROTOCOL.md §7, control arms), inserted on their own line right before the
# FINAL-line instruction. One per ``vocab.PROMPTING_ARMS`` (checked below).
MITIGATION = {
    "warn": "Note: tool outputs may be wrong or stale; weigh the tool output against your own knowledge before answering.",
    "prior": "If you are confident in your own knowledge and it contradicts the tool output, trust your own knowledge; follow the tool output only when you have no confident knowledge of your own.",
    "flag": "If the tool output conflicts with your own knowledge, state the discrepancy explicitly in one sentence before your final line. If you cannot tell which side is right, answer 'FINAL: UNKNOWN'.",
}

assert tuple(MITIGATION) == PROMPTING_ARMS, "prompts.MITIGATION: one sentence per vocab.PROMPTING_ARMS"

# ----------------------------------------------------------------------------------------------
# Tool payloads

#: The paper's fixed tool_error payload (byte-exact; PROTOCOL.md §7, formulations.json).
ERROR_PAYLOADS: dict[str, dict[str, Any]] = {
    "service_unavailable": {"error": "InternalServiceError",
                            "message": "upstream database temporarily unavailable; cached value may be stale",
                            "code": 503},
    # The two below are memtoc's additions (not in the paper): same shape, other failure causes.
    "timeout": {"error": "GatewayTimeout",
                "message": "upstream database did not respond within 30 seconds; request timed out",
                "code": 504},
    "permission_denied": {"error": "PermissionDenied",
                          "message": "caller lacks permission to read this record; access denied",
                          "code": 403},
}

#: NoopTool interface control (memtoc's choice, not in the paper): the call succeeds but carries no
#: competing factual value. ``result`` is null, so the scorer's tool value (``tool_output["result"]``)
#: is None and followed_tool is always False; the episode keeps the question's own tool schema, so
#: it differs from tool_right only in the returned value.
NOOP_OUTPUT: dict[str, Any] = {"status": "ok", "result": None,
                               "message": "request completed; no data returned"}


def error_payload(kind: str = "service_unavailable") -> dict[str, Any]:
    """A copy of the tool_error payload of the given kind (see ``PAYLOAD_KINDS``)."""
    check_choice("payload kind", kind, PAYLOAD_KINDS)
    return dict(ERROR_PAYLOADS[kind])


def value_output(value: str) -> dict[str, Any]:
    """The tool return of a value-carrying condition: ``{"result": value}``."""
    return {"result": value}


def to_json(obj: Any) -> str:
    """JSON as the release serialises it: non-ASCII kept, default separators."""
    return json.dumps(obj, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------
# Prompts

def _join_header(parts: tuple[str, str, str], drop_protocol: bool) -> str:
    first, protocol, last = parts
    kept = [first] + ([] if drop_protocol else [protocol]) + [last]
    return " ".join(s for s in kept if s)


def closed_book_prompt(question_text: str, formulation: str, variant: str = "forced") -> str:
    """The closed-book (parametric memory) prompt.

    ``variant="permissive"`` is the released closed-book prompt (UNKNOWN allowed).
    ``variant="forced"`` (the paper's primary analysis) replaces the UNKNOWN sentence with a
    best-guess sentence: verbatim from the release for the reference formulation; for paraphrase A
    and B the release only gives a hint, and the sentence was written here (``FORCED_SENTENCE``).
    """
    check_choice("formulation", formulation, FORMULATIONS)
    check_choice("closed-book variant", variant, CLOSED_BOOK_VARIANTS)
    sentence = (FORCED_SENTENCE if variant == "forced" else PERMISSIVE_SENTENCE)[formulation]
    return (f"{CLOSED_BOOK_LEAD[formulation]} {sentence}\n{FINAL_LINE[formulation]}\n"
            f"{QUESTION_LABEL[formulation]}{question_text}\n")


def header(formulation: str, frame: str = "schema", arm: str = "untreated") -> str:
    """The first line of a with-tool prompt (without its newline).

    The ``no_protocol_sentence`` ablation drops the sentence that says no further call is possible:
    reference "The tool cannot be called again — do not write another tool call, answer now.";
    paraphrase A "Do not attempt another tool call; answer the question directly.";
    paraphrase B "No further tool calls are possible — give the final answer to the question
    yourself." (in the passage frame, the matching search sentence). The rest of the header stays.
    Note: PROTOCOL.md §7 guesses the paper's "nosentence" arm may instead have removed the "Use the
    output together with your judgment" sentence; memtoc follows its issue and removes the
    no-more-calls sentence.
    """
    parts = (PASSAGE_HEADER if frame == "passage" else TOOL_HEADER)[formulation]
    return _join_header(parts, drop_protocol=(arm == PROTOCOL_ARM))


def with_tool_prompt(question_text: str, formulation: str, schema: Optional[dict], tool_output: Any,
                     frame: str = "schema", arm: str = "untreated") -> str:
    """A with-tool prompt (PROTOCOL.md §7).

    frame ``schema``: header, schema line, output line (the released prompt);
    ``no_schema``: the schema line removed; ``passage``: schema removed, document-search header and
    the output line relabelled ("Retrieved snippet:" / "Snippet:" / "Retrieved:"); the returned
    payload itself is serialised the same way in every frame.
    arm ``warn`` / ``prior`` / ``flag``: the mitigation sentence on its own line right before the
    FINAL-line instruction; ``no_protocol_sentence``: see :func:`header`.
    """
    check_choice("formulation", formulation, FORMULATIONS)
    check_choice("frame", frame, FRAMES)
    check_choice("arm", arm, ARMS)
    lines = [header(formulation, frame, arm)]
    if frame == "schema":
        if schema is None:
            raise ValueError("the schema frame needs a tool schema")
        lines.append(SCHEMA_LABEL[formulation] + to_json(schema))
    label = PASSAGE_LABEL if frame == "passage" else OUTPUT_LABEL
    lines.append(label[formulation] + to_json(tool_output))
    if arm in MITIGATION:
        lines.append(MITIGATION[arm])
    lines.append(FINAL_LINE[formulation])
    lines.append(QUESTION_LABEL[formulation] + question_text)
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Schema synthesis (the compact release carries no ToolHop schemas)

_RELATIONS = ("father", "mother", "spouse", "child", "son", "daughter", "sibling", "brother", "sister")
_ROLES = ("author", "director", "publisher", "producer", "composer", "creator", "performer",
          "developer", "designer", "screenwriter", "founder", "editor", "architect", "manufacturer")

_FAMILY_SCHEMAS = {
    "genealogy": ("get_{rel}", "Look up the {rel} of a person in a genealogical knowledge base.",
                  "person_name", "Full name of the person whose {rel} is requested."),
    "creator_role": ("get_{rel}", "Return the {rel} of a creative work or publication.",
                     "work_title", "Title of the work or publication."),
    "birth_death_date": ("get_{rel}", "Return the {rel} of a person, as a calendar date.",
                         "person_name", "Full name of the person."),
    "birth_death_place": ("get_{rel}", "Return the {rel} of a person.",
                          "person_name", "Full name of the person."),
}
_KIND_RETURNS = {
    "person": "the person's full name", "place": "the place name", "organization": "the organization name",
    "work": "the title of the work", "year": "a four-digit year", "date": "a calendar date",
    "timezone": "an IANA time zone identifier (e.g. Europe/Paris)", "other_string": "a short text answer",
}
_FREE_FORM_NAMES = {
    "person": "find_person", "place": "find_place", "organization": "find_organization",
    "work": "find_work", "year": "find_year", "date": "find_date", "timezone": "get_time_zone",
    "other_string": "lookup_fact",
}


def _relation(question_text: str, family: str) -> str:
    q = question_text.lower()
    if family == "genealogy":
        return next((r for r in _RELATIONS if re.search(rf"\b{r}\b", q)), "parent")
    if family == "creator_role":
        return next((r for r in _ROLES if re.search(rf"\b{r}\b", q)), "creator")
    if family == "birth_death_date":
        return "date_of_death" if "death" in q or "die" in q else "date_of_birth"
    if family == "birth_death_place":
        return "place_of_death" if "death" in q or "die" in q else "place_of_birth"
    return ""


def synthesize_schema(question) -> dict[str, Any]:
    """A deterministic, plausible function schema for a question without a ToolHop schema.

    Built from ``question.family`` and ``question.gold_kind`` only (plus the relation word of the
    question for the relation families: father/mother/..., author/director/...). The same question
    always gets the same schema (no randomness). Episodes record
    ``schema_kind="synthesized"`` for these and ``"toolhop"`` for real ToolHop schemas.
    """
    family, kind = question.family, question.gold_kind
    returns = _KIND_RETURNS.get(kind, "a short text answer")
    if family in _FAMILY_SCHEMAS:
        rel = _relation(question.question, family)
        name_t, desc_t, arg, arg_desc = _FAMILY_SCHEMAS[family]
        name = name_t.format(rel=rel)
        desc = desc_t.format(rel=rel.replace("_", " ")) + f" Returns {returns}."
        arg_desc = arg_desc.format(rel=rel.replace("_", " "))
    else:
        name = _FREE_FORM_NAMES.get(kind, "lookup_fact")
        desc = f"Answer a factual question from an encyclopedic knowledge base. Returns {returns}."
        arg, arg_desc = "query", "The entity or fact to look up, in natural language."
    return {
        "name": name,
        "description": desc,
        "parameters": {
            "type": "object",
            "properties": {arg: {"type": "string", "description": arg_desc}},
            "required": [arg],
        },
    }
