"""The run's paper report: ``<run_dir>/paper/report.md`` and ``<run_dir>/paper/claims.json``.

:func:`build_report` resolves the claim registry (``paper/claims.yaml``) against the run's
summaries, adds the claims of "This run and the paper" (:mod:`memtoc.stages.report.replication`: each paper model's
numbers beside the paper's, with a verdict per interval), writes ``claims.json`` and renders
``report.md``: one section per registry section,
the claims without a table as sentences, the table claims as Markdown tables, and the figures found
in ``<run_dir>/figures/``. Every number of the report is a claim value rendered through
:func:`memtoc.stages.report.claims.tag` (an invisible ``<!--claim:ID-->`` marker around it), so
``memtoc verify RUN_DIR`` can check each printed number against its file; the report's own text
carries no digits (identifiers such as model names sit in code spans).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from memtoc.config.runconfig import RunPaths
from memtoc.core.io import atomic_write_text
from memtoc.core.project import REPO_ROOT, bundled_resources
from memtoc.stages.report import claims as C, replication

MISSING_CELL = "—"


def _table(rows_claims: list[C.Claim]) -> str:
    rows: list[str] = []
    cols: list[str] = []
    cells: dict[tuple[str, str], list[C.Claim]] = {}
    for c in rows_claims:
        r, k = c.table["row"], c.table["col"]
        if r not in rows:
            rows.append(r)
        if k not in cols:
            cols.append(k)
        cells.setdefault((r, k), []).append(c)   # several claims in one cell: an interval lo–hi
    out = ["| | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for r in rows:
        out.append(f"| {r} | " + " | ".join(C.RANGE_DASH.join(C.tag(c) for c in cells[(r, k)])
                                          if (r, k) in cells else MISSING_CELL for k in cols) + " |")
    return "\n".join(out)


def render_report(claims: list[C.Claim], omitted: list[dict], sections: dict[str, str],
                  figures: list[Path], run_name: str, provenance: Optional[dict] = None,
                  captions: Optional[dict[str, str]] = None,
                  figure_sections: Optional[dict[str, str]] = None,
                  notes: Optional[dict[str, str]] = None) -> str:
    """The Markdown text of the report (pure: no file access). ``notes``: a line (no digits) under a
    section's heading; a section with a note is shown even without claims."""
    md: list[str] = [f"# MemToC reproduction report: run `{run_name}`", ""]
    md.append("Every number below is read from the run's summaries through the claim registry "
              "(`paper/claims.yaml`) and carries an invisible claim marker; `memtoc verify` re-derives "
              "each one from its file. Rates are percentages; changes are percentage points; "
              "pooled values are the unweighted mean over the formulations.")
    md.append("")
    order = list(sections) + sorted({c.section for c in claims} - set(sections))
    placed = {f.stem: (figure_sections or {}).get(f.stem) for f in figures}
    shown: set[str] = set()
    for sec in order:
        items = [c for c in claims if c.section == sec]
        figs = [f for f in figures if placed[f.stem] == sec]
        note = (notes or {}).get(sec)
        if not items and not figs and not note:
            continue
        md += [f"## {sections.get(sec, sec or 'Other claims')}", ""]
        if note:
            md += [note, ""]
        prose = [c for c in items if not c.table]
        for c in prose:
            md.append(f"- {C.tagged_statement(c)}")
        if prose:
            md.append("")
        tables: dict[str, list[C.Claim]] = {}
        for c in items:
            if c.table:
                tables.setdefault(c.table.get("name", "table"), []).append(c)
        for name, tc in tables.items():
            cap = (captions or {}).get(name)
            md += [f"Table `{name}`" + (f": {cap}" if cap else ""), "", _table(tc), ""]
        for f in figs:
            md += [f"![`{f.stem}`](../figures/{f.name})", ""]
            shown.add(f.name)
    rest = [f for f in figures if f.name not in shown]
    if rest:
        md += ["## Figures", ""]
        for f in rest:
            md += [f"![`{f.stem}`](../figures/{f.name})", ""]
    if omitted:
        md += ["## Not part of this run", "",
               "These registry claims were not resolved because their stage did not run or did not "
               "write the section (the reasons are in `claims.json`):", ""]
        md += [f"- `{o['id']}`" for o in omitted]
        md.append("")
    if provenance:
        md += ["## Provenance", "", "```", json.dumps(provenance, indent=1, default=str), "```", ""]
    return "\n".join(md)


def _provenance(run_dir: Path) -> dict[str, Any]:
    path = RunPaths(run_dir).config_json
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}
    prov = cfg.get("provenance") or {}
    keep = {"started": cfg.get("started"), "git": prov.get("git"), "python": prov.get("python"),
            "packages": prov.get("packages"), "release": (prov.get("release") or {}).get("path")}
    return {k: v for k, v in keep.items() if v}


def build_report(run_dir: str | Path, registry: str | Path | None = None) -> tuple[Path, Path, list[C.Claim]]:
    """Resolve the claims of a run, write ``paper/claims.json`` and ``paper/report.md``.

    Returns (report path, claims path, claims)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise C.ClaimError(f"run directory {run_dir} does not exist; run `memtoc run PARAMS.yaml` first")
    paths = RunPaths(run_dir)
    reg = C.load_registry(registry)
    claims, omitted = C.resolve_all(run_dir, reg)
    beside = replication.build(run_dir)         # "This run and the paper": claims and figure
    claims = claims + beside.claims
    claims_path = C.write_claims(run_dir, claims, omitted, registry)
    figures = sorted(paths.figures.glob("*.png")) if paths.figures.is_dir() else []
    md = render_report(claims, omitted, {**(reg.get("sections") or {}), replication.SECTION: replication.TITLE},
                       figures, run_dir.name, _provenance(run_dir), {**(reg.get("tables") or {}), **beside.captions},
                       {**(reg.get("figures") or {}), replication.FIGURE: replication.SECTION},
                       notes={replication.SECTION: beside.note})
    report_path = atomic_write_text(paths.report_md, md)
    return report_path, claims_path, claims


DEPARTURES = Path("docs") / "departures.md"


def departures_markdown() -> str:
    """The one table of departures from the paper (``docs/departures.md``) without its title, as
    notebook 08 shows it; found in the project folder, else in the installed package's files."""
    for root in (REPO_ROOT, bundled_resources()):
        path = (root / DEPARTURES) if root else None
        if path is not None and path.is_file():
            return path.read_text(encoding="utf-8").split("\n", 1)[-1].strip()
    return ("docs/departures.md is not in this project folder (an older `memtoc init`?): read it in the "
            "memtoc repository")

