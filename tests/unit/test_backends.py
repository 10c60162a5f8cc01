"""Backend pieces that need no server and no vllm: FINAL-line stop rule, batching plan, request
building for the vllm and openai backends, retries."""
import socket
import time
from types import SimpleNamespace

import pytest

from memtoc.generation import models
from memtoc.generation.backends import base, openai as oa, vllm as vb


@pytest.mark.parametrize("text,done", [
    ("Paris is the capital.\nFINAL: Paris\n", True),
    ("FINAL:\n\nParis\n", True),
    ("final : Paris\n", True),
    ("FINAL: Paris", False),                 # the line is not finished yet
    ("FINAL: \n", False),                    # nothing after the marker yet
    ("End with 'FINAL: x'\n", False),        # a quoted mention, not a marker
    ("FINAL: <answer>\n", False),            # the bare placeholder echo
    ("no marker here\n", False),
])
def test_final_line_done(text, done):
    assert base.final_line_done(text) is done


def test_truncate_after_final():
    assert base.truncate_reply("a\nFINAL: X\nFINAL: Y\n", True, False) == ("a\nFINAL: X\n", "final_line")
    assert base.truncate_reply("no final", True, False) == ("no final", None)


def _plan(batch_size, lengths, budget=1000, max_batch=64, new=10):
    from memtoc.generation.backends.hf import TransformersGenerator
    fake = SimpleNamespace(batch_size=batch_size, token_budget=budget, max_batch=max_batch, max_new_tokens=new)
    return TransformersGenerator.plan_batches(fake, lengths)


def test_plan_batches_fixed_and_sorted():
    b = _plan(2, [5, 9, 7, 9, 1])
    assert b == [[1, 3], [2, 0], [4]]  # longest first, ties by original order
    assert sorted(i for x in b for i in x) == list(range(5))


def test_plan_batches_token_budget():
    lengths = [90, 90, 90, 40, 40, 40, 40, 40, 40]
    b = _plan("auto", lengths, budget=300, new=10)
    for batch in b:
        assert len(batch) * (max(lengths[i] for i in batch) + 10) <= 300 or len(batch) == 1
    assert b[0] == [0, 1, 2] and [len(x) for x in b[1:]] == [6]  # evening out would break the budget
    assert [len(x) for x in _plan("auto", [40] * 9, budget=300, new=10)] == [5, 4]  # greedy 6+3, evened
    assert _plan("auto", [5] * 10, budget=10 ** 6, max_batch=4)[0] == [0, 1, 2, 3]


def test_openai_request_bodies():
    body = oa.build_chat_request("m", "Q?\n", 48)
    assert body["messages"] == [{"role": "user", "content": "Q?\n"}]  # one user turn, no system
    assert body["temperature"] == 0 and body["max_tokens"] == 48 and "seed" not in body
    assert oa.build_completion_request("m", "raw", 7, seed=1)["prompt"] == "raw"


def test_openai_retries_are_bounded_against_a_closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    g = models.load_generator("smollm2-135m-instruct", backend="openai", base_url=f"http://127.0.0.1:{port}/v1",
                              max_retries=2, backoff=0.05, timeout=2, show_progress=False)
    t0 = time.time()
    with pytest.raises(oa.BackendError, match="3 attempts"):
        g.generate(["hi"])
    assert time.time() - t0 < 10


def test_openai_unknown_option_is_an_error():
    with pytest.raises(oa.BackendError, match="unknown openai backend option"):
        models.load_generator("smollm2-135m-instruct", backend="openai", temprature=0.5)


def test_openai_identity_accepts_server_only_names():
    g = models.load_generator("my-served-model", backend="openai", weights_hash="abc")
    assert g.identity["served_model"] == "my-served-model" and g.identity["weights_sha256"] == "abc"


def test_vllm_settings_and_order():
    assert vb.sampling_kwargs(48) == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 48, "n": 1}
    kw = vb.engine_kwargs("/m", "auto", None, {"gpu_memory_utilization": 0.5})
    assert kw["enable_prefix_caching"] is True and kw["gpu_memory_utilization"] == 0.5
    assert "enable_lora" in vb.engine_kwargs("/m", "bfloat16", "/a", {"max_lora_rank": 16})
    assert vb.submission_order(["b x", "a y", "b w"]) == [1, 2, 0]


def test_vllm_missing_is_a_clear_error(monkeypatch):
    import builtins
    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "vllm":
            raise ImportError("no vllm")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(oa.BackendError, match="memtoc\\[gpu\\]"):
        vb.VLLMGenerator(models.get_model("smollm2-135m-instruct"), "/nonexistent")


@pytest.mark.integration
def test_vllm_request_building_matches_transformers_tokens():
    from transformers import AutoTokenizer
    path = models.prepare_model("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    spec = models.get_model("smollm2-135m-instruct")
    reqs = vb.build_requests(tok, spec, ["Question: who?\n", "Q: when?\n"])
    expect = tok("<|im_start|>user\nQuestion: who?\n<|im_end|>\n<|im_start|>assistant\n",
                 add_special_tokens=False)["input_ids"]
    assert reqs[0] == {"prompt_token_ids": expect}
    assert tok.decode(reqs[1]["prompt_token_ids"]).startswith("<|im_start|>user\nQ: when?")


@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
def test_cpu_decode_attention_matches_sdpa(mask_kind):
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from memtoc.generation.backends.hf import cpu_decode_attention
    torch.manual_seed(0)
    B, H, KV, L, D = 3, 6, 2, 7, 8
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, KV, L, D), torch.randn(B, KV, L, D)
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool)
    keep[0, ..., :3] = False  # left padding of the first row
    mask = {"bool": keep, "float": torch.zeros(B, 1, 1, L).masked_fill(~keep, float("-inf")), "none": None}[mask_kind]
    module = SimpleNamespace(num_key_value_groups=H // KV, is_causal=True)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    got, _ = cpu_decode_attention(module, q, k, v, mask, scaling=0.3)
    assert got.shape == want.shape == (B, 1, H, D)
    assert torch.allclose(got, want, atol=1e-5)


def test_plan_batches_in_token_order_group_shared_prefixes():
    ids = [[1, 5, 9], [2, 1], [1, 5, 3, 3], [2, 1, 1, 1, 1], [1, 7]]
    lengths = [len(x) for x in ids]
    assert _plan(2, lengths, budget=100, new=1) == [[3, 2], [0, 1], [4]]          # length order
    fake = SimpleNamespace(batch_size=2, token_budget=100, max_batch=64, max_new_tokens=1)
    from memtoc.generation.backends.hf import TransformersGenerator
    assert TransformersGenerator.plan_batches(fake, lengths, ids) == [[2, 0], [4, 1], [3]]
    # the token budget holds for the longest prompt of each batch, wherever it sits in the batch
    fake.batch_size = "auto"
    fake.token_budget = 12
    for batch in TransformersGenerator.plan_batches(fake, lengths, ids):
        assert len(batch) * (max(lengths[i] for i in batch) + 1) <= 12
