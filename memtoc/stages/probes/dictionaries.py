"""Sparse dictionaries on the residual stream: one module for the ReLU, JumpReLU and TopK
architectures, and readers for the file layouts the paper's dictionaries are published in.

    sae_in = x - b_dec  (only when apply_b_dec_to_input)
    pre    = sae_in W_enc + b_enc
    relu:     f = ReLU(pre)
    jumprelu: f = ReLU(pre) * (pre > threshold)
    topk:     f = the k largest entries of pre, ReLU'd, zero elsewhere
              (rescale_acts_by_decoder_norm: pre * ||W_dec row|| before the selection, f / ||W_dec row|| after)
    decode(f) = f W_dec + b_dec

These are sae-lens 6's ``StandardSAE`` / ``JumpReLUSAE`` / ``TopKSAE`` encode/decode rules. Layouts
(:func:`load_sae` picks one from the files present):

- sae-lens's on-disk layout (``cfg.json`` + ``sae_weights.safetensors``; architecture ``standard``,
  ``jumprelu`` or ``topk``; ``apply_b_dec_to_input`` as recorded, sae-lens's default True). What
  ``SAE.save_model(dir)`` writes, e.g. for Llama Scope or Goodfire releases loaded with
  ``SAE.from_pretrained`` (which folds Llama Scope's activation-norm factor first).
- GemmaScope's ``params.npz`` (``W_enc`` (d_in, d_sae), ``b_enc``, ``threshold``, ``W_dec`` (d_sae, d_in),
  ``b_dec``): JumpReLU, inputs not centred (sae-lens's ``gemma_2`` loader: apply_b_dec_to_input False).
- Llama Scope's own layout (``hyperparams.json`` + ``checkpoints/final.safetensors`` with
  ``encoder.weight`` (d_sae, d_in), ``encoder.bias``, ``decoder.weight`` (d_in, d_sae), ``decoder.bias``):
  JumpReLU with the scalar ``jump_relu_threshold``, inputs not centred, and the dataset-wise input norm
  factor ``s = sqrt(d_model) / dataset_average_activation_norm.in`` folded in as sae-lens does
  (``W_enc * s``, ``W_dec / s``, ``b_dec / s``, threshold ``* s``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from safetensors.torch import load_file

from memtoc.core.errors import MemtocError

WEIGHTS_FILE = "sae_weights.safetensors"
CFG_FILE = "cfg.json"
GEMMASCOPE_FILE = "params.npz"
LLAMASCOPE_CFG = "hyperparams.json"
LLAMASCOPE_WEIGHTS = "checkpoints/final.safetensors"
ARCHITECTURES = ("relu", "jumprelu", "topk")
_SAE_LENS_ARCH = {"standard": "relu", "relu": "relu", "jumprelu": "jumprelu", "topk": "topk"}


class SAEError(MemtocError):
    """A dictionary that cannot be read or does not fit the model."""


class SparseDictionary(torch.nn.Module):
    """A ReLU, JumpReLU or TopK sparse autoencoder (the module docstring's rules)."""

    def __init__(self, d_in: int, d_sae: int, architecture: str = "topk", k: Optional[int] = None,
                 apply_b_dec_to_input: bool = True, rescale_acts_by_decoder_norm: bool = False):
        super().__init__()
        if architecture not in ARCHITECTURES:
            raise SAEError(f"architecture {architecture!r}: one of {', '.join(ARCHITECTURES)}")
        if architecture == "topk" and not (k and k > 0):
            raise SAEError(f"a topk dictionary needs k > 0, got {k!r}")
        self.d_in, self.d_sae, self.k, self.architecture = d_in, d_sae, k, architecture
        self.apply_b_dec_to_input = apply_b_dec_to_input
        self.rescale_acts_by_decoder_norm = rescale_acts_by_decoder_norm
        self.W_enc = torch.nn.Parameter(torch.zeros(d_in, d_sae))
        self.b_enc = torch.nn.Parameter(torch.zeros(d_sae))
        self.W_dec = torch.nn.Parameter(torch.zeros(d_sae, d_in))
        self.b_dec = torch.nn.Parameter(torch.zeros(d_in))
        if architecture == "jumprelu":
            self.threshold = torch.nn.Parameter(torch.zeros(d_sae))

    def follow(self, x: torch.Tensor) -> None:
        """Move the dictionary to ``x``'s device (a dictionary is loaded on the CPU, the model's
        activations may live on the GPU)."""
        if self.W_enc.device != x.device:
            self.to(x.device)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self.follow(x)
        x = x.to(self.W_enc.dtype)
        pre = (x - self.b_dec if self.apply_b_dec_to_input else x) @ self.W_enc + self.b_enc
        if self.architecture == "relu":
            return torch.relu(pre)
        if self.architecture == "jumprelu":
            return torch.relu(pre) * (pre > self.threshold).to(pre.dtype)
        if self.rescale_acts_by_decoder_norm:
            pre = pre * self.W_dec.norm(dim=-1)
        top = pre.topk(self.k, dim=-1)
        z = torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
        return z / self.W_dec.norm(dim=-1) if self.rescale_acts_by_decoder_norm else z

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        self.follow(z)
        return z.to(self.W_dec.dtype) @ self.W_dec + self.b_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))


def _frozen(sae: SparseDictionary, weights: dict[str, torch.Tensor], where: str) -> SparseDictionary:
    want = dict(sae.state_dict())
    missing = sorted(set(want) - set(weights))
    if missing:
        raise SAEError(f"{where}: no tensor {', '.join(missing)} (found {', '.join(sorted(weights))})")
    for name, t in want.items():
        if tuple(weights[name].shape) != tuple(t.shape):
            raise SAEError(f"{where}: {name} has shape {tuple(weights[name].shape)}, expected {tuple(t.shape)}")
    sae.load_state_dict({n: weights[n].float() for n in want})
    sae.eval()
    for p in sae.parameters():
        p.requires_grad_(False)
    return sae


def load_sae(path: Path) -> tuple[SparseDictionary, dict[str, Any]]:
    """A dictionary from ``path``: a folder in sae-lens's, GemmaScope's or Llama Scope's layout, or a
    GemmaScope ``params.npz`` file. Returns the frozen module and its configuration (``layout`` names
    the layout read)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".npz":
        return _gemmascope(path)
    if (path / CFG_FILE).is_file() and (path / WEIGHTS_FILE).is_file():
        return _sae_lens(path)
    if (path / GEMMASCOPE_FILE).is_file():
        return _gemmascope(path / GEMMASCOPE_FILE)
    if (path / LLAMASCOPE_CFG).is_file() and (path / LLAMASCOPE_WEIGHTS).is_file():
        return _llama_scope(path)
    raise SAEError(f"{path}: no dictionary found; expected {CFG_FILE} + {WEIGHTS_FILE} (sae-lens), {GEMMASCOPE_FILE} "
                   f"(GemmaScope) or {LLAMASCOPE_CFG} + {LLAMASCOPE_WEIGHTS} (Llama Scope)")


def _sae_lens(path: Path) -> tuple[SparseDictionary, dict[str, Any]]:
    where = path / CFG_FILE
    cfg = json.loads(where.read_text())
    arch = _SAE_LENS_ARCH.get(str(cfg.get("architecture", "standard")))
    if arch is None:
        raise SAEError(f"{where}: architecture {cfg.get('architecture')!r} is not read here (readable: "
                       f"{', '.join(_SAE_LENS_ARCH)}); load it with sae-lens")
    norm = cfg.get("normalize_activations") or "none"
    if norm != "none" or (cfg.get("reshape_activations") or "none") != "none":
        raise SAEError(f"{where}: normalize_activations {norm!r} / reshape_activations "
                       f"{cfg.get('reshape_activations')!r}: fold the scaling first (sae-lens's SAE.from_pretrained "
                       "does, then SAE.save_model writes a folder this reads)")
    sae = SparseDictionary(int(cfg["d_in"]), int(cfg["d_sae"]), arch, int(cfg["k"]) if arch == "topk" else None,
                           bool(cfg.get("apply_b_dec_to_input", True)),
                           bool(cfg.get("rescale_acts_by_decoder_norm", False)))
    return _frozen(sae, load_file(str(path / WEIGHTS_FILE)), str(path / WEIGHTS_FILE)), cfg | {"layout": "sae-lens"}


def _gemmascope(path: Path) -> tuple[SparseDictionary, dict[str, Any]]:
    with np.load(path) as data:
        w = {("W_" + k[2:] if k.startswith("w_") else k): torch.from_numpy(np.asarray(data[k], dtype=np.float32))
             for k in data.files}
    if "W_enc" not in w:
        raise SAEError(f"{path}: no W_enc array (GemmaScope's params.npz holds W_enc, b_enc, threshold, W_dec, b_dec)")
    d_in, d_sae = w["W_enc"].shape
    sae = SparseDictionary(int(d_in), int(d_sae), "jumprelu", apply_b_dec_to_input=False)
    return _frozen(sae, w, str(path)), {"layout": "gemmascope", "architecture": "jumprelu", "d_in": int(d_in),
                                        "d_sae": int(d_sae), "apply_b_dec_to_input": False}


def _llama_scope(path: Path) -> tuple[SparseDictionary, dict[str, Any]]:
    hp = json.loads((path / LLAMASCOPE_CFG).read_text())
    raw = load_file(str(path / LLAMASCOPE_WEIGHTS))
    try:
        d_in, d_sae = int(hp["d_model"]), int(hp["d_sae"])
        s = math.sqrt(d_in) / float(hp["dataset_average_activation_norm"]["in"])
        thr = float(hp["jump_relu_threshold"]) * s
        w = {"W_enc": raw["encoder.weight"].float().T * s, "b_enc": raw["encoder.bias"].float(),
             "W_dec": raw["decoder.weight"].float().T / s, "b_dec": raw["decoder.bias"].float() / s,
             "threshold": torch.full((d_sae,), thr)}
    except (KeyError, TypeError, ValueError) as e:
        raise SAEError(f"{path}: not Llama Scope's layout ({type(e).__name__}: {e}); expected d_model, d_sae, "
                       "jump_relu_threshold, dataset_average_activation_norm.in and encoder/decoder weights") from None
    sae = SparseDictionary(d_in, d_sae, "jumprelu", apply_b_dec_to_input=False)
    return _frozen(sae, w, str(path / LLAMASCOPE_WEIGHTS)), {
        "layout": "llama-scope", "architecture": "jumprelu", "d_in": d_in, "d_sae": d_sae,
        "apply_b_dec_to_input": False, "norm_scaling_factor": s, "hook_name": hp.get("hook_point_in")}
