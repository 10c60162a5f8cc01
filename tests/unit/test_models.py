"""Model registry, preparation and prompt formatting."""
import json
import os

import pytest

from memtoc.core.errors import ConfigError, MemtocError
from memtoc.generation import models


def test_registry_has_embedded_and_paper_models():
    labels = {s.label for s in models.REGISTRY.values()}
    assert {"llamab", "llamai", "qwen", "gemma", "mistral"} <= labels
    assert models.get_model("smollm2-135m-instruct").source == "embedded"
    assert models.get_model("meta-llama/Llama-3.1-8B").chat is False  # the base model: raw prompt
    assert models.get_model("llamai").hub_id == "meta-llama/Llama-3.1-8B-Instruct"
    assert models.get_model("Qwen/Qwen2.5-7B-Instruct").label == "qwen"


def test_unknown_model_lists_valid_ones():
    with pytest.raises(models.ModelError) as e:
        models.get_model("gpt-17")
    msg = str(e.value)
    assert "gpt-17" in msg and "smollm2-135m-instruct" in msg and "llamai" in msg and "local" in msg
    assert isinstance(e.value, MemtocError)


def test_local_dir_without_config_is_rejected(tmp_path):
    with pytest.raises(models.ModelError, match="config.json"):
        models.get_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    spec = models.get_model(str(tmp_path))
    assert spec.source == "local" and spec.path == str(tmp_path.resolve())


def test_load_generator_validates_arguments():
    with pytest.raises(ConfigError, match="backend"):
        models.load_generator("smollm2-135m-instruct", backend="tgi")
    with pytest.raises(ConfigError, match="batch_size"):
        models.load_generator("smollm2-135m-instruct", batch_size=0)
    with pytest.raises(models.ModelError, match="adapter"):
        models.load_generator("smollm2-135m-instruct", adapter="/nonexistent/adapter")


def test_model_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMTOC_MODEL_CACHE", str(tmp_path / "env"))
    assert models.model_cache_root() == tmp_path / "env"
    assert models.model_cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("MEMTOC_MODEL_CACHE")
    assert str(models.model_cache_root()).endswith(".cache/memtoc/models")


def test_partial_prepare_folder_is_not_reused(tmp_path):
    (tmp_path / "smollm2-135m-instruct").mkdir()
    (tmp_path / "smollm2-135m-instruct" / "config.json").write_text("{}")
    with pytest.raises(models.ModelError, match="not a complete prepared model"):
        models.prepare_model("smollm2-135m-instruct", cache_dir=tmp_path)


def test_weights_hash_is_stored_and_reused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    h = models.weights_hash(tmp_path)
    stored = json.loads((tmp_path / models.HASH_FILE).read_text())
    assert stored["weights_sha256"] == h
    (tmp_path / "model.safetensors").write_bytes(b"abd")  # changed weights -> new hash
    os.utime(tmp_path / "model.safetensors", (1, 1))
    assert models.weights_hash(tmp_path) != h


@pytest.fixture(scope="module")
def smol_path():
    return models.prepare_model("smollm2-135m-instruct")


@pytest.mark.integration
def test_prepare_reuses_and_has_hash(smol_path):
    assert (smol_path / "model.safetensors").is_file()
    assert (smol_path / models.DONE_FILE).is_file()
    assert models.prepare_model("smollm2-135m-instruct") == smol_path  # reused, not rebuilt
    cfg = json.loads((smol_path / "config.json").read_text())
    assert not cfg.get("quantization_config")


@pytest.mark.integration
def test_chat_prompt_has_no_system_turn(smol_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smol_path)
    assert models.detect_default_system(tok)  # SmolLM2's template would inject one
    spec = models.get_model("smollm2-135m-instruct")
    text, special = models.render_prompt(tok, spec, "Question: who?\n")
    assert text == "<|im_start|>user\nQuestion: who?\n<|im_end|>\n<|im_start|>assistant\n"
    assert special is False and "system" not in text
    base = models.ModelSpec("b", "b", "local", chat=False)
    assert models.render_prompt(tok, base, "raw") == ("raw", True)


@pytest.mark.integration
def test_adapter_loads_and_changes_identity(smol_path, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(smol_path, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(tmp_path / "adapter")
    g = models.load_generator("smollm2-135m-instruct", adapter=tmp_path / "adapter", max_new_tokens=3,
                              show_progress=False)
    plain = models.load_generator("smollm2-135m-instruct", max_new_tokens=3, show_progress=False)
    assert g.identity["adapter_sha256"] and plain.identity["adapter_sha256"] is None
    assert g.key("hi") != plain.key("hi")
    # a fresh LoRA (B = 0) leaves the model unchanged: same greedy reply
    assert g.generate(["Say hi."])[0].text == plain.generate(["Say hi."])[0].text
    # ... and the same kernels: the last-position logits of a batch are the same bits as the base
    # model's (a merged model whose weights peft left frozen took another, slower lm_head path)
    x = torch.tensor([plain.encode(["Say hi.", "Name a city.", "Count to three."])[k][:4] for k in range(3)])
    with torch.inference_mode():
        got = g.model(input_ids=x, logits_to_keep=1).logits
        want = plain.model(input_ids=x, logits_to_keep=1).logits
    assert g.torch_dtype == plain.torch_dtype and torch.equal(got, want)
    # the lm_head runs as one matrix product: its weight is not copied once per row of the batch
    from torch.profiler import ProfilerActivity, profile
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        g.model(input_ids=x, logits_to_keep=1)
    vocab = g.model.lm_head.weight.shape[0]
    copies = [e.input_shapes for e in prof.key_averages(group_by_input_shape=True)
              if e.key == "aten::copy_" and any(vocab in shape for shape in e.input_shapes if shape)]
    assert not copies, copies


@pytest.mark.parametrize("name,hub,fmt", [("qwen2.5-3b-instruct", "Qwen/Qwen2.5-3B-Instruct", "hermes"),
                                         ("qwen2.5-1.5b-instruct", "Qwen/Qwen2.5-1.5B-Instruct", "hermes"),
                                         ("llama-3.2-3b-instruct", "meta-llama/Llama-3.2-3B-Instruct", "llama3_json"),
                                         ("hermes-3-llama-3.1-8b", "NousResearch/Hermes-3-Llama-3.1-8B", "hermes")])
def test_table7_models_are_registered_with_their_tool_format(name, hub, fmt):
    from memtoc.stages.agent.parsers import format_for
    spec = models.get_model(name)
    assert spec.hub_id == hub and spec.chat and spec.params_b
    assert format_for([spec.name, spec.hub_id], chat=True, template_renders_tools=True).name == fmt
