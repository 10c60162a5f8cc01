"""Benchmark loading, counts, repairs, folds, selection, bad input, official layout."""
import dataclasses
import json
import shutil
from collections import Counter

import pytest

from memtoc import benchmark as bm
from memtoc.config import PAPER_SEED, DataError, resolve_release_dir

REJUVELAC = "rejuvelac is kind of grain water invented and promoted by which holistic health practitioner"


@pytest.fixture(scope="module")
def release():
    try:
        return resolve_release_dir(None)
    except DataError:
        pytest.skip("release data not available")


@pytest.fixture(scope="module")
def bench(release):
    return bm.load_benchmark(release)


def test_counts_match_the_paper(bench):
    c = bench.counts()
    assert c["layout"] == "compact"
    for key in ("pool", "analysis", "excluded", "repaired", "pass", "far_pool", "far_analysis",
                "human", "generated", "chains"):
        assert c[key] == bm.PAPER_COUNTS[key], key
    assert (c["pool"], c["analysis"], c["excluded"], c["repaired"], c["far_analysis"]) == (575, 542, 33, 39, 443)
    assert c["episodes"]["core"] == 6504 == 542 * 4 * 3
    assert c["episodes"]["tool_far"] == 443 * 3
    assert sum(c["answer_types"].values()) == 575 and sum(c["families_analysis"].values()) == 542
    assert sorted(c["folds_questions"].values()) == [287, 288]
    assert sorted(c["folds_chains"].values()) == [154, 155]


def test_repair_overlay_applied(bench):
    q = bench.by_qkey[REJUVELAC]
    assert q.repaired and not q.excluded
    assert q.near == "Adelle Davis" and q.near_original == "Sylvia Nasar"
    assert q in bench.analysis
    overlay = json.loads((bench.release_dir / "repair_overlay_39.json").read_text())
    for r in overlay:
        assert bench.by_qkey[r["qkey"]].near == r["new_near"]
    unrepaired = [q for q in bench.questions if not q.repaired]
    assert all(q.near == q.near_original for q in unrepaired)


def test_folds_are_the_releases_frozen_split(bench, release):
    """memtoc's partition is crossfit_folds.json's (A = fold 0, B = fold 1), with its summary's sizes
    and stratum counts (family x answer type x distractor source)."""
    frozen = json.loads((release / "crossfit_folds.json").read_text())
    want = {a["instance_id"]: {"A": 0, "B": 1}[a["fold"]] for a in frozen["assignments"]}
    got = {q.instance_id: q.fold for q in bench.questions}
    assert got == want and len(got) == 309
    assert bench.folds_source == {"mode": "frozen", "file": str(release / "crossfit_folds.json"),
                                  "frozen_chains": 309, "rule_chains": 0}
    strata = bm.fold_strata(bench.questions)
    for name, k in (("A", "0"), ("B", "1")):
        ref = frozen["summary"]["folds"][name]
        for key in ("n_questions", "n_instances", "family", "tau", "source_bucket", "stratum"):
            assert strata[k][key] == ref[key], (name, key)
    assert (strata["0"]["n_questions"], strata["0"]["n_instances"]) == (287, 154)
    assert (strata["1"]["n_questions"], strata["1"]["n_instances"]) == (288, 155)
    # the rule alone (folds="rule") is another partition of the same sizes
    ruled = bm.load_benchmark(release, folds="rule")
    assert ruled.folds_source["rule_chains"] == 309 and ruled.folds_source["file"] is None
    assert {q.instance_id: q.fold for q in ruled.questions} != want


def test_chains_the_frozen_split_does_not_cover_get_the_rule(bench, release, tmp_path):
    frozen = bm.read_frozen_folds(release / "crossfit_folds.json")
    qs = bench.questions
    new_chain = [dataclasses.replace(q, instance_id=10_000 + q.instance_id, qkey="new " + q.qkey)
                 for q in qs[:40]]
    changed = dataclasses.replace(qs[0], qkey="a question the file does not list")   # chain 0, new question
    pool = [changed] + qs[1:] + new_chain
    folds, counts = bm.resolve_folds(pool, frozen)
    uncovered = {q.instance_id for q in new_chain} | {qs[0].instance_id}
    assert counts == {"frozen_chains": 309 - 1, "rule_chains": len(uncovered)}
    assert all(folds[c] == frozen[c][0] for c in folds if c not in uncovered)
    rule = bm.assign_folds([q for q in pool if q.instance_id in uncovered])
    assert {c: folds[c] for c in uncovered} == rule
    assert bm.resolve_folds(list(reversed(pool)), frozen) == (folds, counts)
    bad = tmp_path / "crossfit_folds.json"
    bad.write_text(json.dumps({"folds": []}))
    with pytest.raises(DataError, match="assignments"):
        bm.read_frozen_folds(bad)


def test_rule_folds_share_no_chain_and_are_balanced(bench):
    folds = bm.assign_folds(bench.questions)
    assert set(folds.values()) == {0, 1}
    per_chain = {}
    for q in bench.questions:
        per_chain.setdefault(q.instance_id, set()).add(folds[q.instance_id])
    assert all(len(s) == 1 for s in per_chain.values())
    sizes = Counter(folds[q.instance_id] for q in bench.questions)
    assert abs(sizes[0] - sizes[1]) <= 1
    # deterministic and independent of input order; another seed gives another split
    assert bm.assign_folds(list(reversed(bench.questions))) == folds
    other = bm.assign_folds(bench.questions, seed=1)
    assert other != folds
    assert abs(Counter(other[q.instance_id] for q in bench.questions)[0] - 287.5) <= 0.5


def test_select_questions_nested_stratified_deterministic(bench):
    an = bench.analysis
    big = bm.select_questions(an, 200)
    small = bm.select_questions(an, 50)
    assert small == big[:50]
    assert bm.select_questions(list(reversed(an)), 50) == small
    assert len({q.qkey for q in big}) == 200
    pool = Counter(q.gold_kind for q in an)
    got = Counter(q.gold_kind for q in big)
    for kind, n in pool.items():
        assert abs(got[kind] - 200 * n / len(an)) <= 1, kind
    assert Counter(q.gold_kind for q in bm.select_questions(an, 6))["person"] >= 3
    assert bm.select_questions(an, 10, seed=1) != bm.select_questions(an, 10)
    everything = bm.select_questions(an, 10_000)
    assert len(everything) == 542 and {q.qkey for q in everything} == {q.qkey for q in an}


def _copy_compact(release, tmp_path):
    d = tmp_path / "rel"
    d.mkdir()
    for name in bm.COMPACT_FILES:
        shutil.copy(release / name, d / name)
    return d


def test_missing_release_dir_is_explained(tmp_path):
    with pytest.raises(DataError, match="MEMTOC_RELEASE"):
        bm.load_benchmark(tmp_path / "nowhere")


def test_incomplete_release_dir_names_missing_files(tmp_path):
    with pytest.raises(DataError, match="questions_575.jsonl"):
        bm.load_benchmark(tmp_path)


def test_malformed_row_names_file_line_and_field(release, tmp_path):
    d = _copy_compact(release, tmp_path)
    lines = (d / "questions_575.jsonl").read_text().splitlines()
    row = json.loads(lines[4])
    del row["gold_answer"]
    lines[4] = json.dumps(row)
    (d / "questions_575.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"questions_575\.jsonl, line 5: missing field 'gold_answer'"):
        bm.load_benchmark(d)
    row["gold_answer"], row["instance_id"] = "x", "seven"
    lines[4] = json.dumps(row)
    (d / "questions_575.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"line 5: field 'instance_id' must be an integer"):
        bm.load_benchmark(d)
    lines[4] = "{not json"
    (d / "questions_575.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"line 5: not valid JSON"):
        bm.load_benchmark(d)


def test_overlay_inconsistent_with_table_is_reported(release, tmp_path):
    d = _copy_compact(release, tmp_path)
    ov = json.loads((d / "repair_overlay_39.json").read_text())
    ov[0]["qkey"] = "no such question"
    (d / "repair_overlay_39.json").write_text(json.dumps(ov))
    with pytest.raises(DataError, match="repair overlay"):
        bm.load_benchmark(d)


def _official_fixture(release, tmp_path, n_chains=12, keyed=False):
    """A small synthetic release in the official layout, built from the first chains of the table."""
    rows = [json.loads(l) for l in (release / "questions_575.jsonl").read_text().splitlines()]
    chains = sorted({r["instance_id"] for r in rows})[:n_chains]
    rows = [r for r in rows if r["instance_id"] in chains]
    qc = json.loads((release / "qc_lists.json").read_text())
    keys = {r["qkey"] for r in rows}
    overlay = [o for o in json.loads((release / "repair_overlay_39.json").read_text()) if o["qkey"] in keys]
    root = tmp_path / "official"
    (root / "results" / "construction").mkdir(parents=True)
    (root / "results" / "quality_control").mkdir(parents=True)
    (root / "benchmark").mkdir()
    mapping = [{k: r[k] for k in ("qkey", "instance_id", "hop_idx", "gold_answer", "gold_kind", "family",
                                  "final_near", "far", "source", "method")} for r in rows]
    if keyed:  # a mapping keyed by qkey instead of a list
        mapping = {m["qkey"]: {k: v for k, v in m.items() if k != "qkey"} for m in mapping}
    (root / "results/construction/distractor_mapping_575.json").write_text(json.dumps(mapping))
    (root / "results/quality_control/analysis_set_lists.json").write_text(json.dumps(
        {"exclude_qkeys": [k for k in qc["exclude_qkeys"] if k in keys],
         "repair_qkeys": [o["qkey"] for o in overlay]}))
    (root / "benchmark/repair_overlay.json").write_text(json.dumps(overlay))
    for pv, form in enumerate(("reference", "paraphrase_a", "paraphrase_b")):
        eps = []
        for r in rows:
            schema = {"name": f"tool_{r['instance_id']}_{r['hop_idx']}", "description": "ToolHop tool",
                      "parameters": {"type": "object", "properties": {}, "required": []}}
            for cond in ("tool_right", "no_tool"):
                eps.append({"episode_id": f"{r['instance_id']}-{r['hop_idx']}-{cond}-v{pv}",
                            "question": r["question"], "gold": r["gold_answer"],
                            "tool_schema": schema if cond != "no_tool" else None,
                            "tool_output": {"result": r["gold_answer"]} if cond != "no_tool" else None})
        (root / "benchmark" / f"{form}.json").write_text(json.dumps({"episodes": eps}))
    return root, rows, overlay


@pytest.mark.parametrize("keyed", [False, True])
def test_official_layout_fixture(release, tmp_path, keyed):
    root, rows, overlay = _official_fixture(release, tmp_path, keyed=keyed)
    b = bm.load_benchmark(root)
    assert b.layout == "official" and len(b.questions) == len(rows)
    q = b.questions[0]
    assert q.schema == {"name": f"tool_{q.instance_id}_{q.hop_idx}", "description": "ToolHop tool",
                        "parameters": {"type": "object", "properties": {}, "required": []}}
    assert q.question == rows[0]["question"] and q.qkey == rows[0]["qkey"]
    assert b.counts(episodes=False)["toolhop_schemas"] == len(rows)
    for o in overlay:
        assert b.by_qkey[o["qkey"]].near == o["new_near"] and b.by_qkey[o["qkey"]].repaired
    from memtoc.episodes import build_episodes
    e = build_episodes(b.questions[:1], ["reference"], ["tool_right"])[0]
    assert e.schema_kind == "toolhop" and '"name": "tool_' in e.prompt


def test_official_layout_without_qc_lists_is_explained(release, tmp_path):
    root, _, _ = _official_fixture(release, tmp_path)
    (root / "results/quality_control/analysis_set_lists.json").unlink()
    with pytest.raises(DataError, match="QC lists"):
        bm.load_benchmark(root)


def test_cli_json(release, capsys):
    assert bm.cli(["--release", str(release), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    c = out["counts"]
    assert (c["pool"], c["analysis"], c["excluded"], c["repaired"], c["far_analysis"],
            c["episodes"]["core"]) == (575, 542, 33, 39, 443, 6504)
    assert bm.cli(["--release", str(release)]) == 0
    assert "6504" in capsys.readouterr().out


def test_cli_missing_release_is_one_line_error(tmp_path, capsys):
    from memtoc.cli import main
    assert main(["benchmark", "--release", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "error" in err and "MEMTOC_RELEASE" in err and "Traceback" not in err


def test_episodes_use_the_repaired_near_and_identical_question_text(bench):
    from memtoc.episodes import build_episodes
    q = bench.by_qkey[REJUVELAC]
    eps = build_episodes([q], ["reference", "paraphrase_a", "paraphrase_b"], ["tool_wrong", "no_tool"])
    wrong = [e for e in eps if e.condition == "tool_wrong"]
    assert all(e.tool_value == "Adelle Davis" and '{"result": "Adelle Davis"}' in e.prompt for e in wrong)
    assert all("Sylvia Nasar" not in e.prompt for e in eps)
    assert {e.question for e in eps} == {q.question}
    assert all(e.prompt.endswith(q.question + "\n") for e in eps)
