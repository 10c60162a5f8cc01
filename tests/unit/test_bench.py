"""Benchmark helpers (the timed benchmark itself is `memtoc bench generation`, not a test)."""
import pytest

from memtoc.core.errors import ConfigError
from memtoc.run import bench


def test_bench_prompts_are_64_distinct_with_tool_prompts():
    prompts = bench.bench_prompts(64)
    assert len(prompts) == 64 and len(set(prompts)) == 64
    assert all("FINAL" in p for p in prompts)


def test_matmul_rate_is_positive():
    assert bench.matmul_rate("float32", n=128, repeats=2) > 0


def test_the_bound_uses_the_matmul_rate_of_the_dtype_in_use():
    import torch
    assert [bench.matmul_dtype(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == \
        ["float32", "bfloat16", "float16"]
    assert bench.matmul_rate(bench.matmul_dtype(torch.float16), n=64, repeats=1) > 0


def test_param_counts_on_a_tiny_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    m = LlamaForCausalLM(cfg)
    total, non_emb = bench.param_counts(m)
    assert total == sum(p.numel() for p in m.parameters()) and total - non_emb == 100 * 16


def test_cli_rejects_bad_batch_size():
    with pytest.raises(ConfigError, match="batch-size"):
        bench.cli(["generation", "--batch-size", "big"])


@pytest.mark.integration
def test_bench_generation_reports_every_field_on_a_small_run():
    """The real benchmark on 4 prompts (not timed as a test: only its fields and their consistency)."""
    r = bench.bench_generation(n=4, loop_n=2, max_new_tokens=8, repeats=2, compare_share=True, compare_tail=True,
                               backend_options={"max_batch": 3})
    assert r["max_batch"] == 3 and max(r["batch_sizes"]) <= 3 and sum(r["batch_sizes"]) == 4
    for k in ("s_per_episode_loop", "s_per_episode_batched", "speedup_vs_loop", "compute_bound_s_per_episode",
              "bound_ratio", "s_per_episode_batched_no_share", "replies_differing_share_vs_no_share"):
        assert k in r
    if r["dtype"] == "bfloat16":        # the row prefill (CPUs with bf16 instructions): both last-chunk schemes
        assert r["prefill_tail"] == "steps" and 0 <= r["replies_differing_between_tails"] <= 4
        assert r["s_per_episode_batched_tail_chunk"] > 0
    assert len(r["s_per_episode_batched_repeats"]) == 2
    assert sorted(r["s_per_episode_batched_repeats"])[0] <= r["s_per_episode_batched"]
    assert r["speedup_vs_loop"] == pytest.approx(r["s_per_episode_loop"] / r["s_per_episode_batched"])
    assert r["bound_ratio"] == pytest.approx(r["s_per_episode_batched"] / r["compute_bound_s_per_episode"])
    # the 4 prompts share the instruction: fewer prompt tokens computed than given
    assert r["prompt_tokens_computed_per_episode_batched"] < r["prompt_tokens_per_episode_batched"]
    assert r["replies_differing_between_repeats"] == 0


class _Reply:
    def __init__(self, text, n_new_tokens=3):
        self.text, self.n_new_tokens = text, n_new_tokens


class _Engine:
    """A stand-in generator that records when it runs and answers by a rule."""

    def __init__(self, name, log, rule, backend="vllm"):
        self.name, self.log, self.rule, self.backend, self.closed = name, log, rule, backend, False
        self.llm = self

    def generate(self, prompts):
        self.log.append((self.name, len(prompts)))
        return [_Reply(self.rule(p)) for p in prompts]

    def reset_prefix_cache(self):
        self.log.append((self.name, "reset"))

    def forget_prefixes(self):
        self.log.append((self.name, "forget"))

    def close(self):
        self.closed = True


def test_the_peer_is_timed_in_turn_with_memtoc_and_its_replies_compared():
    log = []
    prompts = [f"p{i}" for i in range(6)]
    mine = _Engine("memtoc", log, lambda p: p.upper(), backend="transformers")
    peers = []

    def load():
        peers.append(_Engine("peer", log, lambda p: p.upper() if p != "p3" else "other"))
        return peers[-1]

    out = bench.peer_comparison(mine, prompts, mine.generate(prompts), load, repeats=2)
    runs = [entry for entry in log[1:] if entry[1] == 6 or entry[1] == 2]
    assert runs == [("peer", 2), ("memtoc", 6), ("peer", 6), ("memtoc", 6), ("peer", 6)]   # warm-up, then in turn
    assert ("peer", "reset") in log and ("memtoc", "forget") in log                      # cold each time
    assert out["replies_differing_memtoc_vs_peer"] == 1 and out["replies_differing_between_peer_repeats"] == 0
    assert out["peer"] == "vllm" and len(out["s_per_episode_peer_repeats"]) == 2
    assert out["peer_over_memtoc"] == pytest.approx(out["s_per_episode_peer"] / out["s_per_episode_batched_interleaved"])
    assert peers[0].closed


def test_an_unknown_peer_and_a_bad_peer_option_are_refused():
    with pytest.raises(ConfigError, match="peers are vllm"):
        bench.bench_generation(n=2, peer="llamacpp")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        bench._options(["enforce_eager"])
    with pytest.raises(ConfigError, match="dtype: set by memtoc for both engines"):
        bench.check_peer("vllm", {"dtype": "bfloat16"})
    import importlib.util
    if importlib.util.find_spec("vllm") is None:                      # the main environment: no vLLM there
        with pytest.raises(ConfigError, match="make vllm-env"):
            bench.bench_generation(n=2, peer="vllm")
    assert bench._options(["enforce_eager=true", "max_num_seqs=8"]) == {"enforce_eager": True, "max_num_seqs": 8}
