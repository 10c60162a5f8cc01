"""docs/results/: the rendered default run (memtoc/snapshot.py). The committed snapshot must match the
notebooks' code and verify against its own claims; both checks are shown to fail on a changed copy."""
from __future__ import annotations

import json
import shutil

import pytest

from memtoc import snapshot
from memtoc.claims import MARKER_RE
from memtoc.config import REPO_ROOT

DEST = REPO_ROOT / "docs" / "results"


def test_the_committed_snapshot_shows_the_current_notebooks():
    assert DEST.is_dir(), "docs/results/ is missing: `make run && make docs`"
    assert snapshot.stale_notebooks(DEST) == []
    assert len(list((DEST / "notebooks").glob("[0-9][0-9]_*.ipynb"))) == 9


def test_the_committed_report_verifies_against_its_own_claims():
    assert snapshot.verify_snapshot(DEST) == []
    stamp = json.loads((DEST / "STAMP.json").read_text())
    assert stamp["commit"] and stamp["seconds"] and stamp["status"] == "ok"
    text = "".join(p.read_text(encoding="utf-8") for p in DEST.rglob("*") if p.suffix in (".md", ".json", ".ipynb"))
    assert str(REPO_ROOT) not in text and "/root/" not in text      # machine paths stripped


def test_a_changed_notebook_or_report_is_caught(tmp_path):
    copy = tmp_path / "results"
    shutil.copytree(DEST, copy)
    nb_path = copy / "notebooks" / "03_evaluation.ipynb"
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code" and "injected-parameters" not in c["metadata"].get("tags", []))
    cell["source"] = ["print('changed')\n"] + cell["source"]
    nb_path.write_text(json.dumps(nb), encoding="utf-8")
    assert snapshot.stale_notebooks(copy) == ["03_evaluation.ipynb: its code cells differ from notebooks/03_evaluation.ipynb"]
    report = copy / "paper" / "report.md"
    md = report.read_text(encoding="utf-8")
    m = MARKER_RE.search(md)
    report.write_text(md[:m.start(2)] + m.group(2) + "1" + md[m.end(2):], encoding="utf-8")
    assert any(p.startswith("report:markers") for p in snapshot.verify_snapshot(copy))


def test_render_needs_a_finished_run(tmp_path):
    with pytest.raises(snapshot.SnapshotError, match="no finished run"):
        snapshot.render(tmp_path, tmp_path / "out")
    (tmp_path / "paper").mkdir()
    (tmp_path / "paper" / "claims.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"status": "running"}))
    with pytest.raises(snapshot.SnapshotError, match="not 'ok'"):
        snapshot.render(tmp_path, tmp_path / "out")
