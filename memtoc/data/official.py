"""The official MemToC release layout: where its files are and how they are shaped.

The public MemToC release (``ArceniyVarlamov/memtoc``) keeps the benchmark in these files, all paths
relative to the release directory:

* ``results/construction/distractor_mapping_575.json``: the frozen question table, a JSON object whose
  ``rows`` list holds one record per question (``id``, ``instance_id``, ``hop_idx``, ``qkey``,
  ``question``, ``gold_answer``, ``gold_kind``, ``family``, ``final_near``, ``far``, ``source``,
  ``method``, ...); ``summary.final_rows`` states how many. Its near values are those **before** the 39
  repairs (``excluded_rows`` are questions removed at construction, not part of the pool).
* ``benchmark/{reference,paraphrase_a,paraphrase_b}.json``: ``{summary, episodes}``, the evaluated
  episodes of one formulation (575 questions x 5 conditions, repairs applied). Each episode carries
  the question's real ToolHop tool schema (``tool_schema``); ``tool_wrong`` episodes carry the near
  value in ``distractor``.
* ``benchmark/repair_overlay/<formulation>.json``: ``{summary, episodes}``, the 39 repaired
  ``tool_wrong`` episodes; the qkey is ``provenance.qkey`` and the repaired value ``distractor``.
* ``results/quality_control/repair_list_39.json``: ``{schema_version, date, provenance, repairs}``,
  each repair with ``qkey``, ``old_near`` and ``new_near``.
* ``results/quality_control/analysis_set_lists.json``: ``exclude_qkeys`` and ``repair_qkeys``.
* ``results/quality_control/crossfit_folds.json``: the frozen two-fold split (``assignments``).

This module reads and cross-checks those files; ``memtoc.data.benchmark`` assembles the questions.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from memtoc.config.params import FORMULATIONS
from memtoc.core.errors import DataError
from memtoc.core.records import Question

MAPPING = Path("results/construction/distractor_mapping_575.json")
EPISODE_DIR = Path("benchmark")
OVERLAY_DIR = Path("benchmark/repair_overlay")
REPAIR_LIST = Path("results/quality_control/repair_list_39.json")
QC_LISTS = Path("results/quality_control/analysis_set_lists.json")
FOLDS = Path("results/quality_control/crossfit_folds.json")

_ONE_RELEASE = "use the files of one release"


def read_json(path: Path) -> Any:
    """A JSON file's value; an unreadable or malformed file raises a DataError naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e}") from None


def _records(obj: Any, path: Path, key: str, what: str) -> list[dict]:
    """``obj[key]``, a list of JSON objects, or a DataError naming the file and the field."""
    recs = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(recs, list):
        got = f"a JSON object without {key!r}" if isinstance(obj, dict) else f"a {type(obj).__name__}"
        raise DataError(f"{path}: missing field {key!r} (the list of {what}); the file holds {got}. "
                        f"Use the release's own file, a JSON object with a {key!r} list")
    for i, r in enumerate(recs):
        if not isinstance(r, dict):
            raise DataError(f"{path}: {key}[{i}] is a {type(r).__name__}, expected a JSON object")
    return recs


def check_complete(obj: dict, path: Path, key: str, count: str) -> None:
    """The file states how many records ``key`` holds (``summary.<count>``); a shorter list means a
    truncated or edited copy."""
    summary = obj.get("summary")
    stated = summary.get(count) if isinstance(summary, dict) else None
    if isinstance(stated, int) and not isinstance(stated, bool) and stated != len(obj[key]):
        raise DataError(f"{path}: field {key!r} holds {len(obj[key])} records but 'summary.{count}' says "
                        f"{stated}; the file is truncated or edited (use the complete release file)")


def read_mapping_rows(path: Path) -> list[dict]:
    """The question records (``rows``) of ``distractor_mapping_575.json``."""
    obj = read_json(path)
    rows = _records(obj, path, "rows", "question records")
    check_complete(obj, path, "rows", "final_rows")
    if not rows:
        raise DataError(f"{path}: field 'rows' is empty; expected the release's question records")
    return rows


def read_episode_file(path: Path) -> list[dict]:
    """The ``episodes`` of a ``{summary, episodes}`` file (a formulation's episodes or its overlay)."""
    obj = read_json(path)
    eps = _records(obj, path, "episodes", "episode records")
    check_complete(obj, path, "episodes", "n_episodes")
    return eps


def _int(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _episode_key(ep: dict, path: Path, i: int) -> tuple[int, int]:
    inst, hop = _int(ep.get("instance_id")), _int(ep.get("hop_idx"))
    if inst is None or hop is None:
        raise DataError(f"{path}: episodes[{i}] ({ep.get('episode_id', 'no episode_id')}): fields 'instance_id' "
                        "and 'hop_idx' must be integers; use the release's own episode file")
    return inst, hop


def _episode_qkey(ep: dict, path: Path, i: int) -> str:
    qkey = (ep.get("provenance") or {}).get("qkey") if isinstance(ep.get("provenance"), dict) else None
    if not isinstance(qkey, str) or not qkey.strip():
        raise DataError(f"{path}: episodes[{i}] ({ep.get('episode_id', 'no episode_id')}): missing field "
                        "'provenance.qkey'; use the release's own episode file")
    return qkey


def _distractor(ep: dict) -> Any:
    """The near value a ``tool_wrong`` episode shows: ``distractor``, else the tool output's ``result``."""
    if "distractor" in ep:
        return ep["distractor"]
    out = ep.get("tool_output")
    return out.get("result") if isinstance(out, dict) else None


def episode_schemas(root: Path, files: dict[str, str]) -> tuple[dict[tuple[int, int], dict], list[tuple]]:
    """From ``benchmark/<formulation>.json`` (those present): the ToolHop schema per (instance_id,
    hop_idx) and the shown near values ``[(file, episode_id, (instance_id, hop_idx), value)]`` of the
    ``tool_wrong`` episodes (for :func:`check_episode_distractors`). Paths go into ``files``."""
    schemas: dict[tuple[int, int], dict] = {}
    shown: list[tuple] = []
    for form in FORMULATIONS:
        path = root / EPISODE_DIR / f"{form}.json"
        if not path.is_file():
            continue
        files[f"episodes_{form}"] = str(path)
        for i, ep in enumerate(read_episode_file(path)):
            key = _episode_key(ep, path, i)
            sch = ep.get("tool_schema")
            if sch is not None and not isinstance(sch, dict):
                raise DataError(f"{path}: episodes[{i}] ({ep.get('episode_id')}): field 'tool_schema' must be a "
                                f"JSON object or null, got {type(sch).__name__}")
            if sch is not None:
                schemas.setdefault(key, sch)
            if ep.get("condition") == "tool_wrong":
                shown.append((path, ep.get("episode_id"), key, _distractor(ep)))
    return schemas, shown


def check_episode_distractors(questions: list[Question], shown: list[tuple], mapping: str) -> None:
    """Every ``tool_wrong`` episode shows its question's near value with the repairs applied."""
    by_key = {(q.instance_id, q.hop_idx): q for q in questions}
    for path, episode_id, key, value in shown:
        q = by_key.get(key)
        if q is None:
            raise DataError(f"{path}: episode {episode_id}: question {key[0]}.{key[1]} is not in {mapping}; "
                            f"the episode file and the mapping are from different releases ({_ONE_RELEASE})")
        if value != q.near:
            raise DataError(f"{path}: episode {episode_id} (qkey {q.qkey!r}): field 'distractor' is {value!r} but "
                            f"the near value (mapping with the repairs applied) is {q.near!r}; the episode "
                            f"and repair files are from different releases ({_ONE_RELEASE})")


def read_repair_list(path: Path) -> dict[str, dict]:
    """``repair_list_39.json``: ``{qkey: repair}`` with ``qkey``, ``old_near`` and ``new_near``."""
    out: dict[str, dict] = {}
    for i, r in enumerate(_records(read_json(path), path, "repairs", "repairs")):
        qkey, old, new = r.get("qkey"), r.get("old_near"), r.get("new_near")
        if not isinstance(qkey, str) or not isinstance(new, str) or not new.strip() or not isinstance(old, str):
            raise DataError(f"{path}: repairs[{i}] needs the string fields 'qkey', 'old_near' and a non-empty "
                            f"'new_near', got {r!r}")
        if qkey in out:
            raise DataError(f"{path}: repairs[{i}]: qkey {qkey!r} is repaired twice (keep one repair per qkey)")
        out[qkey] = dict(r, file=str(path))
    return out


def read_overlay_dir(root: Path, files: dict[str, str]) -> Optional[dict[str, dict]]:
    """``benchmark/repair_overlay/<formulation>.json`` (those present): ``{qkey: {qkey, new_near, file}}``
    from the ``tool_wrong`` episodes' ``provenance.qkey`` and ``distractor``; the formulations must
    agree. None when the folder holds none of the files."""
    out: Optional[dict[str, dict]] = None
    for form in FORMULATIONS:
        path = root / OVERLAY_DIR / f"{form}.json"
        if not path.is_file():
            continue
        files[f"overlay_{form}"] = str(path)
        these: dict[str, dict] = {}
        for i, ep in enumerate(read_episode_file(path)):
            qkey, new = _episode_qkey(ep, path, i), _distractor(ep)
            if ep.get("condition") != "tool_wrong" or not isinstance(new, str) or not new.strip():
                raise DataError(f"{path}: episodes[{i}] (qkey {qkey!r}): a repair episode must be 'tool_wrong' with "
                                "a non-empty 'distractor'; use the release's own overlay file")
            these[qkey] = {"qkey": qkey, "new_near": new, "file": str(path)}
        if out is None:
            out = these
        else:
            _same_repairs(these, out)
    return out


def _same_repairs(a: dict[str, dict], b: dict[str, dict]) -> None:
    """Two repair sources hold the same qkeys with the same new near values (else a DataError naming
    the file and the qkey)."""
    for x, y in ((a, b), (b, a)):
        extra = next((k for k in x if k not in y), None)
        if extra is not None:
            other = next(iter(y.values()))["file"] if y else "the other repair source"
            raise DataError(f"{x[extra]['file']}: qkey {extra!r} is repaired here but not in {other}; the repair "
                            f"sources disagree ({_ONE_RELEASE})")
    for k, r in a.items():
        if r["new_near"] != b[k]["new_near"]:
            raise DataError(f"{r['file']}: qkey {k!r}: repaired near value {r['new_near']!r} differs from "
                            f"{b[k]['new_near']!r} in {b[k]['file']}; the repair sources disagree ({_ONE_RELEASE})")


def read_repairs(root: Path, repair_qkeys: list[str], qc_path: Path, files: dict[str, str]) -> dict[str, dict]:
    """The 39 repairs ``{qkey: {qkey, new_near[, old_near]}}`` from ``repair_list_39.json`` and/or the
    ``benchmark/repair_overlay/`` files (whichever exist; both must agree) and checked against the QC
    lists' ``repair_qkeys``. ``files["overlay"]`` names the source used."""
    listed = read_repair_list(root / REPAIR_LIST) if (root / REPAIR_LIST).is_file() else None
    overlay = read_overlay_dir(root, files)
    if listed is None and overlay is None:
        raise DataError(f"official release at {root}: no repair source; expected {REPAIR_LIST} or "
                        f"{OVERLAY_DIR}/{{{','.join(FORMULATIONS)}}}.json (the 39 repaired near values)")
    if listed is not None:
        files["repair_list"] = str(root / REPAIR_LIST)
    if listed is not None and overlay is not None:
        _same_repairs(overlay, listed)
    repairs = listed if listed is not None else overlay
    files["overlay"] = next(iter(repairs.values()))["file"] if repairs else str(root / REPAIR_LIST)
    wanted = set(repair_qkeys)
    for k, r in repairs.items():
        if k not in wanted:
            raise DataError(f"{r['file']}: qkey {k!r} is repaired here but is not in 'repair_qkeys' of {qc_path} "
                            f"({_ONE_RELEASE})")
    missing = next((k for k in repair_qkeys if k not in repairs), None)
    if missing is not None:
        raise DataError(f"{qc_path}: 'repair_qkeys' lists {missing!r} but {files['overlay']} has no repair for it "
                        f"({_ONE_RELEASE})")
    return repairs
