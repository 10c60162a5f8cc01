"""docs/results/: a finished run rendered for readers (memtoc/run/snapshot.py, `make docs`). The staleness
check and the report check are tested here on copies; when a snapshot is committed, it must show the
current notebooks' code and verify against its own claims."""
from __future__ import annotations

import json
import shutil

import pytest

from memtoc.core.project import REPO_ROOT
from memtoc.run import snapshot
from memtoc.stages.report.claims import MARKER_RE

DEST = REPO_ROOT / "docs" / "results"
committed = pytest.mark.skipif(not (DEST / "STAMP.json").is_file(),
                               reason="no rendered run is committed under docs/results/ (`make run && make docs`)")


def _code_cell(nb):
    return next(c for c in nb["cells"] if c["cell_type"] == "code"
                and snapshot.INJECTED_TAG not in c["metadata"].get("tags", []))


def test_stale_notebooks_are_caught(tmp_path):
    dest = tmp_path / "results"
    shutil.copytree(REPO_ROOT / "notebooks", dest / "notebooks")
    assert snapshot.stale_notebooks(dest) == []
    path = dest / "notebooks" / "03_evaluation.ipynb"
    nb = json.loads(path.read_text(encoding="utf-8"))
    nb["cells"].insert(1, {"cell_type": "code", "metadata": {"tags": [snapshot.INJECTED_TAG]}, "outputs": [],
                           "execution_count": None, "source": ["params_file = 'x'\n"]})
    path.write_text(json.dumps(nb), encoding="utf-8")
    assert snapshot.stale_notebooks(dest) == []            # papermill's injected cell is not the notebook's code
    _code_cell(nb)["source"] = ["print('changed')\n"] + _code_cell(nb)["source"]
    path.write_text(json.dumps(nb), encoding="utf-8")
    assert snapshot.stale_notebooks(dest) == ["03_evaluation.ipynb: its code cells differ from notebooks/03_evaluation.ipynb"]
    (dest / "notebooks" / "09_verify.ipynb").unlink()
    assert any(p.startswith("09_verify.ipynb: not in") for p in snapshot.stale_notebooks(dest))


def test_render_needs_a_finished_run(tmp_path):
    with pytest.raises(snapshot.SnapshotError, match="no finished run"):
        snapshot.render(tmp_path, tmp_path / "out")
    (tmp_path / "paper").mkdir()
    (tmp_path / "paper" / "claims.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"status": "running"}))
    with pytest.raises(snapshot.SnapshotError, match="not 'ok'"):
        snapshot.render(tmp_path, tmp_path / "out")


def test_machine_paths_are_replaced():
    pairs = [("/home/u/memtoc/outputs/default", "<run>"), ("/home/u/memtoc", "<repo>"), ("/home/u", "~")]
    text = "wrote /home/u/memtoc/outputs/default/summaries/x.json from /home/u/memtoc/params and /home/u/data"
    assert snapshot.scrub(text, pairs) == "wrote <run>/summaries/x.json from <repo>/params and ~/data"


@committed
def test_the_committed_snapshot_shows_the_current_notebooks():
    assert snapshot.stale_notebooks(DEST) == []


@committed
def test_the_committed_report_verifies_against_its_own_claims(tmp_path):
    assert snapshot.verify_snapshot(DEST) == []
    copy = tmp_path / "results"
    shutil.copytree(DEST, copy)
    report = copy / "paper" / "report.md"
    md = report.read_text(encoding="utf-8")
    m = MARKER_RE.search(md)
    report.write_text(md[:m.start(2)] + m.group(2) + "1" + md[m.end(2):], encoding="utf-8")
    assert any(p.startswith("report:markers") for p in snapshot.verify_snapshot(copy))
