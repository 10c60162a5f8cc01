"""The MemToC benchmark: load the question table, QC lists and repairs; folds; question selection.

Two release layouts are read:

* ``compact`` (``../shared/memtoc-release``): ``questions_575.jsonl``, ``qc_lists.json``,
  ``repair_overlay_39.json``.
* ``official`` (the public MemToC release): the question table ``rows`` of
  ``results/construction/distractor_mapping_575.json``, the ToolHop tool schemas of the episode files
  ``benchmark/{reference,paraphrase_a,paraphrase_b}.json``, the QC lists
  ``results/quality_control/analysis_set_lists.json``, and the repairs from
  ``results/quality_control/repair_list_39.json`` and/or ``benchmark/repair_overlay/<formulation>.json``
  (cross-checked). Paths and shapes: :mod:`memtoc.data.official`.

The evaluated benchmark is the table with the repair overlay applied: ``Question.near`` is the
repaired value for the 39 REPAIR questions and ``Question.near_original`` keeps the table's value.

Cross-fitting folds (``Question.fold``, 0 | 1) are the release's frozen two-fold split by chain
(``crossfit_folds.json``; official layout: ``results/quality_control/crossfit_folds.json``): its fold
``A`` is memtoc's fold 0 and ``B`` fold 1. Chains the file does not cover (a new pool, or a chain whose
questions the file does not list) get :func:`assign_folds`, run over those chains only (see
:func:`resolve_folds`); ``load_benchmark(..., folds="rule")`` uses the rule for every chain.
"""
from __future__ import annotations

import argparse
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Optional

from memtoc.config.params import FORMULATIONS, PAPER_SEED, resolve_release_dir
from memtoc.core.errors import DataError
from memtoc.core.jsonl import json_lines
from memtoc.core.records import Question
from memtoc.core.vocab import CORE_CONDITIONS
from memtoc.data import official
from memtoc.data.episodes import build_episodes
from memtoc.data.official import read_json
from memtoc.data.selection import select_questions

COMPACT_FILES = ("questions_575.jsonl", "qc_lists.json", "repair_overlay_39.json")
FOLDS_FILE = "crossfit_folds.json"
#: The release's fold names -> memtoc's fold numbers.
FROZEN_FOLD_NAMES = {"A": 0, "B": 1}
FOLD_MODES = ("frozen", "rule")
OFFICIAL_MAPPING = official.MAPPING
HUMAN_SOURCES = ("dual_human_adjudication",)
HUMAN_METHODS = ("human_authorized",)

#: The paper's construction counts (MemToC release README / semantic review), for side-by-side
#: comparison only; memtoc's own counts are always computed from the data.
PAPER_COUNTS: dict[str, int] = {
    "pool": 575, "analysis": 542, "excluded": 33, "repaired": 39, "pass": 503,
    "far_pool": 463, "far_analysis": 443, "human": 149, "generated": 426, "chains": 309,
    "fold_questions_small": 287, "fold_questions_large": 288,
    "fold_chains_small": 154, "fold_chains_large": 155,
    "episodes_core": 6504,
}


@dataclass
class Benchmark:
    """The loaded benchmark. ``questions`` = the 575-question pool (repair overlay applied, folds
    set); ``analysis`` = the questions not excluded by the semantic review (542)."""

    questions: list[Question]
    release_dir: Path
    layout: str                      # "compact" | "official"
    files: dict[str, str] = field(default_factory=dict)
    #: where the folds came from: {"mode", "file", "frozen_chains", "rule_chains"}
    folds_source: dict[str, Any] = field(default_factory=dict)

    @property
    def analysis(self) -> list[Question]:
        return [q for q in self.questions if not q.excluded]

    @property
    def by_qkey(self) -> dict[str, Question]:
        return {q.qkey: q for q in self.questions}

    def counts(self, episodes: bool = True) -> dict[str, Any]:
        """Construction counts computed from the data (see ``PAPER_COUNTS`` for the paper's)."""
        qs, an = self.questions, self.analysis
        human = [q for q in qs if is_human_distractor(q)]
        fold_q = Counter(q.fold for q in qs)
        fold_c = Counter(f for f in {q.instance_id: q.fold for q in qs}.values())
        out: dict[str, Any] = {
            "layout": self.layout,
            "release_dir": str(self.release_dir),
            "pool": len(qs),
            "analysis": len(an),
            "excluded": sum(q.excluded for q in qs),
            "repaired": sum(q.repaired for q in qs),
            "repaired_in_analysis": sum(q.repaired for q in an),
            "pass": sum((not q.excluded) and (not q.repaired) for q in qs),
            "far_pool": sum(q.far is not None for q in qs),
            "far_analysis": sum(q.far is not None for q in an),
            "human": len(human),
            "generated": len(qs) - len(human),
            "chains": len({q.instance_id for q in qs}),
            "chains_analysis": len({q.instance_id for q in an}),
            "toolhop_schemas": sum(q.schema is not None for q in qs),
            "answer_types": dict(Counter(q.gold_kind for q in qs).most_common()),
            "answer_types_analysis": dict(Counter(q.gold_kind for q in an).most_common()),
            "families": dict(Counter(q.family for q in qs).most_common()),
            "families_analysis": dict(Counter(q.family for q in an).most_common()),
            "methods": dict(Counter(q.method for q in qs).most_common()),
            "folds_questions": {str(k): fold_q[k] for k in sorted(fold_q, key=str)},
            "folds_chains": {str(k): fold_c[k] for k in sorted(fold_c, key=str)},
            "folds_source": dict(self.folds_source),
        }
        if episodes:
            core = build_episodes(an, FORMULATIONS, CORE_CONDITIONS)
            far = build_episodes(an, FORMULATIONS, ("tool_far",))
            out["episodes"] = {
                "core": len(core),
                "core_per_formulation": dict(Counter(e.formulation for e in core)),
                "core_per_condition": dict(Counter(e.condition for e in core)),
                "tool_far": len(far),
            }
        return out


# ----------------------------------------------------------------------------------------------
# Reading helpers

def _records(obj: Any, path: Path, keys: Iterable[str] = ("rows", "records", "items", "data", "mapping",
                                                           "questions", "episodes", "repairs")) -> list[dict]:
    """A list of dict records from a JSON value: a list, a mapping holding a list, or a mapping
    from keys to records (the key is kept as ``_key``)."""
    if isinstance(obj, list):
        recs = obj
    elif isinstance(obj, dict):
        for k in keys:
            if isinstance(obj.get(k), list):
                recs = obj[k]
                break
        else:
            vals = [v for v in obj.values() if isinstance(v, dict)]
            if not vals:
                raise DataError(f"{path}: expected a list of records (or a mapping holding one)")
            recs = [dict(v, _key=k) for k, v in obj.items() if isinstance(v, dict)]
    else:
        raise DataError(f"{path}: expected a list of records, got {type(obj).__name__}")
    for i, r in enumerate(recs):
        if not isinstance(r, dict):
            raise DataError(f"{path}: record {i} is a {type(r).__name__}, expected a JSON object")
    return recs


def _get(rec: dict, names: Iterable[str], default: Any = KeyError) -> Any:
    for n in names:
        if n in rec:
            return rec[n]
    if default is KeyError:
        raise KeyError(tuple(names)[0])
    return default


def qkey_of(text: str) -> str:
    """The release's qkey recipe (lowercase, delete everything but a-z, 0-9 and spaces, collapse
    spaces). Only for data that lacks a qkey: keys are otherwise always taken from the data."""
    return re.sub(r"\s+", " ", re.sub(r"[^a-z0-9\s]", "", text.lower())).strip()


_ALIASES = {
    "id": ("id", "question_id"),
    "instance_id": ("instance_id", "instance", "chain_id"),
    "hop_idx": ("hop_idx", "hop", "hop_index"),
    "qkey": ("qkey",),
    "question": ("question", "question_text"),
    "gold": ("gold_answer", "gold", "answer"),
    "gold_kind": ("gold_kind", "answer_type", "kind"),
    "family": ("family", "question_family"),
    "near": ("final_near", "near", "near_distractor", "distractor"),
    "far": ("far", "far_distractor", "final_far"),
    "source": ("source",),
    "method": ("method",),
    "validation_status": ("validation_status",),
}


def _question_from_row(row: dict, where: str, schema: Optional[dict] = None) -> Question:
    """Build a Question from a table row; a missing or mistyped field raises a DataError naming
    ``where`` (file and line) and the field."""

    def need(key: str, kind: type, allow_none: bool = False, allow_empty: bool = False):
        try:
            v = _get(row, _ALIASES[key])
        except KeyError:
            raise DataError(f"{where}: missing field {_ALIASES[key][0]!r} "
                            f"(accepted names: {', '.join(_ALIASES[key])})") from None
        if v is None and allow_none:
            return None
        if kind is int and isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise DataError(f"{where}: field {_ALIASES[key][0]!r} must be {'an integer' if kind is int else 'a string'}"
                            f"{' or null' if allow_none else ''}, got {v!r}")
        if kind is str and not allow_empty and not v.strip():
            raise DataError(f"{where}: field {_ALIASES[key][0]!r} is empty")
        return v

    instance_id = need("instance_id", int)
    hop_idx = need("hop_idx", int)
    question = need("question", str)
    qkey = _get(row, _ALIASES["qkey"], None)
    if qkey is None:
        qkey = qkey_of(question)
    elif not isinstance(qkey, str) or not qkey.strip():
        raise DataError(f"{where}: field 'qkey' must be a non-empty string, got {qkey!r}")
    qid = _get(row, _ALIASES["id"], None) or f"{instance_id}.{hop_idx}"
    near = need("near", str)
    far = need("far", str, allow_none=True)
    if far is not None and not far.strip():
        far = None
    return Question(
        id=str(qid), instance_id=instance_id, hop_idx=hop_idx, qkey=qkey, question=question,
        gold=need("gold", str), gold_kind=need("gold_kind", str),
        family=str(_get(row, _ALIASES["family"], "") or "unknown"),
        near=near, near_original=near, far=far,
        source=str(_get(row, _ALIASES["source"], "") or ""),
        method=str(_get(row, _ALIASES["method"], "") or ""),
        validation_status=str(_get(row, _ALIASES["validation_status"], "") or ""),
        schema=schema,
    )


def read_question_table(path: Path) -> list[Question]:
    """Read ``questions_575.jsonl``; malformed rows (and a repeated qkey) raise a DataError naming
    file, line and field."""
    out = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for lineno, row, bad in json_lines(fh):
            where = f"{path}, line {lineno}"
            if bad:
                raise DataError(f"{where}: {bad}")
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            q = _question_from_row(row, where)
            if q.qkey in seen:
                raise DataError(f"{where}: qkey {q.qkey!r} repeats line {seen[q.qkey]}; every question of "
                                "the table needs its own qkey (remove or fix the duplicate)")
            seen[q.qkey] = lineno
            out.append(q)
    if not out:
        raise DataError(f"{path}: no questions in the file")
    return out


def _read_qc(path: Path) -> tuple[list[str], list[str]]:
    obj = read_json(path)
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a JSON object with 'exclude_qkeys' and 'repair_qkeys'")
    out = []
    for key in ("exclude_qkeys", "repair_qkeys"):
        v = obj.get(key)
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise DataError(f"{path}: field {key!r} must be a list of qkey strings")
        out.append(v)
    return out[0], out[1]


def _read_overlay(path: Path) -> dict[str, dict]:
    obj = read_json(path)
    if isinstance(obj, dict) and obj and all(isinstance(v, str) for v in obj.values()):
        return {k: {"qkey": k, "new_near": v} for k, v in obj.items()}
    out = {}
    for i, r in enumerate(_records(obj, path)):
        qkey = r.get("qkey", r.get("_key"))
        new = _get(r, ("new_near", "near", "final_near", "replacement"), None)
        if not isinstance(qkey, str) or not isinstance(new, str) or not new.strip():
            raise DataError(f"{path}: record {i}: needs a 'qkey' and a non-empty 'new_near'")
        out[qkey] = r | {"qkey": qkey, "new_near": new}
    return out


def _apply_qc(questions: list[Question], exclude: list[str], repair: list[str],
              overlay: dict[str, dict], files: dict[str, str]) -> list[Question]:
    keys = {q.qkey for q in questions}
    for name, lst, src in (("exclude_qkeys", exclude, files["qc"]), ("repair_qkeys", repair, files["qc"]),
                           ("repair overlay", list(overlay), files["overlay"])):
        missing = [k for k in lst if k not in keys]
        if missing:
            raise DataError(f"{src}: {len(missing)} {name} entries match no question of the table "
                            f"(first: {missing[0]!r}); the QC files and the table are from different releases")
    if set(repair) != set(overlay):
        raise DataError(f"{files['overlay']}: the overlay covers {len(overlay)} qkeys but {files['qc']} lists "
                        f"{len(repair)} repair_qkeys; they must be the same set")
    ex = set(exclude)
    out = []
    for q in questions:
        rep = overlay.get(q.qkey)
        if rep is not None:
            old = rep.get("old_near")
            if isinstance(old, str) and old != q.near_original:
                raise DataError(f"{files['overlay']}: qkey {q.qkey!r}: old_near {old!r} differs from the "
                                f"table's near value {q.near_original!r}")
            q = replace(q, near=rep["new_near"], repaired=True)
        out.append(replace(q, excluded=q.qkey in ex))
    return out


def read_frozen_folds(path: Path) -> dict[int, tuple[int, frozenset[str]]]:
    """The release's frozen split: ``{instance_id: (fold 0 | 1, the chain's qkeys)}`` from
    ``crossfit_folds.json`` (``assignments``: instance_id, fold ``A`` | ``B``, qkeys)."""
    obj = read_json(path)
    recs = obj.get("assignments") if isinstance(obj, dict) else None
    if not isinstance(recs, list):
        raise DataError(f"{path}: expected a JSON object with an 'assignments' list "
                        "(instance_id, fold A|B, qkeys), as in the release's crossfit_folds.json")
    official.check_complete(obj, path, "assignments", "n_instances")
    out: dict[int, tuple[int, frozenset[str]]] = {}
    for i, r in enumerate(recs):
        inst, fold, qkeys = (r.get("instance_id"), r.get("fold"), r.get("qkeys")) if isinstance(r, dict) else (None,) * 3
        if (not isinstance(inst, int) or isinstance(inst, bool) or fold not in FROZEN_FOLD_NAMES
                or not isinstance(qkeys, list) or not all(isinstance(k, str) for k in qkeys)):
            raise DataError(f"{path}: assignments[{i}] needs an integer 'instance_id', 'fold' A or B and a "
                            f"list of 'qkeys', got {r!r}")
        if inst in out:
            raise DataError(f"{path}: instance_id {inst} is assigned twice (assignments[{i}])")
        out[inst] = (FROZEN_FOLD_NAMES[fold], frozenset(qkeys))
    return out


def resolve_folds(questions: Iterable[Question], frozen: Optional[dict[int, tuple[int, frozenset[str]]]] = None,
                  seed: int = PAPER_SEED) -> tuple[dict[int, int], dict[str, int]]:
    """``({instance_id: fold}, {"frozen_chains": n, "rule_chains": m})``.

    A chain takes its frozen fold when ``frozen`` lists its instance_id and every one of the chain's
    qkeys under it (the paper's split). Every other chain (none when ``frozen`` is None) gets the
    deterministic rule :func:`assign_folds`, run over those chains only, so that they are balanced
    among themselves and a chain is never split.
    """
    questions = list(questions)
    by_chain: dict[int, set[str]] = {}
    for q in questions:
        by_chain.setdefault(q.instance_id, set()).add(q.qkey)
    frozen = frozen or {}
    folds = {c: frozen[c][0] for c, keys in by_chain.items() if c in frozen and keys <= frozen[c][1]}
    rest = [q for q in questions if q.instance_id not in folds]
    folds.update(assign_folds(rest, seed) if rest else {})
    n_rule = len({q.instance_id for q in rest})
    return folds, {"frozen_chains": len(by_chain) - n_rule, "rule_chains": n_rule}


def _with_folds(questions: list[Question], folds_file: Optional[Path], files: dict[str, str],
                mode: str = "frozen", seed: int = PAPER_SEED) -> tuple[list[Question], dict[str, Any]]:
    """Set each question's fold: the frozen split of ``folds_file`` (None: none) where it covers a
    chain, the rule elsewhere; ``mode="rule"``: the rule for every chain."""
    if mode not in FOLD_MODES:
        raise DataError(f"folds must be one of {list(FOLD_MODES)}, got {mode!r}")
    path = folds_file if mode == "frozen" else None
    frozen = read_frozen_folds(path) if path is not None else None
    if path is not None:
        files["folds"] = str(path)
    folds, counts = resolve_folds(questions, frozen, seed)
    source = {"mode": mode, "file": str(path) if path else None, **counts}
    return [replace(q, fold=folds[q.instance_id]) for q in questions], source


# ----------------------------------------------------------------------------------------------
# Layouts

def _load_compact(root: Path, folds: str = "frozen") -> Benchmark:
    paths = {name: root / name for name in COMPACT_FILES}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise DataError(f"release directory {root} lacks {', '.join(missing)}; expected the compact "
                        f"layout ({', '.join(COMPACT_FILES)}) or the official one ({OFFICIAL_MAPPING} + "
                        "benchmark/*.json)")
    files = {"table": str(paths["questions_575.jsonl"]), "qc": str(paths["qc_lists.json"]),
             "overlay": str(paths["repair_overlay_39.json"])}
    qs = read_question_table(paths["questions_575.jsonl"])
    exclude, repair = _read_qc(paths["qc_lists.json"])
    overlay = _read_overlay(paths["repair_overlay_39.json"])
    qs = _apply_qc(qs, exclude, repair, overlay, files)
    folds_file = root / FOLDS_FILE if (root / FOLDS_FILE).is_file() else _find_one(root, ("crossfit_folds*.json",))
    qs, source = _with_folds(qs, folds_file, files, folds)
    return Benchmark(questions=qs, release_dir=root, layout="compact", files=files, folds_source=source)


def _find_one(root: Path, patterns: Iterable[str]) -> Optional[Path]:
    for pat in patterns:
        hits = sorted(p for p in root.rglob(pat) if p.is_file())
        if hits:
            return hits[0]
    return None


def _load_official(root: Path, folds: str = "frozen") -> Benchmark:
    mpath = root / official.MAPPING
    files = {"table": str(mpath)}
    rows = official.read_mapping_rows(mpath)
    schemas, shown = official.episode_schemas(root, files)
    qs: list[Question] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        where = f"{mpath}, rows[{i}]"
        q = _question_from_row(row, where)
        q = replace(q, schema=schemas.get((q.instance_id, q.hop_idx)))
        if q.qkey in seen:
            raise DataError(f"{where}: qkey {q.qkey!r} repeats rows[{seen[q.qkey]}]; every question needs its own "
                            "qkey (remove or fix the duplicate)")
        seen[q.qkey] = i
        qs.append(q)
    qc = root / official.QC_LISTS
    if not qc.is_file():
        raise DataError(f"official release at {root}: the QC lists {official.QC_LISTS} are missing; they define "
                        "the 542-question analysis set and the 39 repaired questions (restore the release file)")
    files["qc"] = str(qc)
    exclude, repair = _read_qc(qc)
    repairs = official.read_repairs(root, repair, qc, files)
    qs = _apply_qc(qs, exclude, repair, repairs, files)
    official.check_episode_distractors(qs, shown, str(mpath))
    folds_file = root / official.FOLDS
    qs, source = _with_folds(qs, folds_file if folds_file.is_file() else None, files, folds)
    return Benchmark(questions=qs, release_dir=root, layout="official", files=files, folds_source=source)


def load_benchmark(release_dir=None, folds: str = "frozen") -> Benchmark:
    """Load the benchmark from ``release_dir`` (default: ``$MEMTOC_RELEASE``, then
    ``../shared/memtoc-release``), detecting the compact or the official layout.

    ``folds``: ``"frozen"`` (default: the release's ``crossfit_folds.json`` where it covers a chain,
    the rule elsewhere) or ``"rule"`` (:func:`assign_folds` for every chain)."""
    root = resolve_release_dir(release_dir)
    if (root / OFFICIAL_MAPPING).is_file():
        return _load_official(root, folds)
    return _load_compact(root, folds)


# ----------------------------------------------------------------------------------------------
# Folds and selection

def assign_folds(questions: Iterable[Question], seed: int = PAPER_SEED) -> dict[int, int]:
    """Two chain-level cross-fitting folds by a deterministic rule: ``{instance_id: 0 | 1}``. Used
    for chains that the release's frozen split (``crossfit_folds.json``) does not cover.

    Chains are shuffled with ``random.Random(seed)`` and split in half by chain count (the extra
    chain of an odd count goes to fold 1); then, while the question counts differ by more than one,
    the swap of one chain from the larger fold with one from the smaller fold that best reduces the
    difference is made (ties: first in shuffled order). Chain counts stay balanced, no chain is in
    both folds, and the result depends only on the chains and the seed (not on input order).
    On the 575 pool this gives 287/288 questions from 154/155 chains, the paper's sizes, but not the
    paper's partition (it agrees with the frozen one on about half the chains).
    """
    sizes = Counter(q.instance_id for q in questions)
    chains = sorted(sizes)
    random.Random(seed).shuffle(chains)
    half = len(chains) // 2
    folds = [chains[:half], chains[half:]]
    tot = [sum(sizes[c] for c in f) for f in folds]
    while abs(tot[0] - tot[1]) > 1:
        big, small = (0, 1) if tot[0] > tot[1] else (1, 0)
        diff = tot[big] - tot[small]
        best = None
        for i, a in enumerate(folds[big]):
            for j, b in enumerate(folds[small]):
                d = sizes[a] - sizes[b]
                if 0 < d and abs(diff - 2 * d) < diff and (best is None or abs(diff - 2 * d) < best[0]):
                    best = (abs(diff - 2 * d), i, j, d)
        if best is None:
            break
        _, i, j, d = best
        folds[big][i], folds[small][j] = folds[small][j], folds[big][i]
        tot[big] -= d
        tot[small] += d
    return {c: k for k in (0, 1) for c in folds[k]}


def is_human_distractor(q: Question) -> bool:
    """The distractor was authored by hand (the release's ``human`` source bucket)."""
    return q.source in HUMAN_SOURCES or q.method in HUMAN_METHODS


def fold_strata(questions: Iterable[Question]) -> dict[str, dict[str, Any]]:
    """Per fold (``"0"``, ``"1"``): n_questions, n_instances and the counts by family, answer type
    (``tau``), distractor source (``source_bucket``: human | machine) and their product (``stratum``,
    "family|gold_kind|source"), laid out like the ``summary.folds`` block of crossfit_folds.json."""
    questions = list(questions)
    out: dict[str, dict[str, Any]] = {}
    for k in sorted({q.fold for q in questions if q.fold is not None}):
        qs = [q for q in questions if q.fold == k]
        src = ["human" if is_human_distractor(q) else "machine" for q in qs]
        out[str(k)] = {
            "n_questions": len(qs), "n_instances": len({q.instance_id for q in qs}),
            "family": dict(sorted(Counter(q.family for q in qs).items())),
            "tau": dict(sorted(Counter(q.gold_kind for q in qs).items())),
            "source_bucket": dict(sorted(Counter(src).items())),
            "stratum": dict(sorted(Counter(f"{q.family}|{q.gold_kind}|{s}" for q, s in zip(qs, src)).items())),
        }
    return out


# ----------------------------------------------------------------------------------------------
# CLI

def _format_counts(c: dict[str, Any]) -> str:
    lines = [f"MemToC benchmark ({c['layout']} layout) at {c['release_dir']}"]
    paper = PAPER_COUNTS
    for key, label in (("pool", "construction pool"), ("analysis", "analysis set"), ("pass", "PASS"),
                       ("repaired", "REPAIR (near value replaced)"), ("excluded", "EXCLUDE"),
                       ("far_pool", "far value (pool)"), ("far_analysis", "far value (analysis set)"),
                       ("human", "human-authored distractors"), ("generated", "generator-built distractors"),
                       ("chains", "chains (ToolHop instances)")):
        lines.append(f"  {label:<32} {c[key]:>6}   (paper {paper.get(key, '-')})")
    fq, fc = c["folds_questions"], c["folds_chains"]
    lines.append(f"  {'cross-fitting folds (0 / 1)':<32} {' / '.join(map(str, fq.values()))} questions, "
                 f"{' / '.join(map(str, fc.values()))} chains   (paper {paper['fold_questions_small']}/"
                 f"{paper['fold_questions_large']}, {paper['fold_chains_small']}/{paper['fold_chains_large']})")
    lines.append("  answer types (pool): " + ", ".join(f"{k} {v}" for k, v in c["answer_types"].items()))
    lines.append("  families (pool):     " + ", ".join(f"{k} {v}" for k, v in c["families"].items()))
    if "episodes" in c:
        e = c["episodes"]
        lines.append(f"  {'evaluation episodes (core)':<32} {e['core']:>6}   (paper {paper['episodes_core']}) = "
                     f"{c['analysis']} questions x {len(e['core_per_condition'])} conditions x "
                     f"{len(e['core_per_formulation'])} formulations")
        lines.append(f"  {'tool_far episodes':<32} {e['tool_far']:>6}")
    return "\n".join(lines)


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="memtoc benchmark", description="print benchmark and episode counts")
    ap.add_argument("--release", default=None, help="release directory (default: $MEMTOC_RELEASE or ../shared/memtoc-release)")
    ap.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = ap.parse_args(argv)
    bench = load_benchmark(args.release)
    counts = bench.counts()
    if args.json:
        print(json.dumps({"counts": counts, "paper": PAPER_COUNTS}, indent=1, ensure_ascii=False))
    else:
        print(_format_counts(counts))
    return 0
