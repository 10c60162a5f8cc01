"""The transformers backend on tiny random gemma-2 (attention logit soft-capping, sliding windows)
and gemma-3 (sliding-window layers, QK-norm) configs, float32: the compact loop with the plain and
the shared-prefix prefill gives ``model.generate``'s replies, and its logits equal an eager forward."""

import pytest

from memtoc.generation import models
from memtoc.generation.backends import hf

WINDOW = 6   # smaller than every prompt below, so the sliding layers really cut


def _prompts(n):
    head = "Answer from the context; end with FINAL: and your answer.\n"
    return [head + f"Context {i // 3}: " + "the river runs north. " * (1 + i // 3 % 2)
            + f"\nQ{i}: " + "capital of France? " * (1 + i % 3) for i in range(n)]


def _save(model_cls, cfg, tok, d):
    import torch
    torch.manual_seed(0)
    model_cls(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(models.prepare_model("smollm2-135m-instruct"))


def _common(tok):
    return dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                initializer_range=0.3, tie_word_embeddings=False, sliding_window=WINDOW, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory, tok):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    cfg = Gemma2Config(**_common(tok), attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                       query_pre_attn_scalar=16)
    return _save(Gemma2ForCausalLM, cfg, tok, tmp_path_factory.mktemp("tiny-gemma2"))


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, tok):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(**_common(tok), query_pre_attn_scalar=16)
    return _save(Gemma3ForCausalLM, cfg, tok, tmp_path_factory.mktemp("tiny-gemma3"))


def _gen(d, **kw):
    gen = hf.TransformersGenerator(models.get_model("smollm2-135m-instruct"), d, dtype="float32",
                                   max_new_tokens=8, batch_size=6, show_progress=False, **kw)
    gen.eos_ids = gen.eos_ids | set(range(3, len(gen.tokenizer), 31))   # rows end at different steps
    return gen


def _reference_replies(d, gen, prompts, attention):
    """``model.generate`` of an independently loaded model, one unpadded prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation=attention).eval()
    out = []
    for ids in gen.encode(prompts):
        x = torch.tensor([ids])
        with torch.inference_mode():
            y = ref.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=gen.max_new_tokens,
                             do_sample=False, eos_token_id=sorted(gen.eos_ids), pad_token_id=gen.tokenizer.pad_token_id)
        new = y[0, len(ids):].tolist()
        cut = next((i for i, t in enumerate(new) if t in gen.eos_ids), len(new))
        out.append(gen.tokenizer.decode(new[:cut], skip_special_tokens=True))
    return ref, out


def _all_paths(gen, prompts):
    out = {}
    for name, decode, share in (("generate", "generate", False), ("compact", "compact", False),
                                ("shared", "compact", True)):
        gen.decode, gen.share_prefix = decode, share
        out[name] = [r.text for r in gen.generate(prompts)]
    return out


def test_softcapping_models_get_eager_attention_everywhere():
    from transformers import Gemma2Config, LlamaConfig
    g2 = Gemma2Config(num_hidden_layers=2)
    assert models.attention_implementation(g2, "auto", "cpu") == "eager"
    assert models.attention_implementation(g2, "auto", "cuda") == "eager"
    assert models.attention_implementation(g2, "auto", "cuda", training=True) == "eager"
    with pytest.warns(UserWarning, match="soft-caps"):
        assert models.attention_implementation(g2, "sdpa", "cuda") == "eager"
    assert models.attention_implementation(g2, "flash_attention_2", "cuda") == "flash_attention_2"
    ll = LlamaConfig(num_hidden_layers=2)
    assert models.attention_implementation(ll, "auto", "cpu") == "memtoc_cpu"
    assert models.attention_implementation(ll, "auto", "cuda") == "sdpa"
    assert models.attention_implementation(ll, "auto", "cpu", training=True) == "sdpa"


def test_gemma2_softcapping_logits_and_replies_equal_eager(gemma2_dir):
    """Backend logits (plain and shared prefill, the first decode steps) within 1e-4 of an eager
    forward of each prompt alone; greedy replies equal eager ``model.generate``."""
    import torch
    prompts = _prompts(6)
    gen = _gen(gemma2_dir)
    assert gen.attention == "eager" and gen.info["decode_path"] == "compact"
    assert gen.sliding_window == WINDOW and all(len(x) > 3 * WINDOW for x in gen.encode(prompts))
    ref, want = _reference_replies(gemma2_dir, gen, prompts, "eager")
    ids = gen.encode(prompts)
    enc = gen.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
    with torch.inference_mode():
        eager = torch.stack([ref(input_ids=torch.tensor([x])).logits[0, -1] for x in ids])
        for prefill in (gen._prefill_plain, gen._prefill_shared):
            _, got = prefill(enc["input_ids"], enc["attention_mask"])
            assert (got - eager).abs().max().item() < 1e-4, prefill.__name__
    for path, replies in _all_paths(gen, prompts).items():
        assert replies == want, path
    assert len(set(want)) >= 3


def test_gemma3_sliding_window_replies_equal_generate(gemma3_dir):
    """gemma-3 text (sliding-window layers narrower than the prompts, QK-norm): the compact loop with
    the plain and the shared-prefix prefill gives ``model.generate``'s replies in float32."""
    import torch
    prompts = _prompts(6)
    gen = _gen(gemma3_dir)
    assert gen.info["decode_path"] == "compact" and gen.sliding_window == WINDOW
    ref, want = _reference_replies(gemma3_dir, gen, prompts, "sdpa")
    ids = gen.encode(prompts)
    enc = gen.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
    with torch.inference_mode():
        alone = torch.stack([ref(input_ids=torch.tensor([x])).logits[0, -1] for x in ids])
        for prefill in (gen._prefill_plain, gen._prefill_shared):
            _, got = prefill(enc["input_ids"], enc["attention_mask"])
            assert (got - alone).abs().max().item() < 1e-4, prefill.__name__
    out = _all_paths(gen, prompts)
    for path, replies in out.items():
        assert replies == want, path
    assert len(set(want)) >= 3
    # the window matters, and the loop's own decode masks apply it: without them replies change
    gen.sliding_window, gen.decode, gen.share_prefix = None, "compact", False
    assert [r.text for r in gen.generate(prompts)] != want


@pytest.mark.parametrize("which,attention,tail", [("gemma3", "sdpa", "steps"), ("gemma3", "sdpa", "chunk"),
                                                  ("gemma2", "eager", "steps")])
def test_row_prefill_on_sliding_window_layers(gemma2_dir, gemma3_dir, which, attention, tail):
    """The row prefill in chunks of 4 under a window of 6 (gemma-3; gemma-2 with eager attention and
    soft-capping), its last chunk stepped (the default) or in one forward: first logits within 1e-4
    of a forward of each prompt alone, and the aligned loop's replies are ``model.generate``'s, in
    float32, in one batch and one by one."""
    import torch
    d = gemma3_dir if which == "gemma3" else gemma2_dir
    prompts = _prompts(6)
    gen = _gen(d, row_prefill=True, prefill_chunk=4, prefill_tail=tail)
    assert gen.sliding_window == WINDOW and gen.attention == ("eager" if which == "gemma2" else "memtoc_cpu")
    ref, want = _reference_replies(d, gen, prompts, attention)
    ids = gen.encode(prompts)
    assert len({len(x) % 4 for x in ids}) >= 2                  # last chunks of different lengths
    enc = gen.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
    with torch.inference_mode():
        alone = torch.stack([ref(input_ids=torch.tensor([x])).logits[0, -1] for x in ids])
        _, got = gen._prefill_chunks(enc["input_ids"], enc["attention_mask"])
    assert (got - alone).abs().max().item() < 1e-4
    assert [r.text for r in gen.generate(prompts)] == want
    gen.batch_size = 1
    assert [r.text for r in gen.generate(prompts[:2])] == want[:2]


def test_unsupported_architectures_fall_back_to_generate_and_say_so(gemma3_dir, caplog):
    """A generation config with a logits processor: the compact loop is not used, the generator
    logs it and records it in ``info``; replies still come (from ``model.generate``)."""
    import json
    import shutil
    d = gemma3_dir.parent / "tiny-gemma3-penalty"
    if not d.exists():
        shutil.copytree(gemma3_dir, d)
        gc = json.loads((d / "generation_config.json").read_text())
        gc["repetition_penalty"] = 1.3
        (d / "generation_config.json").write_text(json.dumps(gc))
    with caplog.at_level("WARNING"):
        gen = _gen(d)
    assert gen.info["decode_path"] == "generate" and "logits processors" in gen.info["compact_unsupported"]
    assert "model.generate" in caplog.text
    before = dict(gen.decode_stats)
    assert len(gen.generate(_prompts(2))) == 2
    assert gen.decode_stats["batches"] == before["batches"]   # the compact loop never ran


@pytest.mark.parametrize("chunk", [0, 4])
def test_gemma3_row_prefill_in_chunks_keeps_the_window(gemma3_dir, chunk):
    """The row prefill (in one piece, or in chunks of 4 tokens across the 6-token window) and the
    aligned cache: float32 first logits within 1e-4 of a forward of each prompt alone and replies
    equal ``model.generate``'s; in bf16 the replies do not depend on the batch."""
    import torch
    prompts = _prompts(6)
    gen = _gen(gemma3_dir, row_prefill=True, prefill_chunk=chunk)
    ref, want = _reference_replies(gemma3_dir, gen, prompts, "sdpa")
    ids = gen.encode(prompts)
    enc = gen.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
    prefill = gen._prefill_chunks if chunk else gen._prefill_rows
    with torch.inference_mode():
        alone = torch.stack([ref(input_ids=torch.tensor([x])).logits[0, -1] for x in ids])
        _, got = prefill(enc["input_ids"], enc["attention_mask"])
    assert (got - alone).abs().max().item() < 1e-4
    assert [r.text for r in gen.generate(prompts)] == want
    bf16 = hf.TransformersGenerator(models.get_model("smollm2-135m-instruct"), gemma3_dir, dtype="bfloat16",
                                    max_new_tokens=8, show_progress=False, prefill_chunk=chunk)
    bf16.eos_ids = gen.eos_ids
    runs = []
    for bs, order in ((1, prompts), (6, prompts[::-1]), (4, prompts)):
        bf16.batch_size = bs
        runs.append(dict(zip(order, (r.text for r in bf16.generate(order)))))
    assert runs[0] == runs[1] == runs[2] and len(set(runs[0].values())) >= 3
