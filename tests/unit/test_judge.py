"""The LLM-judge overlay (PROTOCOL §4b, memtoc/stages/evaluation/judge.py): request selection, reply parsing, the
overlay rules, CAR_judge, the cache-backed judge run and the notebook-03 glue. Fast tests use a
fake judge; one integration test runs the embedded model as judge."""
from __future__ import annotations

import json
import time

import pandas as pd
import pytest
from conftest import ScriptedGenerator

from memtoc.config.params import DEFAULTS, validate_params
from memtoc.config.runconfig import RunConfig
from memtoc.core import metrics, scoring
from memtoc.core.errors import ConfigError
from memtoc.stages.evaluation import judge as J


def _row(eid, condition, response, *, gold="Paris", tool_value="Lyon", memory_span="Paris",
         qkey="q1", formulation="reference", question="What is the capital of France?", model="m",
         arm="untreated", frame="schema"):
    """One scored row, scored by the real det code (score_reply / memory_status / assign_cell)."""
    tool_correct = {"tool_right": True, "tool_wrong": False, "tool_error": False, "no_tool": None}[condition]
    absent = (not memory_span) or scoring.is_abstain(memory_span)
    mc = None if absent else scoring.match(memory_span, gold)
    dec = scoring.score_reply(response, gold, tool_value, "" if absent else memory_span)
    return {"model": model, "episode_id": eid, "question_id": f"{qkey}.0", "qkey": qkey,
            "instance_id": 1, "formulation": formulation, "condition": condition, "frame": frame,
            "arm": arm, "payload_kind": None, "tool_value": tool_value, "tool_correct": tool_correct,
            "question": question, "gold": gold, "gold_kind": "place", **dec, "response": response,
            "memory_span": memory_span, "mem_absent": absent, "memory_correct": mc,
            "cell": metrics.assign_cell(mc, absent, tool_correct), "matcher": "paper"}


@pytest.fixture
def scored():
    echo_q = "Which city hosts the Louvre museum in Paris?"
    echo_span = "The Louvre museum is in the city of Paris"        # 9 words > 1 + 2, gold in question
    rows = [
        # q1: memory correct (arb for tool_wrong)
        _row("e1", "tool_wrong", "I am not going to say it."),                 # neither/other -> extract
        _row("e2", "tool_wrong", "FINAL: Lyon"),                               # followed_tool: ack only
        _row("e3", "tool_wrong", "FINAL: UNKNOWN"),                            # neither/abstain: ack only
        _row("e4", "tool_right", "whatever", tool_value="Paris"),              # never judged
        # q2: a suspicious (echo) closed-book span, correct by det thanks to the echo
        _row("e5", "tool_wrong", "Hmm.", qkey="q2", question=echo_q, memory_span=echo_span),
        _row("e6", "tool_right", "FINAL: Paris", qkey="q2", question=echo_q, memory_span=echo_span,
             tool_value="Paris"),
        # q3: a long span but the gold is not in the question -> not suspicious
        _row("e7", "tool_wrong", "FINAL: Lyon", qkey="q3", memory_span="I believe that it would be Paris, France"),
        # q4: the same echo rule but the span is short -> not suspicious
        _row("e8", "tool_wrong", "FINAL: Lyon", qkey="q4", question=echo_q, memory_span="Paris"),
        # q1 in a prompting arm: judged alike
        _row("e9", "tool_wrong", "I would rather write a poem.", arm="warn"),
        # q5: tool_far (another incorrect value) is not judged
        _row("e10", "tool_wrong", "xyz", qkey="q5").copy() | {"condition": "tool_far"},
    ]
    return pd.DataFrame(rows)


def _j(req, text):
    return J.Judgment(req, text)


def _req(reqs, task, target, eid=None, qkey=None):
    for q in reqs:
        if q.task == task and q.target == target and (eid is None or q.episode_id == eid) \
                and (qkey is None or q.qkey == qkey):
            return q
    raise AssertionError(f"no request {task} {target} {eid} {qkey}")


# ---------------------------------------------------------------------------------------- requests

def test_requests_follow_the_protocol_rules(scored):
    reqs = J.judge_requests(scored)
    finals = {q.episode_id for q in reqs if q.task == "extract" and q.target == "final"}
    books = {q.qkey for q in reqs if q.target == "closed_book"}
    acks = {q.episode_id for q in reqs if q.task == "ack"}
    # tool_wrong neither/other finals, every arm alike; not neither/abstain (e3), not tool_far (e10)
    assert finals == {"e1", "e5", "e9"}
    # the echo span only; a long span without the gold in the question (q3) and a short one (q4) are not
    assert books == {"q2"}
    assert J.suspicious_span("The Louvre museum is in the city of Paris", "Paris",
                             "Which city hosts the Louvre museum in Paris?")
    assert not J.suspicious_span("I believe that it would be Paris, France", "Paris", "What is the capital of France?")
    assert not J.suspicious_span("in Paris", "Paris", "Which city hosts the Louvre museum in Paris?")
    # one closed-book request per (model, formulation, qkey), whatever the number of rows
    assert sum(q.target == "closed_book" for q in reqs) == 1
    # ack for every tool_wrong final (any outcome, any arm)
    assert acks == {"e1", "e2", "e3", "e5", "e7", "e8", "e9"}
    assert J.request_counts(reqs) == {"extract_final": 3, "extract_closed_book": 1, "ack": 7}
    q = _req(reqs, "ack", "final", "e2")
    assert "Lyon" in q.prompt and "FINAL: Lyon" in q.prompt and "YES or NO" in q.prompt
    assert "ABSTAIN" in _req(reqs, "extract", "closed_book").prompt
    assert q.key == ("ack", "final", "m", "e2") and q.hop == "q1.0"


def test_absent_closed_book_span_is_not_sent(scored):
    d = scored.copy()
    d.loc[d["qkey"] == "q2", "mem_absent"] = True
    assert not any(q.target == "closed_book" for q in J.judge_requests(d))


def test_requests_need_scored_columns(scored):
    with pytest.raises(J.JudgeError, match="memory_span"):
        J.judge_requests(scored.drop(columns=["memory_span"]))


# ---------------------------------------------------------------------------------------- parsers

@pytest.mark.parametrize("text, want", [
    ("Paris", ("entity", "Paris")),
    ("  \n\"Paris\"\nbecause the reply says so", ("entity", "Paris")),   # leading blank, first line, quotes
    ("**Paris**", ("entity", "Paris")),
    ('*"Jean Dupont"*', ("entity", "Jean Dupont")),
    ("ABSTAIN", ("abstain", None)),
    ("Abstain - the reply gives no answer", ("abstain", None)),
    ("ABSTAINED", ("abstain", None)),                                      # a prefix, as written in §4b
    ("", None), ("   \n  ", None), ('""', None), ("**", None), (None, None),  # empty / an error
    (" ".join(["word"] * 12), ("entity", " ".join(["word"] * 12))),        # 12 words: kept
    (" ".join(["word"] * 13), None),                                       # 13 words: ignored
    ("ABSTAIN " + " ".join(["because"] * 12), None),                       # the word limit comes first
])
def test_parse_extract(text, want):
    assert J.parse_extract(text) == want


@pytest.mark.parametrize("text, want", [
    ("YES", True), ("Yes, it flags the conflict.", True), ("**YES**", True), ('"no"', False),
    ("NO.", False), ("no\nYES", False), ("  \nYES", True),
    ("Maybe", None), ("", None), (None, None), ("NOT SURE", None), ("Nothing", None), ("yesterday", None),
])
def test_parse_ack(text, want):
    assert J.parse_ack(text) is want


# ---------------------------------------------------------------------------------------- overlay

def test_overlay_rules(scored):
    reqs = J.judge_requests(scored)
    js = [
        _j(_req(reqs, "extract", "final", "e1"), "ABSTAIN"),
        _j(_req(reqs, "extract", "final", "e9"), "Lyon"),                  # -> followed_tool
        _j(_req(reqs, "extract", "final", "e5"), "Paris"),
        _j(_req(reqs, "ack", "final", "e2"), "YES"),
        _j(_req(reqs, "ack", "final", "e3"), "NO"),
        _j(_req(reqs, "ack", "final", "e7"), "I cannot tell"),             # missing
    ]
    out = J.apply_overlay(scored, js)
    by = out.set_index("episode_id")
    det = scored.set_index("episode_id")
    assert (out["layer"] == "judged").all() and len(out) == len(scored)
    # ABSTAIN: neither/abstain, abstain True, nothing else moves
    assert by.loc["e1", "neither_subtype"] == "abstain" and bool(by.loc["e1", "abstain"]) is True
    assert by.loc["e1", "outcome"] == "neither" and by.loc["e1", "judge_final"] == "ABSTAIN"
    # entity: ft / km recomputed, outcome rebuilt, final_correct NOT recomputed
    assert bool(by.loc["e9", "followed_tool"]) is True and by.loc["e9", "outcome"] == "followed_tool"
    assert by.loc["e9", "neither_subtype"] is None and by.loc["e9", "judge_final"] == "Lyon"
    assert by.loc["e9", "final_correct"] == det.loc["e9", "final_correct"]
    assert bool(by.loc["e5", "kept_memory"]) is True and by.loc["e5", "outcome"] == "kept_memory"
    assert bool(by.loc["e5", "final_correct"]) is False                          # the det label stays
    # ack_judge on tool_wrong rows only (None when missing or not asked)
    assert by.loc["e2", "ack_judge"] is True and by.loc["e3", "ack_judge"] is False
    assert by.loc["e7", "ack_judge"] is None and by.loc["e4", "ack_judge"] is None
    # untouched rows keep every det value
    for e in ("e2", "e3", "e4", "e6", "e7", "e8", "e10"):
        for c in ("outcome", "followed_tool", "kept_memory", "abstain", "cell", "memory_correct", "neither_subtype"):
            a, b = by.loc[e, c], det.loc[e, c]
            assert (pd.isna(a) and pd.isna(b)) or a == b, (e, c)
    # the input frame is not modified
    assert "layer" not in scored.columns and bool(det.loc["e1", "abstain"]) is False


def test_closed_book_fix_is_per_hop_and_changes_the_cell(scored):
    reqs = J.judge_requests(scored)
    book = _req(reqs, "extract", "closed_book")
    # det: the echo span "matches" the gold -> arb / agree; the judge says the span commits to Lyon
    assert set(scored.loc[scored["qkey"] == "q2", "cell"]) == {"arb", "agree"}
    out = J.apply_overlay(scored, [_j(book, "Lyon")])
    q2 = out[out["qkey"] == "q2"].set_index("episode_id")
    assert (q2["memory_span"] == "Lyon").all() and (q2["memory_correct"] == False).all()  # noqa: E712
    assert q2.loc["e5", "cell"] == "both_wrong" and q2.loc["e6", "cell"] == "tool_gold"
    assert (q2["judge_memory"] == "Lyon").all()
    assert (out.loc[out["qkey"] != "q2", "judge_memory"].isna()).all()
    # ABSTAIN, or an entity that the det abstention detector flags -> mem_absent
    for text in ("ABSTAIN", "unknown"):
        q2 = J.apply_overlay(scored, [_j(book, text)]).query("qkey == 'q2'")
        assert q2["mem_absent"].all() and q2["memory_correct"].isna().all()
        assert set(q2["cell"]) == {"mem_absent"}
    # an ignored reply changes nothing
    q2 = J.apply_overlay(scored, [_j(book, " ".join(["w"] * 20))]).query("qkey == 'q2'")
    assert set(q2["cell"]) == {"arb", "agree"}


def test_corrected_final_uses_the_judged_memory_span(scored):
    reqs = J.judge_requests(scored)
    js = [_j(_req(reqs, "extract", "closed_book"), "Marseille"),
          _j(_req(reqs, "extract", "final", "e5"), "Marseille")]
    e5 = J.apply_overlay(scored, js).set_index("episode_id").loc["e5"]
    assert bool(e5["kept_memory"]) is True and bool(e5["followed_tool"]) is False and e5["cell"] == "both_wrong"
    # a corrected final on an absent memory cannot keep it
    js = [_j(_req(reqs, "extract", "closed_book"), "ABSTAIN"),
          _j(_req(reqs, "extract", "final", "e5"), "Paris")]
    e5 = J.apply_overlay(scored, js).set_index("episode_id").loc["e5"]
    assert bool(e5["kept_memory"]) is False and e5["outcome"] == "neither" and e5["neither_subtype"] == "other"


def test_overlay_keeps_models_apart(scored):
    two = pd.concat([scored, scored.assign(model="other")], ignore_index=True)
    reqs = J.judge_requests(two)
    assert J.request_counts(reqs) == {"extract_final": 6, "extract_closed_book": 2, "ack": 14}
    q = next(r for r in reqs if r.model == "other" and r.episode_id == "e1" and r.task == "extract")
    out = J.apply_overlay(two, [_j(q, "ABSTAIN")])
    assert bool(out.loc[(out["model"] == "other") & (out["episode_id"] == "e1"), "abstain"].item()) is True
    assert bool(out.loc[(out["model"] == "m") & (out["episode_id"] == "e1"), "abstain"].item()) is False


def test_car_judge(scored):
    reqs = J.judge_requests(scored)
    js = [_j(_req(reqs, "ack", "final", e), t) for e, t in
          (("e1", "YES"), ("e2", "NO"), ("e3", "maybe"), ("e7", "YES"), ("e9", "NO"), ("e5", "YES"))]
    out = J.apply_overlay(scored, js)
    # arb ∪ both_wrong tool_wrong rows: e1 e2 e3 e7 e8 e9 (arb) and e5 (arb by det); e3 unparsable, e8 not asked
    assert J.car_judge(out) == {"value": pytest.approx(3 / 5), "n": 5, "n_missing": 2}
    u = J.car_units(out)
    assert list(u.columns) == ["model", "arm", "frame", "formulation", "qkey", "value"] and len(u) == 5
    empty = J.apply_overlay(scored[scored["condition"] != "tool_wrong"], [])
    assert J.car_judge(empty) == {"value": None, "n": 0, "n_missing": 0}


def test_parse_and_changed_counts(scored):
    reqs = J.judge_requests(scored)
    js = [_j(_req(reqs, "extract", "final", "e1"), "ABSTAIN"), _j(_req(reqs, "extract", "final", "e9"), "Lyon"),
          _j(_req(reqs, "extract", "final", "e5"), ""), _j(_req(reqs, "ack", "final", "e2"), "YES")]
    pc = J.parse_counts(js)
    assert pc["extract_final"] == {"entity": 1, "abstain": 1, "ignored": 1}
    assert pc["ack"] == {"yes": 1, "no": 0, "missing": 0}
    ch = J.changed_counts(scored, J.apply_overlay(scored, js))
    assert ch == {"outcome": 1, "abstain": 1, "memory_correct": 0, "cell": 0}


# ---------------------------------------------------------------------------------------- config

def test_judge_parameter_defaults_to_null_and_is_validated():
    assert DEFAULTS["judge"] is None and validate_params({})["judge"] is None
    p = validate_params({"judge": {"model": "smollm2-135m-instruct"}})
    assert p["judge"] == {"model": "smollm2-135m-instruct", "backend": "transformers", "backend_options": {},
                          "max_new_tokens": 32}
    for bad, field in (({"backend": "vllm"}, "judge.model"), ("yes", "judge"), ({"model": "x", "temp": 1}, "temp"),
                       ({"model": "x", "backend": "tgi"}, "judge.backend"),
                       ({"model": "x", "backend_options": [1]}, "judge.backend_options"),
                       ({"model": "x", "max_new_tokens": 0}, "judge.max_new_tokens")):
        with pytest.raises(ConfigError, match=field):
            validate_params({"judge": bad})
    assert RunConfig.of({"judge": None}).judge is None
    assert J.judge_label("org/Some Model") == "judge__org_Some_Model"


# ---------------------------------------------------------------------------------------- run + glue

def _rule(p):
    if "YES or NO" in p:
        return "YES" if "Lyon" in p.split("Reply:")[1] else "NO"
    return "ABSTAIN" if "Hmm" in p else "Lyon"


def test_run_judge_writes_the_cache_and_reuses_it(scored, tmp_path):
    gen = ScriptedGenerator(_rule, name="fake-judge")
    js = J.run_judge(gen, "judge__fake", scored, tmp_path)
    d = tmp_path / "generations" / "judge__fake"
    assert sorted(p.name for p in d.glob("*.jsonl")) == ["judge_ack.jsonl", "judge_extract.jsonl"]
    n_distinct = len({j.request.prompt for j in js})       # e2 and e7 share one ack prompt: asked once
    assert len(js) == 11 and n_distinct == 10 and gen.n_generated == 10 and not any(j.cached for j in js)
    assert [j.request for j in js] == J.judge_requests(scored)
    assert sum(1 for _ in open(d / "judge_ack.jsonl")) == 6
    js2 = J.run_judge(gen, "judge__fake", scored, tmp_path)
    assert gen.n_generated == 10 and all(j.cached for j in js2)
    assert [j.text for j in js2] == [j.text for j in js]


def test_add_judged_is_a_no_op_without_a_judge(scored, tmp_path):
    summary = {"models": {"m": {}}}
    P = RunConfig.of(dict(DEFAULTS, run_dir=tmp_path))
    assert J.add_judged(summary, {"m": scored}, P) is summary
    assert not (tmp_path / "scored_judged").exists() and not (tmp_path / "generations").exists()


def test_add_judged_writes_rows_and_the_summary_section(scored, tmp_path):
    P = RunConfig.of(dict(DEFAULTS, run_dir=tmp_path, n_boot=50, judge={"model": "fake-judge"}))
    gen = ScriptedGenerator(_rule, name="fake-judge")
    out = J.add_judged({"models": {}}, {"m": scored}, P, generator=gen)
    sec = out["judged"]
    assert sec["judge"]["label"] == "judge__fake-judge" and sec["judge"]["backend"] == "transformers"
    m = sec["models"]["m"]
    assert m["requests"] == {"extract_final": 3, "extract_closed_book": 1, "ack": 7}
    assert m["parsed"]["extract_final"] == {"entity": 2, "abstain": 1, "ignored": 0}
    assert set(m["headline"]) >= {"reference", "pooled"} and "retention" in m["headline"]["pooled"]
    assert m["car_judge"]["pooled"]["n"] == 6 and m["car_judge_missing"] == 0
    files = sorted(p.name for p in (tmp_path / "scored_judged" / "m").glob("*.jsonl"))
    assert files == ["untreated__reference.jsonl", "warn__reference.jsonl"]
    back = J.read_judged(tmp_path, "m")
    assert len(back) == len(scored) and (back["layer"] == "judged").all() and "ack_judge" in back.columns
    json.dumps(out)                                       # JSON-ready


# ---------------------------------------------------------------------------------------- real judge

@pytest.mark.integration
def test_embedded_model_as_judge(scored, tmp_path):
    from memtoc.generation import models

    sub = scored[scored["episode_id"].isin(["e1", "e2", "e3", "e5", "e9"])]
    reqs = J.judge_requests(sub)
    assert 6 <= len(reqs) <= 10
    label = J.judge_label(models.EMBEDDED)
    gen = models.load_generator(models.EMBEDDED, backend="transformers", max_new_tokens=8)
    try:
        t0 = time.time()
        js = J.run_judge(gen, label, sub, tmp_path)
        assert time.time() - t0 < 60
        d = tmp_path / "generations" / label
        assert (d / "judge_extract.jsonl").is_file() and (d / "judge_ack.jsonl").is_file()
        assert len(js) == len(reqs) and not any(j.cached for j in js)
        assert all(isinstance(j.text, str) for j in js)
        js2 = J.run_judge(gen, label, sub, tmp_path)
        assert all(j.cached for j in js2) and [j.text for j in js2] == [j.text for j in js]
    finally:
        gen.close()
    out = J.apply_overlay(sub, js)
    for c in ("layer", "ack_judge", "judge_final", "judge_memory"):
        assert c in out.columns
    assert (out["layer"] == "judged").all()
    assert set(out.loc[out["condition"] != "tool_wrong", "ack_judge"].dropna()) == set()
    assert (out["final_correct"].to_numpy() == sub["final_correct"].to_numpy()).all()
