"""Claim values: the errors, RFC 6901 JSON pointers, the rounding rules and the report's claim markers
of :mod:`memtoc.stages.report.claims` (its module docstring documents them); re-exported there."""
from __future__ import annotations

import json
import math
import re
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from memtoc.core.errors import MemtocError

RANGE_DASH = "–"
MARKER_RE = re.compile(r"<!--claim:([^>]*?)-->(.*?)<!--/claim-->", re.S)

class ClaimError(MemtocError):
    """The registry, a run file, a pointer or claims.json is missing or malformed."""


class MissingSource(ClaimError):
    """A claim's file or pointer does not exist (the claim cannot be derived)."""


# --------------------------------------------------------------------------------------------
# JSON pointers (RFC 6901)

def escape_token(token: Any) -> str:
    return str(token).replace("~", "~0").replace("/", "~1")


def unescape_token(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def json_pointer(doc: Any, pointer: str, *, where: str = "<document>") -> Any:
    """Return the value at ``pointer`` in ``doc``; raise MissingSource naming the missing token."""
    if pointer == "":
        return doc
    if not pointer.startswith("/"):
        raise ClaimError(f"{where}: JSON pointer {pointer!r} must start with '/' (RFC 6901)")
    cur = doc
    walked = ""
    for raw in pointer[1:].split("/"):
        tok = unescape_token(raw)
        walked += "/" + raw
        if isinstance(cur, dict):
            if tok not in cur:
                raise MissingSource(f"{where}: pointer {pointer} not found: no key {tok!r} at "
                                    f"{walked[:-len(raw) - 1] or '/'} (keys there: {', '.join(map(str, list(cur)[:12]))})")
            cur = cur[tok]
        elif isinstance(cur, list):
            if not re.fullmatch(r"0|[1-9][0-9]*", tok) or int(tok) >= len(cur):
                raise MissingSource(f"{where}: pointer {pointer} not found: index {tok!r} out of range "
                                    f"(list of {len(cur)}) at {walked}")
            cur = cur[int(tok)]
        else:
            raise MissingSource(f"{where}: pointer {pointer} not found: {walked} goes into a "
                                f"{type(cur).__name__}")
    return cur


# --------------------------------------------------------------------------------------------
# Rounding

def parse_rounding(rule: str) -> tuple[str, int]:
    if not isinstance(rule, str) or not rule:
        raise ClaimError(f"rounding rule {rule!r}: expected e.g. 'percent:1', 'decimal:3', 'int', 'exact'")
    kind, _, digits = rule.partition(":")
    if kind in ("percent", "pp", "decimal", "signed"):
        if not digits.isdigit():
            raise ClaimError(f"rounding rule {rule!r}: {kind} needs a number of decimals, e.g. '{kind}:1'")
        return kind, int(digits)
    if kind in ("int", "thousands", "exact") and not digits:
        return kind, 0
    raise ClaimError(f"unknown rounding rule {rule!r}; valid: percent:N, pp:N, decimal:N, signed:N, "
                     "int, thousands, exact")


def _is_missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _quantize(value: Any, digits: int, scale: int = 1) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClaimError(f"value {value!r} is not a number")
    d = Decimal(repr(value)) * scale
    return d.quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)


def format_value(value: Any, rule: str) -> str:
    """Print ``value`` with a rounding rule (module docstring). Returns the printed string."""
    kind, digits = parse_rounding(rule)
    if kind == "exact":
        if isinstance(value, bool):
            return "yes" if value else "no"
        if value is None:
            return "n/a"
        if isinstance(value, (dict, list)):
            return json.dumps(value, ensure_ascii=False, sort_keys=True)
        return str(value)
    if _is_missing(value):
        return "n/a"
    if kind == "percent":
        q = _quantize(value, digits, 100)
    elif kind == "pp":
        q = _quantize(value, digits, 100)
    elif kind in ("decimal", "signed"):
        q = _quantize(value, digits)
    else:  # int / thousands
        q = _quantize(value, 0)
    if q == 0:
        q = abs(q)  # no "-0.0"
    if kind in ("pp", "signed"):
        return f"{q:+f}" if digits else f"{int(q):+d}"
    if kind == "int":
        return str(int(q))
    if kind == "thousands":
        return f"{int(q):,}"
    return f"{q:f}"


# --------------------------------------------------------------------------------------------
# The report's claim markers

def fill_statement(template: str, value: str) -> str:
    """The statement with its printed value (a missing value drops the unit: "n/a", not "n/a%")."""
    if value == "n/a":
        template = template.replace("{value}%", "{value}")
    return template.replace("{value}", value)


def tag(claim: Any, value: str | None = None) -> str:
    """The report's marker for one printed claim value."""
    if not isinstance(claim, str):     # a Claim
        return f"<!--claim:{claim.id}-->{claim.value}<!--/claim-->"
    return f"<!--claim:{claim}-->{value}<!--/claim-->"


def tagged_statement(c: Any) -> str:
    t = c.template.replace("{value}%", "{value}") if c.value == "n/a" else c.template
    return t.replace("{value}", tag(c))


def untagged_numbers(markdown: str) -> list[str]:
    """Lines of report text holding digits outside claim markers, code spans and link targets."""
    text = MARKER_RE.sub("", markdown)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return [ln.strip() for ln in text.splitlines() if re.search(r"\d", ln)]
