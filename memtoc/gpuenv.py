"""Is there a usable GPU for what a run asks of one? Checked before any work starts.

``gpu_needs(params)`` lists the stages a run configures for the GPU (a vLLM backend, a judge or an
agent runtime on vLLM or CUDA, a transformers backend told ``device: cuda``); ``cuda_facts()``
describes the machine (torch's CUDA build, whether a device answers, its name and free memory);
``check_gpu(params, source)`` raises one ``ConfigError`` line when a stage needs a GPU the machine
does not have. ``memtoc run`` calls it before the first notebook, ``memtoc gpucheck`` before any
check (unless ``--device cpu``).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Optional

from .config import ConfigError


@dataclass(frozen=True)
class CudaFacts:
    """What torch sees of CUDA on this machine."""

    torch: str
    built_for: Optional[str]          # torch.version.cuda (None: a CPU build)
    available: bool                   # torch.cuda.is_available()
    devices: int
    name: Optional[str] = None
    free_gib: Optional[float] = None
    total_gib: Optional[float] = None

    def describe(self) -> str:
        if not self.built_for:
            return f"torch {self.torch} is a CPU build (no CUDA)"
        if not self.available:
            return (f"torch {self.torch} is built for CUDA {self.built_for} but no CUDA device answers "
                    "(no GPU, or a driver too old for this CUDA version)")
        return (f"{self.devices} CUDA device(s), {self.name}, {self.free_gib:.1f} of {self.total_gib:.1f} GiB free "
                f"(torch {self.torch}, CUDA {self.built_for})")


def cuda_facts() -> CudaFacts:
    import torch

    built = torch.version.cuda
    avail = bool(built) and torch.cuda.is_available()
    if not avail:
        return CudaFacts(torch.__version__, built, False, 0)
    free, total = torch.cuda.mem_get_info()
    return CudaFacts(torch.__version__, built, True, torch.cuda.device_count(), torch.cuda.get_device_name(),
                     free / 2**30, total / 2**30)


def _on_gpu(backend: Optional[str], options: Optional[dict]) -> bool:
    device = str((options or {}).get("device") or "")
    return backend == "vllm" or device.startswith("cuda")


def gpu_needs(params: dict[str, Any]) -> list[str]:
    """Each part of the run that is configured for the GPU, as ``"what (setting)"``."""
    out = []
    if _on_gpu(params.get("backend"), params.get("backend_options")):
        out.append(f"generation (backend: {params.get('backend')})")
    judge = params.get("judge") or {}
    if judge and _on_gpu(judge.get("backend"), judge.get("backend_options")):
        out.append(f"the judged layer (judge.backend: {judge.get('backend')})")
    agent = params.get("agent") or {}
    if agent.get("enabled", True) and _on_gpu(agent.get("runtime"), agent.get("runtime_options")):
        out.append(f"the agent loop (agent.runtime: {agent.get('runtime')})")
    return out


def check_gpu(params: dict[str, Any], source: str = "<params>", facts: Optional[CudaFacts] = None,
              min_free_gib: float = 1.0) -> Optional[CudaFacts]:
    """Raise one ConfigError line when the run needs a GPU that is not there (or has no free memory);
    returns the facts (None when nothing needs a GPU)."""
    needs = gpu_needs(params)
    if not needs:
        return None
    facts = facts or cuda_facts()
    if not facts.available:
        raise ConfigError(f"{source}: {', '.join(needs)} needs a CUDA GPU, but {facts.describe()}; run it on a "
                          "GPU machine (docs/gpu.md), or use backend: transformers on the CPU")
    if facts.free_gib is not None and facts.free_gib < min_free_gib:
        raise ConfigError(f"{source}: {', '.join(needs)} needs GPU memory, but only {facts.free_gib:.1f} GiB of "
                          f"{facts.name} is free; stop the process that holds it (nvidia-smi lists it)")
    return facts


def release_memory(device: Optional[str]) -> None:
    """Hand memory back after a model is dropped: a garbage collection (trainers and engines keep
    reference cycles), then CUDA's cached blocks when ``device`` is a GPU."""
    gc.collect()
    if str(device or "").startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
