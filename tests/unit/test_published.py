"""memtoc verify --published: the paper's printed numbers (paper/published/) against values
re-derived from the release's computed summaries through memtoc's own analysis code, on both
release layouts."""
from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from memtoc.cli import verify as verifycmd
from memtoc.config.params import resolve_release_dir
from memtoc.core import intervals, stats
from memtoc.stages.report import published
from memtoc.stages.report.published import printed as printed_mod
from memtoc.stages.report.published.via import PIPELINE_MODULES, trace, via_pipeline

OFFICIAL_SAMPLE = Path(resolve_release_dir()).parent / "memtoc-release-official-sample"
SEC5_4 = {"warn.ret": "13.2", "prior.ret": "31.75", "warn.tool": "-7.4", "prior.tool": "-9.4",
          "warn.err": "-60.7", "prior.err": "-54.4"}


def _cli(capsys, *args) -> dict:
    verifycmd.cli(["--published", "--json", *args])
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def result():
    return published.verify_published()


@pytest.fixture(scope="module")
def rows(result):
    return {c.id: c for c in result.checks}


def _writable_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    dst.chmod(0o755)
    return dst


def test_compact_acceptance(result):
    """Table 4's 64 printed values compared (none UNPUBLISHED) and matching, the six §5.4 deltas
    MATCH, 0 mismatches; most checks derived through the pipeline."""
    s = result.summary_dict()
    assert s["layout"] == "compact" and s["by_status"]["MISMATCH"] == 0, s["mismatches"]
    t4 = [c for c in result.checks if c.family == "table4"]
    assert len(t4) == 64 and all(c.status == "MATCH" for c in t4)
    assert all(c.via == "memtoc.stages.evaluation.analyses.arms.arm_comparison" and "memtoc.core.intervals.rate_intervals" in c.calls for c in t4)
    assert s["by_status"]["UNPUBLISHED"] == 0
    assert s["n_via_pipeline"] > 0.8 * s["n_checks"] and s["n_checks"] >= 250
    assert s["disagreements"] and all(d["reason"] for d in s["disagreements"])
    for c in result.to_dict()["checks"]:
        assert set(c) >= {"id", "family", "published", "derived", "status", "via", "calls"}


def test_sec5_4_deltas_are_question_paired_contrasts(rows):
    for key, val in SEC5_4.items():
        arm, col = key.split(".")
        c = rows[f"sec5_4.Llama-3.1-8B-Instruct.{arm}.{col}_delta"]
        assert (c.status, c.published, c.derived) == ("MATCH", val, val), c
        assert "memtoc.core.intervals.contrast" in c.calls and "memtoc.core.stats.paired_contrast" in c.calls
    assert rows["sec5_4.retention_up_directions"].status == "MATCH"
    e = rows["sec5_4.err_abstain_reduced_by_every_strategy"]
    assert e.status == "DISAGREEMENT" and e.derived == "10 of 12" and "flag" in e.detail


def test_known_values(rows):
    llama = rows["table1.untreated.Llama-3.1-8B-Instruct.ret"]
    assert (llama.status, llama.published, llama.derived, llama.via) == (
        "MATCH", "17.1", "17.1", "memtoc.core.metrics.pooled_point_metrics")
    # printed from the release's 4-decimal rates: rounded twice, stated in detail
    for cid, pub, der in (("table1.untreated.gemma-2-9b-it.err", "99.5", "99.4"),
                          ("table4.Llama-3.1-8B-Instruct.prior.wrong", "60.9", "60.8"),
                          ("table4.Qwen2.5-7B-Instruct.untreated.err", "88.8", "88.7")):
        c = rows[cid]
        assert (c.status, c.published, c.derived) == ("MATCH", pub, der) and "rounded twice" in c.detail
    assert rows["table4.Llama-3.1-8B-Instruct.untreated.ret"].derived == "9.3"      # Reference, not pooled 17.1
    assert rows["sec5_3.formulation_spread.ret"].derived == "7–15"
    for k, v in (("llamai_sft_ret", "14.3"), ("llamai_dpo_ret", "5.8"), ("qwen_sft_tool", "5.9"), ("qwen_sft_wrong", "5.5")):
        assert (rows[f"sec5_2.{k}"].status, rows[f"sec5_2.{k}"].derived) == ("MATCH", v)
    assert rows["finetune.qwen.sft.tool_gold_follow.pooled_units"].derived == "1188"
    c = rows["finetune.Llama-3.1-8B-Instruct.sft.criterion"]
    assert (c.status, c.derived, c.family) == ("MATCH", "yes", "table1") and "memtoc.core.stats.success_criterion" in c.calls
    assert rows["finetune.gemma-2-9b-it.sft.criterion"].status == "ABSENT"
    far = rows["far.printed.base_far_p_holm"]
    assert (far.status, far.derived, far.via) == ("MATCH", "0.0015", "memtoc.core.stats.holm_family")
    assert rows["far.printed.base_far_ret"].via == "memtoc.stages.report.published.checks.release_value"
    assert rows["protocol.printed.tool_gold_follow"].derived == "-9.3"
    assert rows["pooled.order.pooled.keep"].via == "memtoc.core.stats.ranking_stability"
    assert rows["construction.episodes"].derived == "6504"
    assert rows["acknowledgment.acknowledgment.ci95"].via == "memtoc.stages.report.published.registry.op_clopper_pearson"


def test_official_layout_sample(tmp_path, capsys):
    """The official layout's real file names: same checks, ABSENT (file named) where an input is
    missing or truncated; never a crash."""
    off = _writable_copy(OFFICIAL_SAMPLE, tmp_path / "official")
    doc = _cli(capsys, "--release", str(off))
    s, checks = doc["summary"], {c["id"]: c for c in doc["checks"]}
    assert s["layout"] == "official" and s["by_status"]["MISMATCH"] == 0, s["mismatches"]
    assert sum(c["family"] == "table4" and c["status"] == "MATCH" for c in checks.values()) == 64
    for key, val in SEC5_4.items():
        arm, col = key.split(".")
        assert checks[f"sec5_4.Llama-3.1-8B-Instruct.{arm}.{col}_delta"]["derived"] == val
    assert any("results/finetuning/paired_deltas.json does not exist" in a for a in s["absent"])
    assert checks["sec5_2.llamai_sft_ret"]["status"] == "ABSENT"
    assert checks["construction.pool"]["status"] == "ABSENT" and "README.md" in checks["construction.pool"]["detail"]
    assert checks["review.final_total"]["status"] == "ABSENT" and "truncated" in checks["review.final_total"]["detail"]
    assert checks["pooled.stable.keep"]["status"] == "MATCH"            # stable_core flags -> stable_any
    assert checks["acknowledgment.raw_agreement"]["status"] == "MATCH"
    # without the arm metrics: Table 1/4, §5.3/§5.4 and the far checks are ABSENT, naming the file
    (off / "results/summaries/arm_metrics.json").unlink()
    res = published.verify_published(off)
    t4 = [c for c in res.checks if c.family == "table4"]
    assert len(t4) == 64 and all(c.status == "ABSENT" and "arm_metrics.json" in c.detail for c in t4)
    assert res.ok and res.counts()["ABSENT"] > 64


def test_compact_copy_missing_a_summary(tmp_path):
    dst = _writable_copy(resolve_release_dir(), tmp_path / "release")
    (dst / "published_finetuning.json").unlink()
    res = published.verify_published(dst)
    absent = [c for c in res.checks if c.status == "ABSENT"]
    assert res.ok and {c.family for c in absent} >= {"sec5_2", "finetune", "table1"}
    assert all("published_finetuning.json" in c.detail for c in absent)


def test_changed_printed_number_and_changed_release_are_caught(tmp_path, monkeypatch):
    pub = _writable_copy(printed_mod.PUBLISHED_DIR, tmp_path / "published")
    t4 = json.loads((pub / "table4.json").read_text())
    t4["rows"]["gemma-2-9b-it"]["flag"]["tool"] = 60.0
    (pub / "table4.json").write_text(json.dumps(t4))
    prose = json.loads((pub / "prose.json").read_text())
    prose["sec5_4"]["prior_ret"]["value"] = 30.0        # the formulation-unweighted mean of deltas
    (pub / "prose.json").write_text(json.dumps(prose))
    monkeypatch.setattr(printed_mod, "PUBLISHED_DIR", pub)
    rel = _writable_copy(resolve_release_dir(), tmp_path / "release")
    am = json.loads((rel / "published_arm_metrics.json").read_text())
    am["judged"]["qwen"]["canonical_pv0"]["te_abstain"] = 0.8708       # 472/542
    (rel / "published_arm_metrics.json").write_text(json.dumps(am))
    res = published.verify_published(rel)
    assert {c.id for c in res.failures} >= {"table4.gemma-2-9b-it.flag.tool", "sec5_4.Llama-3.1-8B-Instruct.prior.ret_delta",
                                            "table4.Qwen2.5-7B-Instruct.untreated.err"}


def test_a_perturbed_contrast_fails_the_sec5_4_checks(monkeypatch):
    """intervals.contrast (where it is defined) returning +0.01 more moves exactly the checks computed
    through it; the via-tracing records the real function, not the shim."""
    real = intervals.contrast

    def shifted(*a, **k):
        r = real(*a, **k)
        return {**r, "delta": None if r["delta"] is None else r["delta"] + 0.01}
    monkeypatch.setattr(intervals, "contrast", shifted)
    res = published.verify_published()
    sec = [c for c in res.checks if c.family == "sec5_4" and c.id.endswith("_delta")]
    assert sec and all("memtoc.core.intervals.contrast" in c.calls and c.via == "memtoc.stages.evaluation.analyses.arms.arm_comparison"
                       for c in sec)
    failed = {c.id for c in res.failures}
    assert {f"sec5_4.Llama-3.1-8B-Instruct.{k.split('.')[0]}.{k.split('.')[1]}_delta" for k in SEC5_4} <= failed
    assert all(c.status in ("MATCH", "ABSENT") for c in res.checks if c.family in ("table4", "table1"))


def _perturb(v):
    if isinstance(v, (bool, np.bool_)):
        return "perturbed"          # not a flip: two perturbed functions in a row could cancel
    if isinstance(v, (int, np.integer)):
        return int(v) + 1
    if isinstance(v, (float, np.floating)):
        return float(v) + 0.37
    if isinstance(v, dict):
        return {k: _perturb(x) for k, x in v.items()}
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        return v[::-1]
    if isinstance(v, (list, tuple)):
        return type(v)(_perturb(x) for x in v)
    return v


def test_via_pipeline_checks_are_exactly_those_a_perturbation_moves(result, monkeypatch):
    """Perturb every pipeline function a check's value was recorded to come from: every check
    counted "via the pipeline" moves, no other check does."""
    targets = set()
    for c in result.checks:
        pipe = [x for x in c.calls if via_pipeline([x]) and "<locals>" not in x]
        if pipe:
            targets.add(c.via if via_pipeline([c.via]) else pipe[0])
    for name in sorted(targets):
        mod, fn = name.rsplit(".", 1)
        module = importlib.import_module(mod)
        real = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, _real=real, **k: _perturb(_real(*a, **k)))
    after = {c.id: c for c in published.verify_published().checks}
    for c in result.checks:
        moved = (after[c.id].derived, after[c.id].status) != (c.derived, c.status)
        assert moved == c.via_pipeline, (c.id, c.via, c.calls)
    assert sum(c.via_pipeline for c in result.checks) == result.summary_dict()["n_via_pipeline"]


def test_trace_records_what_ran():
    t = trace(lambda: stats.holm_family("far_retention", {"a": {"p": 0.01}, "b": {"p": 0.04}}))
    assert t.via == "memtoc.core.stats.holm_family" and all(c.startswith(PIPELINE_MODULES) for c in t.calls)
    assert trace(lambda: 1 + 1).calls == ()


def test_release_frame_reproduces_the_release_counts():
    from memtoc.core import metrics
    block = {"keep_strict": 0.0926, "n_both_in_arb": 2, "CRA_arb": 0.1049, "n_arb": 162, "prior_bw": 0.7143,
             "tool_gold_follow": 0.8783, "nc_CRA": 0.8598, "n_bw": 378, "te_abstain": 0.893}
    m = metrics.arm_metrics(published.release_frame({"reference": block}, 542))
    assert round(m["retention"], 4) == 0.0926 and m["n_arb"] == 162 and m["n_both_in_arb"] == 2
    assert round(m["wrong_follow"], 4) == 0.7143 and round(m["tool_follow"], 4) == 0.8783
    assert round(m["err_abstain"], 4) == 0.893 and m["n_err"] == 542
    with pytest.raises(published.PublishedCheckError, match="not a count"):
        published.release_frame({"reference": {**block, "keep_strict": 0.0927}}, 542)


def test_cli_prints_one_json_object(capsys):
    doc = _cli(capsys)
    assert set(doc) == {"checks", "summary"} and doc["summary"]["by_status"]["MISMATCH"] == 0


def test_full_official_layout_release(tmp_path):
    """A complete official-layout release built from the compact copy: every summary it carries gives
    the same checks as the compact copy; the fine-tuning file it lacks is ABSENT."""
    build = pytest.importorskip("official_release").build_official_release
    off = build(resolve_release_dir(), tmp_path / "official")
    res = published.verify_published(off)
    compact = {c.id: c for c in published.verify_published().checks}
    assert res.layout == "official" and res.ok
    for c in res.checks:
        if c.status != "ABSENT":
            assert (c.status, c.derived) == (compact[c.id].status, compact[c.id].derived), c.id
    assert {c.family for c in res.checks if c.status == "ABSENT"} >= {"sec5_2", "finetune"}
    assert sum(c.status == "MATCH" for c in res.checks if c.family in ("table4", "pooled", "far")) == 64 + 66 + 22


def test_table4_has_the_papers_arms_whatever_the_package_adds(monkeypatch):
    """Table 4's rows come from the printed file, not from ``vocab.PROMPTING_ARMS``: a prompting arm
    added to the package leaves the published check and its 64 values as they are."""
    from memtoc.core import vocab
    from memtoc.stages.report.published import checks
    t4 = printed_mod.printed("table4")
    assert checks.table4_arms() == ("untreated", "warn", "prior", "flag") == tuple(t4["prompts"])
    assert all(tuple(row) == checks.table4_arms() for row in t4["rows"].values())
    monkeypatch.setattr(vocab, "PROMPTING_ARMS", vocab.PROMPTING_ARMS + ("added_arm",))
    assert checks.paper_strategies() == ("warn", "prior", "flag") and len(checks.table4_ids()) == 64
