"""The lens panel's answers and controls (notebook 05): closed-book spans read without their answer
label, controls drawn from the model's other questions."""
from __future__ import annotations

from test_probes import tiny_lm

from memtoc.core.scoring import strip_answer_label
from memtoc.stages.probes import core, lens as L


def _row(qid, span, outcome="followed_tool", cell="arb", tool="Lyon", absent=False, prompt=None):
    return {"question_id": qid, "memory_span": span, "mem_absent": absent, "tool_value": tool, "cell": cell,
            "outcome": outcome, "prompt": prompt or f"Question {qid}?"}


def test_own_answer_drops_the_label_as_scoring_does():
    for span, want in [("Answer: 1851", "1851"), ("Answer: The film was directed by", "The film was directed by"),
                       ("**Final answer: Paris", "Paris"), ("answer : Rome ", "Rome"), ("A: Paris", "A: Paris"),
                       ("Answer:", "")]:
        assert core.own_answer(_row("q", span)) == want == strip_answer_label(span).strip()
    assert core.own_answer(_row("q", "Answer: 1851", absent=True)) == ""


def test_labelled_span_equal_to_the_tool_value_is_not_an_own_answer():
    rows = [_row("q1", "Answer: Lyon", tool="Lyon"), _row("q2", "Answer: Paris", tool="Lyon"),
            _row("q3", "Answer:", tool="Lyon")]
    assert [r["question_id"] for r in core.episode_sets(rows)["own_answer"]] == ["q2"]


def test_pick_controls_other_questions_distinct_tokens():
    pool = [("q1", 10), ("q2", 11), ("q3", 10), ("q4", 12), ("q2", 13)]
    assert core.pick_controls("q1", 10, pool, 5) == [11, 12, 13]
    assert core.pick_controls("q2", 11, pool, 2, start=3) == [12, 10]
    assert core.pick_controls("q1", 10, [("q1", 10), ("q1", 14)], 3) == []


def test_labelled_spans_rank_the_answer_not_the_label_and_controls_are_filled():
    """Every span labelled "Answer: ...": before the fix the lens ranked the token "A" of "Answer" for
    every episode and the control set was empty (every other answer shared that first token)."""
    lm = tiny_lm()
    eps = [_row(f"q{i}", f"Answer: {a}", o) for i, (a, o) in
           enumerate([("Paris", "kept_memory"), ("Lyon", "followed_tool"), ("1851", "followed_tool")])]
    band = [0, 1]
    lens = L.identity_lens(lm.d_model, band)
    out = core.lens_set(lm, lens, band, eps, n_control=2)
    plain = core.lens_set(lm, lens, band, [e | {"memory_span": core.own_answer(e)} for e in eps], n_control=2)
    assert out == plain
    for r in L.READOUTS:
        assert out[r]["control"]["n"] == 6
    # the rank read is the answer's first token ("P" of Paris), not the label's ("A")
    ids = lm.encode_prompt(eps[0]["prompt"])
    p = ord("P") + 3
    rk = L.readout_ranks(lm, ids, lens, band, {"first": [p], "all": [p], "control": []})
    assert out["logit"]["kept_memory"]["median_rank"] == min(rk["logit"]["first"][l][0] for l in band)


def test_a_one_question_set_draws_controls_from_the_model_pool():
    """A set whose episodes all come from one question (two formulations) has no control of its own;
    the run's pool of other questions' answers supplies them."""
    lm = tiny_lm()
    eps = [_row("q1", "Answer: Paris", "kept_memory"), _row("q1", "Paris", "followed_tool", prompt="Q1 again?")]
    band = [0, 1]
    lens = L.identity_lens(lm.d_model, band)
    assert core.lens_set(lm, lens, band, eps, n_control=2)["logit"]["control"]["n"] == 0
    pool = core.control_pool(lm, eps + [_row("q2", "Answer: Rome"), _row("q3", "1851"), _row("q4", "", absent=True)])
    assert pool == [("q1", ord("P") + 3), ("q2", ord("R") + 3), ("q3", ord("1") + 3)]
    out = core.lens_set(lm, lens, band, eps, n_control=2, pool=pool)
    assert out["logit"]["control"]["n"] == 4 and out["jacobian"]["control"]["n"] == 4
