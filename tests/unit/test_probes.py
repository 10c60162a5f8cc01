"""memtoc.stages.probes: Jacobian lens, TopK SAE, mining splits, steering edits (tiny random models)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memtoc.config.runconfig import RunConfig
from memtoc.core.errors import ConfigError
from memtoc.core.vocab import POSITIONS
from memtoc.stages.probes import (
    core,
    corpus,
    dictionaries,
    lens as L,
    mining as M,
    sae as S,
    saerun as SR,
    steering as ST,
)
from memtoc.stages.probes.hfmodel import residuals, unembed, wrap_model


class CharTokenizer:
    """A byte-level stand-in tokenizer (ids 3..258 = bytes, 1 = BOS, 2 = EOS) with offsets."""

    eos_token_id = 2
    chat_template = None

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        b = text.encode("utf-8")
        ids = ([1] if add_special_tokens else []) + [3 + x for x in b]
        out = {"input_ids": ids}
        if return_offsets_mapping:
            off = [(0, 0)] if add_special_tokens else []
            out["offset_mapping"] = off + [(i, i + 1) for i in range(len(b))]
        return out

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", "replace")


def tiny_lm(seed: int = 0, layers: int = 3, d: int = 16):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=260, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=2, bos_token_id=1)
    return wrap_model(LlamaForCausalLM(cfg).float(), CharTokenizer())


# -- lens ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers", [[0, 1], [1]])
def test_lens_estimator_equals_brute_force_jacobian(layers):
    lm = tiny_lm(layers=3)
    ids = [1, 40, 50, 60, 70, 80, 90, 100, 33]
    J = L.jacobian_for_prompt(lm, ids, layers, dim_batch=5, skip_first=2)
    for l in layers:
        bf = L.brute_force_jacobian(lm, ids, l, skip_first=2)
        assert bf.abs().max() > 0.1
        assert torch.allclose(J[l], bf, atol=1e-5), (l, (J[l] - bf).abs().max())


def test_identity_lens_reproduces_model_logits_at_last_block():
    lm = tiny_lm()
    ids = [1, 10, 20, 30, 40]
    res, logits = residuals(lm, ids, [2])
    assert torch.allclose(L.lens_logits(lm, res[2], None), logits, atol=1e-5)
    eye = L.identity_lens(lm.d_model, [2])
    assert torch.allclose(L.lens_logits(lm, res[2], eye.J[2]), logits, atol=1e-5)
    # an earlier layer read through the identity is not the model's output
    res1, _ = residuals(lm, ids, [0])
    assert not torch.allclose(unembed(lm.model, res1[0]), logits, atol=1e-3)


def test_fit_lens_artifact_layout_resume_and_ranks(tmp_path):
    lm = tiny_lm()
    texts = ["alpha beta gamma delta", "epsilon zeta eta theta", "iota kappa lambda mu"]
    out = tmp_path / "lens"
    lens2 = L.fit_lens(lm, texts[:2], [0, 1], out, max_seq_len=12, skip_first=2, dim_batch=8)
    p = torch.load(out / L.LENS_FILE, weights_only=True)
    assert set(p) >= {"J", "n_prompts", "source_layers", "d_model"} and p["n_prompts"] == 2
    # resume: a checkpoint after 2 prompts + one more text gives the 3-prompt mean
    (out / L.LENS_FILE).unlink()
    lens3 = L.fit_lens(lm, texts, [0, 1], out, max_seq_len=12, skip_first=2, dim_batch=8)
    one = L.jacobian_for_prompt(lm, lm.encode_text(texts[2], 12), [0, 1], 8, 2)
    assert lens3.n_prompts == 3
    assert torch.allclose(lens3.J[0], (2 * lens2.J[0] + one[0]) / 3, atol=1e-5)
    assert L.load_lens(out / L.CHECKPOINT_FILE).n_prompts == 3
    logits = torch.tensor([0.5, 3.0, 1.0, 3.0])
    assert L.ranks_of(logits, [1, 0, 2]) == [1, 4, 3]


def test_load_lens_errors(tmp_path):
    with pytest.raises(L.LensError, match="does not exist"):
        L.load_lens(tmp_path / "none.pt")
    torch.save({"x": 1}, tmp_path / "bad.pt")
    with pytest.raises(L.LensError, match="neither a lens artifact"):
        L.load_lens(tmp_path / "bad.pt")


# -- SAE -----------------------------------------------------------------------------------------
def test_fvu_identity_is_zero_and_mean_is_one():
    x = torch.randn(200, 8)
    assert S.fvu(x, x) == 0.0
    assert abs(S.fvu(x, x.mean(0, keepdim=True).expand_as(x)) - 1.0) < 1e-12


def test_topk_trainer_recovers_planted_dictionary(tmp_path):
    g = torch.Generator().manual_seed(1)
    d, m, k, n = 16, 24, 2, 6000
    D = torch.randn(m, d, generator=g)
    D /= D.norm(dim=1, keepdim=True)
    idx = torch.stack([torch.randperm(m, generator=g)[:k] for _ in range(n)])
    Z = torch.zeros(n, m).scatter(1, idx, torch.rand(n, k, generator=g) * 2 + 0.5)
    X = Z @ D
    sae, info = S.train_topk(X, d_sae=48, k=k, steps=500, batch=256, lr=3e-3, seed=0)
    best = (D @ sae.W_dec.T).max(1).values
    assert (best > 0.95).all(), best
    m_ = S.metrics(sae, X)
    assert m_["fvu"] < 0.1 and m_["passes_gate"] and m_["l0"] <= k
    path = S.save_sae(sae, tmp_path / "sae", model_name="tiny", layer=3)
    cfg = json.loads((path / S.CFG_FILE).read_text())
    assert cfg["architecture"] == "topk" and cfg["metadata"]["hook_name"] == "blocks.3.hook_resid_post"
    again, _ = dictionaries.load_sae(path)
    assert torch.equal(again(X[:10]), sae(X[:10]))


# -- mining --------------------------------------------------------------------------------------
def test_mutual_information_and_mining_sides():
    y = torch.tensor([True, True, False, False] * 10)
    act = torch.stack([y, ~y, torch.ones_like(y)], 1)
    mi = M.mutual_information(act, y)
    assert abs(float(mi[0]) - math.log(2)) < 1e-9 and abs(float(mi[2])) < 1e-12
    z = act.float() * 2.0
    feats = M.mine_features(z, ["kept_memory" if v else "followed_tool" for v in y], z,
                            ["kept_memory" if v else "followed_tool" for v in y], top=2)
    assert [f.index for f in feats[M.MEMORY]] == [0] and [f.index for f in feats[M.TOOL]] == [1]
    assert feats[M.MEMORY][0].agrees is True and feats[M.MEMORY][0].mean_act == 2.0


def test_mi_budget_is_the_fewest_latents_holding_the_share():
    assert M.mi_budget([4, 3, 2, 1], 0.5) == 2          # 7 of 10 >= 5; 4 alone is not
    assert M.mi_budget([4, 3, 2, 1], 0.4) == 1          # exactly the share
    assert M.mi_budget([4, 3, 2, 1], 0.7) == 2 and M.mi_budget([4, 3, 2, 1], 0.71) == 3
    assert M.mi_budget([4, 3, 2, 1], 1.0) == 4
    assert M.mi_budget([], 0.5) == 0 and M.mi_budget([0.0, 0.0], 0.5) == 0


def test_mining_by_mi_share_takes_each_sides_budget():
    g = torch.Generator().manual_seed(0)
    y = torch.rand(200, generator=g) < 0.5
    noise = torch.rand(200, 12, generator=g)
    # latents 0-5 follow the label with falling reliability (memory side: 0-2, tool side: 3-5), 6-11 are noise
    flip = torch.stack([noise[:, j] < p for j, p in enumerate((0.02, 0.1, 0.3, 0.02, 0.15, 0.35))], 1)
    sig = torch.cat([(y[:, None] ^ flip[:, :3]), (~y[:, None] ^ flip[:, 3:])], 1)
    z = torch.cat([sig.float(), (noise[:, 6:] < 0.5).float()], 1)
    lab = ["kept_memory" if v else "followed_tool" for v in y]
    mi = M.mutual_information(z > 0, y)
    by_top = M.mine_features(z, lab, z, lab, top=12)
    for share in (0.3, 0.5, 0.7, 1.0):
        got = M.mine_features(z, lab, z, lab, mi_share=share)
        for side in (M.MEMORY, M.TOOL):
            ranked = [f.index for f in by_top[side]]
            k = M.mi_budget([float(mi[i]) for i in ranked], share)
            assert [f.index for f in got[side]] == ranked[:k]
    assert [f.index for f in by_top[M.MEMORY]][:3] == [0, 1, 2] and [f.index for f in by_top[M.TOOL]][:3] == [3, 4, 5]
    assert len(M.mine_features(z, lab, z, lab, mi_share=0.3)[M.MEMORY]) < len(by_top[M.MEMORY])


def test_mining_and_edit_sets_share_no_chain(release_questions):
    qs = release_questions
    rows = [{"question_id": q.id, "instance_id": q.instance_id, "fold": q.fold, "episode_id": q.id} for q in qs]
    mine, edit, info = M.split_folds(rows, qs, mine_fold=0)
    assert mine and edit
    assert not ({r["instance_id"] for r in mine} & {r["instance_id"] for r in edit})
    from memtoc.stages.construction import related_links
    mi, ed = {r["question_id"] for r in mine}, {r["question_id"] for r in edit}
    for ln in related_links(qs):
        assert not (ln["gold_id"] in mi and ln["subject_id"] in ed)
        assert not (ln["gold_id"] in ed and ln["subject_id"] in mi)
    with pytest.raises(M.SplitError):
        M.assert_disjoint(mine, edit + mine[:1], qs)


@pytest.fixture(scope="module")
def release_questions():
    from memtoc.data.benchmark import load_benchmark
    return load_benchmark().questions


# -- steering ------------------------------------------------------------------------------------
def _greedy(lm, prompt: str, n: int) -> str:
    ids = lm.encode_prompt(prompt)
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=2,
                            pad_token_id=2)
    return lm.tokenizer.decode(out[0, len(ids):].tolist())


def test_strength_zero_edit_leaves_greedy_replies_byte_identical(tmp_path):
    lm = tiny_lm(seed=3)
    sae = S.TopKSAE(lm.d_model, 32, 4)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn_like(p))
    prompts = ['Tool output: {"result": "Paris"}\nQuestion: capital?\n', 'Tool output: {"result": "1999"}\nQ: year?\n']
    spans = {p: p.split("Tool output: ")[1].split("\n")[0] for p in prompts}
    plain = [_greedy(lm, p, 12) for p in prompts]
    for pos in POSITIONS:
        edit0 = ST.Edit(1, "to_memory", pos, 0.0, (0, 1), (5.0, 5.0), (2, 3))
        gen = ST.SteeredGenerator(lm, [(sae, ST.sae_sha256(sae), edit0)], spans, max_new_tokens=12, stop_at_final=False)
        replies = gen.generate(prompts, cache_path=tmp_path / "r.jsonl")
        assert [r.text for r in replies] == plain
    # a real edit changes the residual stream at exactly the edited positions
    h = torch.randn(1, 6, lm.d_model)
    e = ST.Edit(1, "to_memory", "last", 8.0, (0,), (50.0,), ())
    out = ST.apply_edit(sae, h, [5], e)
    assert torch.equal(out[0, :5], h[0, :5]) and not torch.equal(out[0, 5], h[0, 5])
    # replies are cached: a second call reads them
    again = ST.SteeredGenerator(lm, [(sae, ST.sae_sha256(sae), edit0)], spans, max_new_tokens=12, stop_at_final=False)
    assert all(r.cached for r in again.generate(prompts, cache_path=tmp_path / "r.jsonl"))


def test_tool_span_positions_cover_the_tool_output():
    lm = tiny_lm()
    p = 'x Tool output: {"result": "Paris"}\nQ?\n'
    ids, pos = ST.edit_positions(lm, p, "tool_span", '{"result": "Paris"}')
    text = bytes(i - 3 for i in ids if i >= 3).decode()
    assert text[pos[0] - 1: pos[-1]] == '{"result": "Paris"}'


def test_steering_cell_and_bar():
    def sc(ft, km, out):
        return {"followed_tool": ft, "kept_memory": km, "outcome": out,
                "degeneration": {"any": False, "no_final": False, "repetition": False, "schema_echo": False}}
    base = [sc(True, False, "followed_tool")] * 4
    steered = [sc(False, True, "kept_memory"), sc(False, False, "neither")] + [sc(True, False, "followed_tool")] * 2
    c = ST.cell("to_memory", base, steered, bar=0.2)
    assert c["flip_rate"]["value"] == 0.25 and c["delta_followed_tool"] == -0.5 and c["delta_kept_memory"] == 0.25
    assert c["lands_on_neither"]["value"] == 0.25 and c["clears_bar"] is True
    ev = {"models": {"m": {"prompting": {"warn": {"contrasts": {"wrong_follow": {"delta": -0.1}}},
                                         "prior": {"contrasts": {"wrong_follow": {"delta": -0.3}}}}}}}
    b = ST.prompting_bar(ev, "m")
    assert b["arm"] == "prior" and abs(b["bar"] - 0.15) < 1e-12
    assert ST.prompting_bar({}, "m")["bar"] is None
    # every prompting arm of the vocabulary takes part (a new arm cannot drop out of the bar)
    from memtoc.core.vocab import PROMPTING_ARMS
    for best in PROMPTING_ARMS:
        ev = {"models": {"m": {"prompting": {a: {"contrasts": {"wrong_follow": {"delta": -0.5 if a == best else -0.1}}}
                                             for a in PROMPTING_ARMS}}}}
        assert ST.prompting_bar(ev, "m")["arm"] == best
    assert ST.degeneration("a b c d a b c d a b c d")["repetition"]
    assert ST.degeneration('{"parameters": 1}\nFINAL: x')["schema_echo"]


# -- params, corpus, sets -----------------------------------------------------------------------
def test_probes_params_validation():
    assert RunConfig.of({}).probes.strengths == (12,) and RunConfig.of({}).probes.to_dict()["strengths"] == [12]
    with pytest.raises(ConfigError, match="unknown probes key"):
        RunConfig.of({"probes": {"nope": 1}}).probes
    with pytest.raises(ConfigError, match="directions"):
        RunConfig.of({"probes": {"directions": ["sideways"]}}).probes
    with pytest.raises(ConfigError, match="strengths"):
        RunConfig.of({"probes": {"strengths": [0]}}).probes
    assert RunConfig.of({"probes": {"feature_mi_share": 0.5}}).probes.feature_mi_share == 0.5
    for bad in (0, 1.5, "half", True):
        with pytest.raises(ConfigError, match=r"probes\.feature_mi_share.*\(0, 1\]"):
            RunConfig.of({"probes": {"feature_mi_share": bad}}).probes


def test_corpus_builtin_and_file(tmp_path):
    docs, info = corpus.load_corpus()
    assert info.source == "builtin" and info.n_documents == len(docs) > 10
    f = tmp_path / "c.txt"
    f.write_text(("word " * 60 + "\n\n") * 3, encoding="utf-8")
    docs2, info2 = corpus.load_corpus(str(f))
    assert info2.source == "file" and len(docs2) == 3
    fit, held = corpus.split_corpus(docs, 3, 2)
    assert not set(fit) & set(held)
    with pytest.raises(ConfigError, match="neither 'builtin'"):
        corpus.load_corpus(str(tmp_path / "missing.txt"))


def test_episode_sets():
    rows = [{"cell": "arb", "memory_span": "Paris", "mem_absent": False, "tool_value": "Lyon", "outcome": "kept_memory"},
            {"cell": "both_wrong", "memory_span": "Rome", "mem_absent": False, "tool_value": "Rome", "outcome": "both"},
            {"cell": "mem_absent", "memory_span": "", "mem_absent": True, "tool_value": "X", "outcome": "followed_tool"}]
    s = core.episode_sets(rows)
    assert len(s["arbitration"]) == 1 and len(s["own_answer"]) == 1


def test_lens_set_on_tiny_model():
    lm = tiny_lm()
    eps = [{"question_id": f"q{i}", "memory_span": a, "prompt": f"Question {i}?", "outcome": o}
           for i, (a, o) in enumerate([("Paris", "kept_memory"), ("Lyon", "followed_tool"), ("Rome", "followed_tool")])]
    lens = L.identity_lens(lm.d_model, [0, 1])
    out = core.lens_set(lm, lens, [0, 1], eps, n_control=2)
    assert out["n_episodes"] == 3
    for r in L.READOUTS:
        assert out[r]["kept_memory"]["n"] == 1 and out[r]["followed_tool"]["n"] == 2
        assert out[r]["control"]["n"] == 6
    # identity J: the two readouts agree
    assert out["jacobian"]["followed_tool"] == out["logit"]["followed_tool"]


def test_published_blocks():
    pub = core.published()
    assert "lens_table8" in pub and "sae_appendix_c" in pub


def test_pipeline_skips_05_when_probes_disabled(tmp_path):
    from memtoc.run import pipeline
    d = tmp_path / "nb"
    d.mkdir()
    (d / "05_probes.ipynb").write_text("{}")
    P = RunConfig.load(None, overrides={"probes": {"enabled": False}})
    s5 = next(s for s in pipeline.plan(P, None, d) if s.number == "05")
    assert not s5.run and "probes.enabled" in s5.reason
    assert next(s for s in pipeline.plan(RunConfig.load(None), None, d) if s.number == "05").run


def test_run_sae_skips_with_too_few_mining_episodes(tmp_path):
    rows = [{"question_id": "1.1", "instance_id": 1, "fold": 0, "prompt": "p", "outcome": "kept_memory"},
            {"question_id": "2.1", "instance_id": 2, "fold": 1, "prompt": "q", "outcome": "followed_tool"}]
    _, info = corpus.load_corpus()
    res = SR.run_sae(tiny_lm(), RunConfig.of({}), rows, [], tmp_path, ["text " * 50], info, {}, [1])
    assert res["layers"] == {} and "too few mining-set" in res["steer"]["skipped"]


def test_lens_estimator_on_a_tiny_gemma3_with_sliding_window():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                           sliding_window=4, layer_types=["sliding_attention"] * 3 + ["full_attention"])
    model = Gemma3ForCausalLM(cfg).float()
    model.config._attn_implementation = "eager"
    lm = wrap_model(model, None)
    ids = [2, 5, 7, 9, 3, 22, 11, 4, 8, 9]
    J = L.jacobian_for_prompt(lm, ids, [1, 2], dim_batch=5, skip_first=2)
    for l in (1, 2):
        assert torch.allclose(J[l], L.brute_force_jacobian(lm, ids, l, skip_first=2), atol=1e-5)
    assert torch.allclose(L.jacobian_for_prompt(lm, ids, [0, 2], 16, 2)[2], J[2], atol=1e-6)


def test_the_lens_figure_says_which_models_and_lenses_it_shows():
    from memtoc.stages.probes.plots import lens_provenance
    fitted = {"lens_fit": {"source": "fitted here", "corpus": {"name": "python-pydoc_data-topics", "source": "builtin"}}}
    assert lens_provenance({"models": {"smollm2-135m-instruct": fitted, "gemma-3-270m": fitted}}) == \
        "tiny model, offline fit corpus"
    wiki = {"lens_fit": {"source": "fitted here", "corpus": {"name": "wikitext-103", "source": "file"}}}
    got = lens_provenance({"models": {"llama-3.1-8b-instruct": {"lens_fit": {"source": "given"}},
                                      "qwen2.5-7b-instruct": wiki}})
    assert got == "registry models, given lens, lens fitted on wikitext-103" and "tiny" not in got
    assert lens_provenance({"models": {"smollm2-135m-instruct": fitted, "gemma-2-9b-it": fitted}}).startswith(
        "tiny and registry models")


def test_a_bfloat16_model_runs_every_probe_in_float32_read_outs(tmp_path):
    """probes.dtype bfloat16 (half the memory: the 40 GB route): read-outs, the SAE's reconstruction spliced
    back in, and steering edits all run on a bfloat16 model (replacements cast back to its dtype, read-outs
    in float32); a strength-0 edit leaves its greedy replies unchanged; the replies' cache identity records
    the dtype, so a float32 sweep's replies are never reused for it."""
    lm32 = tiny_lm(seed=3)
    lm = tiny_lm(seed=3)
    lm.model.to(torch.bfloat16)
    lm.dtype = "bfloat16"
    res, logits = residuals(lm, lm.encode_text("Question 1? Paris", 16), [0, 1])
    assert res[0].dtype == torch.float32 and logits.dtype == torch.float32
    assert unembed(lm.model, res[1]).dtype == torch.float32
    eps = [{"question_id": f"q{i}", "memory_span": a, "prompt": f"Question {i}?", "outcome": o}
           for i, (a, o) in enumerate([("Paris", "kept_memory"), ("Lyon", "followed_tool")])]
    out = core.lens_set(lm, L.identity_lens(lm.d_model, [0, 1]), [0, 1], eps, n_control=2)
    assert out["jacobian"]["followed_tool"]["n"] == 1
    sae = S.TopKSAE(lm.d_model, 32, 4)
    assert math.isfinite(S.spliced_loss(lm, [lm.encode_text("Question 2? Lyon", 16)], 1, sae)["increase"])
    acts = S.layer_acts(lm, [lm.encode_text("Question 3? Rome", 16)], 1)
    assert acts[0].dtype == torch.float32
    prompts = ['Tool output: {"result": "Paris"}\nQuestion: capital?\n']
    spans = {prompts[0]: '{"result": "Paris"}'}
    plain = [_greedy(lm, p, 8) for p in prompts]
    edit0 = ST.Edit(1, "to_memory", "last", 0.0, (0, 1), (5.0, 5.0), (2, 3))
    gen = ST.SteeredGenerator(lm, [(sae, ST.sae_sha256(sae), edit0)], spans, max_new_tokens=8, stop_at_final=False)
    assert [r.text for r in gen.generate(prompts, cache_path=tmp_path / "r.jsonl")] == plain
    edit = ST.Edit(1, "to_memory", "last", 12.0, (0, 1), (5.0, 5.0), (2, 3))
    ST.SteeredGenerator(lm, [(sae, ST.sae_sha256(sae), edit)], spans, max_new_tokens=8,
                        stop_at_final=False).generate(prompts, cache_path=tmp_path / "r.jsonl")
    g32 = ST.SteeredGenerator(lm32, [(sae, ST.sae_sha256(sae), edit0)], spans, max_new_tokens=8, stop_at_final=False)
    assert gen.identity["dtype"] == "bfloat16" and "dtype" not in g32.identity


def test_probes_models_and_dtype_are_checked():
    run = {"models": ["smollm2-135m-instruct", "gemma-3-270m"]}
    assert RunConfig.of(run).probes.models == ("smollm2-135m-instruct", "gemma-3-270m")
    assert RunConfig.of({**run, "probes": {"models": ["gemma-3-270m"]}}).probes.models == ("gemma-3-270m",)
    with pytest.raises(ConfigError, match=r"probes\.models.*drawn from the run's models"):
        RunConfig.of({**run, "probes": {"models": ["llama-3.1-8b"]}}).probes
    with pytest.raises(ConfigError, match=r"probes\.dtype.*float32, bfloat16"):
        RunConfig.of({**run, "probes": {"dtype": "float16"}}).probes
    with pytest.raises(ConfigError, match=r"probes\.dtype.*needs a lens.*\['gemma-3-270m'\]"):
        RunConfig.of({**run, "probes": {"dtype": "bfloat16", "lens_files": {"smollm2-135m-instruct": "/x/lens.pt"}}}).probes
    assert RunConfig.of({**run, "probes": {"dtype": "bfloat16", "enabled": False}}).probes.dtype == "bfloat16"
    ok = RunConfig.of({**run, "probes": {"dtype": "bfloat16", "models": ["smollm2-135m-instruct"],
                                         "lens_files": {"smollm2-135m-instruct": "/x/lens.pt"}}}).probes
    assert ok.dtype == "bfloat16"
