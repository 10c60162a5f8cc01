"""Statistics checked against scipy / statsmodels references, hand formulas from PROTOCOL §6, and
small simulations of bootstrap coverage and permutation type-I error on clustered data."""
from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from scipy import stats as sps

from memtoc.config.params import resolve_release_dir
from memtoc.core import stats


# ------------------------------------------------------------------------------------------ basics
def test_percentile_ci_uses_the_release_index_rule():
    s = np.arange(1000, dtype=float)[::-1]
    assert list(stats.percentile_ci(s)) == [25.0, 975.0]
    s = np.arange(2000, dtype=float)
    assert list(stats.percentile_ci(s)) == [50.0, 1950.0]
    two = stats.percentile_ci(np.stack([s, 2 * s], 1))
    assert two.shape == (2, 2) and list(two[:, 1]) == [100.0, 3900.0]
    s = np.r_[np.arange(100.0), [np.nan] * 5]
    assert list(stats.percentile_ci(s)) == [2.0, 97.0]          # non-finite replicates ignored
    assert np.isnan(stats.percentile_ci(np.full(10, np.nan))).all()


def test_resample_weights_are_counts_of_integer_draws():
    w = stats.resample_weights(7, 50, seed=3)
    idx = np.random.default_rng(3).integers(0, 7, size=(50, 7))
    ref = np.stack([np.bincount(r, minlength=7) for r in idx])
    assert np.array_equal(w, ref) and (w.sum(1) == 7).all()


def test_cluster_bootstrap_matches_scipy_for_independent_units():
    rng = np.random.default_rng(0)
    x = (rng.random(400) < 0.3).astype(float)
    ours = stats.cluster_bootstrap(x, np.arange(400), n_boot=4000, seed=1)
    ref = sps.bootstrap((x,), np.mean, n_resamples=4000, method="percentile", random_state=2).confidence_interval
    assert ours["value"] == pytest.approx(x.mean())
    assert ours["ci95"][0] == pytest.approx(ref.low, abs=0.01)
    assert ours["ci95"][1] == pytest.approx(ref.high, abs=0.01)


def test_cluster_bootstrap_widens_with_within_cluster_correlation():
    rng = np.random.default_rng(1)
    per_cluster = (rng.random(150) < 0.4).astype(float)
    x = np.repeat(per_cluster, 4)                      # 4 identical units per question
    cl = np.repeat(np.arange(150), 4)
    clustered = stats.cluster_bootstrap(x, cl, n_boot=2000)
    naive = stats.cluster_bootstrap(x, np.arange(x.size), n_boot=2000)
    w_c = clustered["ci95"][1] - clustered["ci95"][0]
    w_n = naive["ci95"][1] - naive["ci95"][0]
    assert w_c == pytest.approx(2 * w_n, rel=0.2)      # sqrt(4) = 2x wider
    assert clustered["n_clusters"] == 150 and clustered["n"] == 600


# ------------------------------------------------------------------------------------------ paired
def _exact_signflip_p(d):
    obs = abs(d.mean())
    perms = [abs((np.array(s) * d).mean()) for s in itertools.product((-1, 1), repeat=d.size)]
    return np.mean(np.array(perms) >= obs - 1e-12)


def test_paired_contrast_delta_and_pvalue_against_exact_and_scipy():
    rng = np.random.default_rng(5)
    t = (rng.random(12) < 0.7).astype(float)
    u = (rng.random(12) < 0.3).astype(float)
    res = stats.paired_contrast(t, u, np.arange(12), n_boot=2000, n_perm=40000, seed=0)
    assert res["delta"] == pytest.approx((t - u).sum() / 12)
    assert res["n_units"] == 12 and res["n_questions"] == 12
    exact = _exact_signflip_p(t - u)
    ref = sps.permutation_test((t, u), lambda a, b, axis: np.mean(a - b, axis=axis), vectorized=True,
                               permutation_type="samples", n_resamples=np.inf).pvalue
    assert exact == pytest.approx(ref)
    assert res["p_signflip"] == pytest.approx(exact, abs=0.01)


def _release_paired_block(csum, cnt, n_boot=1000, n_perm=10000, seed=0):
    """scripts/build_paired_treatment_summary.py:paired_block of the release, transcribed."""
    n_units = int(cnt.sum())
    delta = float(csum.sum()) / n_units
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(csum), size=(n_boot, len(csum)))
    boots = np.sort(csum[idx].sum(axis=1) / cnt[idx].sum(axis=1))
    ci = [float(boots[int(0.025 * n_boot)]), float(boots[min(n_boot - 1, int(0.975 * n_boot))])]
    signs = rng.integers(0, 2, size=(n_perm, len(csum))) * 2 - 1
    perm = (signs @ csum) / n_units
    return delta, ci, (int((np.abs(perm) >= abs(delta) - 1e-12).sum()) + 1) / (n_perm + 1)


def test_signflip_defaults_reproduce_the_release_on_a_release_shaped_example():
    """A fixed example shaped on the release: Llama-3.1-8B-Instruct DPO retention on the Reference
    formulation (published_finetuning.json: 159 paired arb units, delta +0.0566 = 9/159, release
    p 0.090091; the release ships no unit-level data, so the positions of the 16 gains and 7 losses
    are fixed here). With the defaults (n_boot 1000, n_perm 10000, seed 0) memtoc must give the
    release's delta, interval and p on these units. The int8 sign draw memtoc used before gave
    p = 0.0963 where the release procedure gives 0.0943; n_boot 2000 gave another interval."""
    d = np.zeros(159)
    d[np.arange(0, 160, 10)] = 1.0
    d[np.arange(5, 140, 20)] = -1.0
    t, u = (d == 1).astype(float), (d == -1).astype(float)
    res = stats.paired_contrast(t, u, np.arange(159))
    delta, ci, p = _release_paired_block(d, np.ones(159))
    assert round(res["delta"], 4) == 0.0566 == round(delta, 4)
    assert res["ci95"] == pytest.approx(ci)
    assert res["p_signflip"] == p
    assert round(p, 4) == 0.0943                       # frozen: the release procedure on these units
    assert stats.DEFAULT_N_BOOT == 1000


def test_paired_contrast_protocol_definition_on_clusters():
    """delta = sum of unit diffs / units; CI from default_rng(seed) cluster draws; sign flips on
    cluster sums with the same generator continuing (PROTOCOL §6.3)."""
    rng = np.random.default_rng(11)
    cl = np.repeat(np.arange(40), rng.integers(1, 4, 40))
    t = (rng.random(cl.size) < 0.6).astype(float)
    u = (rng.random(cl.size) < 0.4).astype(float)
    res = stats.paired_contrast(t, u, cl, n_boot=1000, n_perm=3000, seed=0)
    d = t - u
    S = np.bincount(cl, weights=d)
    C = np.bincount(cl).astype(float)
    g = np.random.default_rng(0)
    idx = g.integers(0, 40, size=(1000, 40))
    reps = np.sort(S[idx].sum(1) / C[idx].sum(1))
    assert res["delta"] == pytest.approx(d.sum() / d.size)
    assert res["ci95"] == pytest.approx([reps[25], reps[975]])
    signs = g.integers(0, 2, size=(3000, 40)) * 2 - 1          # the release's int64 draw
    perm = signs @ S / d.size
    p = (np.count_nonzero(np.abs(perm) >= abs(res["delta"]) - 1e-12) + 1) / 3001
    assert res["p_signflip"] == pytest.approx(p)
    assert res["n_questions"] == 40 and res["n_units"] == cl.size


def test_paired_contrast_dataframe_input_and_errors():
    import pandas as pd
    df = pd.DataFrame({"treated": [1, 1, 0, 1], "untreated": [0, 1, 0, 0], "qkey": ["a", "a", "b", "c"]})
    res = stats.paired_contrast(df, n_boot=100, n_perm=100)
    assert res["delta"] == pytest.approx(0.5) and res["n_questions"] == 3
    json.dumps(res, allow_nan=False)
    with pytest.raises(stats.StatsInputError, match="lengths differ"):
        stats.paired_contrast([1, 0], [1], [0, 1])
    with pytest.raises(stats.StatsInputError, match="common support"):
        stats.paired_contrast([1, np.nan], [1, 0], [0, 1])
    assert stats.paired_contrast([], [], [])["delta"] is None


# ------------------------------------------------------------------------------------------ simulations
def test_simulation_cluster_bootstrap_coverage():
    """95% CI of a clustered mean (random cluster effects, 1-4 units per cluster) covers the truth
    in about 95% of 300 simulated data sets (measured: 0.933 with 200 clusters; 0.913 with 80:
    the percentile bootstrap undercovers a little when clusters are few)."""
    rng = np.random.default_rng(2024)
    true_p, hits, sims = 0.3, 0, 300
    for _ in range(sims):
        k = 200
        p_cluster = rng.beta(true_p * 4, (1 - true_p) * 4, k)      # mean 0.3, strong clustering
        sizes = rng.integers(1, 5, k)
        cl = np.repeat(np.arange(k), sizes)
        x = (rng.random(cl.size) < p_cluster[cl]).astype(float)
        # the estimand of the ratio estimator: E[sum x] / E[n] = true_p
        ci = stats.cluster_bootstrap(x, cl, n_boot=500, seed=int(rng.integers(1 << 30)))["ci95"]
        hits += ci[0] <= true_p <= ci[1]
    assert 0.90 <= hits / sims <= 0.99


def test_simulation_signflip_type_one_error_and_power():
    """Under the null (treated and untreated exchangeable within a unit, cluster effects shared),
    p < 0.05 in about 5% of simulated data sets; with a real effect the test rejects."""
    rng = np.random.default_rng(7)
    sims, rejections, pvals = 400, 0, []
    for _ in range(sims):
        k = 50
        cl = np.repeat(np.arange(k), 3)
        base = rng.random(k)[cl]
        t = (rng.random(cl.size) < base).astype(float)
        u = (rng.random(cl.size) < base).astype(float)
        p = stats.paired_contrast(t, u, cl, n_boot=10, n_perm=999, seed=int(rng.integers(1 << 30)))["p_signflip"]
        pvals.append(p)
        rejections += p < 0.05
    assert 0.02 <= rejections / sims <= 0.085
    pvals = np.array(pvals)
    for a in (0.01, 0.1, 0.2):                                 # valid at other levels too
        assert np.mean(pvals <= a) <= a + 0.04
    cl = np.repeat(np.arange(50), 3)
    t = (rng.random(150) < 0.6).astype(float)
    u = (rng.random(150) < 0.3).astype(float)
    assert stats.paired_contrast(t, u, cl, n_boot=10, n_perm=2000)["p_signflip"] < 0.01


# ------------------------------------------------------------------------------------------ Holm, z
def _holm_protocol(p):
    """PROTOCOL §6.3: sort ascending; adjusted = running max of min(1, (m - i) p)."""
    p = np.asarray(p, float)
    order = np.argsort(p)
    m = p.size
    adj = np.empty(m)
    running = 0.0
    for i, j in enumerate(order):
        running = max(running, min(1.0, (m - i) * p[j]))
        adj[j] = running
    return adj


def test_holm_matches_protocol_formula():
    p = [0.01, 0.04, 0.03, 0.005, 0.5]
    assert stats.holm(p) == pytest.approx(list(_holm_protocol(p)))
    d = stats.holm({"far": 0.01, "protocol": 0.04, "missing": None})
    assert d["far"] == pytest.approx(0.02) and d["protocol"] == pytest.approx(0.04) and d["missing"] is None


def test_holm_families_marks_significance_within_each_family():
    fams = {"A": {"x": {"delta": 0.1, "p_signflip": 0.01}, "y": {"delta": 0.1, "p_signflip": 0.04}},
            "B": {"z": {"delta": 0.1, "p_signflip": 0.04}}}
    out = stats.holm_families(fams)
    assert out["A"]["y"]["p_holm"] == pytest.approx(0.04) and out["A"]["x"]["p_holm"] == pytest.approx(0.02)
    assert out["B"]["z"]["significant"] and out["A"]["y"]["significant"]
    out = stats.holm_families({"A": {"x": {"p_signflip": 0.03}, "y": {"p_signflip": 0.04}, "w": {"p_signflip": 0.2}}})
    assert not out["A"]["x"]["significant"]                   # 3 x 0.03 = 0.09


def test_two_proportion_z_against_hand_formula():
    k1, n1, k2, n2 = 120, 400, 90, 380
    p = (k1 + k2) / (n1 + n2)
    z = (k1 / n1 - k2 / n2) / math.sqrt(p * (1 - p) * (1 / n1 + 1 / n2))
    res = stats.two_proportion_z(k1, n1, k2, n2)
    assert res["z"] == pytest.approx(z) and res["p"] == pytest.approx(2 * sps.norm.sf(abs(z)))
    assert res["diff"] == pytest.approx(k1 / n1 - k2 / n2)
    assert stats.two_proportion_z(0, 10, 0, 12)["p"] == 1.0
    with pytest.raises(stats.StatsInputError):
        stats.two_proportion_z(1, 0, 1, 5)


# ------------------------------------------------------------------------------------------ criterion
@pytest.mark.parametrize("ret,tool,passed", [
    ({"delta": 0.14, "p_holm": 0.001}, {"delta": -0.01, "p_holm": 0.6}, True),
    ({"delta": 0.14, "p_holm": 0.001}, {"delta": 0.05, "p_holm": 0.001}, True),    # tool up is fine
    ({"delta": 0.14, "p_holm": 0.001}, {"delta": -0.3, "p_holm": 0.001}, False),   # significant drop
    ({"delta": 0.14, "p_holm": 0.2}, {"delta": 0.0, "p_holm": 1.0}, False),        # not significant
    ({"delta": -0.14, "p_holm": 0.001}, {"delta": 0.0, "p_holm": 1.0}, False),     # wrong direction
    ({"delta": 0.14, "p_signflip": 0.01, "p_holm": 0.08}, {"delta": 0.0, "p_signflip": 1.0}, False),  # Holm wins
    ({"delta": 0.14, "p_signflip": 0.01}, {"delta": 0.0, "p_signflip": 1.0}, True),  # no Holm given
])
def test_success_criterion(ret, tool, passed):
    res = stats.success_criterion(ret, tool)
    assert res["passed"] is passed and isinstance(res["reason"], str)


# ------------------------------------------------------------------------------------------ ranking
def test_ranking_stability_on_the_release_orderings():
    """published_pooled.json: the ascending orders per scope, and 'none of the tested orderings is
    stable' (the full ordering differs between formulations)."""
    pub = json.loads((resolve_release_dir() / "published_pooled.json").read_text())
    models = pub["pooled_instructs"]
    for metric, pub_key in (("prior", "prior"), ("keep", "keepQ")):   # keepQ == keep on the 542
        per = {pv: {m: models[m][metric]["per_pv"][pv] for m in models}
               for pv in ("canonical_pv0", "canonical_pv1", "canonical_pv2")}
        pooled = {m: models[m][metric]["pooled_mean"] for m in models}
        res = stats.ranking_stability(per, pooled)
        for scope, order in pub["orders_by_scope"].items():
            assert res["orders"][scope] == order[pub_key]
        assert res["full_order_stable"] is False
    per = {pv: {m: models[m]["prior"]["per_pv"][pv] for m in models}
           for pv in ("canonical_pv0", "canonical_pv1", "canonical_pv2")}
    res = stats.ranking_stability(per, {m: models[m]["prior"]["pooled_mean"] for m in models})
    assert "llamai<qwen" in res["stable_pairs"] and "gemma<qwen" in res["stable_pairs"]
    assert "llamai<mistral" not in res["stable_pairs"]        # mistral < llamai pooled...
    assert "mistral<llamai" not in res["stable_pairs"]        # ...but not under pv0


def test_ranking_stability_small():
    res = stats.ranking_stability({"f1": {"a": 1, "b": 2}, "f2": {"a": 1, "b": 3}}, {"a": 1, "b": 2.5})
    assert res["stable_pairs"] == ["a<b"] and res["full_order_stable"]
    res = stats.ranking_stability({"f1": {"a": 1, "b": 2}, "f2": {"a": 3, "b": 2}}, {"a": 1, "b": 2.5})
    assert res["stable_pairs"] == [] and not res["full_order_stable"]


# ------------------------------------------------------------------------------------------ bench
def test_run_benchmark_small():
    from memtoc.run.bench import stats_benchmark
    res = stats_benchmark(n_questions=40, n_boot=100, n_perm=200, repeats=1)
    assert res["n_episodes"] == 40 * 3 * 4 and res["seconds_metric_set_bootstrap"] > 0
    json.dumps(res, allow_nan=False)


# ------------------------------------------------------------------------------------------ families
def test_families_are_declared_data_and_corrected_per_family():
    assert {"finetune_retention", "finetune_tool_follow", "prompting_retention", "frames_retention",
            "far_retention"} <= set(stats.FAMILIES)
    fam = stats.FAMILIES["prompting_retention"]
    assert fam.axes == ("model", "strategy") and fam.key("m", "warn") == "m|warn"
    members = {fam.key(m, a): {"p": p} for (m, a), p in
               zip([(m, a) for m in ("x", "y") for a in ("warn", "prior", "flag")], [.001, .02, .03, .04, .2, .5])}
    out = stats.holm_family("prompting_retention", members)
    assert out["x|warn"]["p_holm"] == pytest.approx(0.006) and out["x|warn"]["family"] == "prompting_retention"
    with pytest.raises(stats.StatsInputError, match="unknown Holm family"):
        stats.holm_family("nope", members)


def test_two_proportion_holm_over_model_pairs():
    counts = {"a": (30, 100), "b": (10, 100), "c": (12, 100)}
    res = stats.two_proportion_holm(counts, family="cross_model_ztest_retention")
    assert set(res) == {"a|b", "a|c", "b|c"}
    raw = {k: stats.two_proportion_z(*counts[k.split("|")[0]], *counts[k.split("|")[1]])["p"] for k in res}
    assert {k: v["p_holm"] for k, v in res.items()} == pytest.approx(stats.holm(raw))
    base = stats.two_proportion_holm(counts, "base_vs_instruct_ztest_retention", [("a", "b"), ("a", "c")])
    assert set(base) == {"a|b", "a|c"} and base["a|b"]["family"] == "base_vs_instruct_ztest_retention"
    with pytest.raises(stats.StatsInputError, match="paired"):       # a sign-flip family is not a z-test
        stats.two_proportion_holm(counts, family="base_vs_instruct_paired_retention")


# ------------------------------------------------------------------------------------------ preregistered families
EVERY_SLICE = ("reference", "paraphrase_a", "paraphrase_b", "pooled")


def test_preregistered_families_members_slices_and_tests():
    """The paper's families, one table: evaluation arms per formulation and pooled; the far family on
    the Reference formulation over all five models; prompting over the instruction-tuned models only;
    the question-paired base-vs-instruct family (sign-flip) beside the unpaired z-test families."""
    F = stats.FAMILIES
    for name in ("prompting_retention", "prompting_tool_follow", "frames_retention", "finetune_retention",
                 "finetune_tool_follow"):
        assert F[name].slices == EVERY_SLICE, name
    assert F["prompting_retention"].models == "instruct" and F["prompting_tool_follow"].models == "instruct"
    assert F["prompting_retention"].variants == ("warn", "prior", "flag")
    assert F["far_retention"].slices == ("reference",) and F["far_retention"].models == "all"
    paired = F["base_vs_instruct_paired_retention"]
    assert paired.test == "sign-flip" and paired.models == "base_vs_instruct" and paired.slices == ("reference",)
    for metric in ("retention", "wrong_follow"):
        assert F[f"base_vs_instruct_ztest_{metric}"].test == "z-test"
        assert F[f"cross_model_ztest_{metric}"].models == "all_pairs"
    assert "base_vs_instruct_retention" not in F            # the old name of the z-test family
    from memtoc.config.blocks.finetune import OBJECTIVES
    from memtoc.core.vocab import ALT_FRAMES, PROMPTING_ARMS
    assert F["finetune_retention"].variants == OBJECTIVES and F["frames_retention"].variants == ALT_FRAMES
    assert F["prompting_tool_follow"].variants == PROMPTING_ARMS
    assert all(f.metric in f.name for f in F.values())


def _contrast(p, delta=0.1):
    return {"delta": delta, "p": p, "p_holm": None}


def _prompting_summary(ps):
    """A model summary with prompting contrasts: pooled under ``contrasts``, per formulation under
    ``contrasts_by_formulation``; ``ps`` maps (arm, slice) -> p."""
    sec = {}
    for (arm, sl), p in ps.items():
        a = sec.setdefault(arm, {"contrasts": {}, "contrasts_by_formulation": {}})
        target = a["contrasts"] if sl == "pooled" else a["contrasts_by_formulation"].setdefault(sl, {})
        target["retention"] = _contrast(p)
        target["tool_follow"] = _contrast(min(1.0, 2 * p), -0.01)
    return {"prompting": sec}


def test_apply_families_per_slice_and_instruct_only():
    arms = ("warn", "prior", "flag")
    rng = np.random.default_rng(3)
    summ = {m: _prompting_summary({(a, sl): float(rng.uniform(0.001, 0.2)) for a in arms for sl in EVERY_SLICE})
            for m in ("inst1", "inst2", "base")}
    applied = stats.apply_families(summ, "evaluation", base_models=["base"])
    fam = applied["prompting_retention"]
    assert set(fam) == set(EVERY_SLICE)
    for sl in EVERY_SLICE:
        assert set(fam[sl]) == {f"{m}|{a}" for m in ("inst1", "inst2") for a in arms}      # 2 x 3, no base
        raw = {}
        for k in fam[sl]:
            m, a = k.split("|")
            sec = summ[m]["prompting"][a]
            c = sec["contrasts"] if sl == "pooled" else sec["contrasts_by_formulation"][sl]
            raw[k] = c["retention"]["p"]
            assert c["retention"]["family"] == "prompting_retention"
            assert c["tool_follow"]["family"] == "prompting_tool_follow" and c["tool_follow"]["p_holm"] is not None
        assert fam[sl] == pytest.approx(stats.holm(raw))
    base = summ["base"]["prompting"]["warn"]["contrasts"]["retention"]
    assert base["p_holm"] is None and base.get("family") is None
    listed = stats.families_summary("evaluation", applied)["prompting_retention"]
    assert listed["slices"] == list(EVERY_SLICE) and listed["members"] == applied["prompting_retention"]


def test_far_family_is_the_reference_one_with_the_release_p_values():
    """published_other.json far_keep_holm: five models (base included), Reference formulation only;
    the base model's +19.4 points at Holm p 0.0015 on 103 questions (the paper's App. C)."""
    pub = json.loads((resolve_release_dir() / "published_other.json").read_text())
    fh = pub["distractor_distance"]["judged"]["far_keep_holm"]
    summ = {m: {"far": {"contrasts": {"retention": _contrast(0.9)},
                        "contrasts_reference": {"retention": _contrast(v["p_signflip"], v["delta"])}}}
            for m, v in fh.items()}
    applied = stats.apply_families(summ, "evaluation", base_models=["base"])
    assert set(applied["far_retention"]) == {"reference"}
    adj = applied["far_retention"]["reference"]
    assert {m: round(p, 4) for m, p in adj.items()} == {m: v["p_holm"] for m, v in fh.items()}
    assert adj["base"] == pytest.approx(0.0015) and fh["base"]["n_units"] == 103
    assert summ["base"]["far"]["contrasts"]["retention"]["p_holm"] is None      # pooled: not in the family


def test_tool_drop_guard_reads_the_family_adjusted_p():
    """One guard rule (PROTOCOL §6.3, Holm inside pre-declared families): the correct-tool following
    p of the criterion is the family-adjusted one, in prompting as in fine-tuning."""
    ret = {"delta": 0.2, "p": 0.001, "p_holm": 0.004}
    tool = {"delta": -0.05, "p": 0.03, "p_holm": 0.09}
    res = stats.success_criterion(ret, tool)
    assert res["tool_p"] == 0.09 and res["tool_drop"] is False and res["passed"] is True


def test_ranking_rule_is_the_full_ordering_and_the_base_is_compared_on_reference():
    per = {"reference": {"a": 1, "b": 2, "base": 0.5}, "paraphrase_a": {"a": 1, "b": 3, "base": None}}
    res = stats.ranking_stability(per, {"a": 1, "b": 2.5, "base": 0.5}, reference_only=["base"])
    assert "FULL ordering" in res["rule"] and "pairwise" in res["pairwise_note"]
    assert res["orders"]["pooled"] == ["a", "b"] and res["full_order_stable"]
    assert res["reference_order"] == ["base", "a", "b"]
