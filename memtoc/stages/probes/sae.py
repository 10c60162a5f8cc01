"""A TopK sparse autoencoder on residual-stream activations: trainer, metrics, the FVU gate, and
files in sae-lens's on-disk format (``cfg.json`` + ``sae_weights.safetensors``, architecture
``topk``), so ``sae_lens.SAE.load_from_disk(dir)`` reads them on a machine that has sae-lens.

    encode(x) = TopK_k(ReLU((x - b_dec) W_enc + b_enc)),   decode(z) = z W_dec + b_dec

Metrics: FVU = sum ||x - x_hat||^2 / sum ||x - mean(x)||^2 (0 for a perfect reconstruction, 1 for
predicting the mean), L0 (mean active latents per token), dead latents (never active on the
evaluation tokens), and the spliced loss: the model's next-token loss with the layer's residual
stream replaced by its reconstruction, minus the clean loss. The paper's gate: full-sequence
FVU < 0.5 on the run's own episodes' activations. Pretrained dictionaries (ReLU, JumpReLU, TopK in
sae-lens's, GemmaScope's or Llama Scope's layout) load with ``dictionaries.load_sae``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from safetensors.torch import save_file

from memtoc.core.vocab import FVU_GATE
from memtoc.stages.probes.dictionaries import CFG_FILE, WEIGHTS_FILE, SparseDictionary
from memtoc.stages.probes.hfmodel import LoadedModel, decoder_layers, layer_hooks


class TopKSAE(SparseDictionary):
    """The dictionary memtoc trains: TopK, inputs centred by ``b_dec``."""

    def __init__(self, d_in: int, d_sae: int, k: int):
        super().__init__(d_in, d_sae, "topk", k=k, apply_b_dec_to_input=True)


def fvu(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Fraction of variance unexplained over all rows of ``x`` (n, d)."""
    x, x_hat = x.double(), x_hat.double()
    den = ((x - x.mean(0, keepdim=True)) ** 2).sum()
    return float(((x - x_hat) ** 2).sum() / den) if den > 0 else float("nan")


def train_topk(acts: torch.Tensor, d_sae: int, k: int, steps: int = 1000, batch: int = 256,
               lr: float = 1e-3, seed: int = 0) -> tuple[TopKSAE, dict[str, Any]]:
    """Train a TopK SAE on ``acts`` (n, d): Adam on the reconstruction MSE, decoder rows kept at
    unit norm, b_dec initialised at the mean, encoder = decoder transpose at init."""
    g = torch.Generator().manual_seed(seed)
    n, d = acts.shape
    sae = TopKSAE(d, d_sae, k).to(acts.device)
    with torch.no_grad():
        W = torch.randn(d_sae, d, generator=g)
        W /= W.norm(dim=1, keepdim=True)
        sae.W_dec.copy_(W)
        sae.W_enc.copy_(W.T)
        sae.b_dec.copy_(acts.mean(0))
    opt = torch.optim.Adam(sae.parameters(), lr=lr)
    losses = []
    with torch.enable_grad():
        for step in range(steps):
            idx = torch.randint(0, n, (min(batch, n),), generator=g).to(acts.device)
            x = acts[idx]
            loss = ((sae(x) - x) ** 2).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                sae.W_dec /= sae.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-8)
            losses.append(float(loss.detach()))
    sae.eval()
    for p in sae.parameters():
        p.requires_grad_(False)
    return sae, {"steps": steps, "batch": batch, "lr": lr, "seed": seed, "n_train_tokens": n,
                 "final_loss": losses[-1] if losses else None}


def metrics(sae: SparseDictionary, acts: torch.Tensor) -> dict[str, Any]:
    """FVU, L0 and dead latents on ``acts`` (n, d)."""
    with torch.no_grad():
        z = sae.encode(acts)
        rec = sae.decode(z)
    active = (z > 0)
    return {"fvu": fvu(acts, rec), "l0": float(active.sum(-1).float().mean()),
            "dead_fraction": float((~active.any(0)).float().mean()), "n_tokens": int(acts.shape[0]),
            "passes_gate": bool(fvu(acts, rec) < FVU_GATE)}


def spliced_loss(lm: LoadedModel, seqs: Sequence[list[int]], layer: int, sae: SparseDictionary) -> dict[str, Any]:
    """Mean next-token cross-entropy over ``seqs`` clean and with layer ``layer``'s residual stream
    replaced by the SAE reconstruction at every position; ``increase`` = spliced - clean."""
    tot = {"clean": 0.0, "spliced": 0.0}
    n = 0
    for ids in seqs:
        x = lm.ids(ids)
        with torch.no_grad():
            clean = lm.model(input_ids=x, labels=x).loss
            with layer_hooks(lm.model, {layer: lambda h: sae(h)}):
                spl = lm.model(input_ids=x, labels=x).loss
        m = len(ids) - 1
        tot["clean"] += float(clean) * m
        tot["spliced"] += float(spl) * m
        n += m
    c, s = tot["clean"] / n, tot["spliced"] / n
    return {"clean": c, "spliced": s, "increase": s - c, "n_tokens": n}


def save_sae(sae: TopKSAE, path: Path, *, model_name: str, layer: int, extra: Optional[dict] = None) -> Path:
    """sae-lens layout: ``cfg.json`` (TopKSAEConfig fields, architecture ``topk``, metadata with the
    transformer-lens hook name) + ``sae_weights.safetensors`` (W_enc, b_enc, W_dec, b_dec)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().cpu().contiguous() for k, v in sae.state_dict().items()}, str(path / WEIGHTS_FILE))
    cfg = {"d_in": sae.d_in, "d_sae": sae.d_sae, "k": sae.k, "dtype": "float32", "device": "cpu",
           "apply_b_dec_to_input": True, "normalize_activations": "none", "reshape_activations": "none",
           "rescale_acts_by_decoder_norm": False, "architecture": "topk",
           "metadata": {"model_name": model_name, "hook_name": f"blocks.{layer}.hook_resid_post",
                        "hook_head_index": None, "prepend_bos": True, "context_size": None,
                        "dataset_path": None, "model_from_pretrained_kwargs": {},
                        "sae_lens_training_version": None, "memtoc": extra or {}}}
    (path / CFG_FILE).write_text(json.dumps(cfg, indent=1, default=str))
    return path


def layer_acts(lm: LoadedModel, seqs: Sequence[list[int]], layer: int, positions: str = "all"
               ) -> list[torch.Tensor]:
    """Layer ``layer``'s residual stream per sequence ((T, d) each, float32; ``positions='last'``: (1, d)),
    the forward pass stopped after that layer."""
    out = []
    blk = decoder_layers(lm.model)[layer]
    for ids in seqs:
        got = {}

        def hook(module, args, output):
            got["h"] = (output[0] if isinstance(output, tuple) else output)[0].detach().float()
            raise _Halt

        h = blk.register_forward_hook(hook)
        try:
            with torch.no_grad():
                lm.model.model(input_ids=lm.ids(ids))
        except _Halt:
            pass
        finally:
            h.remove()
        out.append(got["h"][-1:] if positions == "last" else got["h"])
    return out


class _Halt(Exception):
    pass
