"""Fast tests of notebook 06's module (memtoc/transfer): matcher table, validation, import, the
built-in set, the no-MemToC-leak guarantee, metrics and the `memtoc transfer` CLI."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from memtoc import cli as memtoc_cli
from memtoc.config.params import load_params
from memtoc.config.runconfig import RunConfig
from memtoc.core import prompts
from memtoc.core.errors import ConfigError
from memtoc.core.records import Question
from memtoc.core.scoring import canon
from memtoc.data.benchmark import select_questions
from memtoc.generation import models
from memtoc.generation.backends.base import Generator, Reply
from memtoc.run.pipeline import plan
from memtoc.stages import elicitation, finetune
from memtoc.stages.transfer import (
    ABSTAIN,
    TransferDataError,
    TransferError,
    build_episodes,
    check_no_memtoc_leak,
    core,
    import_faitheval,
    load_items,
    match_choice,
    reverse_examples,
    score_lines,
    score_replies,
    select_items,
    tables as transfer_tables,
    validate_file,
    validate_lines,
)
from memtoc.stages.transfer.data import builtin_path


def _transfer(P):
    """The run's typed ``transfer`` block of the params mapping ``P``."""
    return RunConfig.of(P).transfer

FIX = Path(__file__).parents[1] / "fixtures" / "transfer"
L4 = ["A", "B", "C", "D"]

# (reply, labels, texts, expected matched, expected rule)
TABLE = [
    # bare label forms
    ("FINAL: B", L4, ["Paris", "Lyon", "Nice", "Metz"], "B", "label"),
    ("FINAL: b", L4, ["Paris", "Lyon", "Nice", "Metz"], "B", "label"),
    ("FINAL: (C)", L4, ["Paris", "Lyon", "Nice", "Metz"], "C", "label"),
    ("FINAL: C)", L4, ["Paris", "Lyon", "Nice", "Metz"], "C", "label"),
    ("FINAL: D.", L4, ["Paris", "Lyon", "Nice", "Metz"], "D", "label"),
    ("FINAL: [A]", L4, ["Paris", "Lyon", "Nice", "Metz"], "A", "label"),
    ("FINAL: Option D", L4, ["Paris", "Lyon", "Nice", "Metz"], "D", "label"),
    ("FINAL: Answer: A", L4, ["Paris", "Lyon", "Nice", "Metz"], "A", "label"),
    ("The answer is C.", L4, ["Paris", "Lyon", "Nice", "Metz"], "C", "label"),
    ("FINAL: The correct answer is B", L4, ["Paris", "Lyon", "Nice", "Metz"], "B", "label"),
    ("FINAL: choice a", L4, ["Paris", "Lyon", "Nice", "Metz"], "A", "label"),
    ("FINAL: B. Lyon", L4, ["Paris", "Lyon", "Nice", "Metz"], "B", "label"),
    ("FINAL: B) Lyon", L4, ["Paris", "Lyon", "Nice", "Metz"], "B", "label"),
    ("FINAL: B: it is the one", L4, ["Paris", "Lyon", "Nice", "Metz"], "B", "label"),
    ("FINAL: B. Nice", L4, ["Paris", "Lyon", "Nice", "Metz"], None, None),          # label vs text conflict
    ("FINAL: 2", ["1", "2", "3", "4"], ["8", "6", "10", "4"], "2", "label"),         # numeric labels win
    ("reasoning...\nFINAL: A\nextra", L4, ["Paris", "Lyon", "Nice", "Metz"], "A", "label"),
    # option text
    ("FINAL: Lyon", L4, ["Paris", "Lyon", "Nice", "Metz"], "B", "text"),
    ("FINAL: lyon.", L4, ["Paris", "Lyon", "Nice", "Metz"], "B", "text"),
    ("FINAL: the Pacific Ocean", L4, ["the Pacific Ocean", "the Atlantic Ocean", "the Indian Ocean", "the Arctic Ocean"], "A", "text"),
    ("FINAL: Pacific Ocean", L4, ["the Pacific Ocean", "the Atlantic Ocean", "the Indian Ocean", "the Arctic Ocean"], "A", "text"),
    ("FINAL: 8", L4, ["8", "6", "10", "4"], "A", "text"),
    ("FINAL: carbon dioxide", L4, ["carbon dioxide", "oxygen", "nitrogen", "helium"], "A", "text"),
    ("No marker, last line: Metz", L4, ["Paris", "Lyon", "Nice", "Metz"], "D", "contains"),
    ("FINAL: K2", L4, ["Mount Everest", "K2", "Kilimanjaro", "Mont Blanc"], "B", "text"),
    # abstention
    ("FINAL: unknown", L4, ["Paris", "Lyon", "Nice", "Metz"], ABSTAIN, "abstain"),
    ("FINAL: I don't know", L4, ["Paris", "Lyon", "Nice", "Metz"], ABSTAIN, "abstain"),
    ("FINAL: The passage does not mention it", L4, ["Paris", "Lyon", "Nice", "Metz"], ABSTAIN, "abstain"),
    ("FINAL: cannot be determined", [], [], ABSTAIN, "abstain"),
    ("FINAL: Paul", [], [], None, None),                                           # unanswerable, answered
    # unique containment
    ("FINAL: I think it is Lyon", L4, ["Paris", "Lyon", "Nice", "Metz"], "B", "contains"),
    ("FINAL: It is salt water", L4, ["salt water", "water", "ice", "steam"], "A", "contains"),  # nested option
    ("FINAL: Everest", L4, ["Mount Everest", "K2", "Kilimanjaro", "Mont Blanc"], "A", "contains"),
    ("FINAL: red", L4, ["red blood cells", "white blood cells", "platelets", "plasma"], "A", "contains"),
    ("FINAL: blood cells", L4, ["red blood cells", "white blood cells", "platelets", "plasma"], None, None),
    ("FINAL: Lyon or Nice", L4, ["Paris", "Lyon", "Nice", "Metz"], None, None),
    ("FINAL: Parisian", L4, ["Paris", "Lyon", "Nice", "Metz"], None, None),          # whole tokens only
    # numeric prefix (the paper's repair)
    ("FINAL: 83", ["A", "B"], ["83 331", "12 500"], "A", "contains"),
    ("FINAL: 83", ["A", "B"], ["83 331", "12 83"], "A", "numeric"),
    ("FINAL: 12", ["A", "B"], ["12 331", "12 500"], None, None),
    # unmatched
    ("FINAL: London", L4, ["Paris", "Lyon", "Nice", "Metz"], None, None),
    ("", L4, ["Paris", "Lyon", "Nice", "Metz"], None, None),
    ("FINAL:", L4, ["Paris", "Lyon", "Nice", "Metz"], None, None),
    ("FINAL: A cat", L4, ["Paris", "Lyon", "Nice", "Metz"], None, None),             # a sentence, not a label
    ("FINAL: E", L4, ["Paris", "Lyon", "Nice", "Metz"], None, None),
]


@pytest.mark.parametrize("reply,labels,texts,matched,rule", TABLE)
def test_matcher_table(reply, labels, texts, matched, rule):
    m = match_choice(reply, labels, texts)
    assert (m.matched, m.rule) == (matched, rule), m


def test_matcher_table_size():
    assert len(TABLE) >= 40


# ---------------------------------------------------------------------------------------------
# validation

def test_validate_bad_fixture_names_file_line_field():
    v = validate_file(FIX / "bad.jsonl")
    src = str(FIX / "bad.jsonl")
    assert [i.id for i in v.items] == ["ok-1"]
    expect = [f"{src}:2:gold_key:", f"{src}:3:cf_key:", f"{src}:4:passage:", f"{src}:5:choices.label:",
              f"{src}:6:-:", f"{src}:7:gold_key:", f"{src}:8:id:", f"{src}:9:answer:", f"{src}:10:choices.text:"]
    for prefix in expect:
        assert any(e.startswith(prefix) for e in v.errors), (prefix, v.errors)
    assert any("serialization filter" in e for e in v.errors if e.startswith(f"{src}:2:"))
    assert not v.ok


def test_validate_cli_exit_status(capsys):
    assert memtoc_cli.main(["transfer", "validate", str(FIX / "bad.jsonl")]) == 1
    err = capsys.readouterr().err
    assert f"{FIX / 'bad.jsonl'}:2:gold_key:" in err
    assert memtoc_cli.main(["transfer", "validate", str(builtin_path())]) == 0


def test_load_items_refuses_invalid_file():
    with pytest.raises(TransferDataError, match="bad.jsonl:2"):
        load_items(str(FIX / "bad.jsonl"))


# ---------------------------------------------------------------------------------------------
# import

def test_import_faitheval_arc_fixtures(tmp_path):
    rows, notes = import_faitheval(FIX / "faitheval_counterfactual.jsonl", FIX / "arc_challenge.jsonl",
                                   FIX / "faitheval_unanswerable.jsonl", verified_ids=["Mercury_0001"])
    v = validate_lines([json.dumps(r) for r in rows], "<imported>")
    by_id = {i.id: i for i in v.items}
    assert by_id["Mercury_0001"].gold_key == "B" and by_id["Mercury_0001"].cf_key == "C"
    assert by_id["Mercury_0001"].verified is True and by_id["Mercury_0002"].verified is False
    assert by_id["Mercury_0001"].passage == "Mars is the planet closest to the Sun."
    assert by_id["Mercury_0003"].labels == ("1", "2", "3", "4") and by_id["Mercury_0003"].gold_key == "1"
    assert by_id["un-q1"].kind == "unanswerable" and by_id["un-q1"].gold_key is None
    # serialization filter: ARC's answerKey "E" is not among the labels; empty unanswerable context
    assert "Mercury_0004" not in by_id and any(":gold_key:" in e and "serialization" in e for e in v.errors)
    assert "un-q2" not in by_id and any(":passage:" in e for e in v.errors)
    assert any("NoArc_0005" in n for n in notes)
    # AI2 layout of ARC gives the same key
    rows2, _ = import_faitheval(FIX / "faitheval_counterfactual.jsonl", FIX / "arc_challenge_ai2.jsonl")
    assert [r["gold_key"] for r in rows2 if r["id"] == "Mercury_0001"] == ["B"]


def test_import_cli_and_parquet(tmp_path):
    pd.DataFrame([json.loads(x) for x in (FIX / "faitheval_counterfactual.jsonl").read_text().splitlines()]) \
        .to_parquet(tmp_path / "cf.parquet")
    out = tmp_path / "set.jsonl"
    assert memtoc_cli.main(["transfer", "import", "--counterfactual", str(tmp_path / "cf.parquet"), "--arc",
                            str(FIX / "arc_challenge.jsonl"), "-o", str(out)]) == 0
    v = validate_file(out)
    assert v.ok and {i.id for i in v.items} == {"Mercury_0001", "Mercury_0002", "Mercury_0003"}


def test_import_needs_arc_for_counterfactual():
    with pytest.raises(TransferDataError, match="--arc"):
        import_faitheval(FIX / "faitheval_counterfactual.jsonl", None)


# ---------------------------------------------------------------------------------------------
# the built-in set

def _run(big, small):
    return any(big[i:i + len(small)] == small for i in range(len(big) - len(small) + 1))


def test_builtin_set_counts_and_passages():
    items, info = load_items("builtin")
    cf = [i for i in items if i.kind == "counterfactual"]
    un = [i for i in items if i.kind == "unanswerable"]
    assert len(cf) == 60 and len(un) == 30 and info["plumbing"] and "not FaithEval" in info["note"]
    for i in cf:
        p = canon(i.passage).split()
        assert not _run(p, canon(i.gold_text).split()), f"{i.id}: passage contains the gold option"
        assert _run(p, canon(i.cf_text).split()), f"{i.id}: passage lacks the counterfactual option"
        assert i.gold_key != i.cf_key
    for i in un:
        assert i.gold_key is None and i.passage
    # answers spread over the labels (a model that always says "A" must not look right)
    assert len({i.gold_key for i in cf}) == 4


def test_builtin_set_ships_as_package_data():
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert 'data/*.jsonl' in text and builtin_path().is_file()


# ---------------------------------------------------------------------------------------------
# reverse-transfer training data: no MemToC content

def test_reverse_examples_have_no_memtoc_content(bench):
    items, _ = load_items("builtin")
    cf, _ = select_items(items, _transfer({}))
    ex = reverse_examples(cf, ["reference", "paraphrase_a", "paraphrase_b"])
    assert len(ex) == 60 * 2 * 3
    assert all(e.chosen == f"FINAL: {cf[0].gold_text}" for e in ex if e.question_id == cf[0].id)
    res = check_no_memtoc_leak(ex, bench.questions)
    assert res["passed"] and res["memtoc_questions"] == 575


def test_leak_check_refuses_memtoc_question_gold_and_distractor(bench):
    q = bench.questions[0]
    items, _ = load_items("builtin")
    base = items[0]
    leaks = [
        type(base)(**{**base.to_dict(), "question": q.question}),                        # MemToC question
        type(base)(**{**base.to_dict(), "texts": (q.gold,) + base.texts[1:], "gold_key": base.labels[0],
                      "cf_key": base.labels[1]}),                                        # MemToC gold as option
        type(base)(**{**base.to_dict(), "texts": (base.texts[0], q.near) + base.texts[2:], "gold_key": base.labels[0],
                      "cf_key": base.labels[1]}),                                        # MemToC distractor
    ]
    for it in leaks:
        with pytest.raises(TransferError, match="MemToC"):
            check_no_memtoc_leak(reverse_examples([it], ["reference"]), bench.questions)


# ---------------------------------------------------------------------------------------------
# episodes and metrics

def test_episodes_and_metrics_on_synthetic_replies():
    items, _ = load_items("builtin")
    tr = _transfer({"transfer": {"n_counterfactual": 3, "n_unanswerable": 2, "formulations": ["reference"]}})
    cf, un = select_items(items, tr)
    eps = build_episodes(cf, un, tr["formulations"], tr["frames"])
    assert [e.condition for e in eps].count("closed_book") == 3 and len(eps) == 3 * 3 + 2
    v = next(e for e in eps if e.condition == "value")
    assert json.dumps({"result": cf[0].cf_text}) in v.prompt and "Tool schema: " in v.prompt
    p = next(e for e in eps if e.condition == "passage")
    assert "Retrieved snippet: " in p.prompt and cf[0].passage[:20] in p.prompt
    # replies: closed-book right on items 0,1; value frame follows cf on item 0; passage keeps gold
    def reply(e):
        it = next(i for i in cf + un if i.id == e.item_id)
        if e.condition == "closed_book":
            return f"FINAL: {it.gold_key}" if it is not cf[2] else f"FINAL: {it.cf_key}"
        if e.condition == "value":
            return f"FINAL: {it.cf_text}" if it is cf[0] else f"FINAL: {it.gold_text}"
        if e.condition == "passage":
            return "FINAL: something else"
        return "FINAL: unknown" if it is un[0] else "FINAL: Bob"
    base = score_replies(eps, [reply(e) for e in eps], "untreated")
    mem = core.memory_right(base)
    assert mem == {("reference", cf[0].id), ("reference", cf[1].id)}
    rates = core.arm_rates(base, mem, ["reference"], tr["frames"], n_boot=50)
    assert rates["closed_book_acc"]["pooled"]["value"] == pytest.approx(2 / 3)
    assert rates["retention_value"]["pooled"]["value"] == pytest.approx(0.5)
    assert rates["cf_follow_value"]["pooled"]["value"] == pytest.approx(0.5)
    assert rates["unmatched_passage"]["pooled"]["value"] == pytest.approx(1.0)
    assert rates["abstention"]["pooled"] == {**rates["abstention"]["pooled"], "value": 0.5, "n": 2}
    # an "adapter" that retains everything on the value frame
    treated = base.copy()
    sel = treated["condition"] == "value"
    treated.loc[sel, "correct"] = True
    treated.loc[sel, "followed_cf"] = False
    d = core.arm_deltas(treated, base, mem, ["reference"], tr["frames"], "sft_fold0", n_boot=50, n_perm=50)
    assert d["retention_value"]["pooled"]["delta"] == pytest.approx(0.5)
    assert d["retention_value"]["pooled"]["n_units"] == 2
    assert d["closed_book_acc"]["pooled"]["delta"] == 0
    assert core.band_check(0.025, 0.03)["inside"] and not core.band_check(-0.045, 0.03)["inside"]
    gaps = core.unmatched_gaps({"unmatched_value": {"pooled": {"value": 0.0765}}},
                               {"unmatched_value": {"pooled": {"value": 0.0071}}}, ["value"], 0.03)
    assert gaps["value"]["flagged"] and not gaps["closed_book"]["flagged"]


def test_transfer_params_and_config():
    tr = _transfer({"formulations": ["reference", "paraphrase_a"]})
    assert tr.formulations == ("reference", "paraphrase_a") and tr.enabled
    assert tr.to_dict()["formulations"] == ["reference", "paraphrase_a"]          # as the summary records it
    assert RunConfig.of({"formulations": ["reference", "paraphrase_a"]}).transfer == tr
    with pytest.raises(ConfigError, match="transfer.frames"):
        _transfer({"transfer": {"frames": ["table"]}})
    with pytest.raises(ConfigError, match="transfer.extra_adapters"):
        _transfer({"transfer": {"extra_adapters": {"untreated": "/x"}}})
    assert _transfer({"transfer": {"extra_adapters": {"pool575_dpo": "/a"}}}).extra_adapters == {"pool575_dpo": "/a"}
    with pytest.raises(ConfigError, match="unknown transfer key"):
        _transfer({"transfer": {"n_items": 3}})
    with pytest.raises(ConfigError, match="'transfer'"):
        load_params(overrides={"transfer": [1]})
    for name in ("default", "smoke"):
        P = load_params(Path(__file__).parents[2] / "params" / f"{name}.yaml")
        assert _transfer(P)["enabled"]


def test_pipeline_runs_06_between_04_and_08():
    P = RunConfig.load(Path(__file__).parents[2] / "params" / "smoke.yaml")
    names = [s.name for s in plan(P) if s.run]
    # 06 after 04 (it reads 04's adapters) and before 08 (the report); 05 / 07 may sit between
    assert names.index("04_finetuning") < names.index("06_transfer") < names.index("08_paper")
    assert [n for n in names if n[:2] in ("04", "06", "08")] == ["04_finetuning", "06_transfer", "08_paper"]
    off = [s for s in plan(RunConfig.load(overrides={"transfer": {"enabled": False}})) if s.number == "06"]
    assert off and not off[0].run and "transfer.enabled" in off[0].reason


# ---------------------------------------------------------------------------------------------
# memtoc transfer score

def test_score_cli_with_malformed_line(tmp_path, capsys):
    out = tmp_path / "scored.jsonl"
    rc = memtoc_cli.main(["transfer", "score", str(FIX / "score_in.jsonl"), "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"{FIX / 'score_in.jsonl'}:3:-: not valid JSON" in err
    assert f"{FIX / 'score_in.jsonl'}:6:gold_key:" in err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [1, 2, 4, 5]
    r1, r2, r4, r5 = rows
    assert (r1["matched"], r1["correct"], r1["followed_cf"], r1["abstain"]) == ("B", False, True, False)
    assert (r2["matched"], r2["correct"], r2["extracted"]) == ("A", True, "Paris")
    assert (r4["matched"], r4["abstain"], r4["correct"], r4["followed_cf"]) == (ABSTAIN, True, None, None)
    assert (r5["matched"], r5["correct"]) == ("A", True)


def test_score_cli_refuses_in_place(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text((FIX / "score_in.jsonl").read_text())
    before = f.read_text()
    assert memtoc_cli.main(["transfer", "score", str(f), "-o", str(f)]) == 2
    assert f.read_text() == before


def test_score_lines_pure():
    recs, errs = score_lines(['{"response": "FINAL: C", "choices": {"label": ["A","B","C"], "text": ["x","y","z"]}, '
                              '"gold_key": "C"}'])
    assert not errs and recs[0]["correct"] is True and recs[0]["followed_cf"] is None


def test_reverse_eval_questions_memory_right_first(tmp_path, bench):
    cfg = RunConfig.of({"run_dir": tmp_path, "n_questions": 20, "seed": 20260721,
                        "transfer": {"reverse_eval_questions": 3}})
    sel = select_questions(bench.analysis, 20, 20260721)
    qs, how = core.reverse_eval_questions(bench, cfg, "m")
    assert qs == sel[:3] and "no closed-book file" in how
    right = {sel[7].qkey, sel[12].qkey}
    path = elicitation.scored_path(tmp_path, "m", "forced")
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps({"model": "m", "formulation": "reference", "variant": "forced",
                                        "question_id": q.id, "qkey": q.qkey, "instance_id": q.instance_id,
                                        "response": "", "span": "", "mem_absent": False,
                                        "memory_correct": q.qkey in right}) + "\n" for q in sel))
    qs, how = core.reverse_eval_questions(bench, cfg, "m")
    assert [q.qkey for q in qs] == [sel[7].qkey, sel[12].qkey, sel[0].qkey] and "2 of 3" in how


# ---------------------------------------------------------------------------------------------
# reverse transfer: the adapter is scored against its own closed-book answers (as notebook 04's)

class _Scripted(Generator):
    """Closed-book prompts: the gold for the questions in ``right``, else a wrong value; with-tool
    prompts: the tool's value (tool_error: UNKNOWN)."""

    backend = "fake"

    def __init__(self, name, questions, right, episodes):
        super().__init__({"model": name})
        self.cb = {prompts.closed_book_prompt(q.question, "reference", "forced"): q for q in questions}
        self.right, self.eps = right, {e.prompt: e for e in episodes}

    def _generate_batches(self, prompt_list, desc):
        out = []
        for p in prompt_list:
            if p in self.cb:
                q = self.cb[p]
                text = f"FINAL: {q.gold if q.id in self.right else 'Somewhere Else'}"
            else:
                text = f"FINAL: {self.eps[p].tool_value or 'UNKNOWN'}"
            out.append(Reply(text, 10, 3, 0.01, "", False))
        yield list(range(len(prompt_list))), out


def test_reverse_adapter_is_scored_against_its_own_closed_book(tmp_path, monkeypatch):
    """Untreated memory right on q0-q2, the reverse adapter's on q0, q1, q3: retention is compared on
    {q0, q1} with one unit on each side only, as notebook 04 compares its adapters."""
    qs = [Question(id=f"{10 + i}.{i}", instance_id=10 + i, hop_idx=i, qkey=f"q{10 + i}x{i}",
                   question=f"Where was person {10 + i}-{i} born?", gold=f"Gold City {i}", gold_kind="place",
                   family="birth_death_place", near=f"Near City {i}", near_original=f"Near City {i}",
                   far="Far Town", fold=1) for i in range(6)]
    eps = finetune.eval_episodes(qs, ["reference"])
    untreated = _Scripted("m", qs, {"10.0", "11.1", "12.2"}, eps)
    memory = elicitation.elicit(untreated, "m", qs, ["reference"], "forced", tmp_path)
    r_base = finetune.score_with(untreated, "m", eps, memory, tmp_path)
    adapter_gen = _Scripted("m+reverse", qs, {"10.0", "11.1", "13.3"}, eps)
    loaded = []
    monkeypatch.setattr(models, "get_model", lambda name: SimpleNamespace(name=name))
    monkeypatch.setattr(models, "prepare_model", lambda name, cache_dir=None: tmp_path / "base")
    monkeypatch.setattr(models, "load_generator", lambda name, adapter=None, **kw: loaded.append(adapter) or adapter_gen)
    monkeypatch.setattr(finetune, "train_adapter", lambda *a, **kw: {"steps": 2, "resumed": False})
    cfg = RunConfig.of({"run_dir": tmp_path, "n_boot": 50, "n_perm": 50, "formulations": ["reference"],
                        "transfer": {"reverse_max_steps": 2}})
    cf, _ = select_items(load_items("builtin")[0], cfg.transfer)
    res = core.reverse(cfg, cf[:2], SimpleNamespace(questions=qs), "m", qs, eps, memory, r_base, {}, progress=False)
    path = tmp_path / "adapters" / "m" / core.REVERSE_OBJECTIVE / "external"
    assert loaded == [path] and (path / "closed_book_forced.jsonl").is_file()
    for metric in ("retention", "tool_follow", "wrong_follow"):
        d = res["deltas"][metric]["pooled"]
        assert (d["n_units"], d["n_treated_only"], d["n_untreated_only"]) == (2, 1, 1), metric
    assert res["closed_book"]["all"]["n_changed"] == 2 and res["closed_book"]["all"]["n_correct"] == 3
    t = transfer_tables.reverse_table({"models": {"m": {"reverse": res}}})
    assert set(t.loc[t["metric"] == "retention", "n_treated_only"]) == {1}
