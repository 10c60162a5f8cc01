"""Multiple-choice matcher (extraction-first) and ``memtoc transfer score``.

:func:`match_choice` reads the answer span with MemToC's extractor (``scoring.extract_final``: the
line after the last ``FINAL:``) and maps it to an option label, in this order (the first rule that
decides wins; ``rule`` names it):

1. ``label``     a bare label form: ``B``, ``(B)``, ``B)``, ``B.``, ``Option B``, ``Answer: B``,
                 ``The answer is B``, or a label followed by text (``B. Paris``, ``B) Paris``) whose
                 text is empty, is option B's text, or is no option's text (a label followed by
                 another option's text is a conflict -> unmatched);
2. ``text``      the option text itself (MemToC canonical form: case, punctuation, articles);
3. ``abstain``   MemToC's abstention detector (``scoring.is_abstain``) -> ``ABSTAIN``;
4. ``contains``  unique containment on whole tokens: exactly one option's text inside the answer
                 ("I think it is evaporation"), where an option nested inside a longer contained
                 option counts for the longer one; else the answer inside exactly one option's text;
5. ``numeric``   numeric prefix: a bare number equal to the first token of exactly one option
                 ("83" for "83 331", the paper's disclosed repair);
6. otherwise unmatched (``matched`` None). The unmatched rate is reported per arm; a gap above
   0.03 between arms is flagged (the paper's repair was triggered by 7.65% vs 0.71%).
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from memtoc.core.errors import MemtocError
from memtoc.core.jsonl import parse_records, read_input, write_output
from memtoc.core.scoring import canon, extract_final, is_abstain

ABSTAIN = "ABSTAIN"
RULES = ("label", "text", "abstain", "contains", "numeric")

_LABEL_FORM = re.compile(
    r"^(?P<pre>(?:the\s+)?(?:correct\s+|best\s+|final\s+)?(?:answer|option|choice)(?:\s+is)?\s*[:\-]?\s*)?"
    r"(?P<open>[\(\[])?\s*(?P<tok>[A-Za-z0-9]{1,2})(?![A-Za-z0-9])\s*(?P<close>[\)\]])?\s*(?P<sep>[.:,;\-])?"
    r"\s*(?P<rest>.*)$", re.IGNORECASE | re.DOTALL)


class TransferScoreError(MemtocError):
    """A `memtoc transfer score` input or output is unusable."""


@dataclass(frozen=True)
class ChoiceMatch:
    extracted: str
    matched: Optional[str]      # a label, ABSTAIN, or None (unmatched)
    rule: Optional[str]         # which rule decided (None: unmatched)


def _tokens(s: str) -> list[str]:
    return canon(s).split()


def _has_run(big: list[str], small: list[str]) -> bool:
    n = len(small)
    return n > 0 and any(big[i:i + n] == small for i in range(len(big) - n + 1))


def _text_match(s: str, labels: Sequence[str], texts: Sequence[str]) -> Optional[str]:
    c = canon(s)
    hits = [lab for lab, t in zip(labels, texts) if c and canon(t) == c]
    return hits[0] if len(hits) == 1 else None


def _label_form(span: str, labels: list[str], texts: list[str]) -> Optional[str]:
    """The label of a label form, "" for a conflicting one ("B. <text of C>"), None if no label form."""
    m = _LABEL_FORM.match(span)
    if not m or not labels:
        return None
    tok, rest = m.group("tok"), m.group("rest").strip()
    marked = bool(m.group("pre") or m.group("open") or m.group("close") or m.group("sep"))
    if rest and not marked:           # "A cat ..." is a sentence, not a label form
        return None
    lab = tok if tok in labels else None
    if lab is None and (not rest or m.group("pre") or m.group("open") or m.group("close")):
        hits = [x for x in labels if x.lower() == tok.lower()]
        lab = hits[0] if len(hits) == 1 else None
    if lab is None:
        return None
    if not rest:
        return lab
    other = _text_match(rest, labels, texts)
    if other is not None:
        return lab if other == lab else ""
    rt = _tokens(rest)
    named = [x for x, t in zip(labels, texts) if _has_run(rt, _tokens(t))]
    if not named or named == [lab]:
        return lab
    return ""


def match_choice(response: Optional[str], labels: Sequence[str], texts: Sequence[str]) -> ChoiceMatch:
    """Map a reply to an option label, ``ABSTAIN`` or None (see the module docstring). Pure."""
    span = extract_final(response or "").strip()
    labels, texts = list(labels), list(texts)
    if not span:
        return ChoiceMatch(span, None, None)
    # 1. label forms
    lab = _label_form(span, labels, texts)
    if lab is not None:
        return ChoiceMatch(span, lab or None, "label" if lab else None)
    # 2. exact option text
    hit = _text_match(span, labels, texts)
    if hit is not None:
        return ChoiceMatch(span, hit, "text")
    # 3. abstention
    if is_abstain(span):
        return ChoiceMatch(span, ABSTAIN, "abstain")
    toks = _tokens(span)
    opt = [(lab, _tokens(t)) for lab, t in zip(labels, texts)]
    # 4. unique containment
    inside = [(lab, t) for lab, t in opt if _has_run(toks, t)]
    if inside:
        maximal = [(lab, t) for lab, t in inside
                   if not any(len(o) > len(t) and _has_run(o, t) for _, o in inside)]
        if len(maximal) == 1:
            return ChoiceMatch(span, maximal[0][0], "contains")
    else:
        around = [lab for lab, t in opt if _has_run(t, toks)]
        if len(around) == 1:
            return ChoiceMatch(span, around[0], "contains")
    # 5. numeric prefix
    if len(toks) == 1 and toks[0].isdigit():
        num = [lab for lab, t in opt if t and t[0] == toks[0]]
        if len(num) == 1:
            return ChoiceMatch(span, num[0], "numeric")
    return ChoiceMatch(span, None, None)


def score_record(obj: dict[str, Any]) -> dict[str, Any]:
    """The decision fields of one reply: extracted, matched, match_rule, correct, followed_cf, abstain."""
    ch = obj.get("choices") or {"label": [], "text": []}
    m = match_choice(obj.get("response"), ch["label"], ch["text"])
    gold, cf = obj.get("gold_key"), obj.get("cf_key")
    return {"extracted": m.extracted, "matched": m.matched, "match_rule": m.rule,
            "correct": None if gold is None else m.matched == gold,
            "followed_cf": None if cf is None else m.matched == cf,
            "abstain": m.matched == ABSTAIN}


def _check_record(obj: Any) -> Optional[str]:
    if not isinstance(obj, dict):
        return f"-: expected a JSON object, got {type(obj).__name__}"
    if not isinstance(obj.get("response"), str):
        return "response: missing or not a string"
    ch = obj.get("choices")
    if not isinstance(ch, dict) or not isinstance(ch.get("label"), list) or not isinstance(ch.get("text"), list) \
            or len(ch["label"]) != len(ch["text"]) or not all(isinstance(x, str) for x in ch["label"] + ch["text"]):
        return 'choices: must be {"label": [...], "text": [...]} (string lists of equal length)'
    for fld in ("gold_key", "cf_key"):
        v = obj.get(fld)
        if fld == "gold_key" and fld not in obj:
            return "gold_key: missing (null for an unanswerable row)"
        if v is not None and (not isinstance(v, str) or v not in ch["label"]):
            return f"{fld}: {v!r} is not among the choice labels {ch['label']}"
    return None


def score_lines(lines: Iterable[str], source: str = "<input>") -> tuple[list[dict[str, Any]], list[str]]:
    """Score JSONL lines: (records with the decision fields added, errors ``source:line:field: ...``)."""
    objs, errors = parse_records(lines, source, _check_record, sep="", json_field="-:")
    out = [{**obj, **score_record(obj)} for obj in objs]
    return out, errors


def score_cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="memtoc transfer score",
        description="Re-score multiple-choice replies offline. Input lines: response, choices "
                    '{"label": [...], "text": [...]}, gold_key (null for unanswerable rows), optional '
                    "cf_key. Output lines add extracted, matched (a label, ABSTAIN or null), match_rule, "
                    "correct, followed_cf, abstain.",
        epilog="Exit status 0: every line scored; 1: some lines malformed (reported on stderr with "
               "file:line:field, left out; the others are scored); 2: usage error.")
    ap.add_argument("input", help="input JSONL file ('-' for stdin)")
    ap.add_argument("-o", "--output", required=True, help="output JSONL (must differ from the input)")
    a = ap.parse_args(argv)
    dst = Path(a.output)
    lines, source = read_input(a.input, dst, TransferScoreError, "memtoc transfer score")
    records, errors = score_lines(lines, source)
    for e in errors:
        print(f"memtoc transfer score: malformed line: {e}", file=sys.stderr)
    write_output(records, dst, TransferScoreError)
    n = len(records)
    um = sum(r["matched"] is None for r in records)
    print(f"memtoc transfer score: {n} scored, {len(errors)} malformed, unmatched {um}/{n}, "
          f"correct {sum(bool(r['correct']) for r in records)}, abstain {sum(r['abstain'] for r in records)} -> {dst}",
          file=sys.stderr)
    return 1 if errors else 0
