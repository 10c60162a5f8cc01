"""One decoding policy on every backend (memtoc.generation.decoding): the model's generation-config penalties,
greedy; vLLM's batch-invariant flag set before the engine starts and recorded in the identity."""
import json
import sys
import types

import pytest

from memtoc.core.errors import ConfigError
from memtoc.generation import decoding, models
from memtoc.generation.backends import hf, vllm as vllm_backend
from test_backends_hf import tiny_model_dir  # noqa: F401  (fixture)

QWEN25_GENERATION_CONFIG = {  # Qwen2.5-7B-Instruct's generation_config.json on the hub
    "bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0"}


def test_policy_reads_the_penalty_and_ignores_sampling_fields(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN25_GENERATION_CONFIG))
    pol = decoding.read_policy(tmp_path)
    assert pol.repetition_penalty == 1.05 and pol.identity() == {"repetition_penalty": 1.05}
    kw = pol.vllm_sampling(128, seed=0)
    assert kw == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 128, "n": 1, "repetition_penalty": 1.05, "seed": 0}


def test_a_model_without_penalties_keeps_its_cache_identity(tmp_path):
    assert decoding.read_policy(tmp_path).identity() == {}           # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.0}))
    assert decoding.read_policy(tmp_path).identity() == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": -1}))
    with pytest.raises(ConfigError, match="generation_config.json: field 'repetition_penalty'"):
        decoding.read_policy(tmp_path)


@pytest.fixture
def qwen_like_dir(tiny_model_dir, tmp_path):  # noqa: F811
    import shutil
    d = tmp_path / "qwen-like"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "generation_config.json").read_text())
    cfg.update({k: QWEN25_GENERATION_CONFIG[k] for k in ("repetition_penalty", "do_sample", "temperature", "top_p", "top_k")})
    (d / "generation_config.json").write_text(json.dumps(cfg))
    return d


def test_transformers_and_vllm_build_the_same_settings(qwen_like_dir, monkeypatch):
    gen = hf.TransformersGenerator(models.get_model("smollm2-135m-instruct"), qwen_like_dir, dtype="float32",
                                   max_new_tokens=6, show_progress=False)
    assert gen.policy.identity() == decoding.read_policy(qwen_like_dir).identity() == {"repetition_penalty": 1.05}
    assert gen.info["decode_path"] == "generate"             # generate applies the penalty
    assert gen.identity["decoding"]["repetition_penalty"] == 1.05
    seen = {}
    real_generate = gen.model.generate

    def spy(**kw):
        seen.update(kw)
        return real_generate(**kw)
    monkeypatch.setattr(gen.model, "generate", spy)
    gen.generate(["What is the capital of France?"])
    assert seen["repetition_penalty"] == 1.05 and seen["do_sample"] is False


def test_plain_model_identity_has_no_penalty(tiny_model_dir):  # noqa: F811
    gen = hf.TransformersGenerator(models.get_model("smollm2-135m-instruct"), tiny_model_dir, dtype="float32",
                                   max_new_tokens=4, show_progress=False)
    assert "repetition_penalty" not in gen.identity["decoding"] and gen.policy.identity() == {}


@pytest.mark.parametrize("setting,cap,on", [("auto", (9, 0), True), ("auto", (8, 0), False), ("auto", None, False),
                                            (True, (8, 0), True), (False, (9, 0), False)])
def test_batch_invariant_decision(setting, cap, on):
    assert decoding.batch_invariant_on(setting, cap, vllm_version=None) is on


@pytest.mark.parametrize("cap, v019, v033", [
    ((8, 0), True, True),       # A100: Triton matmuls in both
    ((8, 6), False, True),      # A10 / RTX 30: no path in 0.19.x, the SM 8 family in later releases
    ((8, 9), True, True),       # L4 / Ada
    ((9, 0), True, True),       # H100 / H200: split-k off through cuBLAS
    ((10, 0), True, True),      # B200
    ((7, 5), False, False),     # T4
])
def test_auto_follows_the_installed_vllms_own_rule(cap, v019, v033):
    """``auto`` follows each release's rule (recorded from its batch_invariant.py), not one constant: the
    CUDA-12 lock's vLLM 0.19.1 covers an A100 and an L4, which the old 9.0 floor left out."""
    assert decoding.batch_invariant_on("auto", cap, vllm_version="0.19.1") is v019
    assert decoding.batch_invariant_on("auto", cap, vllm_version="0.33.0") is v033
    assert decoding.batch_invariant_on("auto", cap, vllm_version="0.32.0+cpu") is v033
    assert decoding.batch_invariant_on("auto", cap, vllm_version="0.11.0") is (cap >= (9, 0))   # older: the documented floor


def test_batch_invariant_setting_is_checked():
    with pytest.raises(ConfigError, match="'batch_invariant' must be auto, true or false"):
        decoding.batch_invariant_on("yes", (9, 0))


class _FakeVLLM(types.ModuleType):
    """A vLLM-shaped module: records the engine's keyword arguments, the environment the engine was
    built under, and the sampling parameters of each generate call."""

    def __init__(self):
        super().__init__("vllm")
        fake = self
        fake.engines, fake.sampling = [], []

        class LLM:
            def __init__(self, **kw):
                fake.engines.append({"kw": kw, "env": decoding.os.environ.get(decoding.BATCH_INVARIANT_ENV)})

            def generate(self, reqs, sp, use_tqdm=False, lora_request=None):
                out = types.SimpleNamespace(text="FINAL: Paris", finish_reason="stop", token_ids=[1, 2])
                return [types.SimpleNamespace(outputs=[out]) for _ in reqs]

        class SamplingParams:
            def __init__(self, **kw):
                fake.sampling.append(kw)
        self.LLM, self.SamplingParams = LLM, SamplingParams


class _Finder:
    """Serves the fake module on ``import vllm`` (it is not loaded before the generator imports it)."""

    def __init__(self, module):
        self.module = module

    def find_spec(self, name, path=None, target=None):
        if name != "vllm":
            return None
        from importlib.machinery import ModuleSpec
        return ModuleSpec("vllm", self)

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        pass


@pytest.fixture
def fake_vllm(monkeypatch):
    fake = _FakeVLLM()
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Finder(fake)] + sys.meta_path)
    yield fake
    sys.modules.pop("vllm", None)


@pytest.mark.parametrize("setting,env", [(True, "1"), (False, "0")])
def test_the_batch_invariant_flag_reaches_the_engine(qwen_like_dir, monkeypatch, fake_vllm, setting, env):
    fake = fake_vllm
    assert "vllm" not in sys.modules
    monkeypatch.setenv(decoding.BATCH_INVARIANT_ENV, "0")   # recorded: restored after the test
    monkeypatch.setattr(vllm_backend, "gpu_capability", lambda: (9, 0))
    gen = vllm_backend.VLLMGenerator(models.get_model("qwen2.5-7b-instruct"), qwen_like_dir, dtype="bfloat16",
                                     max_new_tokens=8, show_progress=False, batch_invariant=setting)
    assert fake.engines[0]["env"] == env and "batch_invariant" not in fake.engines[0]["kw"]
    assert gen.identity.get("batch_invariant", False) is setting
    gen.generate(["What is the capital of France?"])
    assert fake.sampling[0]["repetition_penalty"] == 1.05 and fake.sampling[0]["temperature"] == 0.0


@pytest.mark.parametrize("where", ["option", "checkpoint"])
def test_auto_leaves_batch_invariance_off_for_awq_weights(qwen_like_dir, monkeypatch, fake_vllm, where):
    """params/scale70b.yaml on an H100: batch invariance would make vLLM drop its AWQ Marlin kernels and
    dequantize every weight on every forward (auto_awq.py), so ``auto`` leaves it off for AWQ weights,
    named by the ``quantization`` option or by the checkpoint's config.json; ``true`` still turns it on."""
    import json
    assert decoding.batch_invariant_on("auto", (9, 0), "0.33.0", quantization="awq_marlin") is False
    assert decoding.batch_invariant_on("auto", (9, 0), "0.33.0", quantization="AWQ") is False
    assert decoding.batch_invariant_on("auto", (9, 0), "0.33.0", quantization="fp8") is True
    assert decoding.batch_invariant_on(True, (9, 0), "0.33.0", quantization="awq") is True
    monkeypatch.setenv(decoding.BATCH_INVARIANT_ENV, "0")
    monkeypatch.setattr(vllm_backend, "gpu_capability", lambda: (9, 0))
    monkeypatch.setattr(decoding, "package_version", lambda name: "0.33.0")
    options = {}
    if where == "option":
        options["quantization"] = "awq_marlin"
    else:
        cfg = json.loads((qwen_like_dir / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
        (qwen_like_dir / "config.json").write_text(json.dumps(cfg))
    try:
        gen = vllm_backend.VLLMGenerator(models.get_model("qwen2.5-7b-instruct"), qwen_like_dir, dtype="float16",
                                         max_new_tokens=8, show_progress=False, **options)
    finally:
        cfg = json.loads((qwen_like_dir / "config.json").read_text())
        cfg.pop("quantization_config", None)
        (qwen_like_dir / "config.json").write_text(json.dumps(cfg))
    assert fake_vllm.engines[0]["env"] == "0" and gen.batch_invariant is False


def test_a_loaded_vllm_cannot_switch_the_flag(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", _FakeVLLM())
    monkeypatch.setenv(decoding.BATCH_INVARIANT_ENV, "1")
    with pytest.raises(ConfigError, match="already loaded with VLLM_BATCH_INVARIANT=1"):
        decoding.set_batch_invariant_env(False)
