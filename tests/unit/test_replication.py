"""This run and the paper (memtoc/stages/report/replication.py): a run whose model is registered under a paper
model's name, made by the real stage code with a scripted generator at a tiny size (no model load)."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pandas as pd
import pytest
from conftest import PlainGenerator
from test_claims import make_run

from memtoc.config.params import DEFAULTS
from memtoc.config.runconfig import RunConfig
from memtoc.core.project import REPO_ROOT
from memtoc.core.prompts import closed_book_prompt
from memtoc.data.benchmark import load_benchmark, select_questions
from memtoc.data.episodes import run_episodes
from memtoc.stages import construction as construct, elicitation, evaluation as ev, report as R
from memtoc.stages.evaluation import analyses
from memtoc.stages.report import claims as C, replication

MODEL = "llama-3.1-8b-instruct"          # a registry name the paper reports (Table 1, 4, 7)
RET = f"replication.{MODEL}.table1.untreated.retention"


def _scripted(seed, gold):
    rng = random.Random(seed)
    return lambda p: ("FINAL: " + gold.get(p, "something else")) if rng.random() < 0.5 else "FINAL: UNKNOWN"


@pytest.fixture(scope="module")
def paper_run(tmp_path_factory):
    bench = load_benchmark()
    P = dict(DEFAULTS, n_questions=6, n_questions_extra=3, n_boot=50, n_perm=50, run_name="paperrun",
             extra_arms=[])
    rd = tmp_path_factory.mktemp("paperrun")
    eps = run_episodes(bench, RunConfig.of(P))
    qs = select_questions(bench.analysis, P["n_questions"], P["seed"])
    (rd / "summaries").mkdir(parents=True, exist_ok=True)
    (rd / "summaries" / "construction.json").write_text(
        json.dumps(construct.construction_summary(bench, eps), default=str))
    gold = {closed_book_prompt(q.question, f, v): q.gold for q in qs for f in P["formulations"]
            for v in ("forced", "permissive")}
    mems = [elicitation.elicit(PlainGenerator(_scripted(v == "forced", gold)), MODEL, qs, P["formulations"], v, rd)
            for v in ("forced", "permissive")]
    scored = {MODEL: ev.evaluate(PlainGenerator(_scripted(2, {e.prompt: e.gold for e in eps})), MODEL, eps, mems[0], rd)}
    (rd / "summaries" / "elicitation.json").write_text(json.dumps(elicitation.summary(pd.concat(mems)), default=str))
    analyses.write_summary(analyses.evaluation_summary(scored, {MODEL: mems[0]}, RunConfig.of(P)), rd)
    return rd


def _set_interval(run, lo, hi):
    path = run / "summaries" / "evaluation.json"
    doc = json.loads(path.read_text())
    node = doc["models"][MODEL]["headline"]["pooled"]["retention"]
    node["ci95"], node["value"] = [lo, hi], (lo + hi) / 2
    path.write_text(json.dumps(doc))


def _by_id(claims):
    return {c.id: c for c in claims}


def test_covers_uses_the_printed_precision():
    assert C.covers([0.10, 0.1705], 17.1, 0.01) == "inside"       # 17.1 printed: 17.05..17.15
    assert C.covers([0.10, 0.1704], 17.1, 0.01) == "outside"
    assert C.covers([0.9, 1.0], 0.992) == "inside" and C.covers([0.2, 0.3], 0.992) == "outside"
    assert C.covers(None, 17.1, 0.01) == "no interval"
    assert replication.paper_model(MODEL) == "Llama-3.1-8B-Instruct"
    assert replication.paper_model("tiny-a") is None and replication.paper_model("smollm2-135m") is None


def test_section_appears_and_verify_rederives_it(paper_run):
    R.build_report(paper_run)
    md = (paper_run / "paper" / "report.md").read_text()
    assert "## This run and the paper" in md and "replication.png" in md
    got = _by_id(C.read_claims(paper_run)[0])
    for part in ("run", "ci", "paper", "verdict"):
        assert f"{RET}.{part}" in got
    assert got[f"{RET}.paper"].value == "17.1" and got[f"{RET}.paper"].file.startswith("project:paper/published/")
    assert got[f"{RET}.verdict"].value in ("inside", "outside")
    assert f"replication.{MODEL}.table1.sft.retention.run" not in got      # no 04 in this run
    res = C.verify(paper_run)
    assert res.ok, "\n".join(f"{r.id}: {r.detail}" for r in res.failures)
    assert {r.status for r in res.rows if r.id.startswith("replication.")} == {"PASS"}


@pytest.mark.parametrize("lo,hi,verdict", [(0.10, 0.25, "inside"), (0.30, 0.45, "outside"), (0.01, 0.16, "outside")])
def test_verdicts_follow_the_interval(paper_run, tmp_path, lo, hi, verdict):
    run = tmp_path / "run"
    shutil.copytree(paper_run, run)
    _set_interval(run, lo, hi)
    R.build_report(run)
    claims = _by_id(C.read_claims(run)[0])
    assert claims[f"{RET}.verdict"].value == verdict
    assert claims[f"{RET}.ci"].value == C.format_value(lo, "percent:1") + C.RANGE_DASH + C.format_value(hi, "percent:1")
    assert C.verify(run).ok


def test_tampering_with_a_summary_value_fails_verify(paper_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(paper_run, run)
    _set_interval(run, 0.10, 0.25)
    R.build_report(run)
    assert C.verify(run).ok
    _set_interval(run, 0.30, 0.45)             # the paper's 17.1 no longer inside
    failed = {r.id: r for r in C.verify(run).failures}
    assert f"{RET}.verdict" in failed and "'inside'" in failed[f"{RET}.verdict"].detail
    assert f"{RET}.ci" in failed


def test_a_run_without_paper_models_says_so(tmp_path):
    run = make_run(tmp_path)
    R.build_report(run)
    md = (run / "paper" / "report.md").read_text()
    assert replication.NO_PAPER_MODELS in md
    assert not any(c.id.startswith("replication.") for c in C.read_claims(run)[0])
    assert not (run / "figures" / "replication.png").exists()
    assert C.verify(run).ok


SNAPSHOT = REPO_ROOT / "docs" / "results" / "summaries"       # a default run's real 06/07 summaries
TINY = "smollm2-135m-instruct"


def _as_paper_model(src: Path, dest: Path, rename_arms: dict[str, str] | None = None) -> dict:
    """A real stage summary with the embedded model's entry filed under the paper model's name (and
    forward arms renamed as a run with ``transfer.extra_adapters`` {sft, dpo} names them)."""
    doc = json.loads(src.read_text())
    doc["models"] = {MODEL: doc["models"][TINY]}
    for old, new in (rename_arms or {}).items():
        fwd = doc["models"][MODEL]["forward"]
        fwd[new] = fwd.pop(old)
    dest.write_text(json.dumps(doc))
    return doc


@pytest.mark.skipif(not (SNAPSHOT / "agent.json").is_file(), reason="no rendered run under docs/results/")
def test_agent_and_transfer_rows_come_from_07_and_06(paper_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(paper_run, run)
    agent = _as_paper_model(SNAPSHOT / "agent.json", run / "summaries" / "agent.json")
    _as_paper_model(SNAPSHOT / "transfer.json", run / "summaries" / "transfer.json",
                    {"sft_fold0": "sft", "dpo_fold0": "dpo"})
    R.build_report(run)
    got = _by_id(C.read_claims(run)[0])
    variant = next(iter(agent["models"][MODEL]["slices"]["memory_right"]))
    node = agent["models"][MODEL]["slices"]["memory_right"][variant]
    for p in replication.TABLE7:
        key = f"replication.{MODEL}.table7.{p}"
        assert got[f"{key}.run"].raw == node["protocols"][p]["answer_agreement"]["pooled"]["value"]
        assert got[f"{key}.verdict"].value in ("inside", "outside")
    g2a = f"replication.{MODEL}.sec5_4.guided_to_auto"
    assert got[f"{g2a}.run"].raw == node["contrasts"]["guided_to_auto"]["answer_agreement"]["delta"]
    assert got[f"{g2a}.paper"].value == "-66.4"                     # §5.4: Llama's guided -> auto change
    for method in ("sft", "dpo"):
        for metric in replication.TABLE6.values():
            assert f"replication.{MODEL}.table6.{method}.{metric}.verdict" in got
    assert C.verify(run).ok
    # the verdict follows the run's interval: move 07's guided-to-auto interval onto the paper's value
    path = run / "summaries" / "agent.json"
    doc = json.loads(path.read_text())
    con = doc["models"][MODEL]["slices"]["memory_right"][variant]["contrasts"]["guided_to_auto"]["answer_agreement"]
    was = got[f"{g2a}.verdict"].value
    con["ci95"] = [-0.70, -0.60] if was == "outside" else [0.10, 0.20]
    path.write_text(json.dumps(doc))
    failed = {r.id for r in C.verify(run).failures}
    assert f"{g2a}.verdict" in failed and f"{g2a}.ci" in failed
    R.build_report(run)
    assert _by_id(C.read_claims(run)[0])[f"{g2a}.verdict"].value == ("inside" if was == "outside" else "outside")
    assert C.verify(run).ok
