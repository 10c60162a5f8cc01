"""The external multiple-choice counterfactual set: its JSONL format, validation, import, built-in set.

File format (one JSON object a line; ``memtoc transfer validate FILE`` checks every rule)::

    {"id": "arc-0001",                          # unique, non-empty string
     "kind": "counterfactual",                  # counterfactual | unanswerable
     "question": "How many legs does a spider have?",
     "choices": {"label": ["A", "B", "C", "D"], "text": ["8", "6", "10", "4"]},
     "gold_key": "A",                           # the world-true option (ARC-Challenge answerKey)
     "cf_key": "B",                             # the option the counterfactual passage supports
     "passage": "Spiders are arachnids with 6 legs ...",   # the counterfactual passage (FaithEval context)
     "pools": ["value", "passage"],             # optional: frames the item belongs to (default: both)
     "verified": false,                         # optional: human-verified item (the paper's 279/185 pools)
     "source": "faitheval-counterfactual"}      # optional: provenance

    {"id": "un-0001", "kind": "unanswerable", "question": "...", "passage": "...",
     "gold_key": null, "cf_key": null}           # choices optional; no key: the target is to abstain

Rules (each error names ``file:line:field``): valid JSON object; known fields only; ``id`` unique;
``question`` and ``passage`` non-empty; ``choices`` with ``label`` and ``text`` lists of equal
length (>= 2), labels non-empty and distinct, option texts non-empty and distinct after
normalisation; counterfactual rows: ``gold_key`` and ``cf_key`` among the labels (the paper's
serialization filter: "answerKey not among the choice labels", 19 of 1,000 rows) and different;
unanswerable rows: no keys.

``import_faitheval`` builds such a file from local copies of FaithEval counterfactual (fields
``id, question, choices{label,text}, answerKey, context``), FaithEval unanswerable (``qid`` or
``id, question, context, answers``) and ARC-Challenge (Hugging Face layout ``id, question,
choices{text,label}, answerKey`` or the AI2 JSONL layout ``id, question{stem, choices[{text,
label}]}, answerKey``), each as .jsonl, .json or .parquet. The FaithEval row's ``answerKey`` is the
counterfactual key; the ARC row with the same id (else the same normalised question) gives the
world-true key.

The built-in set (``memtoc/data/transfer_builtin.jsonl``) is a small plumbing set written for this
project (60 counterfactual + 30 unanswerable items), not FaithEval and not a replication.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import pandas as pd

from memtoc.core.errors import MemtocError
from memtoc.core.io import json_line
from memtoc.core.jsonl import json_lines, read_lines, split_lines
from memtoc.core.scoring import canon
from memtoc.core.vocab import BUILTIN, POOLS

KINDS = ("counterfactual", "unanswerable")
FIELDS = ("id", "kind", "question", "choices", "gold_key", "cf_key", "passage", "pools", "verified", "source")
BUILTIN_FILE = "transfer_builtin.jsonl"
PLUMBING_NOTE = ("built-in plumbing set written for memtoc (60 counterfactual + 30 unanswerable items), "
                 "not FaithEval/ARC: its numbers test the pipeline and say nothing about the paper's claim")


class TransferDataError(MemtocError):
    """A transfer data file is malformed (the message names file:line:field and the fix)."""


@dataclass(frozen=True)
class TransferItem:
    """One external item: a multiple-choice counterfactual row or an unanswerable row."""

    id: str
    kind: str
    question: str
    labels: tuple[str, ...]
    texts: tuple[str, ...]
    gold_key: Optional[str]
    cf_key: Optional[str]
    passage: str
    pools: tuple[str, ...] = POOLS
    verified: Optional[bool] = None
    source: str = ""

    def option(self, key: Optional[str]) -> Optional[str]:
        """The text of option ``key`` (None for a missing key)."""
        return None if key is None else self.texts[self.labels.index(key)]

    @property
    def gold_text(self) -> Optional[str]:
        return self.option(self.gold_key)

    @property
    def cf_text(self) -> Optional[str]:
        return self.option(self.cf_key)

    def to_json(self) -> dict[str, Any]:
        """The item as one line of the file format."""
        d: dict[str, Any] = {"id": self.id, "kind": self.kind, "question": self.question}
        if self.labels:
            d["choices"] = {"label": list(self.labels), "text": list(self.texts)}
        d.update(gold_key=self.gold_key, cf_key=self.cf_key, passage=self.passage, pools=list(self.pools))
        if self.verified is not None:
            d["verified"] = self.verified
        if self.source:
            d["source"] = self.source
        return d

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Validation:
    """Result of validating a file: the items that passed and one message per problem."""

    path: str
    items: list[TransferItem] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def _is_str(v: Any) -> bool:
    return isinstance(v, str) and bool(v.strip())


def check_row(obj: Any, where: str) -> tuple[Optional[TransferItem], list[str]]:
    """Validate one decoded row. ``where`` = ``file:line``; errors read ``file:line:field: problem``."""
    errs: list[str] = []

    def err(fld: str, msg: str) -> None:
        errs.append(f"{where}:{fld}: {msg}")

    if not isinstance(obj, dict):
        return None, [f"{where}:-: expected a JSON object, got {type(obj).__name__}"]
    for k in sorted(set(obj) - set(FIELDS)):
        err(k, f"unknown field; valid fields are: {', '.join(FIELDS)}")
    if not _is_str(obj.get("id")):
        err("id", "must be a non-empty string")
    kind = obj.get("kind", "counterfactual")
    if kind not in KINDS:
        err("kind", f"must be one of {', '.join(KINDS)}, got {kind!r}")
    if not _is_str(obj.get("question")):
        err("question", "must be a non-empty string")
    if not _is_str(obj.get("passage")):
        err("passage", "is empty; every row needs its passage (the counterfactual context, or the "
                       "context that lacks the answer for an unanswerable row)")
    labels: list[str] = []
    texts: list[str] = []
    ch = obj.get("choices")
    if ch is None:
        if kind == "counterfactual":
            err("choices", 'missing; a counterfactual row needs {"label": [...], "text": [...]}')
    elif not isinstance(ch, dict) or not isinstance(ch.get("label"), list) or not isinstance(ch.get("text"), list):
        err("choices", 'must be {"label": [...], "text": [...]} (two lists)')
    else:
        labels, texts = ch["label"], ch["text"]
        if len(labels) != len(texts):
            err("choices", f"{len(labels)} labels but {len(texts)} texts")
        elif len(labels) < 2:
            err("choices", "needs at least two options")
        if not all(_is_str(x) for x in labels):
            err("choices.label", "every label must be a non-empty string")
        elif len(set(labels)) != len(labels):
            dup = sorted({x for x in labels if labels.count(x) > 1})
            err("choices.label", f"duplicate label(s) {dup}")
        if not all(_is_str(x) for x in texts):
            err("choices.text", "every option text must be a non-empty string")
        else:
            norm = [canon(t) for t in texts]
            if len(set(norm)) != len(norm):
                dup = sorted({t for t, n in zip(texts, norm) if norm.count(n) > 1})
                err("choices.text", f"options {dup} are the same after normalisation; the matcher could not tell them apart")
    gold, cf = obj.get("gold_key"), obj.get("cf_key")
    if kind == "counterfactual":
        for fld, key in (("gold_key", gold), ("cf_key", cf)):
            if not _is_str(key):
                err(fld, "must be one of the choice labels")
            elif labels and key not in labels:
                err(fld, f"{key!r} is not among the choice labels {labels} (the serialization filter: "
                         "drop or repair this row)")
        if _is_str(gold) and gold == cf:
            err("cf_key", f"equals gold_key {gold!r}: the passage must support a wrong option")
    elif kind == "unanswerable":
        for fld, key in (("gold_key", gold), ("cf_key", cf)):
            if key is not None:
                err(fld, "must be null for an unanswerable row (its target is to abstain)")
    pools = obj.get("pools", list(POOLS))
    if not isinstance(pools, list) or not pools or any(p not in POOLS for p in pools):
        err("pools", f"must be a non-empty list drawn from {list(POOLS)}, got {pools!r}")
    ver = obj.get("verified")
    if ver is not None and not isinstance(ver, bool):
        err("verified", f"must be true, false or absent, got {ver!r}")
    if "source" in obj and not isinstance(obj["source"], str):
        err("source", "must be a string")
    if errs:
        return None, errs
    return TransferItem(id=obj["id"], kind=kind, question=obj["question"].strip(), labels=tuple(labels),
                        texts=tuple(texts), gold_key=gold, cf_key=cf, passage=obj["passage"].strip(),
                        pools=tuple(p for p in POOLS if p in pools), verified=ver,
                        source=obj.get("source", "")), []


def validate_lines(lines: Iterable[str], source: str) -> Validation:
    """Validate JSONL lines (blank lines skipped); duplicate ids are reported at their second line."""
    res = Validation(source)
    seen: dict[str, int] = {}
    for lineno, obj, bad in json_lines(lines):
        where = f"{source}:{lineno}"
        if bad:
            res.errors.append(f"{where}:-: {bad}")
            continue
        item, errs = check_row(obj, where)
        if item is not None and item.id in seen:
            errs = [f"{where}:id: duplicate id {item.id!r} (first at line {seen[item.id]})"]
            item = None
        res.errors += errs
        if item is not None:
            seen[item.id] = lineno
            res.items.append(item)
    if not res.items and not res.errors:
        res.errors.append(f"{source}:-:-: no rows")
    return res


def validate_file(path) -> Validation:
    path = Path(path)
    lines = read_lines(path, TransferDataError,
                       missing=f"{path}: no such file; give a JSONL file in the format of memtoc.stages.transfer.data")
    return validate_lines(lines, str(path))


def builtin_path() -> Path:
    """Path of the shipped built-in set (package data ``memtoc/data/transfer_builtin.jsonl``)."""
    return Path(str(resources.files("memtoc") / "data" / BUILTIN_FILE))


def load_items(dataset: str = BUILTIN) -> tuple[list[TransferItem], dict[str, Any]]:
    """Items of ``dataset`` (``"builtin"`` or a path) and a description (path, sha256, counts,
    ``plumbing``). Raises TransferDataError listing the first problems when the file is invalid."""
    path = builtin_path() if dataset == BUILTIN else Path(dataset)
    v = validate_file(path)
    if not v.ok:
        more = f" (+{len(v.errors) - 5} more)" if len(v.errors) > 5 else ""
        raise TransferDataError("invalid transfer data; fix these rows or run `memtoc transfer validate "
                                f"{path}`: " + "; ".join(v.errors[:5]) + more)
    info = {"dataset": dataset, "path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "n_counterfactual": sum(i.kind == "counterfactual" for i in v.items),
            "n_unanswerable": sum(i.kind == "unanswerable" for i in v.items),
            "plumbing": dataset == BUILTIN, "note": PLUMBING_NOTE if dataset == BUILTIN else ""}
    return v.items, info


def write_items(items: Sequence[TransferItem], path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json_line(i.to_json()) + "\n" for i in items), encoding="utf-8")
    return path


# ==================================================================================================
# import from FaithEval / ARC-Challenge files

def read_rows(path) -> list[dict[str, Any]]:
    """Rows of a .jsonl, .json (a list, or {"data": [...]}) or .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise TransferDataError(f"{path}: no such file")
    suf = path.suffix.lower()
    if suf == ".parquet":
        rows = pd.read_parquet(path).to_dict("records")
        return [_plain(r) for r in rows]
    text = path.read_text(encoding="utf-8")
    if suf == ".json":
        obj = json.loads(text)
        rows = obj.get("data", obj.get("rows")) if isinstance(obj, dict) else obj
        if not isinstance(rows, list):
            raise TransferDataError(f"{path}: expected a JSON list of rows (or {{\"data\": [...]}})")
        return rows
    out = []
    for n, obj, bad in json_lines(split_lines(text)):
        if bad:
            raise TransferDataError(f"{path}:{n}: {bad}")
        out.append(obj)
    return out


def _plain(x: Any) -> Any:
    """numpy arrays / scalars from parquet -> lists / Python values."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if hasattr(x, "tolist"):
        return _plain(x.tolist())
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def arc_choices(row: dict[str, Any]) -> tuple[str, list[str], list[str], Optional[str]]:
    """(question text, labels, texts, answerKey) of an ARC row in either public layout."""
    q = row.get("question")
    if isinstance(q, dict):                        # AI2 JSONL: question{stem, choices[{text, label}]}
        chs = q.get("choices") or []
        return (q.get("stem", ""), [str(c.get("label")) for c in chs], [str(c.get("text")) for c in chs],
                row.get("answerKey"))
    ch = row.get("choices") or {}
    return q or "", [str(x) for x in ch.get("label", [])], [str(x) for x in ch.get("text", [])], row.get("answerKey")


def import_faitheval(counterfactual=None, arc=None, unanswerable=None, verified_ids: Iterable[str] = ()
                     ) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of the transfer format from local FaithEval / ARC files, and notes on rows left out.

    Counterfactual rows need ``arc`` for the world-true key (joined by id, else by normalised
    question). Rows are emitted as they are; ``validate_lines`` (run by the CLI on the result)
    applies the serialization filter. Unanswerable rows keep their passage and no key."""
    out: list[dict[str, Any]] = []
    notes: list[str] = []
    verified = set(verified_ids)
    if counterfactual is not None:
        if arc is None:
            raise TransferDataError("--arc is required with --counterfactual: the world-true key comes from "
                                    "ARC-Challenge (FaithEval's answerKey is the counterfactual one)")
        by_id: dict[str, dict] = {}
        by_q: dict[str, dict] = {}
        for r in read_rows(arc):
            q, labels, texts, key = arc_choices(r)
            rec = {"labels": labels, "texts": texts, "key": key}
            if r.get("id") is not None:
                by_id[str(r["id"])] = rec
            by_q.setdefault(canon(q), rec)
        for n, r in enumerate(read_rows(counterfactual), 1):
            rid = str(r.get("id", f"cf-{n}"))
            q, labels, texts, cf_key = arc_choices(r)
            a = by_id.get(rid) or by_q.get(canon(q))
            if a is None:
                notes.append(f"{counterfactual}:{n}: id {rid!r} has no ARC-Challenge row (by id or question); left out")
                continue
            gold = a["key"]
            if a["labels"] != labels and a["labels"]:
                # label sets differ between the two files: carry ARC's key over through the option text
                if gold in a["labels"]:
                    gt = a["texts"][a["labels"].index(gold)]
                    hit = [lab for lab, t in zip(labels, texts) if canon(t) == canon(gt)]
                    gold = hit[0] if len(hit) == 1 else gold
            out.append({"id": rid, "kind": "counterfactual", "question": q,
                        "choices": {"label": labels, "text": texts}, "gold_key": gold, "cf_key": cf_key,
                        "passage": r.get("context", ""), "pools": list(POOLS), "verified": rid in verified,
                        "source": "faitheval-counterfactual+arc-challenge"})
    if unanswerable is not None:
        for n, r in enumerate(read_rows(unanswerable), 1):
            rid = str(r.get("qid", r.get("id", f"un-{n}")))
            row = {"id": rid, "kind": "unanswerable", "question": r.get("question", ""), "gold_key": None,
                   "cf_key": None, "passage": r.get("context", ""), "pools": ["passage"],
                   "verified": rid in verified, "source": "faitheval-unanswerable"}
            out.append(row)
    return out, notes
