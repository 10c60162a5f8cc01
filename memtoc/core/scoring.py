"""Extraction-first answer scoring (PROTOCOL.md §1-§5) and ``memtoc score``.

Two matchers:

``paper`` (default)
    The published deterministic scorer (v1.3), reproduced rule by rule, including the lenient
    character-level containment ("Paris" matches "Parish") and NFKD accent *splitting*
    ("Pérez" -> "pe rez", so "Perez" does not match "Pérez").

``strict`` (opt-in; reported beside the paper numbers, never instead of them)
    The same pipeline with these changes, each one tested in ``tests/unit/test_scoring.py``:

    S1. Accent folding: NFKD, then combining marks are *removed* (not turned into spaces), and a
        few letters without a decomposition are folded (ø->o, æ->ae, œ->oe, ß->ss, ð->d, þ->th,
        đ->d, ł->l, ı->i). "Pérez" == "Perez", "Sørensen" == "Sorensen".
    S2. Word boundaries: containment is on whole tokens (a contiguous run of tokens), so "Paris"
        no longer matches "Parish" and "Jo" no longer matches "John Smith".
    S3. A *complete* answer may be verbose: the answer matches when it contains the whole target
        as a token run ("It was Jewel Staite." matches "Jewel Staite").
    S4. A *partial* answer (a token run inside a longer target) does not match, except when it
        EQUALS (a) the target's head before its first comma ("Stanley Park" for "Stanley Park,
        Blackpool"; any head length, unlike the paper's >= 2 tokens), or (b) the target without a
        trailing parenthetical disambiguator ("Sing" for "Sing (2016 American film)"; "Sing 2"
        does not match), or (c) it passes the person-name rule (S5).
    S5. Person names (only when ``kind == "person"``, i.e. the gold's ``gold_kind``): a one-token
        answer matches when it is the target's LAST token (surname; "Mawson" for "Thomas Mawson",
        but not "Thomas"); a longer answer matches when its tokens are an in-order subsequence of
        the target's that keeps the first and last tokens (middle names dropped: "John Smith" for
        "John Michael Smith"). Without a kind the rule is off and a surname alone does not match.
        The rule only applies to target forms without parentheses ("Boy (album)" mislabelled as a
        person does not let the alias "album" of "October (album)" pass as a surname).
    S6. Years and dates: a bare-year answer matches only a bare-year target ("1950" no longer
        matches "March 3, 1950"). A bare-date target matches only an answer that states the same
        (year, month, day) or contains the target's tokens. Date recognition is more tolerant than
        the paper's: word boundaries on every pattern, "Sept" is a month, and "March 3,1950" (no
        space after the comma) is a date.
    S7. Parenthetical aliases in the answer ("Jane Doe (née Smith)") are kept, with S2-S6 applied
        to the alias.

Both matchers require a non-empty canonical answer and target (an empty answer never matches).
"""
from __future__ import annotations

import argparse
import re
import sys
import unicodedata
from pathlib import Path
from typing import Any, Iterable, Optional

from memtoc.core.errors import MemtocError, check_choice
from memtoc.core.jsonl import parse_records, read_input, write_output

MATCHERS = ("paper", "strict")
OUTCOMES = ("followed_tool", "kept_memory", "both", "neither")
DECISION_FIELDS = ("extracted", "followed_tool", "kept_memory", "final_correct", "abstain",
                   "outcome", "neither_subtype")


class ScoreInputError(MemtocError):
    """A line of a `memtoc score` input file is malformed."""


# --------------------------------------------------------------------------------------------
# §1 extraction
_MARKER = re.compile(r"final\s*:\s*", re.IGNORECASE)
_QUOTE_CHARS = frozenset("'\"\u2019\u2018\u201c\u201d`")
_PLACEHOLDER = "<answer>"
_ANSWER_LABEL = re.compile(r"^[\s*_]*(?:final\s+)?answer\s*:\s*", re.IGNORECASE)


def _lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


def has_final_line(text: Optional[str]) -> bool:
    """Whether a reply carries a ``FINAL:`` marker at all (PROTOCOL §1's pattern): FINAL-line
    compliance, reported per model (App. D)."""
    return bool(text) and _MARKER.search(text) is not None


def extract_final(text: Optional[str]) -> str:
    """The answer span of a reply (PROTOCOL §1): the first line after the last ``FINAL:`` marker.

    No word boundary before the marker ("semifinal: X" counts); hits preceded by a quote character
    are ignored unless every hit is quoted; an echoed ``<answer>`` placeholder falls back to the
    text after it or to the last line before the marker; without a marker the last line is used,
    with the loop-truncation fix. Then a leading answer label is dropped
    (:func:`strip_answer_label`: memtoc's one addition, so every consumer of the span sees it).
    """
    return strip_answer_label(_marked_or_last_line(text))


def strip_answer_label(span: str) -> str:
    """``span`` without a leading answer label, "Answer:" or "Final answer:" (any case, spaces
    allowed before the colon; leading markdown emphasis goes with it, what follows the colon stays,
    as for the FINAL marker). Base models label their first line so ("Answer: 1851"); "Final
    answer:" is not a FINAL marker (PROTOCOL §1: the colon must follow "final"). "A:" is left
    alone: it is an option label of the multiple-choice transfer set ("A: <text>" names option A
    there, ``transfer.matcher``), and as an article it already drops out of ``canon``."""
    return _ANSWER_LABEL.sub("", span, count=1)


def _marked_or_last_line(text: Optional[str]) -> str:
    """PROTOCOL §1 rules 1-6, unchanged."""
    if not text:
        return ""
    text = str(text)
    hits = list(_MARKER.finditer(text))
    if hits:
        unquoted = [h for h in hits if not (h.start() > 0 and text[h.start() - 1] in _QUOTE_CHARS)]
        hit = (unquoted or hits)[-1]
        after = _lines(text[hit.end():])
        span = after[0] if after else ""
        if span[:len(_PLACEHOLDER)].lower() == _PLACEHOLDER:
            rest = span[len(_PLACEHOLDER):].strip()
            if rest:
                return rest
            before = _lines(text[:hit.start()])
            return before[-1] if before else ""
        return span
    lines = _lines(text)
    if not lines:
        return text.strip()
    last = lines[-1]
    for ln in reversed(lines[:-1]):
        if ln != last and ln.startswith(last):
            return ln
    return last


# --------------------------------------------------------------------------------------------
# §2 normalisation
_NONWORD = re.compile(r"[^\w\s]")
_SPACES = re.compile(r"\s+")
_ARTICLES = frozenset({"the", "a", "an"})
_TOKEN_ALIASES = {"st": "saint", "mt": "mount"}
_FOLD = str.maketrans({"ø": "o", "æ": "ae", "œ": "oe", "ß": "ss", "ð": "d", "þ": "th",
                       "đ": "d", "ł": "l", "ı": "i", "ħ": "h"})


def normalize(s: Optional[str]) -> str:
    """Base normalisation (PROTOCOL §2a): NFKD, lowercase, strip, non-word chars -> one space,
    collapse spaces. Combining marks are not word characters, so "Pérez" -> "pe rez"."""
    if s is None:
        return ""
    s = unicodedata.normalize("NFKD", str(s)).lower().strip()
    s = _NONWORD.sub(" ", s)
    return _SPACES.sub(" ", s).strip()


def normalize_strict(s: Optional[str]) -> str:
    """Strict-matcher normalisation (S1): like :func:`normalize` but accents are folded away."""
    if s is None:
        return ""
    s = unicodedata.normalize("NFKD", str(s))
    s = "".join(ch for ch in s if not unicodedata.combining(ch)).lower().translate(_FOLD).strip()
    s = _NONWORD.sub(" ", s)
    return _SPACES.sub(" ", s).strip()


def _canon_tokens(norm: str) -> list[str]:
    return [_TOKEN_ALIASES.get(t, t) for t in norm.split(" ") if t and t not in _ARTICLES]


def canon(s: Optional[str]) -> str:
    """Canonical form (PROTOCOL §2b): normalize, drop the articles the/a/an, st->saint, mt->mount."""
    return " ".join(_canon_tokens(normalize(s)))


def canon_strict(s: Optional[str]) -> str:
    return " ".join(_canon_tokens(normalize_strict(s)))


# --------------------------------------------------------------------------------------------
# §3 matching: dates
_MONTHS = {m: i + 1 for i, m in enumerate(
    ["january", "february", "march", "april", "may", "june", "july", "august", "september",
     "october", "november", "december"])}
_MONTHS.update({m[:3]: i for m, i in list(_MONTHS.items())})
_MONTHS_STRICT = dict(_MONTHS, sept=9)

_DATE_PATTERNS_PAPER = (
    ("ymd", re.compile(r"\b(\d{4})-(\d{1,2})-(\d{1,2})\b", re.IGNORECASE)),
    ("mdy", re.compile(r"([a-z]{3,9})\.?\s+(\d{1,2})(?:st|nd|rd|th)?\s*,?\s+(\d{4})", re.IGNORECASE)),
    ("dmy", re.compile(r"(\d{1,2})(?:st|nd|rd|th)?\s+([a-z]{3,9})\.?,?\s+(\d{4})", re.IGNORECASE)),
)
_DATE_PATTERNS_STRICT = (
    ("ymd", re.compile(r"\b(\d{4})-(\d{1,2})-(\d{1,2})\b", re.IGNORECASE)),
    ("mdy", re.compile(r"\b([a-z]{3,9})\.?\s+(\d{1,2})(?:st|nd|rd|th)?\s*,?\s*(\d{4})\b", re.IGNORECASE)),
    ("dmy", re.compile(r"\b(\d{1,2})(?:st|nd|rd|th)?\s+([a-z]{3,9})\.?,?\s+(\d{4})\b", re.IGNORECASE)),
)


def find_dates(s: Optional[str], strict: bool = False) -> tuple[list[tuple[int, int, int]], str]:
    """Recognise dates (PROTOCOL §3d): the three patterns run in sequence, each recognised date is
    replaced by a space before the next pattern runs; a match whose month word does not resolve or
    whose day is outside 1..31 is left in place. Returns ((year, month, day) list, remaining text)."""
    rest = s or ""
    months = _MONTHS_STRICT if strict else _MONTHS
    found: list[tuple[int, int, int]] = []
    for kind, pat in (_DATE_PATTERNS_STRICT if strict else _DATE_PATTERNS_PAPER):
        def repl(m: re.Match) -> str:
            if kind == "ymd":
                y, mo, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
                ok = 1 <= mo <= 12
            elif kind == "mdy":
                mo, d, y = months.get(m.group(1).lower()), int(m.group(2)), int(m.group(3))
                ok = mo is not None
            else:
                d, mo, y = int(m.group(1)), months.get(m.group(2).lower()), int(m.group(3))
                ok = mo is not None
            if ok and 1 <= d <= 31:
                found.append((y, mo, d))
                return " "
            return m.group(0)
        rest = pat.sub(repl, rest)
    return found, rest


def _bare_date(target: str, strict: bool = False) -> Optional[tuple[int, int, int]]:
    dates, rest = find_dates(target, strict)
    if len(dates) == 1 and (canon_strict(rest) if strict else canon(rest)) == "":
        return dates[0]
    return None


_PAREN = re.compile(r"\(([^()]*)\)")
_ALIAS_PREFIX = re.compile(r"^(?:née|nee|born|formerly|aka|a\.k\.a\.|also known as)\s+", re.IGNORECASE)


def _aliases(answer: str) -> list[str]:
    return [_ALIAS_PREFIX.sub("", g.strip(), count=1) for g in _PAREN.findall(answer)]


def _match_paper(answer: str, target: str) -> bool:
    a, t = canon(answer), canon(target)
    if not a or not t:
        return False
    if t in a or a in t:                                     # (a) containment, character level
        return True
    for alias in _aliases(answer):                           # (b) parenthetical alias in answer
        c = canon(alias)
        if c and (c in t or t in c):
            return True
    if "," in target:                                        # (c) inverted "Name, Title" target
        head = canon(target.split(",", 1)[0])
        if len(head.split()) >= 2 and (head in a or a in head):
            return True
    tdate = _bare_date(target)                               # (d) bare-date equivalence
    if tdate is not None and tdate in find_dates(answer)[0]:
        return True
    return False


# ---- strict matcher
def _has_run(big: list[str], small: list[str]) -> bool:
    n, m = len(big), len(small)
    if m == 0 or m > n:
        return False
    return any(big[i:i + m] == small for i in range(n - m + 1))


def _is_subsequence(small: list[str], big: list[str]) -> bool:
    it = iter(big)
    return all(tok in it for tok in small)


def _strict_pair(a: list[str], t: list[str], kind: Optional[str], whole: bool, name_like: bool) -> bool:
    """``whole``: ``t`` is the full target (a verbose answer may contain it); otherwise ``t`` is a
    secondary form (comma head, target without its disambiguator) that the answer must equal.
    ``name_like``: the target form has no parenthetical, so the person rule may apply."""
    if not a or not t:
        return False
    if a == t or (whole and _has_run(a, t)):                # S3 / S4a / S4b
        return True
    if kind == "person" and name_like and len(t) > 1 and _is_subsequence(a, t):   # S5
        if len(a) == 1:
            return a[0] == t[-1]
        return a[0] == t[0] and a[-1] == t[-1]
    return False


def _match_strict(answer: str, target: str, kind: Optional[str] = None) -> bool:
    a_forms = [canon_strict(answer)] + [canon_strict(x) for x in _aliases(answer)]
    a_forms = [f.split(" ") for f in a_forms if f]
    t_full = canon_strict(target)
    if not a_forms or not t_full:
        return False
    tdate = _bare_date(target, strict=True)
    if tdate is not None:                                    # S6: a bare-date target
        return tdate in find_dates(answer, strict=True)[0] or any(
            _has_run(a, t_full.split(" ")) for a in a_forms)
    t_forms = [(t_full.split(" "), True, "(" not in target)]
    if "," in target:                                        # S4a: head before the first comma
        head = target.split(",", 1)[0]
        t_forms.append((canon_strict(head).split(" "), False, "(" not in head))
    stripped = re.sub(r"\([^()]*\)\s*$", "", target).strip()
    if stripped != target.strip():                           # S4b: trailing disambiguator
        t_forms.append((canon_strict(stripped).split(" "), False, "(" not in stripped))
    return any(_strict_pair(a, t, kind, whole, name_like)
               for a in a_forms for t, whole, name_like in t_forms if t != [""])


def match(answer: Optional[str], target: Optional[str], matcher: str = "paper",
          kind: Optional[str] = None) -> bool:
    """Does ``answer`` match ``target``? ``matcher="paper"`` is PROTOCOL §3 (a)-(e);
    ``matcher="strict"`` is the opt-in stricter matcher described in the module docstring
    (``kind`` = the gold's gold_kind enables its person-name rule; the paper matcher ignores it)."""
    answer = "" if answer is None else str(answer)
    target = "" if target is None else str(target)
    if matcher == "paper":
        return _match_paper(answer, target)
    if matcher == "strict":
        return _match_strict(answer, target, kind)
    check_choice("matcher", matcher, MATCHERS)
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------
# §4a abstention
_ABSTAIN_A1 = re.compile(
    r"\b(unknown"
    r"|do(?:es)?\s*n'?o?t\s*know"
    r"|(?:cannot|can'?t)\s*(?:answer|determine|provide|say|tell)"
    r"|no\s*(?:information|answer|idea)"
    r"|not\s*(?:available|sure)"
    r"|unavailable"
    r"|re-?run the tool"
    r"|unable\s*to"
    r"|na|n/a)\b", re.IGNORECASE)
_ABSTAIN_A2_START = re.compile(
    r"\A(?:(?:i )?need more information|more information is (?:needed|required))", re.IGNORECASE)
_ABSTAIN_A2 = re.compile(
    r"\b(?:(?:cannot|can not|could not) be (?:determined|retrieved|found|verified|identified|established)"
    r"|(?:does|did) not (?:provide|specify|identify|mention|contain|allow|state|answer|include)"
    r"|not (?:provided|specified|mentioned|found|determined|known|possible to determine)"
    r"|insufficient (?:information|data)|(?:information|data) is insufficient"
    r"|insufficient to (?:answer|determine)"
    r"|do(?:es)? not have enough information"
    r"|is not relevant to the question"
    r"|no exact match)", re.IGNORECASE)
_ABSTAIN_B = re.compile(
    r"^\s*(?:(?:unfortunately[,\s]*)?i (?:encountered|ran into) an? (?:issue|error|problem)"
    r"|(?:unfortunately,\s*)?i (?:couldn't|could not|cannot|can't|was unable to) find any information"
    r"|i'?m sorry[^.!?]*i (?:don't|do not) have[^.!?]*information"
    r"|(?:q|question):)", re.IGNORECASE)


def is_abstain(text: Optional[str]) -> bool:
    """Abstention detector (PROTOCOL §4a): pattern group A anywhere (A2's first two only at the very
    start), or pattern group B at the start. Only the straight apostrophe counts ("don’t know"
    does not abstain); "unknown" and a bare "NA"/"n/a" anywhere do."""
    if not text:
        return False
    return bool(_ABSTAIN_A1.search(text) or _ABSTAIN_A2_START.search(text)
                or _ABSTAIN_A2.search(text) or _ABSTAIN_B.search(text))


# --------------------------------------------------------------------------------------------
# §3-§5 per-reply decisions
def outcome_of(followed_tool: bool, kept_memory: bool) -> str:
    if followed_tool and kept_memory:
        return "both"
    if followed_tool:
        return "followed_tool"
    if kept_memory:
        return "kept_memory"
    return "neither"


def score_reply(response: Optional[str], gold: str, tool_value: Optional[str], memory: Optional[str],
                matcher: str = "paper", gold_kind: Optional[str] = None) -> dict[str, Any]:
    """Score one with-tool reply (PROTOCOL §3-§4).

    ``memory`` is the extracted closed-book span; an empty or abstaining span is mem_absent, i.e.
    the parametric span is "" and kept_memory is False. ``tool_value`` is None for tool_error /
    no_tool (followed_tool False). ``gold_kind`` only feeds the strict matcher's person rule.
    """
    check_choice("matcher", matcher, MATCHERS)
    fin = extract_final(response)
    ft, km = source_matches(fin, tool_value, memory, matcher, gold_kind)
    fc = match(fin, gold, matcher, gold_kind)
    ab = is_abstain(fin)
    outcome = outcome_of(ft, km)
    return {
        "extracted": fin,
        "followed_tool": ft,
        "kept_memory": km,
        "final_correct": bool(fc),
        "abstain": bool(ab),
        "outcome": outcome,
        "neither_subtype": neither_subtype(outcome, ab),
    }


def source_matches(answer: str, tool_value: Optional[str], memory: Optional[str], matcher: str = "paper",
                   gold_kind: Optional[str] = None) -> tuple[bool, bool]:
    """(followed_tool, kept_memory) of an answer: it matches the tool value (None: no value to
    follow) / the parametric span (empty or abstaining: mem_absent, nothing to keep)."""
    mem = "" if (not memory or is_abstain(memory)) else str(memory)
    ft = tool_value is not None and match(answer, str(tool_value), matcher, gold_kind)
    km = bool(mem) and match(answer, mem, matcher, gold_kind)
    return bool(ft), bool(km)


def neither_subtype(outcome: str, abstain: bool) -> Optional[str]:
    """``abstain`` / ``other`` for a neither outcome, None otherwise."""
    return ("abstain" if abstain else "other") if outcome == "neither" else None


def memory_status(closed_book_response: Optional[str], gold: str, matcher: str = "paper",
                  gold_kind: Optional[str] = None) -> tuple[str, bool, Optional[bool]]:
    """(span, mem_absent, memory_correct) of a closed-book reply (PROTOCOL §5)."""
    check_choice("matcher", matcher, MATCHERS)
    span = extract_final(closed_book_response) if closed_book_response else ""
    mem_absent = (not span) or is_abstain(span)
    memory_correct = None if mem_absent else bool(match(span, gold, matcher, gold_kind))
    return span, bool(mem_absent), memory_correct


# --------------------------------------------------------------------------------------------
# memtoc score
_REQUIRED = {"response": (str,), "gold": (str,), "tool_value": (str, type(None)),
             "memory": (str, type(None))}
_OPTIONAL = {"id": (str, int), "question": (str,), "gold_kind": (str, type(None))}


def _check_record(obj: Any) -> Optional[str]:
    """None if ``obj`` is a valid input record, else a description of what is wrong."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    for field, types in _REQUIRED.items():
        if field not in obj:
            return f"missing field {field!r}"
        if not isinstance(obj[field], types) or isinstance(obj[field], bool):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            return f"field {field!r} must be {want}, got {type(obj[field]).__name__}"
    for field, types in _OPTIONAL.items():
        if field in obj and (not isinstance(obj[field], types) or isinstance(obj[field], bool)):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            return f"field {field!r} must be {want}, got {type(obj[field]).__name__}"
    return None


def score_lines(lines: Iterable[str], source: str = "<input>", matcher: str = "paper"
                ) -> tuple[list[dict[str, Any]], list[str]]:
    """Score JSONL lines. Returns (scored records, error messages "source:line: ...")."""
    objs, errors = parse_records(lines, source, _check_record)
    out = [{**obj, **score_reply(obj["response"], obj["gold"], obj["tool_value"], obj["memory"],
                                 matcher=matcher, gold_kind=obj.get("gold_kind"))} for obj in objs]
    return out, errors


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="memtoc score",
        description="Re-score replies offline with the MemToC scorer (PROTOCOL.md §1-§4). Each input "
                    "line is a JSON object with response (raw reply text), gold, tool_value (null "
                    "for tool_error / no_tool), memory (the extracted closed-book answer, may be "
                    "empty or null); optional id, question, gold_kind. Each output line is the input "
                    "object plus extracted, followed_tool, kept_memory, final_correct, abstain, "
                    "outcome, neither_subtype.",
        epilog="Exit status: 0 when every line was scored; 1 when some line was malformed (bad JSON, "
               "a missing field or a field of the wrong type): those lines are reported on stderr "
               "with file, line number and field, and every other line is still scored; 2 on a "
               "usage error or an unreadable input file.")
    ap.add_argument("input", help="input JSONL file ('-' for stdin)")
    ap.add_argument("-o", "--output", help="output JSONL file (default: stdout)")
    ap.add_argument("--matcher", default="paper", choices=MATCHERS,
                    help="paper (default; the published v1.3 rules) or strict (word boundaries, accent "
                         "folding, person-name and year rules)")
    args = ap.parse_args(argv)

    out = Path(args.output) if args.output else None
    lines, source = read_input(args.input, out, ScoreInputError, "memtoc score")
    records, errors = score_lines(lines, source=source, matcher=args.matcher)
    for err in errors:
        print(f"memtoc score: malformed line: {err}", file=sys.stderr)
    write_output(records, out, ScoreInputError)
    counts = {o: sum(r["outcome"] == o for r in records) for o in OUTCOMES}
    n = len(records)
    fc = sum(r["final_correct"] for r in records)
    ab = sum(r["abstain"] for r in records)
    print(f"memtoc score: {n} scored, {len(errors)} malformed, matcher={args.matcher}; "
          + ", ".join(f"{k} {v}" for k, v in counts.items())
          + f"; final_correct {fc}/{n}, abstain {ab}/{n}"
          + (f" -> {args.output}" if args.output else ""), file=sys.stderr)
    return 1 if errors else 0
