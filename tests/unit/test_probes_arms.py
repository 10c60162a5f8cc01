"""App. C's recipe in notebook 05: multi-layer arms, the DPO-pair mining set and the dev-flip bar
(tiny random models; the release for the pair set)."""
from __future__ import annotations

import json

import pytest
import torch
from test_probes import tiny_lm

from memtoc.config.runconfig import RunConfig, RunPaths
from memtoc.core.errors import ConfigError
from memtoc.core.records import arm_key
from memtoc.stages.finetune import crossfit
from memtoc.stages.probes import corpus, mining as M, sae as S, saerun as SR, steering as ST
from memtoc.stages.probes.hfmodel import layer_hooks


def _sae(lm, seed: int, n: int = 32, k: int = 4):
    torch.manual_seed(seed)
    sae = S.TopKSAE(lm.d_model, n, k)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn_like(p))
    return sae


# -- config ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("probes, key", [
    ({"arms": {"m": [{"layers": [1, 1]}]}}, "arms.m[0].layers"),
    ({"arms": {"m": [{"layers": "all"}]}}, "arms.m[0].layers"),
    ({"arms": {"m": [{"layers": [1, 2], "position": "middle"}]}}, "arms.m[0].position"),
    ({"arms": {"m": [{"layer": [1]}]}}, "arms.m[0]"),
    ({"arms": {"m": {"layers": [1]}}}, "arms.m"),
    ({"mining_set": "pairs"}, "mining_set"),
    ({"steer_bar": "half"}, "steer_bar"),
])
def test_probes_arm_settings_are_checked(probes, key):
    with pytest.raises(ConfigError) as e:
        RunConfig.of({"probes": probes})
    assert f"probes.{key}" in str(e.value)


def test_arms_resolve_band_and_refuse_layers_outside_the_model():
    lm = tiny_lm(layers=4)
    cfg = RunConfig.of({"probes": {"arms": {lm.name: [{"layers": [2, 1]}, {"layers": "band", "position": "tool_span"}]}}})
    arms = SR.multi_arms(cfg, lm, [1, 2])
    assert [(a.layers, a.position, a.name) for a in arms] == [((1, 2), "last", "L1-2@last"),
                                                              ((1, 2), "tool_span", "L1-2@tool_span")]
    assert SR.Arm((0, 2), "last").name == "L0,2@last"
    bad = RunConfig.of({"probes": {"arms": {lm.name: [{"layers": [1, 7]}]}}})
    with pytest.raises(ConfigError, match=r"probes.arms.*\[7\] outside"):
        SR.multi_arms(bad, lm, [1, 2])


def test_a_multi_layer_arm_passes_on_its_median_fvu():
    layers = {"1": {"fvu": 0.42}, "2": {"fvu": 0.51}, "3": {"fvu": 0.48}}
    g = SR.arm_gate(SR.Arm((1, 2, 3), "last"), layers, 0.5)
    assert g["fvu_median"] == 0.48 and g["passes_gate"] is True      # layer 2 alone would fail (App. C: Llama Scope)
    assert SR.arm_gate(SR.Arm((1, 2), "last"), layers, 0.46)["passes_gate"] is False


# -- the multi-layer edit ----------------------------------------------------------------------------
def test_an_arm_edits_every_layer_in_one_pass():
    lm = tiny_lm(seed=5, layers=3)
    sae1, sae2 = _sae(lm, 1), _sae(lm, 2)
    prompt = 'Tool output: {"result": "Paris"}\nQuestion: capital?\n'
    e1 = ST.Edit(0, "to_memory", "last", 6.0, (0, 1), (4.0, 4.0), (2,))
    e2 = ST.Edit(1, "to_memory", "last", 6.0, (3,), (5.0,), (4, 5))
    both = ST.SteeredGenerator(lm, [(sae1, "a", e1), (sae2, "b", e2)], {}, max_new_tokens=6, stop_at_final=False)
    one = ST.SteeredGenerator(lm, [(sae1, "a", e1)], {}, max_new_tokens=6, stop_at_final=False)
    assert both.identity["edit"] == [e1.to_dict(), e2.to_dict()] and both.identity["sae_sha256"] == ["a", "b"]
    assert one.identity["edit"] == e1.to_dict() and one.identity["sae_sha256"] == "a"   # the single-layer key
    # the first step's logits equal a forward pass with both edits hooked by hand
    ids = lm.encode_prompt(prompt)
    last = [len(ids) - 1]
    with torch.no_grad(), layer_hooks(lm.model, {0: lambda h: ST.apply_edit(sae1, h, last, e1),
                                                  1: lambda h: ST.apply_edit(sae2, h, last, e2)}):
        by_hand = int(lm.model(input_ids=lm.ids(ids)).logits[0, -1].argmax())
    with torch.no_grad(), layer_hooks(lm.model, {0: lambda h: ST.apply_edit(sae1, h, last, e1)}):
        first_only = lm.model(input_ids=lm.ids(ids)).logits[0, -1]
    with torch.no_grad(), layer_hooks(lm.model, {0: lambda h: ST.apply_edit(sae1, h, last, e1),
                                                  1: lambda h: ST.apply_edit(sae2, h, last, e2)}):
        second_too = lm.model(input_ids=lm.ids(ids)).logits[0, -1]
    assert not torch.allclose(first_only, second_too)           # the second layer's edit is not a no-op
    reply = both.reply(prompt)
    assert reply.n_new_tokens >= 1 and lm.tokenizer(reply.text, add_special_tokens=False)["input_ids"][0] == by_hand
    with pytest.raises(ValueError, match="one edit per layer"):
        ST.SteeredGenerator(lm, [(sae1, "a", e1), (sae2, "b", e1)], {})
    with pytest.raises(ValueError, match="one position kind"):
        ST.SteeredGenerator(lm, [(sae1, "a", e1), (sae2, "b", ST.Edit(1, "to_memory", "tool_span", 1.0, (), (), ()))], {})


def test_strength_zero_arm_is_the_unedited_model(tmp_path):
    lm = tiny_lm(seed=2, layers=3)
    prompt = 'Tool output: {"result": "1999"}\nQ: year?\n'
    span = {prompt: '{"result": "1999"}'}
    edits = [(_sae(lm, s), str(s), ST.Edit(l, "to_tool", "tool_span", 0.0, (1,), (9.0,), (0,)))
             for s, l in ((1, 0), (2, 1), (3, 2))]
    ids = lm.encode_prompt(prompt)
    plain = lm.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=2, pad_token_id=2)
    got = ST.SteeredGenerator(lm, edits, span, max_new_tokens=8, stop_at_final=False).generate(
        [prompt], cache_path=tmp_path / "r.jsonl")
    assert got[0].text == lm.tokenizer.decode(plain[0, len(ids):].tolist())


# -- the dev-flip bar ---------------------------------------------------------------------------------
def _row(q, outcome, arm="untreated"):
    return {"question_id": q, "condition": "tool_wrong", "formulation": "reference", "frame": "schema", "arm": arm,
            "outcome": outcome, "kept_memory": outcome == M.MEMORY, "followed_tool": outcome == M.TOOL}


def test_dev_flip_bar_is_half_the_best_prompt_sentences_flip_of_the_same_episodes():
    dev = [_row(q, M.TOOL) for q in ("1", "2", "3", "4")]
    arms = {"warn": {ST.episode_key(r): r for r in [_row("1", M.MEMORY, "warn"), _row("2", M.TOOL, "warn"),
                                                    _row("3", M.TOOL, "warn"), _row("4", M.TOOL, "warn")]},
            "prior": {ST.episode_key(r): r for r in [_row("1", M.MEMORY, "prior"), _row("2", M.MEMORY, "prior"),
                                                     _row("3", "neither", "prior"), _row("4", M.TOOL, "prior")]},
            "flag": {ST.episode_key(_row("1", M.MEMORY)): _row("1", M.MEMORY)}}   # does not cover the dev set
    bar = ST.dev_flip_bar(dev, arms)
    assert bar["kind"] == "dev_flip" and bar["arm"] == "prior" and bar["effect"] == 0.5 and bar["bar"] == 0.25
    assert set(bar["flips"]) == {"warn", "prior"} and bar["flips"]["warn"]["k"] == 1
    assert ST.dev_flip_bar(dev, {})["bar"] is None and ST.dev_flip_bar([], arms)["bar"] is None
    # a dev-flip bar is compared with the flip rate, a pooled bar with the change toward the target
    def sc(ft, km, out):
        return {"followed_tool": ft, "kept_memory": km, "outcome": out,
                "degeneration": {"any": False, "no_final": False, "repetition": False, "schema_echo": False}}
    base = [sc(True, False, M.TOOL)] * 4
    steered = [sc(False, True, M.MEMORY), sc(True, True, "both")] + [sc(True, False, M.TOOL)] * 2
    assert ST.cell("to_memory", base, steered, 0.25, "dev_flip")["clears_bar"] is True      # flip 1/4
    assert ST.cell("to_memory", base, steered, 0.3, "dev_flip")["clears_bar"] is False
    assert ST.cell("to_memory", base, steered, 0.3, "pooled")["clears_bar"] is True         # delta kept memory 2/4
    # a zero bar (no prompting effect on the dev set) is not cleared by an edit that moves nothing
    assert ST.cell("to_memory", base, base, 0.0, "dev_flip")["clears_bar"] is False
    assert ST.cell("to_memory", base, steered, 0.0, "dev_flip")["clears_bar"] is True


def test_the_bar_reads_notebook_03s_prompt_sentences(tmp_path):
    lm = tiny_lm()
    label = lm.spec.label
    paths = RunPaths(tmp_path)
    for arm, outcome in (("warn", M.MEMORY), ("prior", M.TOOL)):
        p = paths.scored_file(label, arm_key(arm, "schema", "reference"))
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(_row("1", outcome, arm)) + "\n")
    dev = [_row("1", M.TOOL)]
    cfg = RunConfig.of({"probes": {"steer_bar": "dev_flip"}})
    bar = SR.steer_bar(cfg, lm, tmp_path, {}, dev)
    assert bar["arm"] == "warn" and bar["bar"] == 0.5 and set(bar["flips"]) == {"warn", "prior"}
    pooled = SR.steer_bar(RunConfig.of({"probes": {"steer_bar": "pooled"}}), lm, tmp_path, {}, dev)
    assert pooled["kind"] == "pooled" and pooled["bar"] is None


# -- the DPO-pair mining set ------------------------------------------------------------------------------
def test_dpo_pair_mining_set_is_the_fold_s_tool_wrong_training_hops(bench):
    cfg = RunConfig.of({"finetune": {"train_questions_per_fold": 20, "train_formulations": ["reference"]},
                        "probes": {"mining_set": "dpo_pairs", "mine_fold": 1}})
    plans, examples = crossfit.plan(cfg, bench)
    keys = SR.pair_hop_keys(cfg)
    assert keys == {(e.question_id, e.formulation) for e in examples[1] if e.condition == "tool_wrong"}
    assert 0 < len(keys) <= 20
    in_pairs = sorted(keys)[:3]
    fold1 = {q.id: q for q in bench.questions if q.fold == 1}
    other = next(q for q in fold1.values() if (q.id, "reference") not in keys)
    rows = [{"question_id": q, "instance_id": fold1[q].instance_id, "fold": 1, "formulation": f, "outcome": M.TOOL}
            for q, f in in_pairs]
    rows += [{"question_id": other.id, "instance_id": other.instance_id, "fold": 1, "formulation": "reference",
              "outcome": M.TOOL},
             {"question_id": in_pairs[0][0], "instance_id": fold1[in_pairs[0][0]].instance_id, "fold": 1,
              "formulation": "paraphrase_a", "outcome": M.TOOL}]     # a formulation the pairs were not built on
    mine, _, info = SR.mining_rows(cfg, rows, bench.questions)
    assert [(r["question_id"], r["formulation"]) for r in mine] == in_pairs
    assert info["mining_set"] == "dpo_pairs" and info["n_pair_hops"] == len(keys) and info["n_mine"] == 3
    fold_cfg = RunConfig.of({"probes": {"mine_fold": 1}})
    assert len(SR.mining_rows(fold_cfg, rows, bench.questions)[0]) == 5
    with pytest.raises(ConfigError, match="probes.mine_fold"):
        SR.pair_hop_keys(RunConfig.of({"finetune": {"folds": [0]}, "probes": {"mining_set": "dpo_pairs",
                                                                              "mine_fold": 1}}))


# -- the probe with an arm, end to end on a tiny model ----------------------------------------------------
def _episode(i: int, fold: int, outcome: str) -> dict:
    value = ["Paris", "Rome", "Oslo", "Lima", "Bern", "Kyiv"][i % 6]
    out = {"result": value}
    return {"question_id": f"{i}.1", "episode_id": f"{i}-1-tool_wrong-v0", "instance_id": i, "fold": fold,
            "formulation": "reference", "condition": "tool_wrong", "frame": "schema", "outcome": outcome,
            # the two labels end on different text, so the last position's codes can separate them
            "prompt": f"Tool output: {json.dumps(out)}\nQuestion {i}: which city{'?' if outcome == M.MEMORY else ' ~~ !!'}",
            "tool_output": out,
            "tool_value": value, "gold": "Madrid", "gold_kind": "place", "memory_span": "Madrid", "response": ""}


def test_run_sae_steers_a_multi_layer_arm_beside_the_single_layer(tmp_path):
    lm = tiny_lm(seed=1, layers=4)
    # mining halves are alternate questions in id order: label pairs of them so each half has both labels
    order = sorted(range(10, 26), key=lambda i: f"{i}.1")
    rows = [_episode(i, 0, (M.MEMORY, M.TOOL)[(order.index(i) // 2) % 2]) for i in range(10, 26)]
    rows += [_episode(100 + i, 1, (M.MEMORY, M.TOOL)[i % 2]) for i in range(4)]
    cfg = RunConfig.of({"max_new_tokens": 4, "probes": {
        "fvu_gate": 1e9, "sae_steps": 5, "sae_prompts": 8, "sae_heldout_prompts": 2, "mine_per_label": 4,
        "top_features": 2, "positions": ["last"], "strengths": [4],
        "arms": {lm.name: [{"layers": "band", "position": "tool_span"}]}}})
    _, info = corpus.load_corpus()
    res = SR.run_sae(lm, cfg, rows, [], tmp_path, ["text " * 50], info, {}, [1, 2])
    assert sorted(res["layers"]) == ["1", "2"]                   # the single layer (band middle: 2) and the arm's
    assert res["arms"]["L1-2@tool_span"]["layers"] == [1, 2] and res["arms"]["L1-2@tool_span"]["passes_gate"]
    steer = res["steer"]
    assert steer["bar"]["kind"] == "dev_flip" and steer["bar"]["bar"] is None and "2" in steer   # no 03 files here
    arm = steer["arms"]["L1-2@tool_span"]
    assert arm.get("layers") == [1, 2], (arm, res["mining"])
    for d in ("to_memory", "to_tool"):
        assert arm[d]["n"] == 2 and arm[d]["tool_span"]["4"]["n"] == 2 and arm[d]["baseline"]["n"] == 2
    from memtoc.stages.probes.plots import steer_table
    table = steer_table({"models": {lm.name: {"sae": res}}})
    assert set(table["edit"]) == {"L2", "L1-2@tool_span"} and set(table["position"]) == {"last", "tool_span"}


def test_paper_params_run_app_c_recipe_and_the_dry_run_counts_its_dictionaries():
    from memtoc.config.params import load_params
    from memtoc.core.project import REPO_ROOT
    from memtoc.generation import models
    from memtoc.run import dryrun
    cfg = RunConfig.of(load_params(REPO_ROOT / "params" / "paper.yaml"))
    pr = cfg.probes
    assert pr.mining_set == "dpo_pairs" and pr.steer_bar == "dev_flip" and pr.feature_mi_share == 0.5
    assert pr.arms["gemma-2-9b-it"] == [{"layers": [23, 24, 25, 26], "position": "last"},
                                        {"layers": "band", "position": "tool_span"}]
    gemma, qwen = models.get_model("gemma-2-9b-it"), models.get_model("qwen2.5-7b-instruct")
    # gemma: band 10-38 (29 layers) holds the single layers 20, 23 and the arm 23-26; qwen: one layer, no arm
    assert dryrun.steering_plan(gemma, pr) == (29, 2, 2)
    assert dryrun.steering_plan(qwen, pr) == (1, 1, 0)
    one = RunConfig.of({"probes": {"arms": {}}}).probes
    assert dryrun.probes_seconds(gemma, pr, 100) > dryrun.probes_seconds(gemma, RunConfig.of(
        load_params(REPO_ROOT / "params" / "paper.yaml") | {"probes": {**pr.to_dict(), "arms": {}}}).probes, 100)
    assert dryrun.steering_plan(gemma, one) == (1, 1, 0)
    # the released dictionaries cover the last-position arms' layers (Llama Scope 12-15, GemmaScope PT 23-26)
    for model, arm in (("llama-3.1-8b-instruct", [12, 13, 14, 15]), ("gemma-2-9b-it", [23, 24, 25, 26])):
        assert pr.arms[model][0]["layers"] == arm and set(arm) <= set(pr.sae_files[model])
        assert all(str(v).startswith("hf://") for v in pr.sae_files[model].values())
    # the published lens is read, not fitted: no fit time for gemma, the fit for the base Llama
    assert pr.lens_files["gemma-2-9b-it"] == "published" and "llama-3.1-8b" not in pr.lens_files
    fitted = RunConfig.of({"probes": {**pr.to_dict(), "lens_files": {}, "models": None}}).probes
    assert dryrun.probes_seconds(gemma, fitted, 100) - dryrun.probes_seconds(gemma, pr, 100) > 3600


def test_run_sae_reads_a_given_dictionary_beside_a_trained_one(tmp_path):
    import numpy as np

    from memtoc.stages.probes import dictionaries as D
    lm = tiny_lm(seed=1, layers=4)
    order = sorted(range(10, 26), key=lambda i: f"{i}.1")
    rows = [_episode(i, 0, (M.MEMORY, M.TOOL)[(order.index(i) // 2) % 2]) for i in range(10, 26)]
    g = torch.Generator().manual_seed(3)
    given = tmp_path / "gemmascope" / "layer_2"
    given.mkdir(parents=True)
    np.savez(given / D.GEMMASCOPE_FILE, W_enc=torch.randn(16, 24, generator=g).numpy(),
             b_enc=np.zeros(24, np.float32), threshold=np.full(24, 0.1, np.float32),
             W_dec=torch.randn(24, 16, generator=g).numpy(), b_dec=np.zeros(16, np.float32))
    cfg = RunConfig.of({"max_new_tokens": 4, "model_cache_dir": str(tmp_path / "cache"), "probes": {
        "fvu_gate": 1e9, "sae_steps": 5, "sae_prompts": 8, "sae_heldout_prompts": 2, "mine_per_label": 4,
        "top_features": 2, "positions": ["last"], "strengths": [4], "directions": ["to_memory"],
        "sae_files": {lm.name: {2: str(given)}}, "arms": {lm.name: [{"layers": [1, 2]}]}}})
    _, info = corpus.load_corpus()
    res = SR.run_sae(lm, cfg, rows, [], tmp_path, ["text " * 50], info, {}, [1, 2])
    two, one = res["layers"]["2"], res["layers"]["1"]
    assert two["source"] == "given" and two["layout"] == "gemmascope" and two["url"] is None
    assert list(two["sha256"]) == [D.GEMMASCOPE_FILE] and one["source"] == "trained here"
    assert res["dictionary"]["used"] == {1: "trained here", 2: "given"}
    bad = RunConfig.of({"probes": {**cfg.probes.to_dict(), "sae_files": {lm.name: {1: str(given)}}}})
    with pytest.raises(ConfigError, match=r"probes.sae_files.*\.1: .* d_in = 16|reads d_in"):
        SR.run_sae(tiny_lm(seed=1, layers=4, d=8), bad, rows, [], tmp_path, ["text " * 50], info, {}, [1, 2])
