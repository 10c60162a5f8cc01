"""Evaluation stage: scoring of episodes, cache routing, and the analysis functions on synthetic
replies (no model: a fake generator answers by rule)."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import PlainGenerator, ScriptedGenerator

from memtoc.config.params import DEFAULTS, FORMULATIONS
from memtoc.config.runconfig import RunConfig
from memtoc.core import intervals, metrics, stats, vocab
from memtoc.core.prompts import closed_book_prompt
from memtoc.data.benchmark import select_questions
from memtoc.data.episodes import run_episodes
from memtoc.generation import cache
from memtoc.stages import evaluation as ev
from memtoc.stages.evaluation import analyses, tables


def _params(**kw):
    P = dict(DEFAULTS)
    P.update(n_questions=24, n_questions_extra=12, n_boot=200, n_perm=500)
    P.update(kw)
    return P


def _memory(questions, forms, rng, p_correct=0.5, p_absent=0.1):
    rows = []
    for f in forms:
        for q in questions:
            u = rng.random()
            resp = ("FINAL: UNKNOWN" if u < p_absent else
                    f"FINAL: {q.gold}" if u < p_absent + p_correct else f"FINAL: {q.near}")
            rows.append({"model": "fake", "formulation": f, "variant": "forced", "question_id": q.id,
                         "qkey": q.qkey, "instance_id": q.instance_id, "response": resp})
    return pd.DataFrame(rows)


def _answer_by_episode(episodes, seed=0, follow=0.6, abstain=0.1):
    """A reply for every prompt: follow the tool value / answer gold / UNKNOWN, by a seeded draw."""
    rng = random.Random(seed)
    table = {}
    for e in episodes:
        u = rng.random()
        if e.tool_value is not None and u < follow:
            table[e.prompt] = f"The tool says so.\nFINAL: {e.tool_value}"
        elif u < follow + abstain:
            table[e.prompt] = "FINAL: UNKNOWN"
        else:
            table[e.prompt] = f"FINAL: {e.gold}" if rng.random() < 0.5 else "FINAL: something else entirely"
    return lambda p: table[p]


@pytest.fixture(scope="module")
def run(bench, tmp_path_factory):
    P = _params()
    eps = run_episodes(bench, RunConfig.of(P))
    qs = select_questions(bench.analysis, P["n_questions"], P["seed"])
    mem = _memory(qs, P["formulations"], random.Random(1))
    gen = PlainGenerator(_answer_by_episode(eps))
    rd = tmp_path_factory.mktemp("run")
    df = ev.evaluate(gen, "fake", eps, mem, rd)
    return P, eps, mem, gen, rd, df


def test_evaluate_rows_files_and_cache_routing(run):
    P, eps, mem, gen, rd, df = run
    assert len(df) == len(eps)
    assert list(df["episode_id"]) == [e.episode_id for e in eps]
    for col in ("extracted", "followed_tool", "kept_memory", "final_correct", "abstain", "outcome",
                "neither_subtype", "cell", "memory_span", "mem_absent", "memory_correct", "response", "model"):
        assert col in df.columns, col
    # no_tool episodes are routed to the elicitation's closed-book cache file, never to an arm file
    names = [n for n, _ in gen.calls]
    for f in P["formulations"]:
        assert f"closed_book_forced__{f}.jsonl" in names
    n_no_tool = sum(n for name, n in gen.calls if name.startswith("closed_book_forced__"))
    assert n_no_tool == sum(e.condition == "no_tool" for e in eps)
    # one generate call per cache file
    assert len(names) == len(set(names))
    # scored files: one per arm_key, rows add up
    files = sorted((rd / "scored" / "fake").glob("*.jsonl"))
    assert {p.stem for p in files} == {e.arm_key for e in eps}
    assert sum(len(p.read_text().splitlines()) for p in files) == len(eps)
    back = ev.read_scored(rd, "fake")
    assert len(back) == len(eps)


def test_cells_follow_memory_and_tool(run):
    P, eps, mem, gen, rd, df = run
    tw = df[df["condition"] == "tool_wrong"]
    assert set(tw["cell"].dropna()) <= {"arb", "both_wrong", "mem_absent"}
    tr = df[df["condition"] == "tool_right"]
    assert set(tr["cell"].dropna()) <= {"agree", "tool_gold", "mem_absent"}
    assert df.loc[df["condition"].isin(["no_tool", "noop"]), "cell"].isna().all()
    # memory correct iff the closed-book reply was the gold (fake memory: gold or near or UNKNOWN)
    m = mem.set_index(["formulation", "qkey"])["response"]
    for _, r in tw.head(30).iterrows():
        resp = m[(r["formulation"], r["qkey"])]
        if resp == "FINAL: UNKNOWN":
            assert r["cell"] == "mem_absent"
        elif resp == f"FINAL: {r['gold']}":
            assert r["cell"] == "arb"


def test_missing_memory_is_a_clear_error(run):
    P, eps, mem, gen, rd, df = run
    with pytest.raises(ev.EvaluationError, match="elicitation"):
        ev.score_episodes(eps[:5], ["FINAL: x"] * 5, mem.iloc[0:0])
    with pytest.raises(ev.EvaluationError, match="lacks column"):
        ev.score_episodes(eps[:5], ["FINAL: x"] * 5, mem.drop(columns=["response"]))


def test_metric_units_agree_with_arm_metrics(run):
    df = run[-1]
    d = analyses.select_arm(df, conditions=["tool_right", "tool_wrong", "tool_error", "no_tool"])
    d = d[d["formulation"] == "reference"]
    am = metrics.arm_metrics(d)
    for m in ("retention", "tool_follow", "wrong_follow", "err_abstain", "cra_conflict", "nc_acc"):
        u = metrics.metric_units(d, m)
        if len(u):
            assert u["value"].mean() == pytest.approx(am[m]), m
        else:
            assert np.isnan(am[m])


def test_rate_intervals_pooled_is_unweighted_mean():
    rng = np.random.default_rng(0)
    rows = []
    for f, p, n in (("reference", 0.2, 40), ("paraphrase_a", 0.8, 10)):
        for i in range(n):
            rows.append({"formulation": f, "qkey": f"q{i}", "value": float(rng.random() < p)})
    u = pd.DataFrame(rows)
    r = analyses.rate_intervals(u, FORMULATIONS, n_boot=300)
    a, b = u[u.formulation == "reference"].value.mean(), u[u.formulation == "paraphrase_a"].value.mean()
    assert r["reference"]["value"] == pytest.approx(a)
    assert r["pooled"]["value"] == pytest.approx((a + b) / 2)   # not the episode-weighted mean
    assert r["pooled"]["n"] == 50
    lo, hi = r["pooled"]["ci95"]
    assert lo <= r["pooled"]["value"] <= hi and hi - lo > 0
    assert "paraphrase_b" not in r


def test_contrast_detects_a_real_shift_and_not_a_null():
    rng = np.random.default_rng(1)
    base = pd.DataFrame({"formulation": "reference", "qkey": [f"q{i}" for i in range(200)],
                         "value": (rng.random(200) < 0.3).astype(float)})
    up = base.assign(value=np.maximum(base["value"], (rng.random(200) < 0.5).astype(float)))
    c = analyses.contrast(up, base, n_boot=500, n_perm=2000)
    assert c["delta"] > 0.2 and c["p"] < 0.01 and c["ci95"][0] > 0
    same = analyses.contrast(base, base, n_boot=200, n_perm=500)
    assert same["delta"] == 0 and same["p"] == 1.0
    # common support: only shared (formulation, qkey) units count
    c2 = analyses.contrast(up.iloc[:50], base, n_boot=100, n_perm=100)
    assert c2["n_units"] == 50


def test_prompting_success_and_holm(run):
    P, eps, mem, gen, rd, df = run
    # make "prior" keep memory on every arb episode: retention must rise and pass the criterion
    d = df.copy()
    m = (d["arm"] == "prior") & (d["condition"] == "tool_wrong") & (d["cell"] == "arb")
    d.loc[m, "outcome"] = "kept_memory"
    sec = analyses.arm_comparison(d, vocab.PROMPTING_ARMS, ("retention", "tool_follow"), "prompting",
                            n_boot=300, n_perm=2000)
    models = {"fake": {"prompting": sec}}
    analyses.apply_families(models, 0.05)
    assert set(sec) >= {"warn", "prior", "flag", "untreated"}
    c = sec["prior"]["contrasts"]["retention"]
    assert c["delta"] > 0 and c["p_holm"] >= c["p"] and c["family"] == "prompting_retention"
    assert sec["prior"]["pooled"]["retention"]["value"] == 1.0
    # one tool-drop guard rule: correct-tool following is read Holm-adjusted in its family, as in fine-tuning
    t = sec["prior"]["contrasts"]["tool_follow"]
    assert t["family"] == "prompting_tool_follow" and t["p_holm"] is not None
    assert sec["prior"]["success"]["tool_p"] == t["p_holm"]
    n_arb_extra = int(m.sum())
    if n_arb_extra >= 8 and sec["untreated"]["pooled"]["retention"]["value"] < 0.5:
        assert sec["prior"]["success"]["passed"] is True
    assert sec["warn"]["success"]["passed"] in (True, False)


def test_holm_families_span_models_and_leave_diagnostics_uncorrected(run):
    """Issue 12 item 6: prompting retention is one Holm family over models x strategies (not one
    per model), formed in every slice (each formulation and pooled); frames compute retention and
    form models x frames; far forms one family over models on the Reference formulation;
    incorrect-tool following and the other diagnostics stay uncorrected; the summary lists the
    families with their slices and members."""
    P, eps, mem, gen, rd, df = run
    d2 = df.copy()
    m = (d2["arm"] == "warn") & (d2["condition"] == "tool_wrong") & (d2["cell"] == "arb")
    d2.loc[m, "outcome"] = "kept_memory"
    d2["model"] = "fake2"
    s = analyses.evaluation_summary({"fake": df, "fake2": d2}, None, RunConfig.of(dict(P, n_boot=100, n_perm=400)))
    fam = s["holm_families"]["prompting_retention"]
    assert fam["axes"] == ["model", "strategy"] and fam["slices"] == list(FORMULATIONS) + ["pooled"]
    assert set(fam["members"]) == set(FORMULATIONS) | {"pooled"}
    for sl, members in fam["members"].items():
        assert len(members) == 2 * len(vocab.PROMPTING_ARMS), sl      # two instruct models x strategies

        def contrasts(mod, a, sl=sl):
            sec = s["models"][mod]["prompting"][a]
            return sec["contrasts"] if sl == "pooled" else sec["contrasts_by_formulation"][sl]
        raw = {f"{mod}|{a}": contrasts(mod, a)["retention"]["p"] for mod in ("fake", "fake2") for a in vocab.PROMPTING_ARMS}
        expect = stats.holm(raw)
        for k, v in members.items():
            mod, a = k.split("|")
            assert v == pytest.approx(expect[k])
            assert contrasts(mod, a)["retention"]["p_holm"] == pytest.approx(expect[k])
            assert contrasts(mod, a)["wrong_follow"]["p_holm"] is None
    assert set(s["holm_families"]["far_retention"]["members"]) == {"reference"}
    assert len(s["holm_families"]["far_retention"]["members"]["reference"]) == 2
    assert s["models"]["fake"]["far"]["contrasts_reference"]["retention"]["family"] == "far_retention"
    assert s["models"]["fake"]["far"]["contrasts"]["retention"]["p_holm"] is None
    assert len(s["holm_families"]["frames_retention"]["members"]["pooled"]) == 4
    assert "retention" in s["models"]["fake"]["frames"]["passage"]["contrasts"]


def test_base_model_families(run):
    """A base model (gemma-3-270m, registry chat=False) joins the far family but not the prompting
    family (the paper's: the four instruction-tuned models x three strategies); the question-paired
    base-vs-instruct family (sign-flip, Reference formulation) sits beside the unpaired z-tests."""
    P, eps, mem, gen, rd, df = run
    base = "gemma-3-270m"
    d2 = df.assign(model=base)
    flip = (d2["condition"] == "tool_wrong") & (d2["cell"] == "arb")
    d2.loc[flip, "outcome"] = "kept_memory"
    s = analyses.evaluation_summary({"fake": df, base: d2}, None, RunConfig.of(dict(P, n_boot=100, n_perm=400)))
    fams = s["holm_families"]
    assert all(not k.startswith(base) for sl in fams["prompting_retention"]["members"].values() for k in sl)
    assert s["models"][base]["prompting"]["warn"]["contrasts"]["retention"]["p_holm"] is None
    assert set(fams["far_retention"]["members"]["reference"]) == {"fake", base}
    cm = s["cross_model"]["retention"]
    paired = cm["base_vs_instruct_paired"][f"{base}|fake"]
    assert paired["family"] == "base_vs_instruct_paired_retention" and paired["n_units"] > 0
    assert paired["delta"] > 0 and paired["p_holm"] == pytest.approx(paired["p"])     # one member
    assert paired["treatment"] == base and paired["baseline"] == "fake"
    assert cm["base_vs_instruct"][f"{base}|fake"]["family"] == "base_vs_instruct_ztest_retention"
    listed = fams["base_vs_instruct_paired_retention"]
    assert listed["slices"] == ["reference"] and listed["test"] == "sign-flip"
    assert listed["members"] == {"reference": {f"{base}|fake": paired["p_holm"]}}
    assert fams["cross_model_ztest_retention"]["members"]["reference"][f"fake|{base}"] is not None


def test_far_frames_payloads_noop_sections(run):
    P, eps, mem, gen, rd, df = run
    far = analyses.far_comparison(df, n_boot=100, n_perm=200)
    assert far["n_common"] <= P["n_questions_extra"]
    assert set(far["contrasts"]) >= {"retention", "wrong_follow"}
    fr = analyses.frames_comparison(df, n_boot=100, n_perm=200)
    assert set(fr) >= {"schema", "no_schema", "passage"}
    assert "correct_value_follow" in fr["passage"]["pooled"] and "incorrect_value_follow" in fr["passage"]["pooled"]
    pl = analyses.payload_comparison(df, n_boot=100, n_perm=200)
    assert set(pl["contrasts"]) == {"timeout", "permission_denied"}
    # every payload kind is asked of the same questions
    assert pl["timeout"]["pooled"]["err_abstain"]["n"] == pl["service_unavailable"]["pooled"]["err_abstain"]["n"]
    no = analyses.noop_comparison(df, n_boot=100, n_perm=200)
    assert no["noop"]["pooled"]["accuracy"]["n"] == no["no_tool"]["pooled"]["accuracy"]["n"]


def test_matcher_sensitivity_reports_both_matchers(run):
    P, eps, mem, gen, rd, df = run
    ms = analyses.matcher_sensitivity(df, mem, P["formulations"])
    v = ms["pooled"]["tool_follow"]
    assert set(v) == {"paper", "strict", "delta"}
    assert 0 <= ms["changed_decisions"]["final_correct"] <= 1


def test_summary_json_structure(run):
    P, eps, mem, gen, rd, df = run
    s = analyses.evaluation_summary({"fake": df}, {"fake": mem}, RunConfig.of(P))
    path = analyses.write_summary(s, rd)
    s2 = json.loads(path.read_text())
    m = s2["models"]["fake"]
    for metric in vocab.HEADLINE_METRICS:
        iv = m["headline"]["pooled"][metric]
        assert set(iv) >= {"value", "ci95", "n"}
    assert m["n_questions"] == {"headline": 24, "extra": 12}
    for sec in ("prompting", "protocol", "frames", "far", "payloads", "noop", "matcher_sensitivity", "source_matrix"):
        assert sec in m, sec
    assert "success" in m["prompting"]["flag"]
    assert "retention" in s2["ranking_stability"]
    t = tables.headline_table(s2)
    assert {"model", "formulation", "metric", "value", "lo", "hi", "n"} <= set(t.columns)
    assert len(tables.contrast_table(s2, "prompting")) == len(vocab.PROMPTING_ARMS) * 4
    assert len(tables.contrast_table(s2, "far")) >= 2
    assert not tables.arms_table(s2, "frames").empty


class KeyedFake(ScriptedGenerator):
    """A generator with the real cache (memtoc's one caching path), 16 prompts a batch; records each
    batch's prompts and can be killed at a given batch."""

    def __init__(self, answer, fail_on_call=None):
        super().__init__(answer, identity={"model": "keyed-fake", "v": 1}, batch=16)
        self.fail_on_call = fail_on_call
        self.calls: list[list[str]] = []
        self.requests: list[list[str]] = []      # the prompts of each generate() that reached the model

    def _generate_batches(self, prompts, desc):
        self.requests.append(list(prompts))
        for idx, replies in super()._generate_batches(prompts, desc):
            self.calls.append([prompts[i] for i in idx])
            if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
                raise KeyboardInterrupt("killed")
            yield idx, replies


def test_generation_batches_across_arms_caches_per_arm_and_resumes(bench, tmp_path):
    P = _params(n_questions=6, n_questions_extra=4, formulations=["reference"])
    eps = run_episodes(bench, RunConfig.of(P))
    answer = _answer_by_episode(eps)
    gen_dir = tmp_path / "generations" / "fake"
    # the elicitation already answered the forced closed-book prompts: no_tool must reuse them
    g0 = KeyedFake(answer)
    cb = [e for e in eps if e.condition == "no_tool"]
    cache.append_records(gen_dir / "closed_book_forced__reference.jsonl",
                         [{"key": g0.key(e.prompt), "text": "FINAL: x", "n_new_tokens": 2} for e in cb])
    assert all(e.prompt == closed_book_prompt(e.question, "reference", "forced") for e in cb)

    # killed during the second chunk: the first chunk's replies are already in their arm files
    g1 = KeyedFake(answer, fail_on_call=2)
    with pytest.raises(KeyboardInterrupt):
        ev.generate_replies(g1, "fake", eps, tmp_path)
    done = sum(len(cache.read_cache(p)) for p in gen_dir.glob("*.jsonl")) - len(cb)
    assert done == 16
    first_chunk = set(g1.calls[0])
    assert len(g1.requests) == 1                                          # one call for every arm
    assert len({e.arm_key for e in eps if e.prompt in set(g1.requests[0])}) > 1

    g2 = KeyedFake(answer)
    reps = ev.generate_replies(g2, "fake", eps, tmp_path)
    regenerated = [p for call in g2.calls for p in call]
    assert not (set(regenerated) & first_chunk)                    # finished work is not redone
    assert not (set(regenerated) & {e.prompt for e in cb})         # no_tool never regenerated
    assert len(regenerated) == len({e.prompt for e in eps}) - len(cb) - 16
    assert [r.text for r in reps] == [("FINAL: x" if e.condition == "no_tool" else answer(e.prompt)) for e in eps]
    # one file per arm, holding exactly its own episodes' replies
    for stem, idx in ev.group_episodes(eps).items():
        recs = cache.read_cache(gen_dir / f"{stem}.jsonl")
        assert set(recs) == {g2.key(eps[i].prompt) for i in idx}, stem
    # a rerun is served entirely from the cache
    g3 = KeyedFake(answer)
    reps3 = ev.generate_replies(g3, "fake", eps, tmp_path)
    assert g3.calls == [] and all(r.cached for r in reps3)


def test_cross_model_closed_book_and_reference_contrasts(run):
    """Issue 12 items 8 and 14: far vs near and the protocol ablation also on the Reference
    formulation; two-proportion tests over model pairs with Holm; FINAL-line compliance; forced vs
    permissive agreement."""
    P, eps, mem, gen, rd, df = run
    d2 = df.assign(model="fake2")
    s = analyses.evaluation_summary({"fake": df, "fake2": d2}, {"fake": mem, "fake2": mem}, RunConfig.of(dict(P, n_boot=50, n_perm=50)))
    m = s["models"]["fake"]
    assert set(m["far"]["contrasts_reference"]) >= {"retention", "wrong_follow"}
    assert "retention" in m["protocol"]["no_protocol_sentence"]["contrasts_reference"]
    pair = s["cross_model"]["retention"]["all_pairs"]["fake|fake2"]
    assert pair["diff"] == 0 and pair["family"] == "cross_model_ztest_retention"
    assert 0 <= m["closed_book"]["final_line_with_tool"]["rate"] <= 1
    forced = pd.DataFrame({"formulation": "reference", "qkey": ["a", "b", "c", "d"],
                           "mem_absent": [False, False, False, False], "memory_correct": [True, False, True, True]})
    perm = forced.assign(mem_absent=[False, False, True, False], memory_correct=[True, True, None, True])
    ag = analyses.closed_book_agreement(forced, perm)["pooled"]
    assert ag == {"n": 4, "both_answered": 3, "same_correctness": pytest.approx(2 / 3), "permissive_abstained": 0.25}
    assert analyses.final_line_compliance(["x\nFINAL: y", "no marker", None]) == {"n": 3, "rate": pytest.approx(1 / 3)}


def test_finetune_families_span_models_and_objectives():
    """Issue 12 item 6 for fine-tuning: retention and correct-tool following are each one Holm family
    over models x objectives per slice; the diagnostics stay uncorrected; the criterion is recomputed."""
    def c(p, d=0.1):
        return {"delta": d, "p": p, "p_holm": p}
    summ = {"models": {m: {"objectives": {o: {"deltas": {
        "retention": {"pooled": c(p), "reference": c(p)}, "tool_follow": {"pooled": c(0.5, -0.01)},
        "wrong_follow": {"pooled": c(0.01)}}} for o, p in (("sft", 0.01), ("dpo", 0.04))}} for m in ("a", "b")}}
    applied = stats.apply_finetune_families(summ)
    fam = applied["finetune_retention"]["pooled"]
    assert set(fam) == {"a|sft", "a|dpo", "b|sft", "b|dpo"}
    assert fam["a|dpo"] == pytest.approx(0.08)            # 2 x 0.04 after the two 0.01s
    d = summ["models"]["a"]["objectives"]["dpo"]
    assert d["deltas"]["wrong_follow"]["pooled"]["p_holm"] is None
    assert d["criterion"]["passed"] is False and summ["models"]["a"]["objectives"]["sft"]["criterion"]["passed"]
    assert summ["holm_families"]["finetune_retention"]["members"]["pooled"] == fam
    assert set(summ["holm_families"]["finetune_retention"]["members"]) == {"pooled", "reference"}
    assert applied["finetune_tool_follow"]["pooled"]["a|sft"] is not None


def test_every_extra_arm_has_its_summary_section(run):
    """An extra arm whose episodes were generated never vanishes from the summary: each entry of
    vocab.EXTRA_ARM_SPECS (all of them are in the default extra_arms) yields its section."""
    P, eps, mem, gen, rd, df = run
    assert set(P["extra_arms"]) == set(vocab.EXTRA_ARMS)
    s = analyses.model_summary(df, mem, P["formulations"], n_boot=50, n_perm=50)
    for spec in vocab.EXTRA_ARM_SPECS:
        assert s.get(spec.section), f"extra arm {spec.name}: no '{spec.section}' section"
    for arm in vocab.PROMPTING_ARMS:
        assert arm in s["prompting"]


def test_paper_params_run_the_judged_layer_and_plan_its_memory():
    """params/paper.yaml: the paper's judge (Qwen2.5-7B-Instruct, greedy, 32 new tokens) on vLLM;
    the dry run's GPU plan has a line for the judge engine (no weights are loaded)."""
    from memtoc.run import dryrun
    P = RunConfig.load(Path(__file__).resolve().parents[2] / "params" / "paper.yaml")
    assert P["judge"]["model"] == "qwen2.5-7b-instruct" and P["judge"]["max_new_tokens"] == 32
    assert P["judge"]["backend"] == "vllm" and P["judge"]["backend_options"]["gpu_memory_utilization"] < 0.85
    lines, cannot = [], []
    est = dryrun.judge_memory(P, lines, cannot)
    assert len(est) == 1 and est[0]["weights_gb"] > 10 and not cannot
    assert lines[0].strip().startswith("judge qwen2.5-7b-instruct")
    assert dryrun.judge_memory(P.replace(judge=None), [], []) == []


def test_family_table_lists_every_member_of_every_slice():
    from memtoc.stages.evaluation import tables
    summary = {"holm_families": {
        "prompting_retention": {"metric": "retention", "test": "sign_flip",
                                "members": {"pooled": {"m1/warn": 0.01, "m1/prior": 0.2}, "reference": {"m1/warn": 0.03}}},
        "empty": {"metric": "retention", "members": {}}}}
    t = tables.family_table(summary)
    assert len(t) == 3 and set(t["slice"]) == {"pooled", "reference"}
    assert t.loc[(t["slice"] == "reference") & (t["member"] == "m1/warn"), "p_holm"].item() == 0.03
    assert tables.family_table({}).empty


def test_rate_intervals_and_summarize_group_share_the_estimator():
    """Where a unit table covers every question of the arm in every formulation (err_abstain: all
    tool_error episodes), intervals.rate_intervals draws the same questions as
    metrics.summarize_group and gives the same entries; where a metric's cell holds a subset of the
    questions (retention), the rates agree and the intervals rest on other draws."""
    d = metrics.synthetic_arm(60, seed=3)
    sg = metrics.summarize_group(d, n_boot=300)
    ri = intervals.rate_intervals(metrics.metric_units(d, "err_abstain"), FORMULATIONS, n_boot=300)
    assert set(ri) == set(FORMULATIONS) | {"pooled"}
    for f, iv in ri.items():
        assert iv["value"] == pytest.approx(sg[f]["err_abstain"]["value"], abs=1e-15)
        assert (iv["ci95"], iv["n"]) == (sg[f]["err_abstain"]["ci95"], sg[f]["err_abstain"]["n"]), f
    assert ri["pooled"]["n_boot_used"] == sg["pooled"]["err_abstain"]["n_boot_used"] == 300
    ret = intervals.rate_intervals(metrics.metric_units(d, "retention"), FORMULATIONS, n_boot=300)
    assert all(ret[f]["value"] == pytest.approx(sg[f]["retention"]["value"]) for f in ret)
    assert any(ret[f]["ci95"] != sg[f]["retention"]["ci95"] for f in ret)


def test_the_analyses_package_keeps_every_name_its_callers_use():
    """Every attribute of the analyses package named across memtoc/, notebooks/, tests/ and tools/
    resolves, and the shared statistics are the bottom layer's own functions (re-exported, not
    copied)."""
    root = Path(__file__).resolve().parents[2]
    used = set()
    for folder in ("memtoc", "notebooks", "tests", "tools"):
        for p in (root / folder).rglob("*"):
            if p.suffix in (".py", ".ipynb") and p.is_file():
                used |= set(re.findall(r"\banalyses\.([A-Za-z_]\w*)", p.read_text(errors="replace")))
    used.discard("py")                                         # the old file name, in prose
    assert {"contrast", "rate_intervals", "evaluation_summary"} <= used
    assert not sorted(n for n in used if not hasattr(analyses, n))
    for name in ("rate_intervals", "contrast", "apply_holm", "add_rates", "interval_obj"):
        assert getattr(analyses, name) is getattr(intervals, name)
    assert analyses.apply_finetune_families is stats.apply_finetune_families
