"""``memtoc verify --published``: the MemToC paper's printed numbers against values re-derived from
the release's computed summaries through memtoc's own analysis code.

* The paper's printed numbers are repository files, ``paper/published/`` (:mod:`.printed`; each
  value with the table, section or appendix that prints it).
* The release's computed summaries are read from either release layout, compact or official, into
  one structure (:mod:`.release`); a check whose input is absent is ABSENT, naming the file.
* The release's rates are rebuilt as scored frames with the same counts (:mod:`.frames`) and run
  through the pipeline: ``metrics.pooled_point_metrics`` (Table 1), notebook 03's prompting section
  ``analyses.arm_comparison`` (Table 4: the Reference formulation's rates; §5.4: its question-paired
  contrasts, ``intervals.contrast``), ``metrics.formulation_spread`` (§5.3),
  ``stats.paired_contrast`` / ``stats.holm_family`` / ``stats.success_criterion`` (§5.2, Table 1's
  criterion, distractor distance, protocol sentence), ``stats.ranking_stability`` (the orderings).
* Each check's ``via`` (the outermost function) and ``calls`` (every pipeline function that ran)
  are recorded from the call itself (:mod:`.via`).

Each check is ``{"id", "family", "published", "derived", "status", "via", "detail", "source", "calls"}``.
Statuses:

``MATCH``          the printed and the re-derived value agree at the printed precision
``DISAGREEMENT``   a documented disagreement: the paper contradicts its own data (reason in ``detail``)
``UNPUBLISHED``    re-derived, but no printed value is transcribed in ``paper/published/``
``ABSENT``         the release lacks an input (``detail`` names the file)
``MISMATCH``       a failure
"""
from __future__ import annotations

from pathlib import Path

from memtoc.stages.report import claims
from memtoc.stages.report.published.checks import (
    check_pooled,
    check_sec5_4,
    check_table1,
    check_table4,
    guarded,
    prompting_sections,
    sec5_4_ids,
    table1_ids,
    table4_ids,
)
from memtoc.stages.report.published.contrasts import check_far_protocol, check_finetune, far_ids, finetune_ids
from memtoc.stages.report.published.frames import count_of, release_frame, release_units
from memtoc.stages.report.published.printed import PUBLISHED_DIR, printed as printed_numbers
from memtoc.stages.report.published.registry import registry_checks
from memtoc.stages.report.published.release import ReleaseData, open_release
from memtoc.stages.report.published.result import (
    STATUSES,
    Check,
    Collector,
    MissingInput,
    PublishedCheckError,
    PublishedResult,
    fmt,
)
from memtoc.stages.report.published.via import PIPELINE_MODULES, Traced, trace

__all__ = ["verify_published", "PublishedResult", "Check", "PublishedCheckError", "MissingInput", "STATUSES",
           "open_release", "ReleaseData", "release_frame", "release_units", "count_of", "fmt", "printed_numbers",
           "PUBLISHED_DIR", "trace", "Traced", "PIPELINE_MODULES"]


def verify_published(release_dir: str | Path | None = None, registry: str | Path | dict | None = None) -> PublishedResult:
    """Every printed number the release's summaries support, re-derived through memtoc's analysis
    functions, on either release layout."""
    rd = open_release(release_dir)
    reg = claims.load_registry(registry)
    out = Collector()
    guarded(out, "table1", table1_ids, lambda: check_table1(rd, out), "paper Table 1")
    sections: dict = {}
    guarded(out, "table4", table4_ids, lambda: sections.update(prompting_sections(rd)), "paper Table 4")
    if sections:
        check_table4(sections, out)
        check_sec5_4(sections, out)
    else:
        guarded(out, "sec5_4", sec5_4_ids, lambda: prompting_sections(rd), "paper §5.4")
    guarded(out, "pooled", lambda: ["pooled.*"], lambda: check_pooled(rd, out), rd.source("pooled"))
    guarded(out, "finetune", finetune_ids, lambda: check_finetune(rd, out), rd.source("finetuning"))
    guarded(out, "far", far_ids, lambda: check_far_protocol(rd, out), rd.source("distractor_distance"))
    registry_checks(rd, reg.get("published") or [], out)
    ids = [c.id for c in out.checks]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise PublishedCheckError(f"published check ids are produced twice: {sorted(dup)[:5]}")
    return PublishedResult(out.checks, str(rd.dir), rd.layout)
