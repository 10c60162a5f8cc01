"""transformers backend: the compact greedy loop (finished rows dropped after each step), with the
plain prefill or the shared-prefix prefill, gives the same tokens, finish reasons and token counts as
the former ``model.generate`` path."""
import zlib

import pytest

from memtoc import models
from memtoc.backends import hf
from memtoc.config import ConfigError


def _fields(replies):
    return [(r.text, r.n_new_tokens, r.n_prompt_tokens, r.finish) for r in replies]


def _all_modes(gen, prompts):
    """Replies of ``generate``, of the compact loop with the plain prefill, and with the shared one."""
    out = {}
    for mode, share in (("generate", False), ("compact", False), ("shared", True)):
        gen.decode, gen.share_prefix = ("generate" if mode == "generate" else "compact"), share
        out[mode] = gen.generate(prompts)
    return out


def _prompts_with_shared_prefixes(n):
    """Three levels of sharing: one instruction for all, a context per group of four, a question
    each (different lengths, so the batch is left-padded)."""
    head = "Answer the question below from the context; end with FINAL: and your answer.\n"
    return [head + f"Context {i // 4}: " + "the river runs north through the valley. " * (1 + i // 4 % 3)
            + f"\nQuestion {i}: " + "what is the capital of France? " * (1 + i % 3) for i in range(n)]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama with the embedded model's tokenizer (fast, float32); large random
    weights, so that greedy replies vary from row to row and step to step."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(models.prepare_model("smollm2-135m-instruct"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.3, tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.eos_token_id)
    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_compact_loop_matches_generate_on_a_tiny_model(tiny_model_dir, monkeypatch):
    spec = models.get_model("smollm2-135m-instruct")
    gen = hf.TransformersGenerator(spec, tiny_model_dir, dtype="float32", max_new_tokens=12, batch_size=16,
                                   show_progress=False)
    # A random model never writes a FINAL line; make the stop rule fire pseudo-randomly instead, the
    # same way in both loops: every token is "a newline", and a reply is "done" when the crc of its
    # text hits 0 mod 9. Some tokens also count as EOS. Rows then end at many different steps.
    monkeypatch.setattr(hf, "final_line_done", lambda text: zlib.crc32(text.encode()) % 9 == 0)
    gen.newline_ids = set(range(len(gen.tokenizer)))
    gen.eos_ids = gen.eos_ids | set(range(3, len(gen.tokenizer), 29))
    prompts = _prompts_with_shared_prefixes(16)
    before = dict(gen.decode_stats)
    out = _all_modes(gen, prompts)
    old = out["generate"]
    assert _fields(out["compact"]) == _fields(old)
    assert _fields(out["shared"]) == _fields(old)
    lengths = {r.n_new_tokens for r in old}
    finishes = {r.finish for r in old}
    assert len({r.n_prompt_tokens for r in old}) >= 4           # left padding in the batch
    assert len(lengths) >= 4 and 12 in lengths                   # rows end at different steps
    assert finishes == {"eos", "final_line", "length"}
    stats = {k: gen.decode_stats[k] - before[k] for k in before}
    # both compact runs really compacted: decoded row-steps = what the rows needed, not 16 x 12
    assert stats["row_steps"] == 2 * sum(min(r.n_new_tokens + (r.finish == "eos"), 12) for r in old)
    assert stats["row_steps"] < 2 * 16 * 12
    # the shared prefill computed each shared token once, in several calls (tree levels)
    total = sum(r.n_prompt_tokens for r in old)
    assert stats["prompt_tokens_computed"] - total < 0.6 * total
    assert stats["prefill_calls"] >= 3


def test_unknown_decode_loop_is_an_error(tiny_model_dir):
    with pytest.raises(ConfigError, match="decode"):
        hf.TransformersGenerator(models.get_model("smollm2-135m-instruct"), tiny_model_dir, decode="fast",
                                 show_progress=False)


@pytest.mark.integration
def test_compact_loop_matches_generate_on_the_embedded_model():
    """Real bench prompts of different lengths, float32: identical replies from all three paths."""
    from memtoc.bench import bench_prompts
    gen = models.load_generator("smollm2-135m-instruct", batch_size=6, dtype="float32", max_new_tokens=48,
                                show_progress=False)
    prompts = bench_prompts(6)
    out = _all_modes(gen, prompts)
    assert _fields(out["compact"]) == _fields(out["generate"])
    assert _fields(out["shared"]) == _fields(out["generate"])
    assert len({r.n_new_tokens for r in out["generate"]}) >= 3  # rows finished at different steps


def test_fill_holes_moves_only_the_rows_past_the_new_end():
    assert hf._fill_holes([0, 2, 3, 5, 6]) == [0, 5, 2, 3, 6]
    assert hf._fill_holes([0, 1, 2]) == [0, 1, 2]
    assert hf._fill_holes([4]) == [4]
    assert hf._fill_holes([]) == []


@pytest.mark.parametrize("order", [[0, 5, 2, 3, 6], [1, 2, 4], [3, 0, 1]])
def test_compact_layer_matches_dynamic_layer(order):
    """Same keys / values as DynamicLayer; a one-token step returns the whole (contiguous) buffer of
    the live rows, filled part equal to DynamicLayer's and the rest zero."""
    import torch
    from transformers.cache_utils import DynamicLayer
    torch.manual_seed(0)
    B, H, P, D = 7, 2, 5, 4
    layer, ref = hf._compact_layer_class()(P + 4), DynamicLayer()
    k, v = torch.randn(B, H, P, D), torch.randn(B, H, P, D)
    got, want = layer.update(k, v), ref.update(k, v)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    for step in range(3):
        if step == 1:  # drop rows (in place, or by copy when a row is both read and overwritten)
            idx = torch.tensor(order)
            layer.batch_select_indices(idx)
            ref.batch_select_indices(idx)
        n = ref.keys.shape[0]
        k, v = torch.randn(n, H, 1, D), torch.randn(n, H, 1, D)
        got, want = layer.update(k, v), ref.update(k, v)
        L = want[0].shape[2]
        for g, w in zip(got, want):
            assert g.shape == (n, H, P + 4, D) and g.is_contiguous()
            assert torch.equal(g[:, :, :L], w) and not g[:, :, L:].any()
        assert layer.get_seq_length() == ref.get_seq_length() == L
