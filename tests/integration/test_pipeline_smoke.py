"""The whole pipeline on the real embedded model: `memtoc run params/smoke.yaml` through papermill,
then the same command again, which must be served entirely from the generation cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memtoc.core.project import REPO_ROOT
from memtoc.run.pipeline import discover_notebooks

pytestmark = pytest.mark.integration


def _memtoc_run(out_root: Path, timeout: int = 1800) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("MPLBACKEND", "Agg")
    return subprocess.run([sys.executable, "-m", "memtoc", "run", str(REPO_ROOT / "params" / "smoke.yaml"),
                           "--set", f"output_root={out_root}"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _cache_lines(run_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(run_dir)): sum(1 for ln in p.read_text().splitlines() if ln.strip())
            for p in sorted((run_dir / "generations").rglob("*.jsonl"))}


def test_smoke_pipeline_end_to_end_and_resume(tmp_path):
    expected = [p.stem for n, p in sorted(discover_notebooks().items())]
    r = _memtoc_run(tmp_path)
    assert r.returncode == 0, f"memtoc run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    rd = tmp_path / "smoke"
    cfg = json.loads((rd / "config.json").read_text())
    assert cfg["status"] == "ok"
    ran = [n for n in cfg["notebooks"] if n["status"] == "ok"]
    assert [n["notebook"] for n in ran] == expected
    for n in ran:                                   # executed copies, with outputs, no error
        nb = json.loads(Path(n["executed"]).read_text())
        outs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
        assert outs and not any(o.get("output_type") == "error" for o in outs), n["notebook"]
    assert cfg["provenance"]["git"]["commit"] and cfg["provenance"]["release"]["sha256"]

    ev = json.loads((rd / "summaries" / "evaluation.json").read_text())
    model = "smollm2-135m-instruct"
    head = ev["models"][model]["headline"]["pooled"]
    for metric in ("retention", "tool_follow", "wrong_follow", "err_abstain"):
        assert set(head[metric]) >= {"value", "ci95", "n"}
    assert head["err_abstain"]["n"] == 5 * 3       # 5 questions x 3 formulations, every tool_error episode
    for sec in ("prompting", "frames", "far", "payloads", "noop", "matcher_sensitivity"):
        assert sec in ev["models"][model], sec
    for fig in ("source_matrix.png", "headline.png", "prompting_tradeoffs.png"):
        assert (rd / "figures" / fig).stat().st_size > 5000, fig
    for s in ("construction.json", "elicitation.json", "evaluation.json"):
        assert (rd / "summaries" / s).is_file(), s
    scored = list((rd / "scored" / model).glob("*.jsonl"))
    assert any(p.stem == "untreated__reference" for p in scored)

    before = _cache_lines(rd)
    assert sum(before.values()) > 0
    r2 = _memtoc_run(tmp_path)
    assert r2.returncode == 0, f"rerun failed:\n{r2.stdout[-3000:]}\n{r2.stderr[-3000:]}"
    assert _cache_lines(rd) == before, "the rerun generated new replies instead of reading the cache"
    ev2 = json.loads((rd / "summaries" / "evaluation.json").read_text())
    assert ev2["models"][model]["headline"] == ev["models"][model]["headline"]
    cfg2 = json.loads((rd / "config.json").read_text())
    assert cfg2["status"] == "ok" and len(cfg2["history"]) == 1
