"""memtoc verify --published: the paper's numbers re-derived through memtoc's own analysis code."""
from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from memtoc import claims, metrics, published, stats
from memtoc import verifycmd
from memtoc.config import resolve_release_dir


@pytest.fixture(scope="module")
def result():
    return published.verify_published()


def test_acceptance_counts_and_no_mismatch(result):
    """Issue 12: >= 230 checks, >= 60 of family table4, 0 mismatches, disagreements with a reason,
    most checks derived by memtoc.metrics / memtoc.stats / the evaluation code."""
    doc = result.to_dict()
    s = doc["summary"]
    assert s["n_checks"] >= 230 and len(doc["checks"]) == s["n_checks"]
    assert sum(c["family"] == "table4" for c in doc["checks"]) >= 60
    assert s["by_status"]["MISMATCH"] == 0, s["mismatches"]
    assert s["n_via_pipeline"] > 0.8 * s["n_checks"]
    assert s["disagreements"] and all(d["reason"] for d in s["disagreements"])
    for c in doc["checks"]:
        assert set(c) >= {"id", "family", "published", "derived", "status", "via"}


def test_known_values_and_disagreements(result):
    rows = {c.id: c for c in result.checks}
    llama = rows["table1.untreated.Llama-3.1-8B-Instruct.ret"]
    assert (llama.status, llama.published, llama.derived, llama.via) == ("MATCH", "17.1", "17.1", published.V_POOLED)
    g = rows["table1.untreated.gemma-2-9b-it.err"]
    assert g.status == "DISAGREEMENT" and (g.published, g.derived) == ("99.5", "99.4") and "rounded twice" in g.detail
    # §5.4 says every strategy reduces tool-error abstention; abstain-and-flag raises it for two models
    e = rows["sec5_4.err_abstain_reduced_by_every_strategy"]
    assert e.status == "DISAGREEMENT" and e.derived == "10 of 12" and "flag" in e.detail
    assert rows["sec5_4.retention_up_directions"].status == "MATCH"
    for cid, val in (("sec5_4.Llama-3.1-8B-Instruct.warn.ret_delta", "+13"),
                     ("sec5_4.Llama-3.1-8B-Instruct.warn.tool_delta", "-7"),
                     ("sec5_4.Llama-3.1-8B-Instruct.prior.err_delta", "-54")):
        assert (rows[cid].status, rows[cid].derived) == ("MATCH", val)
    assert rows["sec5_3.formulation_spread.ret"].derived == "7–15"
    assert rows["sec5_3.formulation_spread.wrong"].derived == "11–18"
    for k, v in (("llamai_sft_ret", "14.3"), ("llamai_dpo_ret", "5.8"), ("qwen_sft_tool", "5.9"), ("qwen_sft_wrong", "5.5")):
        assert (rows[f"sec5_2.{k}"].status, rows[f"sec5_2.{k}"].derived) == ("MATCH", v)
    # the two Qwen SFT values the release copy lacks (no pooled block) but the prose gives
    q = rows["finetune.qwen.sft.tool_gold_follow.pooled_delta"]
    assert q.status == "MATCH" and q.derived == "5.9" and q.via == published.V_CONTRAST
    assert rows["finetune.qwen.sft.tool_gold_follow.pooled_units"].derived == "1188"
    # the criterion and the Holm family go through stats
    c = rows["finetune.Llama-3.1-8B-Instruct.sft.criterion"]
    assert (c.status, c.derived, c.via) == ("MATCH", "yes", published.V_CRIT)
    assert rows["finetune.Qwen2.5-7B-Instruct.sft.criterion"].derived == "no"
    assert rows["far_keep_holm.base"].status == "MATCH" and rows["far_keep_holm.base"].via == published.V_HOLM
    assert rows["pooled.order.pooled.keep"].via == published.V_RANK
    assert rows["construction.episodes"].derived == "6504"


def test_a_changed_release_is_caught(tmp_path):
    src = resolve_release_dir()
    dst = tmp_path / "release"
    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        p.chmod(0o644)
    dst.chmod(0o755)
    t1 = json.loads((dst / "published_table1.json").read_text())
    t1["rows"]["Qwen2.5-7B-Instruct"]["untreated"]["tool"] = 90.0
    (dst / "published_table1.json").write_text(json.dumps(t1))
    res = published.verify_published(dst)
    assert not res.ok
    assert "table1.untreated.Qwen2.5-7B-Instruct.tool" in {c.id for c in res.failures}


def test_release_frame_reproduces_the_release_counts():
    """The frame rebuilt from a release arm block gives back its rates through metrics.arm_metrics."""
    block = {"keep_strict": 0.0926, "n_both_in_arb": 2, "CRA_arb": 0.1049, "n_arb": 162, "prior_bw": 0.7143,
             "tool_gold_follow": 0.8783, "nc_CRA": 0.8598, "n_bw": 378, "te_abstain": 0.893}
    m = metrics.arm_metrics(published.release_frame({"reference": block}, 542))
    assert round(m["retention"], 4) == 0.0926 and m["n_arb"] == 162 and m["n_both_in_arb"] == 2
    assert round(m["wrong_follow"], 4) == 0.7143 and round(m["tool_follow"], 4) == 0.8783
    assert round(m["err_abstain"], 4) == 0.893 and m["n_err"] == 542
    with pytest.raises(published.PublishedCheckError, match="not a count"):
        published.release_frame({"reference": {**block, "keep_strict": 0.0927}}, 542)


def test_criterion_is_the_one_stats_definition():
    """Issue 12 item 7: memtoc verify --published judges the criterion with stats.success_criterion
    (Holm-adjusted retention p), the function the notebooks and the report use; the old checker's
    own rule read the raw p."""
    ret = {"delta": 0.05, "p_signflip": 0.02, "p_holm": 0.08}
    tool = {"delta": 0.0, "p_signflip": 0.9}
    assert stats.success_criterion(ret, tool)["passed"] is False          # Holm p 0.08 > alpha
    assert not hasattr(claims, "_derive_published")                       # no second implementation


def test_cli_prints_one_json_object(capsys):
    assert verifycmd.cli(["--published", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"checks", "summary"} and doc["summary"]["by_status"]["MISMATCH"] == 0
    assert pd.DataFrame(doc["checks"]).groupby("family").size()["table4"] >= 60
