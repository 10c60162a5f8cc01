"""``memtoc transfer import --hub``: the paper's external set built from the Hugging Face Hub.

Three datasets, read with ``datasets.load_dataset`` (``HUB_SOURCES``, the one place their names,
configs, splits and columns are written down):

- ``Salesforce/FaithEval-counterfactual-v1.0`` (split ``test``): ``id`` (an ARC-Challenge id),
  ``question``, ``choices {label, text}``, ``answerKey`` (the option the counterfactual passage
  supports: memtoc's ``cf_key``), ``context`` (the passage);
- ``allenai/ai2_arc``, config ``ARC-Challenge`` (splits ``train``, ``validation``, ``test``): ``id``,
  ``question``, ``choices {text, label}``, ``answerKey`` (the world-true option: ``gold_key``);
- ``Salesforce/FaithEval-unanswerable-v1.0`` (split ``test``): ``qid``, ``question``, ``context``
  (a passage that lacks the answer; the row's target is to abstain, so both keys are null).

Each counterfactual row is joined by id to the ARC-Challenge row in whichever split holds it (the
number joined per split is printed and recorded). The serialization filter then drops, and counts
by reason, the rows memtoc's format cannot hold: no ARC-Challenge row (``no_arc_row``), a key not
among the choice labels (``key_not_among_labels``; when the two datasets label the options
differently the world-true key is carried over by option text), the world-true and counterfactual
keys equal (``gold_equals_cf``), an empty passage (``empty_passage``); the rest go through the
format's validator (``failed_validation``, ``duplicate_id``). The file is written atomically, with a
sidecar ``<output>.meta.json`` recording each dataset's name, config, splits, requested revision,
resolved commit, version, fingerprints and row counts.

Offline: ``--from-dir DIR`` reads the same three datasets from ``DIR/<dataset name>/<config>/<split>.parquet``
(e.g. ``DIR/allenai/ai2_arc/ARC-Challenge/test.parquet``; FaithEval's config is ``default``), each
loaded with ``datasets.load_dataset("parquet", ...)``.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import datasets

from memtoc.core.io import atomic_write_text, json_line, sha256_file, sha256_text, write_json
from memtoc.core.scoring import canon
from memtoc.stages.transfer.data import POOLS, TransferDataError, check_row, validate_lines

DEFAULT_CONFIG = "default"
META_SUFFIX = ".meta.json"

#: serialization-filter reasons, in the order they are tested and printed
NO_ARC_ROW = "no_arc_row"
KEY_NOT_AMONG_LABELS = "key_not_among_labels"
GOLD_EQUALS_CF = "gold_equals_cf"
EMPTY_PASSAGE = "empty_passage"
FAILED_VALIDATION = "failed_validation"
DUPLICATE_ID = "duplicate_id"
REASONS = (NO_ARC_ROW, KEY_NOT_AMONG_LABELS, GOLD_EQUALS_CF, EMPTY_PASSAGE, FAILED_VALIDATION, DUPLICATE_ID)
#: the reasons that can drop each kind of row
KIND_REASONS = {"counterfactual": REASONS, "unanswerable": (EMPTY_PASSAGE, FAILED_VALIDATION, DUPLICATE_ID)}
MAX_NOTES = 20


@dataclass(frozen=True)
class HubSource:
    """One Hub dataset: where it lives and the columns the importer reads."""

    role: str                       # counterfactual | arc | unanswerable
    name: str
    config: str
    splits: tuple[str, ...]
    columns: tuple[str, ...]        # required columns (``id_column`` included)
    id_column: str = "id"
    source_tag: str = ""            # the ``source`` field of the rows it yields

    def where(self, split: str) -> str:
        return f"{self.name} (config {self.config}, split {split})"

    def local_path(self, root: Path, split: str) -> Path:
        """Path of ``split`` under a ``--from-dir`` folder."""
        return Path(root) / self.name / self.config / f"{split}.parquet"


COUNTERFACTUAL = HubSource("counterfactual", "Salesforce/FaithEval-counterfactual-v1.0", DEFAULT_CONFIG, ("test",),
                           ("id", "question", "choices", "answerKey", "context"),
                           source_tag="faitheval-counterfactual+arc-challenge")
ARC_CHALLENGE = HubSource("arc", "allenai/ai2_arc", "ARC-Challenge", ("train", "validation", "test"),
                          ("id", "question", "choices", "answerKey"))
UNANSWERABLE = HubSource("unanswerable", "Salesforce/FaithEval-unanswerable-v1.0", DEFAULT_CONFIG, ("test",),
                         ("qid", "question", "context"), id_column="qid", source_tag="faitheval-unanswerable")
HUB_SOURCES = {s.role: s for s in (COUNTERFACTUAL, ARC_CHALLENGE, UNANSWERABLE)}
#: the dataset each kind of row comes from
KIND_SOURCE = {"counterfactual": COUNTERFACTUAL, "unanswerable": UNANSWERABLE}
CHOICE_FIELDS = ("label", "text")


@dataclass
class Loaded:
    """A dataset's splits as ``datasets.Dataset`` objects, and what identifies the copy read."""

    source: HubSource
    splits: dict[str, datasets.Dataset]
    provenance: dict[str, Any] = field(default_factory=dict)


Loader = Callable[[HubSource], Loaded]


# ==================================================================================================
# loaders

def _provenance(src: HubSource, splits: dict[str, datasets.Dataset], **extra: Any) -> dict[str, Any]:
    first = next(iter(splits.values()))
    return {"name": src.name, "config": src.config, "splits": list(src.splits), **extra,
            "version": None if first.info.version is None else str(first.info.version),
            "fingerprints": {s: getattr(d, "_fingerprint", None) for s, d in splits.items()},
            "rows": {s: len(d) for s, d in splits.items()}}


def hub_loader(cache_dir: Optional[str] = None, revisions: Optional[dict[str, str]] = None) -> Loader:
    """Read each dataset from the Hub (or the local ``datasets`` cache) at the requested revision;
    the commit the revision resolved to is recorded."""
    revisions = dict(revisions or {})

    def load(src: HubSource) -> Loaded:
        rev = revisions.get(src.role)
        config = None if src.config == DEFAULT_CONFIG else src.config
        try:
            builder = datasets.load_dataset_builder(src.name, config, revision=rev, cache_dir=cache_dir)
            splits = {s: datasets.load_dataset(src.name, config, split=s, revision=rev, cache_dir=cache_dir)
                      for s in src.splits}
        except Exception as e:   # network, authentication, unknown revision: one line with the way out
            msg = " ".join(str(e).split())
            raise TransferDataError(
                f"could not load {src.where(','.join(src.splits))} from the Hugging Face Hub (revision "
                f"{rev or 'main'}): {type(e).__name__}: {msg}; check the network and HF_HUB_OFFLINE, or read a "
                f"local copy with --from-dir DIR (layout DIR/<dataset name>/<config>/<split>.parquet)") from e
        return Loaded(src, splits, _provenance(src, splits, origin="hub", revision_requested=rev,
                                               commit=getattr(builder, "hash", None)))
    return load


def dir_loader(root, cache_dir: Optional[str] = None) -> Loader:
    """Read each dataset from ``root/<dataset name>/<config>/<split>.parquet`` with ``datasets``."""
    root = Path(root)

    def load(src: HubSource) -> Loaded:
        splits = {}
        files = {}
        for s in src.splits:
            path = src.local_path(root, s)
            if not path.is_file():
                raise TransferDataError(f"{path}: no such file; --from-dir needs {src.where(s)} there "
                                        "(layout DIR/<dataset name>/<config>/<split>.parquet)")
            splits[s] = datasets.load_dataset("parquet", data_files={s: str(path)}, split=s, cache_dir=cache_dir)
            files[s] = {"path": str(path), "sha256": sha256_file(path)}
        return Loaded(src, splits, _provenance(src, splits, origin="dir", revision_requested=None, commit=None,
                                               files=files))
    return load


def check_columns(loaded: Loaded) -> None:
    """Raise one clear error when a split lacks a column the importer reads."""
    src = loaded.source
    for split, ds in loaded.splits.items():
        cols = list(ds.column_names)
        for col in src.columns:
            if col not in cols:
                raise TransferDataError(
                    f"{src.where(split)}: column {col!r} is missing (columns: {', '.join(cols)}); the importer "
                    f"reads {', '.join(src.columns)}; pin the revision with that layout (--revision "
                    f"{src.role}=<commit>) or rename the column in the local copy")
        if "choices" in src.columns:
            feat = ds.features["choices"]
            sub = set(feat) if isinstance(feat, dict) else set()
            for fld in CHOICE_FIELDS:
                if fld not in sub:
                    raise TransferDataError(f"{src.where(split)}: column 'choices' has no field {fld!r} (it is "
                                            f"{feat}); expected choices {{label: [...], text: [...]}}")


# ==================================================================================================
# join and serialization filter

@dataclass
class ImportCounts:
    """What the import read, joined, dropped (per kind and reason) and wrote."""

    read: dict[str, dict[str, int]] = field(default_factory=dict)
    joined: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in KIND_SOURCE})
    written: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KIND_SOURCE})
    notes: list[str] = field(default_factory=list)

    def drop(self, kind: str, reason: str, note: str) -> None:
        self.dropped[kind][reason] += 1
        self.notes.append(f"{kind} {reason}: {note}")

    def to_dict(self) -> dict[str, Any]:
        return {"read": self.read, "joined": self.joined,
                "dropped": {k: {r: c[r] for r in REASONS if c[r]} for k, c in self.dropped.items()},
                "written": self.written}


def _text(v: Any) -> str:
    return "" if v is None else str(v).strip()


def _key(v: Any) -> Optional[str]:
    s = _text(v)
    return s or None


def _choices(row: dict[str, Any]) -> tuple[list[str], list[str]]:
    ch = row.get("choices") or {}
    return [_text(x) for x in ch.get("label") or []], [str(x) for x in ch.get("text") or []]


def world_key(arc_row: dict[str, Any], labels: list[str], texts: list[str]) -> Optional[str]:
    """ARC-Challenge's answerKey in the FaithEval row's labels (carried over by option text when the
    two rows label their options differently)."""
    a_labels, a_texts = _choices(arc_row)
    key = _key(arc_row.get("answerKey"))
    if a_labels == labels or key not in a_labels:
        return key
    gold_text = canon(a_texts[a_labels.index(key)])
    hits = [lab for lab, t in zip(labels, texts) if canon(t) == gold_text]
    return hits[0] if len(hits) == 1 else key


def arc_index(arc: Loaded, counts: ImportCounts) -> dict[str, tuple[str, dict[str, Any]]]:
    """ARC-Challenge rows by id: ``id -> (split, row)``."""
    index: dict[str, tuple[str, dict[str, Any]]] = {}
    for split, ds in arc.splits.items():
        counts.joined[split] = 0
        for row in ds:
            index.setdefault(_text(row["id"]), (split, row))
    return index


def counterfactual_rows(cf: Loaded, index: dict[str, tuple[str, dict[str, Any]]], verified: set[str],
                        counts: ImportCounts) -> list[dict[str, Any]]:
    """Joined counterfactual rows that pass the serialization filter (drops counted)."""
    out = []
    for split, ds in cf.splits.items():
        for n, row in enumerate(ds):
            rid = _text(row["id"]) or f"{COUNTERFACTUAL.name}:{split}:{n}"
            hit = index.get(rid)
            if hit is None:
                counts.drop("counterfactual", NO_ARC_ROW, f"{rid}: no ARC-Challenge row with this id in "
                                                          f"{', '.join(ARC_CHALLENGE.splits)}")
                continue
            arc_split, arc_row = hit
            counts.joined[arc_split] += 1
            labels, texts = _choices(row)
            gold, cf_key = world_key(arc_row, labels, texts), _key(row["answerKey"])
            passage = _text(row["context"])
            if gold not in labels or cf_key not in labels:
                counts.drop("counterfactual", KEY_NOT_AMONG_LABELS,
                            f"{rid}: gold_key {gold!r} / cf_key {cf_key!r} not both among labels {labels}")
            elif gold == cf_key:
                counts.drop("counterfactual", GOLD_EQUALS_CF, f"{rid}: both keys are {gold!r}")
            elif not passage:
                counts.drop("counterfactual", EMPTY_PASSAGE, f"{rid}: empty context")
            else:
                out.append({"id": rid, "kind": "counterfactual", "question": _text(row["question"]),
                            "choices": {"label": labels, "text": texts}, "gold_key": gold, "cf_key": cf_key,
                            "passage": passage, "pools": list(POOLS), "verified": rid in verified,
                            "source": COUNTERFACTUAL.source_tag})
    return out


def unanswerable_rows(un: Loaded, verified: set[str], counts: ImportCounts) -> list[dict[str, Any]]:
    """Unanswerable rows (a passage, null keys); empty passages dropped and counted."""
    out = []
    for split, ds in un.splits.items():
        for n, row in enumerate(ds):
            rid = _text(row[UNANSWERABLE.id_column]) or f"{UNANSWERABLE.name}:{split}:{n}"
            passage = _text(row["context"])
            if not passage:
                counts.drop("unanswerable", EMPTY_PASSAGE, f"{rid}: empty context")
                continue
            out.append({"id": rid, "kind": "unanswerable", "question": _text(row["question"]), "gold_key": None,
                        "cf_key": None, "passage": passage, "pools": ["passage"], "verified": rid in verified,
                        "source": UNANSWERABLE.source_tag})
    return out


def validated(rows: Iterable[dict[str, Any]], counts: ImportCounts) -> list[dict[str, Any]]:
    """Rows that pass the format's row validator, first occurrence of each id; the rest counted."""
    keep, seen = [], set()
    for row in rows:
        item, errs = check_row(row, f"{KIND_SOURCE[row['kind']].name}:{row['id']}")
        if item is None:
            counts.drop(row["kind"], FAILED_VALIDATION, "; ".join(errs))
        elif item.id in seen:
            counts.drop(row["kind"], DUPLICATE_ID, f"{item.id}: id already used by an earlier row")
        else:
            seen.add(item.id)
            keep.append(item.to_json())
            counts.written[item.kind] += 1
    return keep


# ==================================================================================================
# the import

def build_rows(loader: Loader, verified_ids: Iterable[str] = ()) -> tuple[list[dict[str, Any]], ImportCounts,
                                                                          dict[str, Any]]:
    """Load the three datasets, join, filter and validate: ``(rows, counts, provenance by role)``."""
    counts = ImportCounts()
    loaded = {}
    for role, src in HUB_SOURCES.items():
        loaded[role] = loader(src)
        check_columns(loaded[role])
        counts.read[role] = {s: len(d) for s, d in loaded[role].splits.items()}
    verified = set(verified_ids)
    index = arc_index(loaded["arc"], counts)
    rows = counterfactual_rows(loaded["counterfactual"], index, verified, counts)
    rows += unanswerable_rows(loaded["unanswerable"], verified, counts)
    return validated(rows, counts), counts, {r: x.provenance for r, x in loaded.items()}


def meta_path(output) -> Path:
    return Path(str(output) + META_SUFFIX)


def import_hub(output, loader: Loader, verified_ids: Iterable[str] = ()) -> ImportCounts:
    """Build the external set with ``loader`` and write ``output`` and ``output.meta.json`` atomically."""
    rows, counts, provenance = build_rows(loader, verified_ids)
    output = Path(output)
    text = "".join(json_line(r) + "\n" for r in rows)
    v = validate_lines(text.splitlines(), str(output))
    if not v.ok:
        raise TransferDataError(f"{output}: the imported rows fail validation ({'; '.join(v.errors[:3])}); "
                                "please report this with the .meta.json of the inputs")
    atomic_write_text(output, text)
    write_json(meta_path(output), {"command": "memtoc transfer import --hub", "output": str(output),
                                   "output_sha256": sha256_text(text), "datasets": provenance,
                                   "counts": counts.to_dict()})
    return counts


# ==================================================================================================
# command line (flags of ``memtoc transfer import``)

def add_hub_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``--hub`` flags of ``memtoc transfer import``."""
    ap.add_argument("--hub", action="store_true",
                    help="build the set from the Hugging Face Hub: " + ", ".join(
                        f"{s.name}" + ("" if s.config == DEFAULT_CONFIG else f" ({s.config})")
                        for s in HUB_SOURCES.values()))
    ap.add_argument("--from-dir", metavar="DIR",
                    help="read the same datasets from DIR/<dataset name>/<config>/<split>.parquet (no network)")
    ap.add_argument("--cache-dir", metavar="DIR", help="datasets cache folder (default: the datasets library's)")
    ap.add_argument("--revision", action="append", default=[], metavar="ROLE=REV",
                    help=f"pin a dataset's Hub revision (branch, tag or commit); ROLE is one of "
                         f"{', '.join(HUB_SOURCES)}; repeat for each")


def parse_revisions(values: Iterable[str]) -> dict[str, str]:
    out = {}
    for v in values:
        role, sep, rev = v.partition("=")
        if not sep or role not in HUB_SOURCES or not rev.strip():
            raise TransferDataError(f"--revision {v!r}: expected ROLE=REV with ROLE one of "
                                    f"{', '.join(HUB_SOURCES)} (e.g. --revision arc=<commit>)")
        out[role] = rev.strip()
    return out


def print_counts(counts: ImportCounts, output, stream=None) -> None:
    """The counts, on stderr by default: rows read, joined, dropped per reason, written."""
    stream = stream or sys.stderr
    p = "memtoc transfer import --hub:"
    for note in counts.notes[:MAX_NOTES]:
        print(f"{p} left out: {note}", file=stream)
    if len(counts.notes) > MAX_NOTES:
        print(f"{p} left out: ... {len(counts.notes) - MAX_NOTES} more (counts below)", file=stream)
    read = "; ".join(f"{HUB_SOURCES[r].name} " + ", ".join(f"{s} {n}" for s, n in by.items())
                     for r, by in counts.read.items())
    print(f"{p} read {read}", file=stream)
    print(f"{p} joined {sum(counts.joined.values())} counterfactual rows to ARC-Challenge ("
          + ", ".join(f"{s} {n}" for s, n in counts.joined.items()) + ")", file=stream)
    for kind, c in counts.dropped.items():
        print(f"{p} dropped {sum(c.values())} {kind} (" + ", ".join(f"{r} {c[r]}" for r in KIND_REASONS[kind]) + ")",
              file=stream)
    print(f"{p} wrote {counts.written['counterfactual']} counterfactual + {counts.written['unanswerable']} "
          f"unanswerable rows -> {output} (provenance: {meta_path(output)})", file=stream)


def import_hub_cli(a: argparse.Namespace) -> int:
    """``memtoc transfer import --hub | --from-dir DIR`` with the parsed arguments of the import command."""
    if a.counterfactual or a.arc or a.unanswerable:
        raise TransferDataError("--hub/--from-dir build the whole set; leave out --counterfactual, --arc and "
                                "--unanswerable (those read local files instead)")
    revisions = parse_revisions(a.revision)
    if a.from_dir:
        if revisions:
            raise TransferDataError("--revision pins a Hub download; a --from-dir folder is read as it is")
        loader = dir_loader(a.from_dir, a.cache_dir)
    else:
        loader = hub_loader(a.cache_dir, revisions)
    verified: list[str] = []
    if a.verified_ids:
        with open(a.verified_ids, encoding="utf-8") as fh:
            verified = [ln.strip() for ln in fh if ln.strip()]
    counts = import_hub(a.output, loader, verified)
    print_counts(counts, a.output)
    return 0
