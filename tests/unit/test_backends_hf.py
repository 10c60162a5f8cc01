"""transformers backend: the compact greedy loop (finished rows dropped after each step), with the
plain prefill or the shared-prefix prefill, gives the same tokens, finish reasons and token counts as
the former ``model.generate`` path."""
import zlib

import pytest

from memtoc.core.errors import ConfigError
from memtoc.generation import models
from memtoc.generation.backends import hf
from memtoc.generation.backends.engine import compact, stopping
from memtoc.generation.backends.engine.rowprefill import tail_order


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
    rule = lambda text, final, first: "final_line" if final and zlib.crc32(text.encode()) % 9 == 0 else None  # noqa: E731
    for module in (compact, stopping):  # the compact loop's and generate's stop rule
        monkeypatch.setattr(module, "line_stop", rule)
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
    from memtoc.run.bench import bench_prompts
    gen = models.load_generator("smollm2-135m-instruct", batch_size=6, dtype="float32", max_new_tokens=48,
                                show_progress=False)
    prompts = bench_prompts(6)
    out = _all_modes(gen, prompts)
    assert _fields(out["compact"]) == _fields(out["generate"])
    assert _fields(out["shared"]) == _fields(out["generate"])
    assert len({r.n_new_tokens for r in out["generate"]}) >= 3  # rows finished at different steps


def test_fill_holes_moves_only_the_rows_past_the_new_end():
    assert compact.fill_holes([0, 2, 3, 5, 6]) == [0, 5, 2, 3, 6]
    assert compact.fill_holes([0, 1, 2]) == [0, 1, 2]
    assert compact.fill_holes([4]) == [4]
    assert compact.fill_holes([]) == []


@pytest.mark.parametrize("order", [[0, 5, 2, 3, 6], [1, 2, 4], [3, 0, 1]])
def test_compact_layer_matches_dynamic_layer(order):
    """Same keys / values as DynamicLayer; a one-token step returns the whole (contiguous) buffer of
    the live rows, filled part equal to DynamicLayer's and the rest zero."""
    import torch
    from transformers.cache_utils import DynamicLayer
    torch.manual_seed(0)
    B, H, P, D = 7, 2, 5, 4
    layer, ref = compact.CompactLayer(P + 4), DynamicLayer()
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


# -- batch invariance (issue 13.1) ----------------------------------------------------------------
def _invariance_gen(tiny_model_dir, **kw):
    kw.setdefault("max_new_tokens", 10)
    gen = hf.TransformersGenerator(models.get_model("smollm2-135m-instruct"), tiny_model_dir,
                                   show_progress=False, **kw)
    gen.eos_ids = gen.eos_ids | set(range(3, len(gen.tokenizer), 37))  # rows end at different steps
    return gen


def _by_prompt(prompts, replies):
    return {p: (r.text, r.finish, r.n_new_tokens) for p, r in zip(prompts, replies)}


@pytest.mark.parametrize("native_bf16", [True, False])
def test_default_cpu_dtype_is_batch_invariant(tiny_model_dir, monkeypatch, native_bf16):
    """``dtype: auto`` on a CPU: bf16 with the row prefill and the aligned cache where the CPU has
    bf16 instructions (no tie-break: nothing to guard, its logits do not move with the batch), else
    float32 with the tie-break. An explicit bf16 gets the row prefill too, unless it is turned off."""
    import torch
    monkeypatch.setattr(hf, "cpu_has_native_bf16", lambda: native_bf16)
    gen = _invariance_gen(tiny_model_dir)
    want = torch.bfloat16 if native_bf16 else torch.float32
    assert gen.torch_dtype == want and gen.row_prefill == native_bf16
    assert gen.tie_margin == (0.0 if native_bf16 else hf.FLOAT32_TIE_MARGIN)
    assert gen.identity["decoding"]["dtype"] == str(want).replace("torch.", "")
    assert gen.identity["decoding"].get("prefill") == ("rows" if native_bf16 else None)
    assert _invariance_gen(tiny_model_dir, dtype="bfloat16").row_prefill
    plain = _invariance_gen(tiny_model_dir, dtype="bfloat16", row_prefill=False)
    assert not plain.row_prefill and plain.tie_margin == 0.0
    assert not _invariance_gen(tiny_model_dir, dtype="bfloat16", decode="generate").row_prefill
    with pytest.raises(ConfigError, match="tie_margin"):
        _invariance_gen(tiny_model_dir, tie_margin=-1)


def test_a_batch_dependent_linear_kernel_is_reported(tiny_model_dir, monkeypatch, caplog):
    """The row prefill relies on a bf16 ``linear`` giving a row the same bits in a call of 2 or 64
    rows; a kernel whose rows change with the batch size is named at load, with the way out."""
    import torch
    gen = _invariance_gen(tiny_model_dir, dtype="bfloat16")
    assert gen.info["linear_rows_differ"] is None and hf.linear_rows_invariant(gen.model) is None
    real = torch.nn.functional.linear

    def batch_dependent(x, w, b=None):
        y = real(x, w, b)
        return y + 0.25 if x.shape[0] > 8 else y
    monkeypatch.setattr(torch.nn.functional, "linear", batch_dependent)
    assert hf.linear_rows_invariant(gen.model).endswith("(64 -> 64): 2 rows vs 64")
    with caplog.at_level("WARNING"):
        gen = _invariance_gen(tiny_model_dir, dtype="bfloat16")
    assert "2 rows vs 64" in gen.info["linear_rows_differ"] and "dtype float32" in caplog.text


@pytest.mark.parametrize("dtype,options", [("float32", {}), ("bfloat16", {}), ("bfloat16", {"prefill_chunk": 0}),
                                           ("bfloat16", {"prefill_chunk": 5, "chunk_memo_mb": 0}),
                                           ("bfloat16", {"prefill_tail": "chunk"})])
def test_replies_do_not_depend_on_the_batch(tiny_model_dir, tmp_path, dtype, options):
    """Both CPU defaults (float32 with the tie-break; bf16 with the row prefill in shared chunks and
    the aligned cache; also in one piece, and in chunks of 5 with nothing kept between calls): the
    same prompts one by one, in batches of 3, 16 and auto, in reverse order, with shared prefixes on
    and off, and after a cache repair (3 lines regenerated in their own batch) give identical
    replies."""
    import random
    prompts = _prompts_with_shared_prefixes(16)
    gen = _invariance_gen(tiny_model_dir, dtype=dtype, **options)
    want = _by_prompt(prompts, gen.generate(prompts))
    assert len({v[2] for v in want.values()}) >= 3              # replies of different lengths
    shuffled = prompts[::-1]
    random.Random(0).shuffle(shuffled)
    for bs, order, share in ((1, prompts[5:9], True), (3, prompts[::-1], True), (16, shuffled, False),
                             ("auto", shuffled, True), (5, prompts[3:11], True)):
        gen.batch_size, gen.share_prefix = bs, share
        assert _by_prompt(order, gen.generate(order)) == {p: want[p] for p in order}, (bs, share)
    gen.batch_size, gen.share_prefix = "auto", True
    cache = tmp_path / "replies.jsonl"
    gen.generate(prompts, cache)
    lines = cache.read_text().splitlines()
    cache.write_text("\n".join(l for i, l in enumerate(lines) if i not in (2, 7, 11)) + "\n")  # damage
    again = gen.generate(prompts, cache)
    assert sum(not r.cached for r in again) == 3
    assert _by_prompt(prompts, again) == want


def test_shared_prefill_chunks_are_computed_once_and_kept(tiny_model_dir):
    """The chunked row prefill computes a chunk shared by several prompts once, keeps it for the
    next call (fewer prompt tokens computed, same replies), forgets it on request, and stays within
    its memory bound (``chunk_memo_mb: 0`` keeps one chunk)."""
    prompts = _prompts_with_shared_prefixes(12)
    total = sum(len(x) for x in _invariance_gen(tiny_model_dir, dtype="bfloat16").encode(prompts))
    gen = _invariance_gen(tiny_model_dir, dtype="bfloat16", prefill_chunk=4)

    def computed(batch):
        before = gen.decode_stats["prompt_tokens_computed"]
        replies = _by_prompt(batch, gen.generate(batch))
        return gen.decode_stats["prompt_tokens_computed"] - before, replies

    cold, want = computed(prompts)
    assert cold < 0.8 * total                         # the shared instruction and contexts once
    warm, again = computed(prompts)
    assert again == want and warm < 0.5 * cold        # the kept chunks: only the last chunks run
    gen.forget_prefixes()
    assert computed(prompts)[0] == cold
    small = _invariance_gen(tiny_model_dir, dtype="bfloat16", prefill_chunk=4, chunk_memo_mb=0)
    assert _by_prompt(prompts, small.generate(prompts)) == want and len(small._chunk_memo) == 1
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="prefill_chunk"):
            _invariance_gen(tiny_model_dir, dtype="bfloat16", prefill_chunk=bad)


@pytest.mark.parametrize("chunk,tail", [(0, "steps"), (5, "steps"), (5, "chunk")])
def test_the_row_prefill_computes_what_a_forward_alone_computes(tiny_model_dir, chunk, tail):
    """float32, where arithmetic order hardly matters: the row prefill's first logits (in one
    piece, or in chunks of 5 after the kept keys of the chunks before, the last chunk stepped or in
    one forward) are a forward of each prompt alone, and its replies with the aligned cache are
    those of ``model.generate``."""
    import torch
    prompts = _prompts_with_shared_prefixes(8)
    gen = _invariance_gen(tiny_model_dir, dtype="float32", row_prefill=True, prefill_chunk=chunk,
                          prefill_tail=tail)
    ids = gen.encode(prompts)
    enc = gen.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
    prefill = gen._prefill_chunks if chunk else gen._prefill_rows
    with torch.inference_mode():
        _, got = prefill(enc["input_ids"], enc["attention_mask"])
        alone = torch.stack([gen.model(input_ids=torch.tensor([x]), use_cache=False, logits_to_keep=1).logits[0, -1]
                             for x in ids])
    assert (got - alone).abs().max().item() < 1e-4
    want = _fields(gen.generate(prompts))
    gen.row_prefill, gen.decode = False, "generate"
    assert _fields(gen.generate(prompts)) == want


def test_the_stepped_last_chunk_feeds_every_row_and_names_the_cache(tiny_model_dir):
    """``prefill_tail: steps`` runs the last chunks as one-token steps of all the rows together
    (never one row: a lone longest tail keeps a ghost), gives the rows back in the caller's order
    whatever their tail lengths, has its own cache identity (``chunk`` keeps the one of before),
    and a bad value is a clear error."""
    import torch
    prompts = _prompts_with_shared_prefixes(8)
    gen = _invariance_gen(tiny_model_dir, dtype="bfloat16", prefill_chunk=5)
    assert gen.identity["decoding"]["prefill_tail"] == "steps"
    chunked = _invariance_gen(tiny_model_dir, dtype="bfloat16", prefill_chunk=5, prefill_tail="chunk")
    assert "prefill_tail" not in chunked.identity["decoding"]
    ids = gen.encode(prompts)
    tails = [len(x) - 5 * ((len(x) - 1) // 5) for x in ids]
    assert len(set(tails)) >= 3 and tail_order([len(x) for x in ids], 5) != list(range(8))
    enc = gen.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
    rows_seen = []
    forward = gen._forward

    def spy(cache, expect, **kw):
        rows_seen.append(kw["input_ids"].shape[0])
        return forward(cache, expect, **kw)
    gen._forward = spy
    with torch.inference_mode():
        cache, logits = gen._prefill_chunks(enc["input_ids"], enc["attention_mask"])
    steps = rows_seen[-max(tails):]
    assert min(steps) >= 2 and steps[0] == 8                    # every row feeds at step 0, never one row
    gen._forward = forward
    # row r of the cache is prompt r: its own prefill alone (a batch of two copies) gives the same bits
    for r in (0, 5):
        two = enc["input_ids"][[r, r]], enc["attention_mask"][[r, r]]
        gen.forget_prefixes()                                    # its chunks computed again, alone
        with torch.inference_mode():
            c2, l2 = gen._prefill_chunks(*two)
        assert torch.equal(l2[0], logits[r])
        n = int(enc["attention_mask"][r].sum())
        assert torch.equal(c2.layers[0].buf_k[0, :, :n], cache.layers[0].buf_k[r, :, :n])
    with pytest.raises(ConfigError, match="prefill_tail"):
        _invariance_gen(tiny_model_dir, dtype="bfloat16", prefill_tail="rows")


def test_row_prefill_without_the_compact_loop_is_an_error(tiny_model_dir):
    with pytest.raises(ConfigError, match="row_prefill needs the compact decode loop"):
        _invariance_gen(tiny_model_dir, dtype="bfloat16", row_prefill=True, decode="generate")


def test_bfloat16_row_prefill_is_the_canonical_forward(tiny_model_dir):
    """The row prefill gives the canonical first logits: equal, bit for bit, to a batch-1 unpadded
    forward of each prompt, where the padded batched prefill does not have to."""
    import torch
    prompts = _prompts_with_shared_prefixes(8)
    gen = _invariance_gen(tiny_model_dir, dtype="bfloat16", tie_margin=0.0, row_prefill=True)
    ids = gen.encode(prompts)
    enc = gen.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
    with torch.inference_mode():
        _, logits = gen._prefill_rows(enc["input_ids"], enc["attention_mask"])
        for r, x in enumerate(ids):
            alone = gen.model(input_ids=torch.tensor([x]), use_cache=False, logits_to_keep=1).logits[0, -1]
            assert torch.equal(logits[r], alone)


def test_the_tie_break_decides_every_near_tie_canonically(tiny_model_dir):
    """With a margin that makes every step a "near tie", every token comes from the batch-1
    canonical forward, so even bf16 replies (whose batched logits move with the batch by up to 1.0 on
    the real model) are identical in every batch, in both decode loops."""
    prompts = _prompts_with_shared_prefixes(12)[::2]
    guarded = _invariance_gen(tiny_model_dir, dtype="bfloat16", tie_margin=1e9, max_new_tokens=4)
    runs = []
    for bs in (1, 6, 4):
        guarded.batch_size = bs
        runs.append(_by_prompt(prompts, guarded.generate(prompts)))
    assert runs[0] == runs[1] == runs[2]
    steps = sum(v[2] + (v[1] == "eos") for v in runs[0].values())
    assert guarded.decode_stats["tie_recomputes"] == 3 * steps
    guarded.decode = "generate"                                   # the generate path has the same guard
    assert _by_prompt(prompts, guarded.generate(prompts)) == runs[0]


def test_cache_keyword_is_read_from_the_forward_signature(tiny_model_dir):
    import inspect
    gen = _invariance_gen(tiny_model_dir)
    params = inspect.signature(gen.model.forward).parameters
    assert gen.cache_kw in params and gen.cache_kw in ("cache", "past_key_values")
    assert gen.info["cache_keyword"] == gen.cache_kw


def test_an_unfilled_cache_is_an_error_not_garbage(tiny_model_dir):
    """A forward that swallows the cache keyword (transformers < 5.24 given `cache=`) must raise."""
    gen = _invariance_gen(tiny_model_dir)
    gen.cache_kw = "cache_under_a_name_the_model_does_not_know"
    for share in (False, True):
        gen.share_prefix = share
        with pytest.raises(hf.GenerationError, match="did not fill the KV cache"):
            gen.generate(_prompts_with_shared_prefixes(4))


def _transformers_before(version):
    import transformers
    from packaging.version import Version
    return Version(transformers.__version__) < Version(version)


@pytest.mark.skipif(not _transformers_before("5.24"), reason="checks an older transformers (the GPU extra's 5.20.2): "
                    "/tmp/venv520/bin/python -m pytest tests/unit/test_backends_hf.py -k older_transformers")
def test_compact_paths_under_an_older_transformers(tiny_model_dir):
    """transformers < 5.24 names the cache `past_key_values`: the plain and shared prefills and the
    compact decode still give generate's replies (before the fix: a crash and garbage)."""
    gen = _invariance_gen(tiny_model_dir, batch_size=16, max_new_tokens=12)
    assert gen.cache_kw == "past_key_values"
    prompts = _prompts_with_shared_prefixes(16)
    out = _all_modes(gen, prompts)
    assert _fields(out["compact"]) == _fields(out["generate"])
    assert _fields(out["shared"]) == _fields(out["generate"])
    assert len({r.text for r in out["generate"]}) > 8          # not one degenerate reply for all


@pytest.mark.integration
def test_real_model_replies_do_not_depend_on_the_batch():
    """The embedded model, default settings: 8 bench prompts in one batch, in batches of 3 in reverse
    order and (two of them) one by one give byte-identical replies."""
    from memtoc.run.bench import bench_prompts
    prompts = bench_prompts(8)
    gen = models.load_generator("smollm2-135m-instruct", max_new_tokens=24, show_progress=False)
    want = _by_prompt(prompts, gen.generate(prompts))
    gen.batch_size = 3
    assert _by_prompt(prompts[::-1], gen.generate(prompts[::-1])) == want
    gen.batch_size = 1
    assert _by_prompt(prompts[2:4], gen.generate(prompts[2:4])) == {p: want[p] for p in prompts[2:4]}


