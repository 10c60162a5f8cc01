"""Construction: QC checks, the non-entity generator vs the frozen table, ToolHop flattening."""
import json
import random

import pytest

from memtoc.config.params import resolve_release_dir
from memtoc.config.runconfig import RunConfig
from memtoc.core.errors import DataError
from memtoc.core.records import Question
from memtoc.data.benchmark import load_benchmark
from memtoc.stages import construction as cs


def _q(**kw):
    d = dict(id="1.0", instance_id=1, hop_idx=0, qkey="k", question="When?", gold="1950", gold_kind="year",
             family="free_form", near="1955", near_original="1955", far="1700")
    d.update(kw)
    return Question(**d)


@pytest.fixture(scope="module")
def bench():
    try:
        return load_benchmark(resolve_release_dir(None))
    except DataError:
        pytest.skip("release data not available")


def test_qc_checks_catch_each_failure():
    assert cs.qc_checks(_q()) == []
    assert "near_empty" in cs.qc_checks(_q(near=" "))
    assert "near_equals_gold" in cs.qc_checks(_q(near="1950 "))
    assert "near_equals_far" in cs.qc_checks(_q(near="1700"))
    assert "far_equals_gold" in cs.qc_checks(_q(far="1950"))
    assert "near_type_mismatch" in cs.qc_checks(_q(near="Paris"))
    assert "far_type_mismatch" in cs.qc_checks(_q(gold_kind="date", gold="3 March 1950", near="4 March 1950", far="1700"))
    assert cs.qc_checks(_q(gold_kind="timezone", gold="Europe/Paris", near="Europe/Rome", far="Asia/Tokyo")) == []
    assert "near_type_mismatch" in cs.qc_checks(_q(gold_kind="timezone", gold="Europe/Paris", near="Rome", far=None))
    assert cs.qc_checks(_q(gold_kind="person", gold="Ann", near="Bob", far=None)) == []


def test_qc_report_on_the_table(bench):
    r = cs.qc_report(bench.questions)
    assert r["n_questions"] == 575
    # the released table passes its own programmatic QC, on both the original and repaired near values
    assert r["n_failed_evaluated"] == 0 and r["n_failed_original"] == 0, r["failures"][:5]


def test_generator_protocol_example():
    g = cs.nonentity_distractors("jewel staite also stars with alan dale in a scifi tv film released in what year",
                                 "2011", "year")
    assert (g["near"], g["far"], g["flags"]) == ("2023", "1832", [])


def test_generator_rng_order_near_then_far():
    rng = random.Random("20260721|some question")
    near, _ = cs.generate_nonentity("1 March 1900", "date", rng, "near")
    far, _ = cs.generate_nonentity("1 March 1900", "date", rng, "far")
    g = cs.nonentity_distractors("some question", "1 March 1900", "date")
    assert (g["near"], g["far"]) == (near, far)
    # far drawn on a fresh rng differs from far drawn after near: the draw order matters
    far_fresh, _ = cs.generate_nonentity("1 March 1900", "date", random.Random("20260721|some question"), "far")
    assert far_fresh != far


def test_generator_reproduces_the_frozen_table(bench):
    rep = cs.reproduce_nonentity(bench.questions)
    gen = rep["generator_branch"]
    assert gen["near"]["n"] == 173  # 44 years + 111 dates + 18 time zones
    # measured: every frozen near and far value of the generator branch is reproduced
    assert gen["both"]["share"] == 1.0, rep["mismatches"][:5]
    for kind, n in (("year", 44), ("date", 111), ("timezone", 18)):
        assert rep["by_kind"][kind]["both"] == {"n": n, "reproduced": n, "share": 1.0}


def test_generator_detects_a_wrong_seed(bench):
    rep = cs.reproduce_nonentity(bench.questions, seed=1)
    assert rep["generator_branch"]["near"]["share"] < 0.5


def test_date_formats_and_flags():
    assert cs.parse_date("1950-03-03")[1] == "iso"
    assert cs.parse_date("3 March 1950")[1] == "dmy"
    assert cs.parse_date("March 3,1950")[1] == "mdy"
    assert cs.parse_date("May 1673")[1] == "my"
    assert cs.parse_date("Sept 3, 1950") is None and cs.parse_date("31 February 1950") is None
    g = cs.nonentity_distractors("q", "May 1673", "date")
    assert g["near"] and len(g["near"].split()) == 2  # month-year keeps its format
    assert cs.nonentity_distractors("q", "Paris", "person")["flags"] == ["unsupported_kind:person"] * 2
    assert cs.nonentity_distractors("q", "c. 1950", "year")["flags"] == ["year_unparsed"] * 2
    tz = cs.nonentity_distractors("q", "Pacific/Auckland", "timezone")
    assert tz["flags"] == ["tz_fallback_region"] and not tz["far"].startswith("Pacific/")


TOOLHOP = [
    {"id": 0, "question": "Where was the father of X born?", "answer": "Lyon",
     "sub_task": {"Who is the father of X?": "Jean X", "Where was Jean X born?": "Lyon"},
     "tools": [{"name": "father_finder"}, {"name": "birthplace_finder"}]},
    {"id": 1, "question": "How many letters are in the first name of the father of X?", "answer": "4",
     "sub_task": [{"question": "Who is the father of X?", "answer": "Jean X"},
                  {"question": "What is the first name of Jean X?", "answer": "Jean"},
                  {"question": "How many letters are in Jean?", "answer": "4"}]},
    {"id": 2, "question": "Is Y older than Z?", "answer": "yes",
     "sub_task": [{"question": "When was Y born?", "answer": "1 May 1901"},
                  {"question": "Is Y older than Z?", "answer": "Yes"},
                  {"question": "", "answer": "x"}]},
]


def test_toolhop_flatten_dedup_filter(tmp_path):
    p = tmp_path / "ToolHop.json"
    p.write_text(json.dumps(TOOLHOP))
    subs, counts = cs.flatten_toolhop(p)
    assert counts == {"chains": 3, "sub_questions": 7, "skipped_malformed": 1}
    assert subs[0].schema == {"name": "father_finder"} and subs[0].qkey == "who is the father of x"
    kept, counts = cs.toolhop_pool(p)
    assert counts["after_dedup"] == 6 and counts["duplicates_removed"] == 1
    assert [s.question for s in kept] == ["Who is the father of X?", "Where was Jean X born?",
                                          "What is the first name of Jean X?", "When was Y born?"]
    assert counts["after_factual_filter"] == 4 and counts["chains_kept"] == 3


def test_toolhop_bad_input(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        cs.flatten_toolhop(tmp_path / "missing.json")
    p = tmp_path / "t.json"
    p.write_text(json.dumps([{"id": 0, "question": "q"}]))
    with pytest.raises(DataError, match="chain 0 has no sub-questions"):
        cs.flatten_toolhop(p)


def test_notebook_helpers(bench, tmp_path):
    from memtoc.config.params import load_params
    from memtoc.data.episodes import run_episodes
    table = cs.counts_table(bench.counts())
    assert table["match"].all(), table[~table["match"]]
    assert table.loc["analysis set (pool - EXCLUDE)", "memtoc"] == 542
    dist = cs.distribution_table(bench.questions, "gold_kind")
    assert dist["pool"].sum() == 575 and dist["analysis"].sum() == 542 and dist["far_analysis"].sum() == 443
    P = load_params(None, {"n_questions": 3, "n_questions_extra": 2})
    eps = run_episodes(bench, RunConfig.of(P))
    s = cs.construction_summary(bench, eps)
    assert s["generator_share"] == 1.0 and s["counts"]["episodes"]["core"] == 6504
    assert s["run_episodes"]["questions"] == 3 and all(s["matches_paper"].values())
    json.dumps(s)  # serialisable as is
    png = cs.plot_answer_types(bench.questions, tmp_path / "figures" / "answer_types.png")
    assert png.stat().st_size > 10_000
    assert set(cs.episode_table(eps).columns) == {"reference", "paraphrase_a", "paraphrase_b"}


def test_related_questions_across_folds(bench):
    """Questions of different chains where one's gold is the other's subject: found, with their
    folds; the paper's example (Chiang Ching-kuo) straddles the release's frozen folds."""
    import dataclasses

    from memtoc.core.records import Question

    def q(i, chain, question, gold, kind="person", fold=0):
        return Question(id=f"{chain}.{i}", instance_id=chain, hop_idx=i, qkey=f"k{chain}{i}", question=question,
                        gold=gold, gold_kind=kind, family="genealogy", near="x", near_original="x", far=None,
                        fold=fold)
    qs = [q(0, 1, "Who is the father of Ann Lee?", "John Lee"),
          q(0, 2, "Who is the child of John Lee?", "Ann Lee", fold=1),
          q(1, 2, "Where was John Leeds born?", "Leeds", kind="place", fold=1),    # "John Lee" is not a phrase here
          q(0, 3, "Which 2011 film is it?", "X"),
          q(0, 4, "When did Y end?", "2011", kind="year", fold=1)]             # values are not subjects
    links = cs.related_links(qs)
    assert [(r["gold_id"], r["subject_id"], r["cross_fold"]) for r in links] == [("1.0", "2.0", True),
                                                                               ("2.0", "1.0", True)]
    same_fold = [dataclasses.replace(x, fold=0) for x in qs]
    assert not any(r["cross_fold"] for r in cs.related_links(same_fold))

    s = cs.related_summary(bench.questions)
    assert s["n_cross_fold"] == len(s["cross_fold_links"]) >= 15
    assert s["n_cross_fold_pairs"] <= s["n_cross_fold"] and s["n_cross_fold_analysis"] <= s["n_cross_fold"]
    example = [r for r in s["cross_fold_links"] if r["subject_question"] == "Who is the child of Chiang Ching-kuo?"]
    assert example and example[0]["gold"] == "Chiang Ching-kuo" and example[0]["gold_fold"] != example[0]["subject_fold"]
    assert cs.construction_summary(bench)["related_questions"]["n_cross_fold"] == s["n_cross_fold"]
