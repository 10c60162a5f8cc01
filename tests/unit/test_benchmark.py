"""Benchmark loading, counts, repairs, folds, selection, bad input, official layout."""
import dataclasses
import json
import re
import shutil
from collections import Counter

import pytest
from official_release import build_official_release, default_sample_dir

from memtoc.config.params import PAPER_SEED, resolve_release_dir
from memtoc.core.errors import DataError
from memtoc.data import benchmark as bm

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


QC_DIR = "results/quality_control"


@pytest.fixture(scope="module")
def sample_dir(release):
    d = default_sample_dir(release)
    if not (d / "MANIFEST.json").is_file():
        pytest.skip("official-layout sample not available")
    return d


@pytest.fixture(scope="module")
def official(release, sample_dir, tmp_path_factory):
    """All 575 questions in the official layout, built from the compact copy."""
    return build_official_release(release, tmp_path_factory.mktemp("official") / "release", sample_dir=sample_dir)


@pytest.fixture
def small_official(release, sample_dir, tmp_path):
    """The first 20 chains (37 questions, 3 repaired, 1 excluded) in the official layout."""
    return build_official_release(release, tmp_path / "release", n_chains=20, sample_dir=sample_dir)


def _load(path):
    return json.loads(path.read_text(encoding="utf-8"))


def _dump(path, obj):
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False), encoding="utf-8")


def _one_error(root, *patterns):
    """Loading ``root`` raises exactly one DataError, one line, whose message matches every pattern."""
    with pytest.raises(DataError) as info:
        bm.load_benchmark(root)
    msg = str(info.value)
    assert "\n" not in msg
    for pat in patterns:
        assert re.search(pat, msg), (pat, msg)
    return msg


def test_official_layout_counts_and_frozen_folds(official):
    b = bm.load_benchmark(official)
    c = b.counts()
    assert b.layout == "official"
    assert (c["pool"], c["analysis"], c["excluded"], c["repaired"], c["far_analysis"], c["chains"]) == \
        (575, 542, 33, 39, 443, 309)
    assert c["episodes"]["core"] == 6504 and c["toolhop_schemas"] == 575
    assert b.folds_source == {"mode": "frozen", "file": str(official / QC_DIR / "crossfit_folds.json"),
                              "frozen_chains": 309, "rule_chains": 0}
    assert sorted(c["folds_questions"].values()) == [287, 288]
    assert b.files["repair_list"].endswith("repair_list_39.json")
    assert b.files["overlay_paraphrase_b"].endswith("repair_overlay/paraphrase_b.json")


def test_official_layout_equals_the_compact_load(official, bench):
    b = bm.load_benchmark(official)
    assert len(b.questions) == len(bench.questions) == 575
    for o, c in zip(b.questions, bench.questions):
        assert o.schema is not None
        assert dataclasses.replace(o, schema=None) == c, c.qkey      # question, near, far, fold, flags
    assert [q.qkey for q in b.analysis] == [q.qkey for q in bench.analysis]
    rej = b.by_qkey[REJUVELAC]
    assert (rej.near, rej.near_original, rej.repaired) == ("Adelle Davis", "Sylvia Nasar", True)
    # the real ToolHop schema of question 0.0 reaches the episodes
    from memtoc.data.episodes import build_episodes
    e = build_episodes([b.questions[0]], ["reference"], ["tool_right"])[0]
    assert e.schema_kind == "toolhop" and '"name": "geo_relationship_finder"' in e.prompt


def test_builder_reproduces_the_samples_real_records(official, sample_dir):
    """Every record the sample keeps (episodes, overlay episodes, mapping and fold rows, summaries)
    comes out of the builder unchanged; the complete QC lists byte for byte."""
    for form in ("reference", "paraphrase_a", "paraphrase_b"):
        for rel in (f"benchmark/{form}.json", f"benchmark/repair_overlay/{form}.json"):
            real, built = _load(sample_dir / rel), _load(official / rel)
            by_id = {e["episode_id"]: e for e in built["episodes"]}
            assert real["summary"] == built["summary"] and list(real) == list(built), rel
            for e in real["episodes"]:
                assert by_id[e["episode_id"]] == e, (rel, e["episode_id"])
    assert len(_load(official / "benchmark/reference.json")["episodes"]) == 2875
    for rel, key in (("results/construction/distractor_mapping_575.json", "rows"),
                     (f"{QC_DIR}/crossfit_folds.json", "rows"), (f"{QC_DIR}/crossfit_folds.json", "assignments")):
        real, built = _load(sample_dir / rel), _load(official / rel)
        assert built[key][:len(real[key])] == real[key] and list(real) == list(built), rel
        assert {k: v for k, v in real.items() if k not in ("rows", "assignments")} == \
            {k: v for k, v in built.items() if k not in ("rows", "assignments")}, rel
    for name in ("analysis_set_lists.json", "repair_list_39.json"):
        assert (official / QC_DIR / name).read_bytes() == (sample_dir / QC_DIR / name).read_bytes()
    assert (official / "results/summaries/arm_metrics.json").read_bytes() == \
        (sample_dir / "results/summaries/arm_metrics.json").read_bytes()


def test_small_official_build_loads_with_frozen_folds(small_official, bench):
    b = bm.load_benchmark(small_official)
    chains = sorted({q.instance_id for q in bench.questions})[:20]
    want = [q for q in bench.questions if q.instance_id in chains]
    assert [dataclasses.replace(q, schema=None) for q in b.questions] == want
    c = b.counts(episodes=False)
    assert (c["pool"], c["chains"], c["repaired"], c["excluded"]) == (37, 20, 3, 1)
    assert b.folds_source["frozen_chains"] == 20 and b.folds_source["rule_chains"] == 0


@pytest.mark.parametrize("drop", ["repair_list", "overlay"])
def test_official_layout_reads_either_repair_source(small_official, drop):
    ref = bm.load_benchmark(small_official).questions
    if drop == "repair_list":
        (small_official / QC_DIR / "repair_list_39.json").unlink()
    else:
        shutil.rmtree(small_official / "benchmark/repair_overlay")
    b = bm.load_benchmark(small_official)
    assert b.questions == ref and ("repair_list" in b.files) == (drop == "overlay")


def test_repair_list_and_overlay_disagreement_is_one_error(small_official):
    path = small_official / QC_DIR / "repair_list_39.json"
    rl = _load(path)
    qkey = rl["repairs"][0]["qkey"]
    rl["repairs"][0]["new_near"] = "Someone Else"
    _dump(path, rl)
    _one_error(small_official, r"repair_overlay/reference\.json", re.escape(repr(qkey)), "Someone Else",
               "repair_list_39.json", "disagree")
    rl["repairs"].pop(0)
    _dump(path, rl)
    _one_error(small_official, r"repair_overlay/reference\.json: qkey " + re.escape(repr(qkey)),
               "not in .*repair_list_39.json")


def test_overlay_formulations_must_agree(small_official):
    path = small_official / "benchmark/repair_overlay/paraphrase_a.json"
    ov = _load(path)
    ov["episodes"][0]["distractor"] = "Another Value"
    _dump(path, ov)
    _one_error(small_official, r"paraphrase_a\.json: qkey " + re.escape(repr(ov["episodes"][0]["provenance"]["qkey"])),
               "Another Value")


def test_repairs_must_match_the_qc_lists(small_official):
    path = small_official / QC_DIR / "analysis_set_lists.json"
    qc = _load(path)
    dropped = qc["repair_qkeys"].pop()
    _dump(path, qc)
    _one_error(small_official, r"repair_list_39\.json: qkey " + re.escape(repr(dropped)), "repair_qkeys",
               "analysis_set_lists.json")


def test_missing_repair_source_is_one_error(small_official):
    (small_official / QC_DIR / "repair_list_39.json").unlink()
    shutil.rmtree(small_official / "benchmark/repair_overlay")
    _one_error(small_official, "no repair source", "repair_list_39.json", r"repair_overlay/")


def test_missing_qc_lists_is_one_error(small_official):
    (small_official / QC_DIR / "analysis_set_lists.json").unlink()
    _one_error(small_official, "analysis_set_lists.json", "analysis set")


@pytest.mark.parametrize("shape", ["renamed", "bare_list"])
def test_mapping_without_rows_is_one_error(small_official, shape):
    path = small_official / "results/construction/distractor_mapping_575.json"
    m = _load(path)
    _dump(path, m["rows"] if shape == "bare_list" else {**{k: v for k, v in m.items() if k != "rows"},
                                                        "records": m["rows"]})
    _one_error(small_official, r"distractor_mapping_575\.json: missing field 'rows'")


def test_episode_file_inconsistent_with_the_mapping_is_one_error(small_official):
    path = small_official / "benchmark/paraphrase_b.json"
    eps = _load(path)
    wrong = next(e for e in eps["episodes"] if e["condition"] == "tool_wrong")
    wrong["distractor"] = "Not The Near Value"
    _dump(path, eps)
    _one_error(small_official, r"paraphrase_b\.json: episode " + wrong["episode_id"], "Not The Near Value")
    eps["episodes"] = eps["episodes"][:3]
    _dump(path, eps)
    _one_error(small_official, r"paraphrase_b\.json: field 'episodes' holds 3 records", "truncated")


def test_the_truncated_official_sample_is_refused_clearly(sample_dir, capsys):
    """The sample keeps only the first records of the big files: loading it is one clear error
    (the mapping states 575 rows and holds 6), on the command line without a traceback."""
    _one_error(sample_dir, r"distractor_mapping_575\.json: field 'rows' holds 6 records", "575", "truncated")
    from memtoc.cli import main
    assert main(["benchmark", "--release", str(sample_dir)]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and "Traceback" not in err


def test_cli_json_on_the_official_layout(official, capsys):
    assert bm.cli(["--release", str(official), "--json"]) == 0
    c = json.loads(capsys.readouterr().out)["counts"]
    assert c["layout"] == "official"
    assert (c["pool"], c["analysis"], c["excluded"], c["repaired"], c["far_analysis"], c["chains"]) == \
        (575, 542, 33, 39, 443, 309)
    assert c["folds_source"] == {"mode": "frozen", "file": str(official / QC_DIR / "crossfit_folds.json"),
                                 "frozen_chains": 309, "rule_chains": 0}
    assert sorted(c["folds_chains"].values()) == [154, 155]


def test_builder_cli_writes_a_loadable_release(release, sample_dir, bench, tmp_path):
    from official_release import main
    dest = tmp_path / "by_hand"
    assert main([str(dest), "--compact", str(release), "--sample", str(sample_dir), "--chains", "5"]) == 0
    first5 = [q.qkey for q in bench.questions if q.instance_id in sorted({p.instance_id for p in bench.questions})[:5]]
    assert [q.qkey for q in bm.load_benchmark(dest).questions] == first5 and len(first5) == 9
    assert main([str(tmp_path / "x"), "--compact", str(tmp_path / "nowhere"), "--sample", str(sample_dir)]) == 2


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
    from memtoc.data.episodes import build_episodes
    q = bench.by_qkey[REJUVELAC]
    eps = build_episodes([q], ["reference", "paraphrase_a", "paraphrase_b"], ["tool_wrong", "no_tool"])
    wrong = [e for e in eps if e.condition == "tool_wrong"]
    assert all(e.tool_value == "Adelle Davis" and '{"result": "Adelle Davis"}' in e.prompt for e in wrong)
    assert all("Sylvia Nasar" not in e.prompt for e in eps)
    assert {e.question for e in eps} == {q.question}
    assert all(e.prompt.endswith(q.question + "\n") for e in eps)
