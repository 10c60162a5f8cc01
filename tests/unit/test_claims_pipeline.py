"""The claim registry against summaries written by the real stage code (no model: fake generators).

Guards the alignment of ``paper/claims.yaml`` with the JSON structures that construct.py,
elicitation.py and evaluation.py (and finetune.py, when present) actually write: if a stage moves a
field, a required claim stops resolving and this test names it.
"""
from __future__ import annotations

import json
import random
import shutil

import pandas as pd
import pytest
from conftest import PlainGenerator, PlainReply

from memtoc.config.params import DEFAULTS
from memtoc.config.runconfig import RunConfig
from memtoc.core.prompts import closed_book_prompt
from memtoc.data.benchmark import load_benchmark, select_questions
from memtoc.data.episodes import run_episodes
from memtoc.stages import construction as construct, elicitation, evaluation as ev, finetune, report as R
from memtoc.stages.evaluation import analyses, judge
from memtoc.stages.report import claims as C

MODELS = ("fake-a", "fake-b")


class _Judge:
    """A scripted judge: YES / NO acks and ABSTAIN / an entity, by the prompt's length parity."""

    def generate(self, prompts, cache_path=None, desc=None):
        if "YES or NO" in (prompts or [""])[0]:
            return [PlainReply("YES" if len(p) % 2 else "NO") for p in prompts]
        return [PlainReply("ABSTAIN" if len(p) % 3 == 0 else "something else") for p in prompts]


def _rule(seed, gold_by_prompt=None):
    rng = random.Random(seed)
    memo = {}

    def answer(p):
        if p not in memo:
            u = rng.random()
            tool = None
            for line in p.splitlines():
                if '"result"' in line:
                    try:
                        tool = json.loads(line.split(":", 1)[1].strip())["result"]
                    except Exception:
                        tool = None
            if tool is not None and u < 0.6:
                memo[p] = f"FINAL: {tool}"
            elif u < 0.7:
                memo[p] = "FINAL: UNKNOWN"
            else:
                memo[p] = f"FINAL: {(gold_by_prompt or {}).get(p, 'something else')}"
        return memo[p]
    return answer


@pytest.fixture(scope="module")
def stage_run(tmp_path_factory):
    bench = load_benchmark()
    P = dict(DEFAULTS, n_questions=10, n_questions_extra=5, n_boot=100, n_perm=200, run_name="stagerun")
    rd = tmp_path_factory.mktemp("stagerun")
    eps = run_episodes(bench, RunConfig.of(P))
    qs = select_questions(bench.analysis, P["n_questions"], P["seed"])
    (rd / "summaries").mkdir(parents=True, exist_ok=True)
    (rd / "summaries" / "construction.json").write_text(
        json.dumps(construct.construction_summary(bench, eps), default=str))
    scored, memory, mems = {}, {}, []
    for i, m in enumerate(MODELS):
        gold = {closed_book_prompt(q.question, f, v): (q.gold if (i + len(q.qkey)) % 2 else q.near)
                for q in qs for f in P["formulations"] for v in ("forced", "permissive")}
        for variant in ("forced", "permissive"):
            df = elicitation.elicit(PlainGenerator(_rule(i, gold)), m, qs, P["formulations"], variant, rd)
            mems.append(df)
            if variant == "forced":
                memory[m] = df
        gold_e = {e.prompt: e.gold for e in eps}
        scored[m] = ev.evaluate(PlainGenerator(_rule(10 + i, gold_e)), m, eps, memory[m], rd)
    (rd / "summaries" / "elicitation.json").write_text(json.dumps(elicitation.summary(pd.concat(mems)), default=str))
    # the optional judged layer (PROTOCOL §4b) with a scripted judge, so its claims are checked too
    summary = judge.add_judged(analyses.evaluation_summary(scored, memory, RunConfig.of(P)), scored,
                               RunConfig.of(dict(P, run_dir=rd, judge={"model": "fake-judge"})), generator=_Judge())
    analyses.write_summary(summary, rd)
    held = finetune.eval_episodes(qs, P["formulations"])
    summ = {"schema_version": 1, "models": {}}
    for i, m in enumerate(MODELS):
        gold_e = {e.prompt: e.gold for e in held}
        untreated = finetune.score_with(PlainGenerator(_rule(10 + i, gold_e)), m, held, memory[m], rd)
        objs = {}
        for j, obj in enumerate(("sft", "dpo")):
            treated = finetune.score_with(PlainGenerator(_rule(20 + 2 * i + j, gold_e)), f"{m}__{obj}", held, memory[m], rd)
            objs[obj] = finetune.paired_deltas(treated, untreated, P["formulations"], n_boot=100, n_perm=200)
        summ["models"][m] = {"base": "fake", "folds": {}, "adapters": {}, "objectives": objs}
    finetune.write_summary(summ, rd)
    # notebook 07's summary, from scripted agent episodes through the stage's own summary code
    from test_agent import CALL, Scripted, spec

    from memtoc.core.io import write_json
    from memtoc.stages.agent import core as agent_core
    from memtoc.stages.agent.protocols import run_episodes as run_agent
    from memtoc.stages.agent.traces import Trace
    a = RunConfig.of(dict(P, models=list(MODELS), agent={"n_questions": 3})).agent
    doc = agent_core.summary_head(a)
    for i, m in enumerate(MODELS):
        specs = [spec(p, question=f"Who is {m}{k}?", model=m, formulation=f) for k in range(3)
                 for f in P["formulations"] for p in a["protocols"]]
        recs = run_agent(Scripted(lambda r, t: CALL if t == 1 and r.tool_choice != "none" else "FINAL: Jane Doe"),
                         specs, Trace(rd / "agent" / m / "traces.jsonl"))["records"]
        doc["models"][m] = agent_core.model_block(recs, a, P["formulations"], 3, {"kind": "scripted"}, {}, 200)
    write_json(rd / "summaries" / "agent.json", doc)
    return rd


def test_registry_resolves_on_real_stage_summaries(stage_run):
    claims, omitted = C.resolve_all(stage_run)
    ids = {c.id for c in claims}
    # every evaluation section the run has is claimed (none silently omitted)
    assert omitted == [], omitted[:5]
    for m in MODELS:
        for metric in ("retention", "tool_follow", "wrong_follow", "err_abstain"):
            assert f"main.{m}.untreated.{metric}" in ids
        assert f"prompting.{m}.warn.success" in ids
        assert f"protocol.{m}.delta.retention" in ids
        assert f"far.{m}.delta.retention" in ids
        assert f"payloads.{m}.timeout.err_abstain" in ids
        assert f"noop.{m}.delta.abstain" in ids
        assert f"matcher.{m}.delta.tool_follow" in ids
        assert f"frames.{m}.passage.incorrect_value_follow" in ids
        assert f"elicit.{m}.forced.memory_correct" in ids
        assert f"prompting.{m}.n_questions.retention" not in ids    # counts are not arms
    assert "ranking.retention.stable" in ids
    assert "judged.judge_model" in ids
    for m in MODELS:
        assert f"judged.{m}.retention" in ids and f"judged.{m}.car" in ids and f"judged.{m}.car.n" in ids
    for m in MODELS:
        for obj in ("sft", "dpo"):
            assert f"main.{m}.{obj}.retention" in ids
            assert f"finetune.{m}.{obj}.success" in ids
            assert f"finetune.{m}.{obj}.delta.tool_follow" in ids
    assert {c.value for c in claims if c.id.endswith(".success")} <= {"yes", "no"}


def test_report_on_real_stage_summaries_verifies_and_detects_a_perturbation(stage_run, tmp_path):
    R.build_report(stage_run)
    res = C.verify(stage_run)
    assert res.ok, "\n".join(f"{r.id}: {r.detail}" for r in res.failures)
    copy = tmp_path / "copy"
    shutil.copytree(stage_run, copy)
    path = copy / "summaries" / "evaluation.json"
    doc = json.loads(path.read_text())
    iv = doc["models"]["fake-b"]["headline"]["pooled"]["wrong_follow"]
    iv["value"] = (iv["value"] or 0) + 0.25 if (iv["value"] or 0) < 0.7 else iv["value"] - 0.25
    path.write_text(json.dumps(doc))
    failed = {r.id for r in C.verify(copy).failures}
    assert "main.fake-b.untreated.wrong_follow" in failed
