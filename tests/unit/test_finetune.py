"""Fine-tuning: parameters, pair construction, cross-fitting without leakage, paired deltas (pure, fast)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from memtoc.config.params import FORMULATIONS, load_params
from memtoc.config.runconfig import RunConfig
from memtoc.core.errors import ConfigError
from memtoc.core.metrics import synthetic_arm
from memtoc.core.records import Question
from memtoc.data.benchmark import select_questions
from memtoc.generation.models import attention_implementation
from memtoc.stages import finetune as F


def _q(i: int, chain: int, fold: int, excluded: bool = False, far: str | None = "Far Town") -> Question:
    return Question(id=f"{chain}.{i}", instance_id=chain, hop_idx=i, qkey=f"q{chain}x{i}",
                    question=f"Where was person {chain}-{i} born?", gold=f"Gold City {i}",
                    gold_kind="place", family="birth_death_place", near=f"Near City {i}",
                    near_original=f"Near City {i}", far=far, excluded=excluded, fold=fold)


# ----------------------------------------------------------------------------------------------
# parameters

def test_defaults_are_the_paper_configuration():
    ft = RunConfig.of(load_params(None)).finetune
    assert ft["lora_r"] == 16 and ft["lora_alpha"] == 32 and ft["epochs"] == 1 and ft["dpo_beta"] == 0.1
    assert ft["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert ft["objectives"] == ["sft", "dpo"] and ft["folds"] == [0, 1]
    assert ft["train_formulations"] == ["reference"]          # the paper trains on the Reference formulation
    assert ft["learning_rate"] == 1e-5                        # the paper's learning rate
    assert ft["exclude_linked"] is False and ft["backend_options"] == {}
    assert ft["seed"] == load_params(None)["seed"]
    # null still means the run's formulations
    every = RunConfig.of(load_params(None, overrides={"finetune": {"train_formulations": None}})).finetune
    assert every["train_formulations"] == list(FORMULATIONS)


def test_paper_params_train_like_the_paper_within_40_gb():
    ft = RunConfig.of(load_params("params/paper.yaml")).finetune
    assert ft["learning_rate"] == 1e-5 and ft["train_formulations"] == ["reference"]
    assert ft["gradient_checkpointing"] is True
    assert ft["batch_size"] * ft["grad_accum"] == 8 and ft["batch_size"] <= 4     # effective batch 8
    assert ft["train_dtype"] == "bfloat16"
    for name in ("params/default.yaml", "params/finetune.yaml", "params/smoke.yaml"):   # embedded model
        assert RunConfig.of(load_params(name)).finetune["learning_rate"] == 1e-4, name


def test_paper_params_give_04_transformers_options_only():
    """A vLLM run's engine options never reach TransformersGenerator: 04's generator arguments,
    built from params/paper.yaml without loading weights, are all TransformersGenerator's."""
    import inspect

    from memtoc.generation.backends.hf import TransformersGenerator
    from memtoc.generation.models import load_generator
    P = RunConfig.load("params/paper.yaml")
    assert P["backend"] == "vllm" and "gpu_memory_utilization" in P["backend_options"]
    kw = F.eval_generator_kwargs(P)
    assert kw["backend"] == "transformers"
    accepted = set(inspect.signature(TransformersGenerator.__init__).parameters) | \
        set(inspect.signature(load_generator).parameters) | {"model_cache_dir"}
    assert set(kw) <= accepted, set(kw) - accepted
    assert "gpu_memory_utilization" not in kw and "max_model_len" not in kw
    assert kw["dtype"] == "bfloat16"
    # options every backend shares (whole replies vs stop at the FINAL line) follow the run
    Pv = RunConfig.load("params/paper.yaml", overrides={"backend_options": {"gpu_memory_utilization": 0.5,
                                                                         "stop_at_final": False}})
    kv = F.eval_generator_kwargs(Pv)
    assert kv["stop_at_final"] is False and "gpu_memory_utilization" not in kv
    # a transformers run keeps its own options, finetune.backend_options on top
    Pt = RunConfig.load(None, overrides={"backend_options": {"token_budget": 4096, "decode": "compact"},
                                      "finetune": {"backend_options": {"token_budget": 2048}}})
    kt = F.eval_generator_kwargs(Pt)
    assert kt["token_budget"] == 2048 and kt["decode"] == "compact"
    with pytest.raises(ConfigError, match="finetune.backend_options"):
        RunConfig.of(load_params(None, overrides={"finetune": {"backend_options": [1]}})).finetune


def test_eval_backend_vllm_serves_the_adapters_on_one_engine():
    """``finetune.eval_backend: vllm``: the vLLM backend with LoRA serving at the rank of the stage's
    adapters (lora_r rounded up to a rank vLLM accepts); a vLLM run's engine options are kept (the same
    engine as 03's), a transformers run's options are not carried over; anything else is refused."""
    import inspect

    from memtoc.generation.backends.vllm import VLLMGenerator
    with pytest.raises(ConfigError, match=r"finetune.backend_options.*\['token_budget'\] are options of the transformers"):
        F.eval_generator_kwargs(RunConfig.load("params/paper.yaml", overrides={"finetune": {"eval_backend": "vllm"}}))
    P = RunConfig.load("params/paper.yaml", overrides={"finetune": {"eval_backend": "vllm", "lora_r": 12,
                                                                    "backend_options": None}})
    kw = F.eval_generator_kwargs(P)
    assert kw["backend"] == "vllm" and kw["enable_lora"] is True and kw["max_lora_rank"] == 16
    assert kw["gpu_memory_utilization"] == 0.85 and kw["dtype"] == "bfloat16"
    assert F.shares_engine(kw) and not F.shares_engine(F.eval_generator_kwargs(RunConfig.load("params/paper.yaml")))
    accepted = set(inspect.signature(VLLMGenerator.__init__).parameters) | {"model_cache_dir", "backend",
                                                                           "enable_lora", "max_lora_rank",
                                                                           "gpu_memory_utilization", "max_model_len"}
    assert set(kw) <= accepted, set(kw) - accepted
    Pt = RunConfig.load(None, overrides={"backend_options": {"token_budget": 4096},
                                      "finetune": {"eval_backend": "vllm"}})
    assert "token_budget" not in F.eval_generator_kwargs(Pt)
    smoke = RunConfig.load("params/smoke-vllm.yaml")
    assert smoke.backend == "vllm" and smoke.finetune.eval_backend == "vllm"
    with pytest.raises(ConfigError, match="finetune.eval_backend.*transformers .*or vllm"):
        RunConfig.of(load_params(None, overrides={"finetune": {"eval_backend": "openai"}})).finetune


def test_warmup_reaches_the_trainer_as_a_ratio(tmp_path):
    assert F.warmup_kwargs(0.1, "4.46.0") == {"warmup_ratio": 0.1, "warmup_steps": 0}
    assert F.warmup_kwargs(0.1, "5.0.0") == {"warmup_steps": 0.1}
    assert F.warmup_kwargs(0.1, "5.24.0") == {"warmup_steps": 0.1}
    assert F.warmup_kwargs(0.0, "5.24.0") == {"warmup_steps": 0}
    from trl import DPOConfig, SFTConfig
    ft = RunConfig.of(load_params(None, overrides={"finetune": {"warmup_ratio": 0.1}})).finetune
    for cls in (SFTConfig, DPOConfig):          # the installed transformers / trl
        args = cls(**F.training_arguments(ft, tmp_path, progress=False))
        assert args.get_warmup_steps(100) == 10 and args.get_warmup_steps(7) == 1
        assert args.gradient_checkpointing is False
    ck = F.training_arguments(dataclasses.replace(ft, gradient_checkpointing=True), tmp_path)
    name = "activation_checkpointing" if "activation_checkpointing" in ck else "gradient_checkpointing"
    assert ck[name] is True and ck[f"{name}_kwargs"] == {"use_reentrant": False}
    assert SFTConfig(**ck).gradient_checkpointing is True
    old = F.training_arguments(dataclasses.replace(ft, gradient_checkpointing=True), tmp_path,
                               arg_names={"gradient_checkpointing"})
    assert old["gradient_checkpointing"] is True and "activation_checkpointing" not in old


def test_softcapping_models_train_with_eager_attention(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM
    cfg = Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    Gemma2ForCausalLM(cfg).save_pretrained(tmp_path / "g2")
    model = F.load_train_model(tmp_path / "g2", RunConfig.of(load_params(None)).finetune)
    assert model.config._attn_implementation == "eager"
    # the rule load_train_model uses (models.attention_implementation with training=True)
    assert Gemma2Config().attn_logit_softcapping
    assert attention_implementation(Gemma2Config(), training=True) == "eager"
    assert attention_implementation(Gemma2Config(), "auto", "cuda", training=True) == "eager"
    assert attention_implementation(LlamaConfig(), training=True) == "sdpa"
    llama = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(llama)
    assert F.load_train_model(llama, RunConfig.of(load_params(None)).finetune).config._attn_implementation == "sdpa"


@pytest.mark.parametrize("bad, field", [
    ({"objectives": ["ppo"]}, "finetune.objectives"),
    ({"learning_rate": 0}, "finetune.learning_rate"),
    ({"folds": [2]}, "finetune.folds"),
    ({"max_steps": 0}, "finetune.max_steps"),
    ({"lora_r": "16"}, "finetune.lora_r"),
    ({"train_formulations": ["nope"]}, "finetune.train_formulations"),
    ({"eval_conditions": ["no_tool"]}, "finetune.eval_conditions"),
    ({"eval_dtype": "int8"}, "finetune.eval_dtype"),
    ({"exclude_linked": "yes"}, "finetune.exclude_linked"),
    ({"lr": 1e-4}, "unknown finetune key"),
])
def test_bad_finetune_params_name_the_field(bad, field):
    with pytest.raises(ConfigError, match=field):
        RunConfig.of(load_params(None, overrides={"finetune": bad})).finetune


def test_training_config_is_shared_by_objectives():
    ft = RunConfig.of(load_params(None)).finetune
    rows = [{"prompt": "p", "completion": "c"}]
    h_sft = F.config_hash("sft", ft, "w", rows)
    assert h_sft == F.config_hash("sft", ft, "w", rows)
    assert h_sft != F.config_hash("dpo", ft, "w", rows)
    assert h_sft != F.config_hash("sft", dataclasses.replace(ft, learning_rate=1e-4), "w", rows)
    assert h_sft != F.config_hash("sft", ft, "w2", rows)
    assert h_sft != F.config_hash("sft", ft, "w", [{"prompt": "p", "completion": "d"}])
    assert h_sft == F.config_hash("sft", dataclasses.replace(ft, enabled=False, eval_questions_per_fold=3), "w", rows)


def test_adapter_config_hashes_are_unchanged_by_the_typed_block(monkeypatch):
    """Finished adapters resume by config hash: the typed block hashes as the resolved dict did
    (values recorded from the dict-based validator, where the training dtype was bfloat16: ``auto``
    resolves to it on a CPU with bf16 instructions, which MEMTOC_CPU_BF16=1 stands for here)."""
    monkeypatch.setenv("MEMTOC_CPU_BF16", "1")
    ft = RunConfig.of(load_params(None)).finetune
    assert F.config_hash("dpo", ft, "w", [{"prompt": "p"}]) == "d5fea04ad5c7c37c"
    ft2 = RunConfig.of(load_params(None, overrides={"finetune": {"learning_rate": 1e-4, "max_steps": 3,
                                                                      "target_modules": "q_proj"}})).finetune
    assert F.config_hash("sft", ft2, "w", [{"prompt": "p"}]) == "c65ad1e2588f60c5"
    assert F.training_config(ft2)["target_modules"] == ["q_proj"] and ft2.target_modules == ("q_proj",)


# ----------------------------------------------------------------------------------------------
# pair construction

def test_pairs_follow_the_paper_rule():
    qs = [_q(0, 1, 0), _q(1, 1, 0)]
    ex = F.training_examples(qs, FORMULATIONS)
    assert len(ex) == 2 * 2 * 3     # two examples per question and formulation
    for e in ex:
        q = next(q for q in qs if q.id == e.question_id)
        assert e.chosen == f"FINAL: {q.gold}" and e.rejected == f"FINAL: {q.near}"
        assert q.question in e.prompt
        if e.condition == "tool_wrong":       # verified answer preferred over the tool's near value
            assert e.tool_value == q.near and f'"result": "{q.near}"' in e.prompt
        else:                                 # the tool value (= gold) preferred over the near value
            assert e.condition == "tool_right"
            assert e.tool_value == q.gold and f'"result": "{q.gold}"' in e.prompt
        assert q.far not in e.prompt + e.chosen + e.rejected   # far values are held out
    assert {e.formulation for e in ex} == set(FORMULATIONS)


def test_pairs_use_the_with_tool_prompts_of_evaluation(bench):
    q = bench.questions[0]
    ex = F.training_examples([q], ["paraphrase_a"])
    eps = F.eval_episodes([q], ["paraphrase_a"], ("tool_right", "tool_wrong"))
    assert sorted(e.prompt for e in ex) == sorted(e.prompt for e in eps)


def test_formulation_subset_and_degenerate_pairs():
    same = dataclasses.replace(_q(2, 2, 0), near="Gold City 2", near_original="Gold City 2")
    ex = F.training_examples([_q(0, 1, 0), same], ["reference"])
    assert {e.question_id for e in ex} == {"1.0"} and len(ex) == 2


def test_sft_and_dpo_rows_share_prompts():
    ex = F.training_examples([_q(0, 1, 0)], ["reference"])
    render = lambda p: f"<user>{p}<assistant>"
    sft, dpo = F.sft_rows(ex, render), F.dpo_rows(ex, render)
    assert [r["prompt"] for r in sft] == [r["prompt"] for r in dpo]
    assert all(r["prompt"].startswith("<user>") for r in sft)
    assert [r["completion"] for r in sft] == [r["chosen"] for r in dpo]
    assert all(r["completion"].startswith("FINAL: ") for r in sft)
    assert all(r["rejected"] != r["chosen"] for r in dpo)


# ----------------------------------------------------------------------------------------------
# cross-fitting

def test_no_evaluated_chain_in_its_adapters_training_data(bench):
    pool = select_questions(bench.analysis, 542)
    plans = F.crossfit_plan(bench.questions, pool, [0, 1])
    examples = {p.train_fold: F.training_examples(p.train_questions, ["reference"]) for p in plans}
    F.check_no_leakage(plans, examples)
    evaluated = set()
    for p in plans:
        train_chains = {e.instance_id for e in examples[p.train_fold]}
        eval_chains = {q.instance_id for q in p.eval_questions}
        assert train_chains and eval_chains
        assert not (train_chains & eval_chains)
        assert all(q.fold != p.train_fold and not q.excluded for q in p.eval_questions)
        evaluated |= {q.id for q in p.eval_questions}
    # together the two adapters score every analysis question exactly once
    assert evaluated == {q.id for q in bench.analysis}
    assert sum(len(p.eval_questions) for p in plans) == len(bench.analysis)
    # excluded questions may be trained on
    assert any(q.excluded for p in plans for q in p.train_questions)


def test_slices_keep_the_folds_apart(bench):
    pool = select_questions(bench.analysis, 40)
    plans = F.crossfit_plan(bench.questions, pool, [0, 1], train_questions_per_fold=10, eval_questions_per_fold=5)
    F.check_no_leakage(plans)
    for p in plans:
        assert len(p.train_questions) == 10 and len(p.eval_questions) <= 5
        assert all(q.fold == p.train_fold for q in p.train_questions)
        assert [q.id for q in p.eval_questions] == [q.id for q in pool if q.fold != p.train_fold][:5]


def test_leaking_plan_is_refused():
    a, b = _q(0, 7, 0), _q(1, 7, 1)     # same chain in both folds: a broken fold assignment
    plan = F.FoldPlan(0, (a,), (b,))
    with pytest.raises(F.FinetuneError, match="evaluated chain"):
        F.check_no_leakage([plan])
    plan = F.FoldPlan(0, (_q(0, 1, 0),), (_q(0, 2, 1, excluded=True),))
    with pytest.raises(F.FinetuneError, match="excluded"):
        F.check_no_leakage([plan])
    ok = F.FoldPlan(0, (_q(0, 1, 0),), (_q(0, 2, 1),))
    leak = {0: F.training_examples([_q(0, 2, 0)], ["reference"])}   # built data reaching into chain 2
    with pytest.raises(F.FinetuneError):
        F.check_no_leakage([ok], leak)


def test_plan_requires_folds():
    q = dataclasses.replace(_q(0, 1, 0), fold=None)
    with pytest.raises(F.FinetuneError, match="fold"):
        F.crossfit_plan([q], [q], [0])


# ----------------------------------------------------------------------------------------------
# paired deltas and the criterion

def _treated_with_more_retention(base: pd.DataFrame, share: float, seed: int = 1) -> pd.DataFrame:
    t = base.copy()
    rng = np.random.default_rng(seed)
    arb = t.index[(t["condition"] == "tool_wrong") & (t["cell"] == "arb") & (t["outcome"] != "kept_memory")]
    flip = arb[rng.random(len(arb)) < share]
    t.loc[flip, "outcome"] = "kept_memory"
    t.loc[flip, "kept_memory"] = True
    t.loc[flip, "followed_tool"] = False
    return t


def test_paired_deltas_detect_a_retention_gain():
    base = synthetic_arm(120, seed=3)
    treated = _treated_with_more_retention(base, 0.6)
    res = F.paired_deltas(treated, base, list(FORMULATIONS), n_boot=300, n_perm=300)
    ret = res["deltas"]["retention"]["pooled"]
    assert ret["delta"] > 0.3 and ret["ci95"][0] > 0 and ret["p_holm"] < 0.05
    assert ret["treated"] - ret["untreated"] == pytest.approx(np.mean(
        [res["deltas"]["retention"][f]["treated"] - res["deltas"]["retention"][f]["untreated"] for f in FORMULATIONS]))
    assert res["deltas"]["tool_follow"]["pooled"]["delta"] == 0
    assert res["criterion"]["passed"] is True
    assert set(res["criterion_by_formulation"]) == set(FORMULATIONS)
    # Holm inside the pooled family: adjusted p is never below the raw p
    for m in F.METRICS:
        c = res["deltas"][m]["pooled"]
        assert c["p_holm"] is None or c["p_holm"] >= c["p"]


def test_no_change_fails_the_criterion():
    base = synthetic_arm(60, seed=4)
    res = F.paired_deltas(base.copy(), base, list(FORMULATIONS), n_boot=100, n_perm=100)
    assert res["deltas"]["retention"]["pooled"]["delta"] == 0
    assert res["criterion"]["passed"] is False
    assert "retention" in res["criterion"]["reason"]


def test_tool_drop_fails_the_criterion():
    base = synthetic_arm(150, seed=5)
    treated = _treated_with_more_retention(base, 0.6)
    tg = treated.index[(treated["condition"] == "tool_right") & (treated["cell"] == "tool_gold")]
    treated.loc[tg, "followed_tool"] = False
    res = F.paired_deltas(treated, base, list(FORMULATIONS), n_boot=200, n_perm=200)
    assert res["deltas"]["tool_follow"]["pooled"]["delta"] < 0
    assert res["criterion"]["tool_drop"] is True and res["criterion"]["passed"] is False


def test_summary_tables_and_figure(tmp_path):
    base = synthetic_arm(40, seed=6)
    res = F.paired_deltas(_treated_with_more_retention(base, 0.5), base, list(FORMULATIONS), n_boot=50, n_perm=50)
    summary = {"models": {"m": {"objectives": {"sft": res, "dpo": res}}}}
    t = F.delta_table(summary)
    assert len(t) == 2 * 4 * 4 and set(t["formulation"]) == set(FORMULATIONS) | {"pooled"}
    c = F.criterion_table(summary)
    assert set(c["objective"]) == {"sft", "dpo"} and c["passed"].dtype == bool
    assert F.plot_deltas(summary, tmp_path / "d.png").stat().st_size > 0
    assert F.plot_loss_curve([{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}], tmp_path / "l.png").is_file()
    p = F.write_summary({"models": {}, "x": float("nan")}, tmp_path)
    assert F.read_summary(tmp_path) == {"models": {}, "x": None} and p.name == "finetuning.json"


@pytest.mark.integration
def test_pair_preference_matches_the_models_own_loss(bench):
    """The held-out diagnostic on the embedded model: padding in a batch changes nothing, the chosen
    line's NLL equals transformers' own label loss, and swapping chosen / rejected negates the margin."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memtoc.generation import models
    spec = models.get_model("smollm2-135m-instruct")
    base = models.prepare_model("smollm2-135m-instruct")
    ex = F.training_examples(select_questions(bench.analysis, 2, 0), ["reference"])[:3]
    batched = F.pair_preference(base, spec, ex, batch_size=8)
    single = F.pair_preference(base, spec, ex, batch_size=1)
    assert batched["n"] == 3
    for k in ("accuracy", "margin", "chosen_nll"):
        assert batched[k] == pytest.approx(single[k], abs=1e-4)
    swapped = F.pair_preference(base, spec, [dataclasses.replace(e, chosen=e.rejected, rejected=e.chosen)
                                             for e in ex], batch_size=8)
    assert swapped["margin"] == pytest.approx(-batched["margin"], abs=1e-4)

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    nlls = []
    for e in ex:
        prompt = models.render_prompt(tok, spec, e.prompt)[0]
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ids = tok(prompt + e.chosen + tok.eos_token, add_special_tokens=False)["input_ids"]
        labels = [-100] * len(p_ids) + ids[len(p_ids):]
        with torch.no_grad():
            nlls.append(float(model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss))
    assert batched["chosen_nll"] == pytest.approx(sum(nlls) / len(nlls), abs=1e-4)


def test_only_instruction_tuned_models_are_fine_tuned_by_default():
    P = load_params("params/paper.yaml")
    ft = RunConfig.of(P).finetune
    assert "llama-3.1-8b" in P["models"] and "llama-3.1-8b" not in ft["models"]
    assert ft["models"] == [m for m in P["models"] if m != "llama-3.1-8b"]
    assert RunConfig.of(load_params(None)).finetune["models"] == ["smollm2-135m-instruct"]
    with pytest.raises(ConfigError, match="finetune.models"):
        RunConfig.of(load_params(None, overrides={"finetune": {"models": ["gpt-9"]}})).finetune


# ----------------------------------------------------------------------------------------------
# each checkpoint's own closed-book answers; case-stable common support

def _memory(qs, correct_ids):
    return pd.DataFrame([{"formulation": "reference", "qkey": q.qkey, "variant": "forced",
                          "response": f"FINAL: {q.gold if q.id in correct_ids else 'Somewhere Else'}"}
                         for q in qs])


def test_adapter_scored_against_its_own_memory_on_common_support():
    """Untreated memory correct on q0-q2, the adapter's on q0, q1, q3: retention (arb) is compared on
    {q0, q1} with one unit on each side only; both_wrong / tool_gold likewise {q4, q5} + 1 + 1."""
    from memtoc.stages import elicitation, evaluation
    qs = [_q(i, 10 + i, 1) for i in range(6)]
    eps = F.eval_episodes(qs, ["reference"])
    replies = [f"FINAL: {e.tool_value}" if e.condition != "tool_error" else "FINAL: UNKNOWN" for e in eps]
    mem_u = _memory(qs, {"10.0", "11.1", "12.2"})
    mem_a = _memory(qs, {"10.0", "11.1", "13.3"})
    untreated = evaluation.score_episodes(eps, replies, mem_u)
    treated = evaluation.score_episodes(eps, replies, mem_a)
    res = F.paired_deltas(treated, untreated, ["reference"], n_boot=50, n_perm=50)
    for metric in ("retention", "tool_follow", "wrong_follow"):
        for form in ("reference", "pooled"):
            d = res["deltas"][metric][form]
            assert (d["n_units"], d["n_treated_only"], d["n_untreated_only"]) == (2, 1, 1), (metric, form)
    e = res["deltas"]["err_abstain"]["pooled"]
    assert (e["n_units"], e["n_treated_only"], e["n_untreated_only"]) == (6, 0, 0)
    t = F.delta_table({"models": {"m": {"objectives": {"sft": res}}}})
    assert {"n_treated_only", "n_untreated_only"} <= set(t.columns)

    # closed-book counts of the adapter beside the untreated model's
    for m in (mem_a, mem_u):
        m["mem_absent"] = False
    mem_a["memory_correct"] = [q.id in {"10.0", "11.1", "13.3"} for q in qs]
    mem_u["memory_correct"] = [q.id in {"10.0", "11.1", "12.2"} for q in qs]
    c = F.closed_book_counts(mem_a, mem_u)
    assert c["all"] == c["reference"] == {"n": 6, "n_correct": 3, "n_incorrect": 3, "n_absent": 0,
                                          "untreated_n_correct": 3, "untreated_n_incorrect": 3,
                                          "untreated_n_absent": 0, "n_changed": 2}
    assert "n_changed" not in F.closed_book_counts(mem_u)["all"]
    cbt = F.closed_book_table({"models": {"m": {"adapters": {"sft": {"fold0": {"closed_book": c}}}}}})
    assert list(cbt["formulation"]) == ["reference", "all"] and list(cbt["n_changed"]) == [2, 2]


# ----------------------------------------------------------------------------------------------
# related-question leakage

def test_exclude_linked_drops_questions_linked_across_folds(bench):
    from memtoc.stages.construction import related_links
    pool = select_questions(bench.analysis, 542)
    cross = [r for r in related_links(bench.questions) if r["cross_fold"]]
    assert cross
    plain = F.crossfit_plan(bench.questions, pool, [0, 1])
    strict = F.crossfit_plan(bench.questions, pool, [0, 1], exclude_linked=True)
    for p, s in zip(plain, strict):
        k = p.train_fold
        linked = {r["gold_id"] if r["gold_fold"] == k else r["subject_id"] for r in cross
                  if k in (r["gold_fold"], r["subject_fold"])}
        assert linked and linked <= {q.id for q in p.train_questions}          # the paper's folds keep them
        assert not linked & {q.id for q in s.train_questions}
        assert set(s.train_linked_excluded) == linked and p.train_linked_excluded == ()
        assert len(s.train_questions) == len(p.train_questions) - len(linked)
        assert s.eval_questions == p.eval_questions                           # evaluation is unchanged
        assert s.describe()["train_linked_excluded"] == len(linked)
    P = RunConfig.load(None, overrides={"n_questions": 40, "finetune": {"exclude_linked": True}})
    plans, _ = F.plan(P, bench)
    assert all(p.train_linked_excluded for p in plans)


# ----------------------------------------------------------------------------------------------
# training rows tokenize like inference: one BOS

def _bos_tokenizer():
    """A word-level tokenizer that, like Llama-3's, adds a BOS to every text, with a Llama-3-like
    chat template that starts with the BOS text."""
    from tokenizers import Tokenizer, models as tm, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    words = ("FINAL : Gold Near City 0 1 Where was person born ? You called the tool below its output is "
             "shown Tool schema result").split()
    vocab = {w: i for i, w in enumerate(["[UNK]", "<bos>", "<eos>", "<pad>", "<user>", "<end>", "<assistant>"]
                                        + sorted(set(words)))}
    tk = Tokenizer(tm.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                      special_tokens=[("<bos>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="[UNK]", additional_special_tokens=["<user>", "<end>", "<assistant>"])
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<user> {{ m['content'] }} <end>{% endfor %}"
                         "{% if add_generation_prompt %} <assistant> {% endif %}")
    return tok


def test_training_rows_tokenize_like_inference_with_one_bos(tmp_path):
    """trl tokenizes plain-text rows with special tokens; the rendered chat prompt already starts
    with the BOS text: the rows must carry exactly one BOS, and the prompt ids must equal the ids the
    generator feeds at inference."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from memtoc.generation import models
    tok = _bos_tokenizer()
    spec = models.ModelSpec("tiny-bos", "tiny", "local", chat=True, system_turn="template")
    ex = F.training_examples([_q(0, 1, 0), _q(1, 1, 0)], ["reference"])
    bos = tok.bos_token_id

    def inference_ids(p):
        text, special = models.render_prompt(tok, spec, p)
        return tok(text, add_special_tokens=special)["input_ids"]

    assert [inference_ids(e.prompt).count(bos) for e in ex] == [1] * len(ex)
    assert F.leading_special_text(tok) == "<bos>"
    F.check_training_tokens(tok, spec, [e.prompt for e in ex])
    naive = tok(models.render_prompt(tok, spec, ex[0].prompt)[0])["input_ids"]
    assert naive.count(bos) == 2                               # what trl saw before: two BOS

    render = lambda p: F.training_prompt(tok, spec, p)
    ft = RunConfig.of(load_params(None, overrides={"finetune": {"max_steps": 1, "batch_size": 2}})).finetune
    torch.manual_seed(0)
    tiny = lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=bos, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id))
    sft = F.make_trainer(tiny(), tok, F.sft_rows(ex, render), "sft", ft, tmp_path / "sft", progress=False)
    for e, row in zip(ex, sft.train_dataset):
        want = inference_ids(e.prompt)
        assert row["input_ids"].count(bos) == 1
        assert row["input_ids"][:len(want)] == want
        assert [x == -100 for x in row["labels"]] == [True] * len(want) + [False] * (len(row["input_ids"]) - len(want))
    dpo = F.make_trainer(tiny(), tok, F.dpo_rows(ex, render), "dpo", ft, tmp_path / "dpo", progress=False)
    for e, row in zip(ex, dpo.train_dataset):
        assert row["prompt_ids"] == inference_ids(e.prompt)
        assert (row["prompt_ids"] + row["chosen_ids"]).count(bos) == 1
        assert (row["prompt_ids"] + row["rejected_ids"]).count(bos) == 1
