"""The attention kernel a model is loaded with (generation and training), and memtoc's CPU decode
attention (``memtoc_cpu``)."""
from __future__ import annotations

import warnings

# kernels that apply gemma-2's attention logit soft-capping (tanh(scores / cap) * cap): transformers'
# eager attention and the flash-attention kernels; SDPA and memtoc's CPU decode kernel do not
SOFTCAP_KERNELS = ("eager", "flash_attention_2", "flash_attention_3")
CPU_ATTENTION = "memtoc_cpu"


def attention_implementation(config, requested: str = "auto", device: str = "cpu",
                             training: bool = False) -> str:
    """The ``attn_implementation`` to load a model with, for generation or training.

    A model whose config has ``attn_logit_softcapping`` (gemma-2) gets ``eager`` on every device
    unless a soft-capping kernel (:data:`SOFTCAP_KERNELS`) was asked for: SDPA has no soft-capping,
    and transformers < 5.22 accepts it silently and computes wrong logits (a tiny random gemma-2:
    off by up to 8.7, 0 of 16 greedy replies equal). Else ``requested``, where ``auto`` means SDPA on
    a GPU and for training, and ``memtoc_cpu`` (SDPA prefill + a grouped matmul for one-token decode
    steps, :func:`cpu_decode_attention`) for CPU generation.
    """
    if getattr(config, "attn_logit_softcapping", None):
        if requested not in ("auto", *SOFTCAP_KERNELS):
            warnings.warn(f"{getattr(config, 'model_type', 'this model')} soft-caps its attention logits; "
                          f"attention {requested!r} would drop the soft-capping, using 'eager'", stacklevel=2)
        return requested if requested in SOFTCAP_KERNELS else "eager"
    if requested != "auto":
        return requested
    return "sdpa" if training or str(device).startswith("cuda") else CPU_ATTENTION


def cpu_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                         scaling=None, is_causal=None, **kwargs):
    """Attention for CPU generation: SDPA for prefill, a plain grouped matmul for one-token decode.

    torch's CPU SDPA kernels are slow for a single query row with a padding mask (measured ~5-14x
    slower than two small matmuls for batch 64, 9 query / 3 key-value heads, 240 keys), and decode
    steps are most of the wall time of short replies. Same maths: scores = q k^T * scale (+ mask),
    softmax in fp32, times v; grouped-query heads share their key/value head without copies. In
    bfloat16 a row's result does not depend on the other rows nor on masked columns after its keys
    (measured; the aligned layout of :mod:`memtoc.generation.backends.engine.compact` relies on it), but it does on
    where its keys start: an odd shift re-pairs the terms of the bf16 dot products.
    """
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # a sliding-window layer's one-token step takes this path only with a mask (the compact loop's
    # masks apply the window); without one (``generate``'s windowed cache) SDPA runs it
    if (query.shape[2] != 1 or dropout or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or (kwargs.get("sliding_window") and attention_mask is None)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    B, H, _, D = query.shape
    KV, L = key.shape[1], key.shape[2]
    G = H // KV
    scale = scaling if scaling is not None else D ** -0.5
    q = query.reshape(B, KV, G, D)
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale          # B, KV, G, L
    if attention_mask is not None:
        m = attention_mask[..., -L:]
        m = m.reshape(B, KV, G, L) if m.shape[1] == H else m.reshape(B, 1, 1, L)
        if m.dtype == torch.bool:
            scores = scores.masked_fill(~m, float("-inf"))
        else:
            scores = scores + m.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)                                          # B, KV, G, D
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None


def register_cpu_attention() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(CPU_ATTENTION, cpu_decode_attention)
    AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)
    return CPU_ATTENTION
