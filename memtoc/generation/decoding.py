"""One decoding policy for every backend: greedy, with the model's own generation-config penalties.

The paper served its models with ``vllm serve``, which starts every request from the model's
``generation_config.json`` (vLLM's ``--generation-config auto``) and lets the request override the
sampling fields: the requests asked for temperature 0, so replies were greedy *with* the model's
repetition penalty (Qwen2.5-Instruct ships ``repetition_penalty: 1.05``). memtoc reads that file once
per model (:func:`read_policy`) and applies the same settings on every backend:

* transformers: ``model.generate`` with ``do_sample=False`` applies the generation config's logits
  processors (the compact decode loop is used only for models without them);
* vLLM: :meth:`DecodingPolicy.vllm_sampling` builds ``SamplingParams`` from the same values.

A model without penalties gets ``DecodingPolicy()`` whose :meth:`identity` is empty, so the cache keys
of such models do not change. :func:`batch_invariant_on` decides vLLM's batch-invariant mode.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from memtoc.core.errors import ConfigError
from memtoc.core.io import package_version

#: generation-config fields that change a greedy reply, and their neutral values
PENALTIES: dict[str, float] = {"repetition_penalty": 1.0}
#: the GPUs on which vLLM's batch-invariant mode makes its matmuls invariant, per release, read from each
#: release's own rule (``enable_batch_invariant_mode``): 0.19.x installs Triton matmuls on SM 8.0, SM 8.9
#: and the SM 10 family and turns split-k off through cuBLAS on SM 9.x, with no path for other SM 8.x;
#: 0.32 installs them on the whole SM 8 family and uses cuBLAS on SM 9 and newer. Releases before 0.19
#: keep the requirement their documentation states (compute capability 9.0 or higher).
BATCH_INVARIANT_RULES: tuple[tuple[tuple[int, int], str], ...] = (
    ((0, 19), "sm80 sm89 sm9x sm10x"),
    ((0, 20), "sm8x+"),
)
BATCH_INVARIANT_MIN_CAPABILITY = (9, 0)
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def _release(version: Optional[str]) -> Optional[tuple[int, int]]:
    try:
        major, minor = str(version).split("+", 1)[0].split(".")[:2]
        return int(major), int(minor)
    except (ValueError, AttributeError):
        return None


def batch_invariant_supported(capability: tuple[int, int], vllm_version: Optional[str]) -> bool:
    """Whether ``vllm_version``'s batch-invariant mode covers a GPU of ``capability`` (major, minor)
    (:data:`BATCH_INVARIANT_RULES`; an unknown version: capability 9.0 or higher)."""
    major, minor = tuple(capability)
    rel = _release(vllm_version)
    rule = None
    for since, r in BATCH_INVARIANT_RULES:
        if rel is not None and rel >= since:
            rule = r
    if rule == "sm8x+":
        return major >= 8
    if rule == "sm80 sm89 sm9x sm10x":
        return (major, minor) in ((8, 0), (8, 9)) or major in (9, 10)
    return (major, minor) >= BATCH_INVARIANT_MIN_CAPABILITY


@dataclass(frozen=True)
class DecodingPolicy:
    """Greedy decoding plus the model's penalties (``source``: the file they came from)."""

    repetition_penalty: float = 1.0
    source: Optional[str] = None

    def identity(self) -> dict[str, Any]:
        """The cache-key part: empty for plain greedy decoding."""
        return {k: getattr(self, k) for k, neutral in PENALTIES.items() if getattr(self, k) != neutral}

    def vllm_sampling(self, max_new_tokens: int, seed: Optional[int] = None) -> dict[str, Any]:
        """Keyword arguments for ``vllm.SamplingParams``: greedy, the penalties, the token budget."""
        kw: dict[str, Any] = {"temperature": 0.0, "top_p": 1.0, "max_tokens": int(max_new_tokens), "n": 1,
                              **self.identity()}
        if seed is not None:
            kw["seed"] = seed
        return kw

    def transformers_generate(self) -> dict[str, Any]:
        """What ``model.generate`` is given besides greedy: the same penalties."""
        return self.identity()


def policy_from_config(config: Any, source: Optional[str] = None) -> DecodingPolicy:
    """The policy of a generation config (a dict, a ``GenerationConfig`` or None)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    values = {}
    for field, neutral in PENALTIES.items():
        v = get(field, None) if config is not None else None
        if v is None:
            v = neutral
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{source or 'generation config'}: field {field!r} must be a positive number, got {v!r}")
        values[field] = float(v)
    return DecodingPolicy(**values, source=source)


def read_policy(model_dir: Path) -> DecodingPolicy:
    """The policy of a model folder (its ``generation_config.json``; none: plain greedy)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return DecodingPolicy()
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (line {e.lineno}): {e.msg}") from None
    return policy_from_config(config, str(path))


#: weight-quantization methods whose fast kernels vLLM gives up in batch-invariant mode: with
#: VLLM_BATCH_INVARIANT its AWQ layers skip the Marlin kernels and dequantize the whole weight before a
#: plain matmul on every forward (vllm/model_executor/layers/quantization/auto_awq.py, 0.32: "Marlin
#: kernels are not batch invariant"; "Batch invariant mode requires torch.matmul path"), so ``auto``
#: leaves the mode off for them (the paper's 70B point ran without it); ``true`` still turns it on.
DEQUANTIZED_WHEN_INVARIANT = frozenset({"awq", "awq_marlin"})


def checkpoint_quantization(path: Path) -> Optional[str]:
    """The quantization method a checkpoint declares (``config.json``'s ``quantization_config.quant_method``,
    lower case), or None."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    method = (config.get("quantization_config") or {}).get("quant_method") if isinstance(config, dict) else None
    return str(method).lower() if method else None


def batch_invariant_on(setting: Any, capability: Optional[tuple[int, int]], vllm_version: Any = "installed",
                       quantization: Optional[str] = None) -> bool:
    """Whether vLLM's batch-invariant mode is on: ``setting`` ``"auto"`` (on where the installed vLLM's
    own rule covers the GPU, :func:`batch_invariant_supported`, and the weights are not in a quantization
    that the mode dequantizes on every forward, :data:`DEQUANTIZED_WHEN_INVARIANT`), ``True`` or
    ``False``; ``capability`` the GPU's (major, minor), None without a GPU; ``vllm_version``: default
    the installed one; ``quantization``: vLLM's ``quantization`` option or the checkpoint's method."""
    if setting not in ("auto", True, False):
        raise ConfigError(f"backend option 'batch_invariant' must be auto, true or false, got {setting!r}")
    if setting == "auto":
        if capability is None or str(quantization or "").lower() in DEQUANTIZED_WHEN_INVARIANT:
            return False
        if vllm_version == "installed":
            vllm_version = package_version("vllm")
        return batch_invariant_supported(capability, vllm_version)
    if setting is True and capability is None:
        raise ConfigError("backend option 'batch_invariant: true' needs a CUDA GPU: vLLM's batch-invariant "
                          "kernels are Triton kernels, and a CPU engine accepts the setting, then crashes at its "
                          "first forward. Use batch_invariant: auto (off on a CPU) or false")
    return bool(setting)


def set_batch_invariant_env(on: bool) -> None:
    """Set ``VLLM_BATCH_INVARIANT`` before vLLM is imported (some releases read it at import time);
    refuses to change it once vLLM is loaded with the other value."""
    want = "1" if on else "0"
    have = os.environ.get(BATCH_INVARIANT_ENV, "0")
    if "vllm" in sys.modules and (have not in ("", "0")) != on:
        raise ConfigError(f"vLLM is already loaded with {BATCH_INVARIANT_ENV}={have}; a second engine cannot "
                          f"switch it to {want}: run the two settings in separate processes")
    os.environ[BATCH_INVARIANT_ENV] = want
