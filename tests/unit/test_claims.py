"""Claims: rounding, pointers, registry expansion, report building and verification (fake runs)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from memtoc.cli import verify as verifycmd
from memtoc.core.errors import MemtocError
from memtoc.stages import report as R
from memtoc.stages.report import claims as C

FORMS = ["reference", "paraphrase_a", "paraphrase_b"]
HEAD = ["retention", "tool_follow", "wrong_follow", "err_abstain"]


# ------------------------------------------------------------------------------- fake run

def _iv(v, n=40):
    return {"value": v, "ci95": None if v is None else [max(0.0, v - 0.05), min(1.0, v + 0.05)], "n": n}


def _contrast(d, p=0.01):
    return {"delta": d, "ci95": [d - 0.02, d + 0.02], "p": p, "p_holm": min(1.0, 3 * p), "n_units": 30,
            "n_clusters": 10, "treatment": "x", "baseline": "untreated"}


def make_run(root: Path, models=("tiny-a", "org/tiny-b"), seed: int = 0, finetune: bool = True,
             prompting: bool = True) -> Path:
    """A run directory with summaries shaped like the documented ones (module docstrings of
    evaluation.py, elicitation.py, construct.py, finetune.py)."""
    import random
    rng = random.Random(seed)
    run = root / "fakerun"
    (run / "summaries").mkdir(parents=True)
    construction = {"counts": {"pool": 575, "analysis": 542, "excluded": 33, "repaired": 39, "pass": 503,
                               "far_pool": 463, "far_analysis": 443, "human": 149, "generated": 426,
                               "chains": 309, "episodes": {"core": 6504}},
                    "generator": {"generator_branch": {"both": {"reproduced": 173, "n": 173}}},
                    "run_episodes": {"total": 1234, "questions": 6}}
    ev: dict = {"schema_version": 1, "formulations": FORMS, "models": {}, "ranking_stability": {}}
    el: dict = {"schema_version": 1, "models": {}}
    ft: dict = {"models": {}}
    for m in models:
        node = ev["models"][m] = {"n_questions": {"headline": 6, "extra": 4}, "headline": {}, "cells": {}}
        for f in FORMS + ["pooled"]:
            node["headline"][f] = {k: _iv(round(rng.random(), 4)) for k in HEAD}
        node["headline"]["reference"]["retention"] = _iv(None, 0)     # an empty cell prints n/a
        for f in FORMS:
            node["cells"][f] = {c: rng.randint(0, 9) for c in ("agree", "arb", "tool_gold", "both_wrong", "mem_absent")}
        if prompting:
            node["prompting"] = {}
            for arm in ("untreated", "warn", "prior", "flag"):
                a = node["prompting"][arm] = {"pooled": {k: _iv(round(rng.random(), 3)) for k in HEAD}}
                if arm != "untreated":
                    a["contrasts"] = {k: _contrast(round(rng.uniform(-0.3, 0.3), 4)) for k in HEAD}
                    a["success"] = {"passed": rng.random() < 0.5}
        el["models"][m] = {v: {"pooled": {"memory_correct": rng.random(), "mem_absent": rng.random() / 5}}
                           for v in ("forced", "permissive")}
        if finetune:
            ft["models"][m] = {"base": "/x", "folds": {}, "adapters": {}, "objectives": {o: {
                "deltas": {k: {f: {**_contrast(round(rng.uniform(-0.2, 0.2), 4)), "treated": round(rng.random(), 4),
                                   "untreated": round(rng.random(), 4)} for f in FORMS + ["pooled"]} for k in HEAD},
                "criterion": {"passed": bool(rng.random() < 0.5), "reason": "x"},
                "n_episodes": 60} for o in ("sft", "dpo")}}
    ev["ranking_stability"]["retention"] = {"pooled_order": list(models), "stable": False}
    (run / "summaries" / "construction.json").write_text(json.dumps(construction))
    (run / "summaries" / "evaluation.json").write_text(json.dumps(ev))
    (run / "summaries" / "elicitation.json").write_text(json.dumps(el))
    if finetune:
        (run / "summaries" / "finetuning.json").write_text(json.dumps(ft))
    return run


@pytest.fixture()
def built(tmp_path):
    run = make_run(tmp_path)
    R.build_report(run)
    return run


# ------------------------------------------------------------------------------- rounding

@pytest.mark.parametrize("value,rule,out", [
    (0.17140, "percent:1", "17.1"),
    (0.99447, "percent:1", "99.4"),
    (0.9945, "percent:1", "99.5"),          # half-up on the decimal value, not binary banker's
    (0.125, "decimal:2", "0.13"),
    (2.5, "int", "3"),
    (6504, "thousands", "6,504"),
    (0.0315, "pp:1", "+3.2"),
    (-0.0315, "pp:1", "-3.2"),
    (-0.0001, "pp:1", "+0.0"),             # no "-0.0"
    (-0.00001, "decimal:3", "0.000"),
    (0.5, "signed:2", "+0.50"),
    (True, "exact", "yes"),
    (False, "exact", "no"),
    ("met", "exact", "met"),
    (None, "percent:1", "n/a"),
    (float("nan"), "decimal:3", "n/a"),
])
def test_format_value(value, rule, out):
    assert C.format_value(value, rule) == out


@pytest.mark.parametrize("rule", ["percent", "percent:x", "round:2", "int:3", ""])
def test_bad_rounding_rule(rule):
    with pytest.raises(C.ClaimError):
        C.parse_rounding(rule)


def test_rounding_rejects_non_numbers():
    with pytest.raises(C.ClaimError):
        C.format_value("0.5", "percent:1")


# ------------------------------------------------------------------------------- pointers

def test_json_pointer_rfc6901():
    doc = {"a/b": {"m~n": [10, 20]}, "": 1}
    assert C.json_pointer(doc, "/a~1b/m~0n/1") == 20
    assert C.json_pointer(doc, "") == doc
    assert C.escape_token("org/m~1") == "org~1m~01"
    with pytest.raises(C.MissingSource, match="no key 'x'"):
        C.json_pointer(doc, "/x")
    with pytest.raises(C.MissingSource, match="out of range"):
        C.json_pointer(doc, "/a~1b/m~0n/2")
    with pytest.raises(C.ClaimError, match="must start with"):
        C.json_pointer(doc, "a")


# ------------------------------------------------------------------------------- registry + resolve

def test_registry_loads_and_rejects_bad_entries(tmp_path):
    reg = C.load_registry()
    assert reg["claims"] and reg["published"] and "paper_prose" not in reg
    bad = {"claims": [{"id": "x", "statement": "no placeholder", "file": "f.json", "pointer": "/a", "rounding": "int"}]}
    with pytest.raises(C.ClaimError, match="placeholder"):
        C.load_registry(bad)
    dup = {"claims": [{"id": "x", "statement": "{value}", "file": "f", "pointer": "/a", "rounding": "int"}] * 2}
    with pytest.raises(C.ClaimError, match="duplicate"):
        C.load_registry(dup)
    with pytest.raises(C.ClaimError, match="derive"):
        C.load_registry({"claims": [{"id": "x", "statement": "{value}", "file": "f", "pointer": "/a",
                                     "rounding": "int", "derive": "median", "over": {"m": [1]}}]})


def test_templates_expand_over_models_and_derive_ranges(tmp_path):
    run = make_run(tmp_path)
    claims = {c.id: c for c in C.resolve(run)}
    ev = json.loads((run / "summaries" / "evaluation.json").read_text())
    for m in ("tiny-a", "org/tiny-b"):
        for k, col in zip(HEAD, ("retention", "tool_follow", "wrong_follow", "err_abstain")):
            c = claims[f"main.{m}.untreated.{col}"]
            assert c.value == C.format_value(ev["models"][m]["headline"]["pooled"][k]["value"], "percent:1")
    # model names with "/" are escaped in the pointer, kept in the id
    assert claims["main.org/tiny-b.untreated.retention"].pointers == ["/models/org~1tiny-b/headline/pooled/retention/value"]
    vals = [ev["models"][m]["headline"]["pooled"]["retention"]["value"] for m in ev["models"]]
    assert claims["headline.retention"].value == (
        f"{C.format_value(min(vals), 'percent:1')}–{C.format_value(max(vals), 'percent:1')}")
    assert claims["headline.n_models"].value == "2"
    assert claims["form.tiny-a.reference.retention"].value == "n/a"
    assert claims["finetune.tiny-a.sft.success"].value in ("yes", "no")
    assert "prompting.tiny-a.untreated.delta.retention" not in claims       # excluded from the domain
    assert claims["prompting.tiny-a.warn.delta.retention"].rounding == "pp:1"
    # the statement carries the printed value
    c = claims["construction.episodes_core"]
    assert c.value == "6,504" and "6,504" in c.statement


def test_metric_domains_come_from_the_registry(tmp_path):
    run = make_run(tmp_path)
    claims = {c.id: c for c in C.resolve(run)}
    # {metrics: headline}: key, table column and prose name from memtoc.core.metrics.METRICS
    c = claims["main.tiny-a.untreated.tool_follow"]
    assert c.table["col"] == "Tool" and "correct-tool following" in c.statement
    reg = {"claims": [{"id": "x.{metric[key]}", "statement": "{metric[name]}: {value}", "file": "summaries/evaluation.json",
                       "pointer": "/models/tiny-a/headline/pooled/{metric[key]}/value", "rounding": "percent:1",
                       "foreach": {"metric": {"metrics": ["retension"]}}}]}
    with pytest.raises(C.ClaimError, match="unknown metric 'retension'"):
        C.resolve(run, registry=reg)


def test_optional_sections_are_omitted_required_ones_fail(tmp_path):
    run = make_run(tmp_path, finetune=False, prompting=False)
    claims, omitted = C.resolve_all(run)
    ids = {c.id for c in claims}
    assert not any(i.startswith(("finetune.", "prompting.")) for i in ids)
    assert any(o["id"].startswith("finetune.") for o in omitted)
    (run / "summaries" / "construction.json").unlink()
    with pytest.raises(C.ClaimError, match="construction.json"):
        C.resolve(run)


# ------------------------------------------------------------------------------- report + verify

def test_report_and_claims_json_written(built):
    md = (built / "paper" / "report.md").read_text()
    doc = json.loads((built / "paper" / "claims.json").read_text())
    assert doc["n_claims"] == len(doc["claims"]) > 100
    first = doc["claims"][0]
    for k in ("id", "statement", "file", "pointer", "rounding", "value", "sha256"):
        assert k in first
    assert "<!--claim:main.tiny-a.untreated.retention-->" in md
    assert C.untagged_numbers(md) == []


def test_verify_passes_on_a_fresh_report(built, capsys):
    res = C.verify(built)
    assert res.ok, res.table()
    assert res.n_pass == res.n_claims > 100
    assert verifycmd.cli([str(built)]) == 0
    out = capsys.readouterr().out
    assert f"{res.n_claims}/{res.n_claims} claims pass" in out


def _perturb(run: Path, rel: str, pointer: str, new) -> None:
    path = run / rel
    doc = json.loads(path.read_text())
    toks = [C.unescape_token(t) for t in pointer[1:].split("/")]
    node = doc
    for t in toks[:-1]:
        node = node[int(t)] if isinstance(node, list) else node[t]
    node[toks[-1]] = new
    path.write_text(json.dumps(doc))


def test_perturbed_copy_fails_and_names_the_claim(built, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    _perturb(copy, "summaries/evaluation.json", "/models/tiny-a/headline/pooled/tool_follow/value", 0.123456)
    res = C.verify(copy)
    assert not res.ok
    failed = {r.id for r in res.failures}
    assert "main.tiny-a.untreated.tool_follow" in failed
    assert verifycmd.cli([str(copy)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "main.tiny-a.untreated.tool_follow" in out
    # the original is untouched and still passes
    assert C.verify(built).ok


def test_a_change_below_the_rounding_passes_the_claim_but_not_the_input_hashes(built):
    ptr = "/models/tiny-a/headline/pooled/err_abstain/value"
    _perturb(built, "summaries/evaluation.json", ptr, 0.12340)
    R.build_report(built)
    assert C.verify(built).ok
    _perturb(built, "summaries/evaluation.json", ptr, 0.123401)      # still prints 12.3
    res = C.verify(built)
    assert any("file changed" in r.detail for r in res.rows
               if r.id == "main.tiny-a.untreated.err_abstain" and r.status == "PASS")
    # the report no longer describes the run's files: the recorded sha256 catches it (issue 13 item 9)
    assert {r.id for r in res.failures} == {"report:inputs"}
    _perturb(built, "summaries/evaluation.json", ptr, 0.1236)        # prints 12.4: fails
    assert "main.tiny-a.untreated.err_abstain" in {r.id for r in C.verify(built).failures}


def test_missing_file_or_pointer_fails_never_skips(built):
    (built / "summaries" / "elicitation.json").unlink()
    res = C.verify(built)
    failed = {r.id for r in res.failures}
    assert "elicit.tiny-a.forced.memory_correct" in failed
    assert all("does not exist" in r.detail for r in res.failures if r.id.startswith("elicit."))


def test_missing_pointer_fails(built):
    path = built / "summaries" / "evaluation.json"
    doc = json.loads(path.read_text())
    del doc["models"]["tiny-a"]["cells"]["reference"]["arb"]
    path.write_text(json.dumps(doc))
    res = C.verify(built)
    assert "cells.tiny-a.reference.arb" in {r.id for r in res.failures}


def test_report_tampering_is_caught(built):
    path = built / "paper" / "report.md"
    md = path.read_text()
    cid = "construction.pool"
    val = json.loads((built / "paper" / "claims.json").read_text())
    assert f"<!--claim:{cid}-->575<!--/claim-->" in md
    path.write_text(md.replace(f"<!--claim:{cid}-->575<!--/claim-->", f"<!--claim:{cid}-->576<!--/claim-->")
                    + "\nRetention rose by 12 points.\n")
    res = C.verify(built)
    bad = {r.id: r.detail for r in res.failures}
    assert "report:markers" in bad and cid in bad["report:markers"]
    assert "report:untagged" in bad and "12" in bad["report:untagged"]
    assert all(not r.id.startswith("construction.") for r in res.failures)  # the files still agree


def test_claims_json_value_tampering_is_caught(built):
    path = built / "paper" / "claims.json"
    doc = json.loads(path.read_text())
    target = next(c for c in doc["claims"] if c["id"] == "construction.analysis")
    target["value"] = "543"
    path.write_text(json.dumps(doc))
    res = C.verify(built)
    failed = {r.id for r in res.failures}
    assert "construction.analysis" in failed and "report:markers" in failed


def test_verify_clear_errors(tmp_path, capsys):
    with pytest.raises(MemtocError, match="does not exist"):
        C.verify(tmp_path / "nope")
    (tmp_path / "run").mkdir()
    with pytest.raises(MemtocError, match="claims.json"):
        C.verify(tmp_path / "run")
    from memtoc.cli import main
    assert main(["verify", str(tmp_path / "run")]) == 2
    assert "claims.json" in capsys.readouterr().err


def test_json_output(built, capsys):
    assert verifycmd.cli([str(built), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc[0]["ok"] and doc[0]["n_pass"] == doc[0]["n_claims"]


# ------------------------------------------------------------------------------- published paper
# memtoc verify --published: tests/unit/test_published.py


def test_claim_dropped_from_claims_json_and_report_is_caught(built):
    path = built / "paper" / "claims.json"
    doc = json.loads(path.read_text())
    doc["claims"] = [c for c in doc["claims"] if c["id"] != "headline.retention"]
    path.write_text(json.dumps(doc))
    rp = built / "paper" / "report.md"
    import re
    rp.write_text("\n".join(l for l in rp.read_text().splitlines() if "claim:headline.retention-->" not in l))
    res = C.verify(built)
    bad = {r.id: r.detail for r in res.failures}
    assert list(bad) == ["report:registry"] and "headline.retention" in bad["report:registry"]


def test_a_model_added_after_the_report_is_caught(built):
    """A range over models is re-checked against the models the run now has."""
    path = built / "summaries" / "evaluation.json"
    doc = json.loads(path.read_text())
    extra = json.loads(json.dumps(doc["models"]["tiny-a"]))
    extra["headline"]["pooled"]["retention"]["value"] = 0.999
    doc["models"]["tiny-c"] = extra
    path.write_text(json.dumps(doc))
    res = C.verify(built)
    bad = {r.id: r.detail for r in res.failures}
    assert "report:registry" in bad
    assert "headline.retention" in bad["report:registry"] and "main.tiny-c.untreated.retention" in bad["report:registry"]


def test_fill_statement_drops_the_unit_of_a_missing_value():
    assert C.fill_statement("retention is {value}%.", "12.5") == "retention is 12.5%."
    assert C.fill_statement("retention is {value}%.", "n/a") == "retention is n/a."


def test_figures_are_referenced_in_their_section(tmp_path):
    run = make_run(tmp_path)
    (run / "figures").mkdir()
    for name in ("headline.png", "extra_2.png"):
        (run / "figures" / name).write_bytes(b"\x89PNG")
    R.build_report(run)
    md = (run / "paper" / "report.md").read_text()
    main = md.index("## Main table")
    assert main < md.index("](../figures/headline.png)") < md.index("## Per-formulation results")
    assert md.count("../figures/headline.png") == 1
    assert md.index("## Figures") < md.index("](../figures/extra_2.png)")
    assert C.verify(run).ok        # figure file names are not untagged numbers
