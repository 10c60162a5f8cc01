"""Closed-book elicitation with a deterministic fake generator (no model): prompts, cache files,
memory status, the scored file, load_memory, cells and the summary."""
import json

import pandas as pd
import pytest
from conftest import ScriptedGenerator as Scripted

from memtoc.core.errors import DataError
from memtoc.core.records import Question
from memtoc.stages import elicitation


def q(i, gold, kind="person"):
    return Question(id=f"{i}.0", instance_id=i, hop_idx=0, qkey=f"question {i}", question=f"Question {i}?",
                    gold=gold, gold_kind=kind, family="free_form", near="x", near_original="x", far=None, fold=i % 2)


QS = [q(1, "Herbert Ross"), q(2, "Paris", "place"), q(3, "1999", "year")]
ANSWERS = {"Question 1?": "I think so.\nFINAL: Herbert Ross\n", "Question 2?": "FINAL: London\n",
           "Question 3?": "FINAL: UNKNOWN\n"}


def test_elicit_frame_files_and_reload(tmp_path):
    g = Scripted(ANSWERS)
    df = elicitation.elicit(g, "fake", QS, ["reference", "paraphrase_b"], "forced", tmp_path)
    assert list(df.columns[:len(elicitation.COLUMNS)]) == elicitation.COLUMNS
    assert len(df) == 6 and set(df.formulation) == {"reference", "paraphrase_b"}
    ref = df[df.formulation == "reference"].set_index("question_id")
    assert ref.loc["1.0", "span"] == "Herbert Ross" and ref.loc["1.0", "memory_correct"] == True  # noqa: E712
    assert ref.loc["2.0", "memory_correct"] == False and not ref.loc["2.0", "mem_absent"]  # noqa: E712
    assert ref.loc["3.0", "mem_absent"] and pd.isna(ref.loc["3.0", "memory_correct"])
    for form in ("reference", "paraphrase_b"):
        assert (tmp_path / "generations" / "fake" / f"closed_book_forced__{form}.jsonl").is_file()
    from memtoc.core.prompts import closed_book_prompt
    assert closed_book_prompt("Question 1?", "reference", "forced") in g.seen
    back = elicitation.load_memory(tmp_path, "fake", "forced")
    assert back[elicitation.COLUMNS].equals(df[elicitation.COLUMNS]) or \
        back[elicitation.COLUMNS].astype(str).equals(df[elicitation.COLUMNS].astype(str))
    # a rerun is served from the cache
    g2 = Scripted(ANSWERS)
    df2 = elicitation.elicit(g2, "fake", QS, ["reference", "paraphrase_b"], "forced", tmp_path)
    assert g2.seen == [] and df2["cached"].all()


def test_cells_rates_summary(tmp_path):
    df = elicitation.elicit(Scripted(ANSWERS), "fake", QS, ["reference"], "forced", tmp_path)
    cells = elicitation.cell_distribution(df)
    got = {(r.memory, r.tool): r.n for r in cells.itertuples()}
    assert got == {("correct", "correct"): 1, ("correct", "incorrect"): 1, ("incorrect", "correct"): 1,
                   ("incorrect", "incorrect"): 1, ("absent", "correct"): 1, ("absent", "incorrect"): 1}
    assert set(cells.cell) == {"agree", "arb", "tool_gold", "both_wrong", "mem_absent"}
    r = elicitation.rates(df).iloc[0]
    assert r["n"] == 3 and r["memory_correct"] == pytest.approx(1 / 3)
    assert r["memory_correct_of_elicited"] == pytest.approx(1 / 2) and r["mem_absent"] == pytest.approx(1 / 3)
    assert r["memory_correct_lo"] < 1 / 3 < r["memory_correct_hi"]
    s = elicitation.summary(df)
    node = s["models"]["fake"]["forced"]["reference"]
    assert node["cells"] == {"agree": 1, "arb": 1, "tool_gold": 1, "both_wrong": 1, "mem_absent": 2}
    assert node["memory_correct"]["n"] == 3 and s["models"]["fake"]["forced"]["pooled"]["mem_absent"] == pytest.approx(1 / 3)
    json.dumps(s)  # serializable


def test_errors(tmp_path):
    with pytest.raises(DataError, match="notebook"):
        elicitation.load_memory(tmp_path, "nobody", "forced")
    with pytest.raises(Exception, match="variant"):
        elicitation.elicit(Scripted(ANSWERS), "fake", QS, ["reference"], "lenient", tmp_path)
    with pytest.raises(DataError, match="no questions"):
        elicitation.elicit(Scripted(ANSWERS), "fake", [], ["reference"], "forced", tmp_path)
