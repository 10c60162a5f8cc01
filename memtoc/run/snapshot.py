"""``make docs`` / ``python -m memtoc.run.snapshot RUN_DIR DEST``: a finished run, rendered for readers.

Copies into ``DEST`` (default ``docs/results/``) what a reader on GitHub wants to see without running
anything: the nine executed notebooks (with their tables and figures), ``paper/report.md`` and
``paper/claims.json``, the summaries the claims are read from, and the figures; machine paths are
replaced by placeholders (``<repo>``, ``<run>``, ``<release>``, ``~``) and ``STAMP.json`` / the
folder's ``README.md`` record the commit, the date, the machine, the command and the duration.

Two checks keep it honest (``tests/unit/test_snapshot.py``): the executed notebooks' code cells must equal
``notebooks/``'s (a stale snapshot fails), and every claim of the stamped report must re-derive from
the stamped summaries and appear in the report with the same value (:func:`verify_snapshot`).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from memtoc.config.runconfig import RunPaths
from memtoc.core.errors import MemtocError
from memtoc.core.io import atomic_write_text, write_json
from memtoc.core.project import REPO_ROOT
from memtoc.stages.report import claims as C

DEFAULT_DEST = REPO_ROOT / "docs" / "results"
INJECTED_TAG = "injected-parameters"     # papermill's cell


class SnapshotError(MemtocError):
    """The run cannot be rendered (unfinished, or a file missing)."""


def _replacements(run_dir: Path, cfg: dict[str, Any]) -> list[tuple[str, str]]:
    pairs = [(str(run_dir.resolve()), "<run>")]
    rel = (cfg.get("release") or {}).get("dir") or (cfg.get("provenance", {}).get("release") or {}).get("path")
    if rel:
        pairs.append((str(Path(rel).resolve()), "<release>"))
    pairs += [(str(REPO_ROOT.resolve()), "<repo>"), (str(Path.home()), "~")]
    return sorted(pairs, key=lambda p: -len(p[0]))          # the longest prefix first


def scrub(text: str, pairs: list[tuple[str, str]]) -> str:
    """``text`` with every machine path replaced by its placeholder."""
    for old, new in pairs:
        text = text.replace(old, new)
    return text


def code_cells(nb: dict[str, Any]) -> list[str]:
    """The source of every code cell a notebook file defines (papermill's injected cell left out)."""
    return ["".join(c.get("source", [])) for c in nb.get("cells", [])
            if c.get("cell_type") == "code" and INJECTED_TAG not in (c.get("metadata", {}).get("tags") or [])]


def stale_notebooks(dest: Path = DEFAULT_DEST, notebook_dir: Path | None = None) -> list[str]:
    """The snapshot's notebooks whose code cells differ from ``notebooks/`` (or that are missing)."""
    notebook_dir = notebook_dir or REPO_ROOT / "notebooks"
    out = []
    for src in sorted(notebook_dir.glob("[0-9][0-9]_*.ipynb")):
        got = Path(dest) / "notebooks" / src.name
        if not got.is_file():
            out.append(f"{src.name}: not in {dest}")
        elif code_cells(json.loads(got.read_text(encoding="utf-8"))) != code_cells(json.loads(src.read_text(encoding="utf-8"))):
            out.append(f"{src.name}: its code cells differ from notebooks/{src.name}")
    return out


def verify_snapshot(dest: Path = DEFAULT_DEST) -> list[str]:
    """Problems of the stamped report: claims that do not re-derive from the stamped summaries, and
    report markers, coverage or untagged numbers that do not match ``claims.json``."""
    dest = Path(dest)
    res = C.verify(dest, check_report=False)
    bad = [f"{r.id}: {r.detail}" for r in res.rows if r.status == "FAIL"]
    claims, _ = C.read_claims(dest)
    bad += [f"{r.id}: {r.detail}" for r in C.check_report(dest, claims) if r.status == "FAIL"]
    return bad


def _copy_scrubbed(src: Path, dst: Path, pairs: list[tuple[str, str]]) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(dst, scrub(src.read_text(encoding="utf-8"), pairs))


def _stamp(cfg: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    prov = cfg.get("provenance") or {}
    git = prov.get("git") or {}
    return {"run": run_dir.name, "commit": git.get("commit"), "dirty": git.get("dirty"),
            "started": cfg.get("started"), "finished": cfg.get("finished"), "seconds": cfg.get("seconds"),
            "notebook_seconds": {n.get("notebook"): n.get("seconds") for n in cfg.get("notebooks", [])},
            "machine": {k: prov.get(k) for k in ("platform", "machine", "cpu_count", "cpu", "python")},
            "packages": {k: v for k, v in (prov.get("packages") or {}).items() if v},
            "command": " ".join(prov.get("command") or []), "status": cfg.get("status")}


def _cpu_text(cpu: Any) -> str:
    """The CPU kind as the README names it (" of kind avx2"), or "" for a run that did not record it."""
    return f" of kind {cpu['name']}" if isinstance(cpu, dict) and cpu.get("name") else ""


def _readme(stamp: dict[str, Any]) -> str:
    secs = stamp.get("seconds") or 0
    per = ", ".join(f"{Path(k).stem[:2]} {v:.0f} s" for k, v in stamp["notebook_seconds"].items() if v is not None)
    m = stamp["machine"]
    return "\n".join([
        "# Results of a default run, rendered",
        "",
        f"The executed notebooks, report and figures of `{stamp['command'] or 'memtoc run params/default.yaml'}` "
        f"(run `{stamp['run']}`), so that they can be read without running anything. Regenerate with "
        "`make docs` after `make run`.",
        "",
        f"- commit `{stamp['commit']}`{' (with uncommitted changes)' if stamp.get('dirty') else ''}; "
        f"finished {stamp['finished']}",
        f"- machine: {m.get('platform')}, {m.get('cpu_count')} CPU cores{_cpu_text(m.get('cpu'))}, "
        f"Python {m.get('python')}; no GPU",
        f"- duration: {secs / 60:.1f} min ({per})",
        "- models: SmolLM2-135M-Instruct and gemma-3-270m base (tiny models: the numbers show the pipeline "
        "working, not how 7–9B models behave)",
        "",
        "| file | what |",
        "|---|---|",
        "| [`paper/report.md`](paper/report.md) | the report: every number tagged with its claim |",
        "| [`notebooks/`](notebooks/) | the nine executed notebooks, outputs included |",
        "| [`figures/`](figures/) | every figure of the run |",
        "| `summaries/`, `paper/claims.json` | the files every claim is read from (`tests/unit/test_snapshot.py` re-derives them) |",
        "",
        "Machine paths are replaced by `<repo>`, `<run>`, `<release>` and `~`.",
        "",
    ])


def render(run_dir: str | Path, dest: str | Path = DEFAULT_DEST) -> Path:
    """Write the snapshot of ``run_dir`` into ``dest`` (replacing what is there); returns ``dest``."""
    run_dir, dest = Path(run_dir), Path(dest)
    paths = RunPaths(run_dir)
    cfg_path = paths.config_json
    if not cfg_path.is_file() or not paths.claims_json.is_file():
        raise SnapshotError(f"{run_dir}: no finished run (config.json and paper/claims.json are needed); "
                            "run `make run` (memtoc run params/default.yaml) first")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("status") != "ok":
        raise SnapshotError(f"{cfg_path}: the run's status is {cfg.get('status')!r}, not 'ok'; finish it first")
    pairs = _replacements(run_dir, cfg)
    tmp = dest.with_name(dest.name + ".tmp")
    out = RunPaths(tmp)                      # the snapshot keeps the run's layout
    shutil.rmtree(tmp, ignore_errors=True)
    for nb in sorted(paths.notebooks.glob("*.ipynb")):
        _copy_scrubbed(nb, out.notebook(nb.name), pairs)
    for f in sorted(paths.summaries.glob("*.json")):
        _copy_scrubbed(f, out.summaries / f.name, pairs)
    for f in (paths.report_md, paths.claims_json):
        _copy_scrubbed(f, out.paper / f.name, pairs)
    out.figures.mkdir(parents=True, exist_ok=True)
    for f in sorted(paths.figures.glob("*.png")):
        shutil.copy2(f, out.figures / f.name)
    stamp = _stamp(cfg, run_dir)
    write_json(tmp / "STAMP.json", json.loads(scrub(json.dumps(stamp), pairs)), indent=1)
    atomic_write_text(tmp / "README.md", _readme(stamp))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m memtoc.run.snapshot", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", nargs="?", default=str(REPO_ROOT / "outputs" / "default"))
    ap.add_argument("dest", nargs="?", default=str(DEFAULT_DEST))
    a = ap.parse_args(argv)
    try:
        dest = render(a.run_dir, a.dest)
    except MemtocError as e:
        print(f"memtoc snapshot: {e}", file=sys.stderr)
        return 2
    problems = stale_notebooks(dest) + verify_snapshot(dest)
    for p in problems:
        print(f"memtoc snapshot: {p}", file=sys.stderr)
    print(f"wrote {dest} ({'OK' if not problems else f'{len(problems)} problem(s)'})")
    return 1 if problems else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(cli(sys.argv[1:]))
