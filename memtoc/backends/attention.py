"""The attention kernel a model is loaded with (generation and training)."""
from __future__ import annotations

import warnings


# kernels that apply gemma-2's attention logit soft-capping (tanh(scores / cap) * cap): transformers'
# eager attention and the flash-attention kernels; SDPA and memtoc's CPU decode kernel do not
SOFTCAP_KERNELS = ("eager", "flash_attention_2", "flash_attention_3")


def attention_implementation(config, requested: str = "auto", device: str = "cpu",
                             training: bool = False) -> str:
    """The ``attn_implementation`` to load a model with, for generation or training.

    A model whose config has ``attn_logit_softcapping`` (gemma-2) gets ``eager`` on every device
    unless a soft-capping kernel (:data:`SOFTCAP_KERNELS`) was asked for: SDPA has no soft-capping,
    and transformers < 5.22 accepts it silently and computes wrong logits (a tiny random gemma-2:
    off by up to 8.7, 0 of 16 greedy replies equal). Else ``requested``, where ``auto`` means SDPA on
    a GPU and for training, and ``memtoc_cpu`` (SDPA prefill + a grouped matmul for one-token decode
    steps, :func:`memtoc.backends.hf.cpu_decode_attention`) for CPU generation.
    """
    if getattr(config, "attn_logit_softcapping", None):
        if requested not in ("auto", *SOFTCAP_KERNELS):
            warnings.warn(f"{getattr(config, 'model_type', 'this model')} soft-caps its attention logits; "
                          f"attention {requested!r} would drop the soft-capping, using 'eager'", stacklevel=2)
        return requested if requested in SOFTCAP_KERNELS else "eager"
    if requested != "auto":
        return requested
    return "sdpa" if training or str(device).startswith("cuda") else "memtoc_cpu"
