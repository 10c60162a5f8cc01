"""The Hugging Face causal LM as the probes see it: decoder layers, the residual stream after each
layer (transformer-lens's ``blocks.<l>.hook_resid_post``), the unembedding (final norm + lm_head +
any final soft cap) and layer hooks that read or replace the residual stream.

memtoc writes these by hand on plain transformers models (no transformer-lens / sae-lens
dependency: sae-lens 6.54 requires transformer-lens < 4 while JacobianLens needs >= 3.9, and both
pull in wandb, plotly, nltk, ... that the lock does not carry).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from memtoc.generation import models
from memtoc.generation.hardware import placement


@dataclass
class LoadedModel:
    """A model ready for probing: float32 (or ``probes.dtype``), eval mode, parameters frozen, on its device
    (the GPU when there is one: every input the probes build is placed on ``device``)."""

    name: str
    spec: Any                 # models.ModelSpec
    path: Path
    model: Any                # transformers PreTrainedModel
    tokenizer: Any
    weights_sha256: str
    dtype: str = "float32"    # the weights' dtype (probes.dtype); steered replies record it when not float32

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def ids(self, ids: list[int]) -> torch.Tensor:
        """A (1, T) token tensor on the model's device."""
        return torch.tensor([list(ids)], device=self.device)

    @property
    def n_layers(self) -> int:
        return len(decoder_layers(self.model))

    @property
    def d_model(self) -> int:
        return int(self.model.config.hidden_size)

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of one user-turn prompt exactly as the generation backends render it."""
        text, add_special = models.render_prompt(self.tokenizer, self.spec, prompt)
        return list(self.tokenizer(text, add_special_tokens=add_special)["input_ids"])

    def encode_text(self, text: str, max_tokens: int) -> list[int]:
        """Plain text (fit corpus): BOS (if the tokenizer adds one) + tokens, truncated."""
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])[:max_tokens]


def load_model(name: str, cache_dir: Optional[str] = None, device: Optional[str] = None,
               dtype: str = "float32") -> LoadedModel:
    """Load ``name`` (a registry name or local directory, prepared by ``memtoc model prepare``) in
    ``dtype`` (float32, or bfloat16: half the memory; read-out logits are computed in float32 either
    way) on ``device`` (default: the GPU when there is one). On a GPU the matrix products use TF32
    (the lens fit's backward passes stay in float32 storage; TF32 keeps ~10 mantissa bits in the
    products, far below the rank differences the read-outs report)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    spec = models.get_model(name)
    path = models.prepare_model(name, cache_dir=cache_dir)
    attn = models.attention_implementation(_config(path), "eager")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype), attn_implementation=attn,
                                                 **placement(device))
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(str(path))
    return LoadedModel(name, spec, path, model, tok, models.weights_hash(path, cache_dir), dtype)


def _config(path: Path):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(str(path))


def wrap_model(model, tokenizer, name: str = "tiny", chat: bool = False) -> LoadedModel:
    """A LoadedModel around an in-memory model (tests, tiny random models)."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    spec = models.ModelSpec(name, name, "local", chat=chat)
    return LoadedModel(name, spec, Path("."), model, tokenizer, "in-memory")


def decoder_layers(model) -> list:
    base = getattr(model, "model", model)
    for attr in ("layers", "h"):
        if hasattr(base, attr):
            return list(getattr(base, attr))
    if hasattr(base, "language_model"):
        return list(base.language_model.layers)
    raise TypeError(f"{type(model).__name__}: cannot find the decoder layers")


def final_norm(model):
    base = getattr(model, "model", model)
    if hasattr(base, "norm"):
        return base.norm
    if hasattr(base, "language_model"):
        return base.language_model.norm
    raise TypeError(f"{type(model).__name__}: cannot find the final norm")


def unembed(model, h: torch.Tensor) -> torch.Tensor:
    """Logits of residual-stream vectors ``h`` (..., d_model): final norm, lm_head, final soft cap."""
    logits = model.lm_head(final_norm(model)(h.to(model.lm_head.weight.dtype))).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _out_tensor(output):
    return output[0] if isinstance(output, tuple) else output


def _with_tensor(output, new):
    return (new, *output[1:]) if isinstance(output, tuple) else new


@contextlib.contextmanager
def layer_hooks(model, fns: dict[int, Callable[[torch.Tensor], Optional[torch.Tensor]]]) -> Iterator[None]:
    """Forward hooks on decoder layers: ``fns[l](resid_post)`` may return a replacement tensor (cast to the
    layer's dtype: a float32 reconstruction or edit goes back into a bfloat16 model as bfloat16)."""
    layers = decoder_layers(model)
    handles = []

    def make(fn):
        def hook(module, args, output):
            new = fn(_out_tensor(output))
            return None if new is None else _with_tensor(output, new.to(_out_tensor(output).dtype))
        return hook

    try:
        for l, fn in fns.items():
            handles.append(layers[l].register_forward_hook(make(fn)))
        yield
    finally:
        for h in handles:
            h.remove()


def residuals(lm: LoadedModel, ids: list[int], layers: list[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """({layer: resid_post (T, d)}, final logits (T, V)) of one sequence, no gradients, in float32 (the
    read-outs of a bfloat16 model too)."""
    got: dict[int, torch.Tensor] = {}

    def grab(l):
        def fn(h):
            got[l] = h[0].detach().float()
        return fn

    with torch.no_grad(), layer_hooks(lm.model, {l: grab(l) for l in layers}):
        out = lm.model(input_ids=lm.ids(ids))
    return got, out.logits[0].float()
