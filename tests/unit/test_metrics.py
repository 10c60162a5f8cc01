"""Cells, the metric set, pooling and common support (PROTOCOL.md §5-§6), with the release's
sanity anchors."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from memtoc.config.params import resolve_release_dir
from memtoc.core import metrics
from memtoc.core.errors import DataError
from memtoc.core.metrics import arm_metrics, assign_cell, rate, summarize


# ------------------------------------------------------------------------------------------ cells
@pytest.mark.parametrize("mc,absent,tc,cell", [
    (True, False, True, "agree"),
    (True, False, False, "arb"),
    (False, False, True, "tool_gold"),
    (False, False, False, "both_wrong"),
    (None, True, True, "mem_absent"),
    (None, True, False, "mem_absent"),
    (True, False, None, None),          # no_tool / noop
    (None, True, None, None),
])
def test_assign_cell(mc, absent, tc, cell):
    assert assign_cell(mc, absent, tc) == cell


def test_assign_cell_rejects_inconsistent_memory():
    with pytest.raises(ValueError, match="mem_absent"):
        assign_cell(None, False, True)


# ------------------------------------------------------------------------------------------ helpers
def ep(qkey, condition, cell, outcome="neither", final_correct=False, abstain=False, formulation="reference"):
    return {"qkey": qkey, "condition": condition, "cell": cell, "formulation": formulation,
            "followed_tool": outcome in ("followed_tool", "both"),
            "kept_memory": outcome in ("kept_memory", "both"),
            "outcome": outcome, "final_correct": final_correct, "abstain": abstain}


def small_arm():
    rows = [
        # tool_wrong, arb: 4 episodes: kept, both, followed, neither
        ep("q1", "tool_wrong", "arb", "kept_memory", True),
        ep("q2", "tool_wrong", "arb", "both", True),
        ep("q3", "tool_wrong", "arb", "followed_tool"),
        ep("q4", "tool_wrong", "arb", "neither"),
        # tool_wrong, both_wrong: 2, one follows
        ep("q5", "tool_wrong", "both_wrong", "followed_tool"),
        ep("q6", "tool_wrong", "both_wrong", "neither", True),
        ep("q7", "tool_wrong", "mem_absent", "followed_tool"),
        # tool_right
        ep("q1", "tool_right", "agree", "both", True),
        ep("q2", "tool_right", "agree", "neither", False),
        ep("q5", "tool_right", "tool_gold", "followed_tool", True),
        ep("q6", "tool_right", "tool_gold", "followed_tool", True),
        ep("q7", "tool_right", "mem_absent", "followed_tool", True),
        ep("q3", "tool_right", "tool_gold", "neither", False),
        # tool_error: 3 episodes incl. mem_absent, two abstain
        ep("q1", "tool_error", "arb", "kept_memory", True, False),
        ep("q5", "tool_error", "both_wrong", "neither", False, True),
        ep("q7", "tool_error", "mem_absent", "neither", False, True),
        # no_tool
        ep("q1", "no_tool", None, "neither", True),
    ]
    return pd.DataFrame(rows)


def test_arm_metrics_definitions():
    m = arm_metrics(small_arm())
    assert m["retention"] == pytest.approx(1 / 4)       # "both" excluded from the numerator
    assert m["keep_flag"] == pytest.approx(2 / 4)       # legacy flag includes "both"
    assert m["cra_arb"] == pytest.approx(2 / 4)
    assert m["wrong_follow"] == pytest.approx(1 / 2)
    assert m["bw_gold"] == pytest.approx(1 / 2)
    assert m["tool_follow"] == pytest.approx(2 / 3)
    assert m["nc_acc"] == pytest.approx(2 / 3)
    assert m["agree_acc"] == pytest.approx(1 / 2)
    assert m["err_abstain"] == pytest.approx(2 / 3)     # all tool_error episodes incl. mem_absent
    assert m["cra_conflict"] == pytest.approx((2 + 2) / (4 + 3))   # arb (tool_wrong) + tool_gold (tool_right)
    assert (m["n_arb"], m["n_tool_gold"], m["n_both_wrong"], m["n_agree"], m["n_err"],
            m["n_mem_absent"], m["n_both_in_arb"]) == (4, 3, 2, 2, 3, 1, 1)


def test_arm_metrics_empty_denominator_is_nan_not_zero():
    df = small_arm()
    m = arm_metrics(df[df.condition != "tool_error"])
    assert math.isnan(m["err_abstain"]) and m["n_err"] == 0
    m = arm_metrics(df[df.cell != "arb"])
    assert math.isnan(m["retention"]) and math.isnan(m["cra_arb"]) and m["n_arb"] == 0


def test_arm_metrics_accepts_object_columns_with_missing_flags():
    df = small_arm().astype({"abstain": object})
    df.loc[df.condition == "tool_error", "abstain"] = [None, True, True]
    assert arm_metrics(df)["err_abstain"] == pytest.approx(2 / 3)


def test_arm_metrics_missing_column_is_a_clear_error():
    with pytest.raises(DataError, match="outcome"):
        arm_metrics(small_arm().drop(columns=["outcome"]))


def test_rate_generic():
    df = small_arm()
    assert rate(df, "tool_wrong", "arb", ("outcome", "kept_memory")) == pytest.approx(1 / 4)
    assert rate(df, "tool_wrong", ["arb", "both_wrong"], "followed_tool") == pytest.approx(3 / 6)
    assert rate(df, "tool_error", None, "abstain") == pytest.approx(2 / 3)
    assert rate(df, "no_tool", None, "final_correct") == 1.0
    assert rate(df, "tool_wrong", "arb", lambda d: d["final_correct"] & ~d["followed_tool"]) == pytest.approx(1 / 4)
    assert math.isnan(rate(df, "noop", None, "final_correct"))
    for spec in metrics.CELL_METRICS:
        if spec.name != "cra_conflict":
            assert rate(df, spec.conditions, spec.cells, spec.flag) == pytest.approx(arm_metrics(df)[spec.name]) or \
                math.isnan(arm_metrics(df)[spec.name])


CELL_NAMES = [s.name for s in metrics.CELL_METRICS]


def test_registry_is_the_vocabulary():
    from memtoc.core import vocab
    assert tuple(metrics.METRICS) == vocab.METRIC_NAMES
    assert CELL_NAMES == ["retention", "keep_flag", "cra_arb", "tool_follow", "wrong_follow", "bw_gold",
                          "err_abstain", "cra_conflict", "agree_acc", "nc_acc"]
    assert all(metrics.METRICS[m].headline for m in vocab.HEADLINE_METRICS)
    assert sum(s.headline for s in metrics.METRICS.values()) == len(vocab.HEADLINE_METRICS)
    # the Holm families come from stats.FAMILIES: retention's contrasts are corrected, cra_arb's are not
    assert "prompting_retention" in metrics.METRICS["retention"].families
    assert metrics.METRICS["cra_arb"].families == ()
    docs = metrics.definitions()
    assert list(docs)[:8] == list(vocab.HEADLINE_METRICS + vocab.SECONDARY_METRICS)
    assert set(docs) == set(vocab.METRIC_NAMES) and all(docs.values())


def test_unknown_metric_is_an_error():
    df = small_arm().assign(formulation="reference")
    with pytest.raises(metrics.UnknownMetricError, match="unknown metric 'retension'.*retention"):
        metrics.metric_units(df, "retension")
    with pytest.raises(metrics.UnknownMetricError, match="needs an explicit condition"):
        metrics.metric_units(df, "accuracy")
    u = metrics.metric_units(df, "accuracy", condition="no_tool")
    assert len(u) == (df["condition"] == "no_tool").sum() and set(u.columns) >= {"formulation", "qkey", "value"}


# ------------------------------------------------------------------------------------------ summarize
def test_summarize_structure_pooling_and_json():
    df = metrics.synthetic_arm(120, seed=3)
    df2 = metrics.synthetic_arm(120, seed=4, model="other")
    out = summarize(pd.concat([df, df2]), n_boot=400, seed=0)
    json.dumps(out, allow_nan=False)          # plain JSON: no numpy types, no NaN
    assert set(out) == {"synthetic", "other"}
    blk = out["synthetic"]["untreated"]
    assert set(blk) == {"reference", "paraphrase_a", "paraphrase_b", "pooled"}
    for f in ("reference", "paraphrase_a", "paraphrase_b"):
        direct = arm_metrics(df[df.formulation == f])
        for name in CELL_NAMES:
            e = blk[f][name]
            assert e["value"] == pytest.approx(direct[name])
            assert e["ci95"][0] <= e["value"] <= e["ci95"][1]
        assert blk[f]["n_arb"] == direct["n_arb"] and blk[f]["retention"]["n"] == direct["n_arb"]
    for name in CELL_NAMES:
        vals = [arm_metrics(df[df.formulation == f])[name] for f in ("reference", "paraphrase_a", "paraphrase_b")]
        assert blk["pooled"][name]["value"] == pytest.approx(np.mean(vals))   # unweighted mean
        lo, hi = blk["pooled"][name]["ci95"]
        assert lo <= blk["pooled"][name]["value"] <= hi
        assert blk["pooled"][name]["n_formulations"] == 3
    assert blk["pooled"]["n_questions"] == 120
    # deterministic for a seed
    assert summarize(df, n_boot=400, seed=0) == summarize(df, n_boot=400, seed=0)


def test_summarize_pooled_ci_is_clustered_on_questions():
    """The pooled interval resamples qkeys once for all formulations: perfectly correlated
    formulations give a pooled CI as wide as one formulation's, not sqrt(3) narrower."""
    one = metrics.synthetic_arm(200, seed=1, formulations=("reference",))
    same = pd.concat([one.assign(formulation=f) for f in ("reference", "paraphrase_a", "paraphrase_b")])
    blk = summarize(same, by=("formulation",), n_boot=1000, seed=0)
    for name in ("retention", "wrong_follow", "tool_follow"):
        assert blk["pooled"][name]["ci95"] == pytest.approx(blk["reference"][name]["ci95"])


def test_summarize_nan_becomes_none_and_missing_formulation_is_skipped():
    df = metrics.synthetic_arm(60, seed=2)
    df = df[~((df.formulation == "paraphrase_b") & (df.condition == "tool_error"))]
    out = summarize(df, by=("formulation",), n_boot=200)
    assert out["paraphrase_b"]["err_abstain"] == {"value": None, "ci95": [None, None], "n": 0, "n_boot_used": 0}
    vals = [out[f]["err_abstain"]["value"] for f in ("reference", "paraphrase_a")]
    assert out["pooled"]["err_abstain"]["value"] == pytest.approx(np.mean(vals))
    assert out["pooled"]["err_abstain"]["n_formulations"] == 2


def test_summarize_requires_formulation():
    with pytest.raises(DataError, match="formulation"):
        summarize(metrics.synthetic_arm(10), by=("model", "arm"))


# ------------------------------------------------------------------------------------------ anchors
def _published(name):
    return json.loads((resolve_release_dir() / name).read_text())


PV = {"canonical_pv0": "reference", "canonical_pv1": "paraphrase_a", "canonical_pv2": "paraphrase_b"}


def _arb_bw_frame(per_pv: dict, n_per_pv: dict, metric: str) -> pd.DataFrame:
    """Episodes whose per-formulation rate is the published one (count = rate x n, rounded)."""
    rows = []
    for pv, form in PV.items():
        n = n_per_pv[pv]
        k = round(per_pv[pv] * n)
        assert round(k / n, 4) == per_pv[pv]          # the published rate is a count over n
        for i in range(n):
            if metric == "keep":
                rows.append(ep(f"q{i}", "tool_wrong", "arb", "kept_memory" if i < k else "followed_tool",
                               formulation=form))
            else:
                rows.append(ep(f"q{i}", "tool_wrong", "both_wrong", "followed_tool" if i < k else "neither",
                               formulation=form))
    return pd.DataFrame(rows)


@pytest.mark.parametrize("model", ["llamai", "qwen", "gemma", "mistral"])
@pytest.mark.parametrize("metric,ours", [("keep", "retention"), ("prior", "wrong_follow")])
def test_anchor_pooled_means_of_the_release(model, metric, ours):
    """published_pooled.json: pooled = unweighted mean of the three formulations' rates
    (llamai keep = (0.0926 + 0.2462 + 0.1754) / 3 = 0.1714)."""
    pub = _published("published_pooled.json")["pooled_instructs"][model][metric]
    df = _arb_bw_frame(pub["per_pv"], pub["n_per_pv"], metric)
    out = summarize(df, by=("formulation",), n_boot=200)
    assert round(out["pooled"][ours]["value"], 4) == pub["pooled_mean"]
    for pv, form in PV.items():
        assert round(out[form][ours]["value"], 4) == pub["per_pv"][pv]
        assert out[form][ours]["n"] == pub["n_per_pv"][pv]
    weighted = sum(round(pub["per_pv"][pv] * pub["n_per_pv"][pv]) for pv in PV) / sum(pub["n_per_pv"].values())
    if round(weighted, 4) != pub["pooled_mean"]:
        assert round(out["pooled"][ours]["value"], 4) != round(weighted, 4)


def test_anchor_llamai_keep_17_1():
    pub = _published("published_pooled.json")["pooled_instructs"]["llamai"]["keep"]
    out = summarize(_arb_bw_frame(pub["per_pv"], pub["n_per_pv"], "keep"), by=("formulation",), n_boot=100)
    assert f"{100 * out['pooled']['retention']['value']:.1f}" == "17.1"


def test_anchor_gemma_err_abstain_99_45():
    """gemma te_abstain 542/542, 537/542, 538/542 over ALL tool_error episodes -> 99.45 pooled."""
    det = _published("published_arm_metrics.json")["det"]["gemma"]
    rows = []
    for pv, form in PV.items():
        k = round(det[pv]["te_abstain"] * 542)
        for i in range(542):
            cell = "mem_absent" if i % 50 == 0 else ("arb" if i % 3 else "both_wrong")
            rows.append(ep(f"q{i}", "tool_error", cell, "neither", abstain=i < k, formulation=form))
    out = summarize(pd.DataFrame(rows), by=("formulation",), n_boot=100)
    assert [out[f]["err_abstain"]["n"] for f in PV.values()] == [542, 542, 542]
    assert [round(out[f]["err_abstain"]["value"] * 542) for f in PV.values()] == [542, 537, 538]
    assert f"{100 * out['pooled']['err_abstain']['value']:.2f}" == "99.45"


def test_anchor_keep_flag_minus_keep_strict_is_both_in_arb():
    """Every arm of published_arm_metrics.json: keep_flag - keep_strict = n_both_in_arb / n_arb,
    i.e. retention excludes "both" and the legacy flag includes it."""
    pub = _published("published_arm_metrics.json")
    checked = 0
    for layer in ("det", "judged"):
        for model, arms in pub[layer].items():
            for arm, v in arms.items():
                n, k = v["n_arb"], round(v["keep_strict"] * v["n_arb"])
                nb, kc = v["n_both_in_arb"], round(v["CRA_arb"] * v["n_arb"])
                outs = ["kept_memory"] * k + ["both"] * nb + ["followed_tool"] * (n - k - nb)
                df = pd.DataFrame([ep(f"q{i}", "tool_wrong", "arb", o, final_correct=i < kc)
                                   for i, o in enumerate(outs)])
                m = arm_metrics(df)
                assert round(m["retention"], 4) == v["keep_strict"], (layer, model, arm)
                assert round(m["keep_flag"], 4) == v["keep_flag"], (layer, model, arm)
                assert round(m["cra_arb"], 4) == v["CRA_arb"], (layer, model, arm)
                assert m["n_both_in_arb"] == nb
                checked += 1
    assert checked == 96


# ------------------------------------------------------------------------------------------ support
def test_pooled_interval_reports_the_replicates_it_used_when_a_cell_is_small():
    """Issue 12 item 10: 30 questions; paraphrase_b's arb cell holds 1 of them, so most bootstrap
    replicates draw no question of it and its rate (and the pooled mean) is undefined there. The
    pooled interval must say how many replicates it rests on instead of dropping them silently."""
    rows = []
    for i in range(30):
        for form in ("reference", "paraphrase_a"):
            rows.append(ep(f"q{i:02d}", "tool_wrong", "arb", "kept_memory" if i % 3 == 0 else "followed_tool",
                           formulation=form))
        rows.append(ep(f"q{i:02d}", "tool_wrong", "arb" if i == 0 else "both_wrong",
                       "kept_memory" if i == 0 else "followed_tool", formulation="paraphrase_b"))
    out = summarize(pd.DataFrame(rows), by=("formulation",), n_boot=2000, seed=0)
    pooled, small = out["pooled"]["retention"], out["paraphrase_b"]["retention"]
    # P(a replicate misses the one question) = (29/30)^30 ~ 0.36: about 1,270 of 2,000 are defined
    assert 1100 < pooled["n_boot_used"] < 1450
    assert small["n_boot_used"] == pooled["n_boot_used"]
    assert out["reference"]["retention"]["n_boot_used"] == 2000
    assert pooled["value"] == pytest.approx((10 / 30 + 10 / 30 + 1.0) / 3)


def test_pooled_interval_drops_undefined_replicates_and_empty_formulations():
    """The one pooled estimator: the unweighted mean of the formulations with a denominator; a
    replicate is the mean of their replicates, undefined when any of them is; the percentile
    interval rests on the defined replicates, counted in n_boot_used."""
    reps = np.array([[0.1, 0.2, np.nan, 0.4, 0.3],        # reference
                     [0.5, 0.6, 0.7, np.nan, 0.5],        # paraphrase_a
                     [np.nan] * 5])                       # paraphrase_b: no unit at all
    p = metrics.pooled_interval([0.2, 0.6, np.nan], reps, [10, 8, 0], alpha=0.5)
    assert p.value == pytest.approx(0.4) and p.n == 18 and p.n_formulations == 2
    assert p.n_boot_used == 3                             # replicates 0, 1, 4 are defined in both
    defined = np.sort([0.3, 0.4, 0.4])                    # their means, sorted
    assert (p.lo, p.hi) == (defined[int(0.25 * 3)], defined[min(2, int(0.75 * 3))])
    one = metrics.pooled_interval([0.2], reps[:1], [10])
    assert one.value == pytest.approx(0.2) and one.n_boot_used == 4
