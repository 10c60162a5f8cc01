"""The release's computed summaries, read from either release layout into one in-memory structure.

Both layouts carry the same computed summaries under other names; the compact copy
(``../shared/memtoc-release``) was transcribed from the official files field by field:

===================  ==================================  ===================================================
summary              compact file                        official file
===================  ==================================  ===================================================
arm_metrics          published_arm_metrics.json          results/summaries/arm_metrics.json
pooled               published_pooled.json               results/summaries/pooled_across_formulations.json
finetuning           published_finetuning.json           results/finetuning/paired_deltas.json
distractor_distance  published_other.json /distractor_distance   results/distractor_distance/summary.json
acknowledgment       published_other.json /acknowledgment        results/acknowledgment/annotation_round.json
analysis_set         questions_575.jsonl + qc_lists.json  results/construction/distractor_mapping_575.json
                                                         /summary/final_rows + results/quality_control/
                                                         analysis_set_lists.json
===================  ==================================  ===================================================

:func:`open_release` detects the layout (the official one has
``results/construction/distractor_mapping_575.json``, as :func:`memtoc.data.benchmark.load_benchmark`
decides) and returns a :class:`ReleaseData` whose :meth:`ReleaseData.get` gives the same structure
for both; the one difference, the pooled summary's stability verdict (compact: the sentence
``stable_core_rule``; official: the per-ordering flags ``stable_core``), is normalised to
``stable_any``. A summary whose file is absent raises :class:`MissingInput` naming the file, and
the check that needed it is reported ABSENT. A file that the release's ``MANIFEST.json`` marks
truncated counts as absent for the arrays it cut.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Optional

from memtoc.config.params import resolve_release_dir
from memtoc.data.benchmark import OFFICIAL_MAPPING
from memtoc.stages.report.published.result import MissingInput, PublishedCheckError

COMPACT_FILES = {"arm_metrics": "published_arm_metrics.json", "pooled": "published_pooled.json",
                 "finetuning": "published_finetuning.json", "distractor_distance": "published_other.json",
                 "acknowledgment": "published_other.json"}
OFFICIAL_FILES = {"arm_metrics": "results/summaries/arm_metrics.json",
                  "pooled": "results/summaries/pooled_across_formulations.json",
                  "finetuning": "results/finetuning/paired_deltas.json",
                  "distractor_distance": "results/distractor_distance/summary.json",
                  "acknowledgment": "results/acknowledgment/annotation_round.json"}
OFFICIAL_QC = "results/quality_control/analysis_set_lists.json"
#: files of the compact copy that the registry's ``published:`` checks name -> (official file, JSON
#: pointer of the equivalent content; "" = the whole file)
OFFICIAL_ALIASES = {"qc_lists.json": (OFFICIAL_QC, ""),
                    "questions_575.jsonl": (str(OFFICIAL_MAPPING), "/rows"),
                    "semantic_review_summary.json": ("results/quality_control/semantic_review_575.json", ""),
                    "repair_overlay_39.json": ("results/quality_control/repair_list_39.json", "/repairs")}
NONE_STABLE = re.compile(r"\bnone of the tested orderings is stable\b")


def _load(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            return [json.loads(l) for l in text.splitlines() if l.strip()]
        return json.loads(text) if path.suffix == ".json" else text
    except json.JSONDecodeError as e:
        raise PublishedCheckError(f"{path}: not valid JSON ({e}); restore the release file") from e


class ReleaseData:
    """One release directory, either layout; summaries read once (see the module docstring)."""

    def __init__(self, root: Path, layout: str):
        self.dir, self.layout = root, layout
        self._files: dict[str, Any] = {}
        self._summaries: dict[str, Any] = {}
        manifest = root / "MANIFEST.json"
        self._cut = _cut_arrays(_load(manifest)) if manifest.is_file() else {}

    # -- files --------------------------------------------------------------------------------
    def file(self, rel: str, pointer: str = "") -> Any:
        """The parsed file ``rel`` (relative to the release), or the array at ``pointer`` in it."""
        path = self.dir / rel
        if not path.is_file():
            raise MissingInput(str(path))
        if pointer and pointer in self._cut.get(rel, {}):
            raise MissingInput(str(path), f"is truncated at {pointer} ({self._cut[rel][pointer]}, MANIFEST.json)")
        if rel not in self._files:
            self._files[rel] = _load(path)
        doc = self._files[rel]
        for tok in [t for t in pointer.split("/") if t]:
            if not isinstance(doc, dict) or tok not in doc:
                raise MissingInput(f"{path}#{pointer}", "is not in the file")
            doc = doc[tok]
        return doc

    def registry_file(self, rel: str) -> Any:
        """A file the registry's ``published:`` checks name (compact names), in this layout."""
        if self.layout == "compact":
            return self.file(rel)
        if rel == "published_other.json":
            return {"distractor_distance": self.get("distractor_distance"), "acknowledgment": self.get("acknowledgment")}
        if rel in OFFICIAL_ALIASES:
            return self.file(*OFFICIAL_ALIASES[rel])
        raise MissingInput(str(self.dir / rel), "is a file of the compact copy only")

    # -- summaries ----------------------------------------------------------------------------
    def get(self, summary: str) -> Any:
        """The summary ``summary`` (a key of :data:`COMPACT_FILES`, or ``analysis_set``)."""
        if summary not in self._summaries:
            reader = _READERS.get((self.layout, summary))
            if reader is None:
                raise PublishedCheckError(f"unknown release summary {summary!r}")
            self._summaries[summary] = reader(self)
        return self._summaries[summary]

    def source(self, summary: str) -> str:
        names = COMPACT_FILES if self.layout == "compact" else OFFICIAL_FILES
        return names.get(summary, summary)

    def analysis_set_size(self) -> int:
        return int(self.get("analysis_set"))


def _cut_arrays(manifest: dict) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for f in manifest.get("files", []):
        if f.get("status") == "truncated":
            for cut in f.get("cut_arrays", []):
                out.setdefault(f["path"], {})[cut["pointer"]] = (f"{cut.get('kept')} of "
                                                                 f"{cut.get('real_length', '?')} records kept")
    return out


def _stable_any_compact(pooled: dict) -> Optional[bool]:
    rule = pooled.get("stable_core_rule")
    return None if rule is None else (False if NONE_STABLE.search(rule) else True)


def _stable_any_official(pooled: dict) -> Optional[bool]:
    core = pooled.get("stable_core")
    return None if core is None else any(bool(v.get("stable_core")) for v in core.values() if isinstance(v, dict))


def _pooled(stable: Callable[[dict], Optional[bool]]) -> Callable[[ReleaseData], dict]:
    def read(rd: ReleaseData) -> dict:
        doc = dict(rd.file(rd.source("pooled")))
        doc["stable_any"] = stable(doc)
        return doc
    return read


def _analysis_compact(rd: ReleaseData) -> int:
    excl = set(rd.file("qc_lists.json")["exclude_qkeys"])
    return sum(r["qkey"] not in excl for r in rd.file("questions_575.jsonl"))


def _analysis_official(rd: ReleaseData) -> int:
    pool = rd.file(str(OFFICIAL_MAPPING), "/summary/final_rows")
    return int(pool) - len(set(rd.file(OFFICIAL_QC)["exclude_qkeys"]))


_READERS: dict[tuple[str, str], Callable[[ReleaseData], Any]] = {
    ("compact", "arm_metrics"): lambda rd: rd.file(COMPACT_FILES["arm_metrics"]),
    ("compact", "pooled"): _pooled(_stable_any_compact),
    ("compact", "finetuning"): lambda rd: rd.file(COMPACT_FILES["finetuning"]),
    ("compact", "distractor_distance"): lambda rd: rd.file("published_other.json", "/distractor_distance"),
    ("compact", "acknowledgment"): lambda rd: rd.file("published_other.json", "/acknowledgment"),
    ("compact", "analysis_set"): _analysis_compact,
    ("official", "arm_metrics"): lambda rd: rd.file(OFFICIAL_FILES["arm_metrics"]),
    ("official", "pooled"): _pooled(_stable_any_official),
    ("official", "finetuning"): lambda rd: rd.file(OFFICIAL_FILES["finetuning"]),
    ("official", "distractor_distance"): lambda rd: rd.file(OFFICIAL_FILES["distractor_distance"]),
    ("official", "acknowledgment"): lambda rd: rd.file(OFFICIAL_FILES["acknowledgment"]),
    ("official", "analysis_set"): _analysis_official,
}


def open_release(release_dir: str | Path | None = None) -> ReleaseData:
    """The release at ``release_dir`` (default: the usual lookup), layout detected."""
    root = resolve_release_dir(release_dir)
    return ReleaseData(root, "official" if (root / OFFICIAL_MAPPING).is_file() else "compact")
