"""The Jacobian lens (Gurnee et al., 2026; transformer-lens ``JacobianLens``) and the logit lens.

    lens_l(h) = unembed(J_l h),   J_l = E[d h_final / d h_l]

``h_l`` is the residual stream after decoder layer ``l`` (``blocks.l.hook_resid_post``), ``h_final``
the one after the last layer (before the final norm); the expectation runs over the corpus prompts,
the source positions and, for each source, the sum over all current-and-future target positions,
exactly as transformer-lens's reference estimator: per prompt, one backward pass per output
coordinate ``i`` with a one-hot cotangent at every valid target position, giving row ``i`` of
``sum_{t >= s} d h_final[t] / d h_l[s]`` for every source ``s`` and every source layer at once; rows
are averaged over the valid source positions (positions ``skip_first .. T-2``), then over prompts.
The logit lens is the same read-out with ``J_l = I``.

Artifacts use the reference layout, so a published lens (e.g. neuronpedia/jacobian-lens's
``<model>_jacobian_lens.pt``) loads with :func:`load_lens` and a lens fitted here loads with
``JacobianLens.load``: ``torch.save({"J": {layer: (d, d)}, "n_prompts", "source_layers", "d_model",
"metadata"})``; the resumable fit checkpoint is the reference's ``{"jacobian_sum", "n_done", ...}``.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from memtoc.core import progress
from memtoc.core.errors import MemtocError
from memtoc.stages.probes.hfmodel import LoadedModel, decoder_layers, layer_hooks, residuals, unembed

LENS_FILE = "lens.pt"
CHECKPOINT_FILE = "checkpoint.pt"
READOUTS = ("jacobian", "logit")


class LensError(MemtocError):
    """A lens file that cannot be read, or a lens that does not fit the model."""


@dataclass
class Lens:
    """Transport matrices per source layer (``J[l]``: (d_model, d_model), out x in)."""

    J: dict[int, torch.Tensor]
    n_prompts: int
    d_model: int
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def source_layers(self) -> list[int]:
        return sorted(self.J)


def identity_lens(d_model: int, layers: Sequence[int]) -> Lens:
    """The logit lens as a Lens: ``J_l = I``."""
    return Lens({int(l): torch.eye(d_model) for l in layers}, 0, d_model, {"estimator": "identity"})


class _Stop(Exception):
    """Raised by a hook to end a forward pass early."""


class _stop_after:
    """Context: a forward hook on layer ``l`` that raises :class:`_Stop` (no work above it)."""

    def __init__(self, model, l: int):
        self.layer = decoder_layers(model)[l]

    def __enter__(self):
        def hook(module, args, output):
            raise _Stop
        self.h = self.layer.register_forward_hook(hook)
        return self

    def __exit__(self, *exc):
        self.h.remove()
        return False


def jacobian_for_prompt(lm: LoadedModel, ids: list[int], layers: Sequence[int], dim_batch: int = 32,
                        skip_first: int = 16) -> dict[int, torch.Tensor]:
    """Exact per-prompt ``mean_s sum_{t>=s} d h_final[t] / d h_l[s]`` for every layer in ``layers``
    (s, t over the valid positions ``skip_first .. T-2``), batched one-hot cotangents."""
    model = lm.model
    T = len(ids)
    last = len(decoder_layers(model)) - 1
    layers = sorted(int(l) for l in layers)
    if layers[-1] >= last:
        raise LensError(f"source layers must be below the last layer {last}; got {layers}")
    valid = torch.arange(skip_first, T - 1, device=lm.device)
    if len(valid) == 0:
        raise LensError(f"a prompt of {T} tokens has no valid position (skip_first={skip_first})")
    d = lm.d_model
    lo = layers[0]
    ids_t = lm.ids(ids)
    with torch.no_grad():      # below the band: once, at batch 1 (the root is layer lo-1's output)
        if lo == 0:
            base = model.get_input_embeddings()(ids_t)
        else:
            got0: dict[int, torch.Tensor] = {}
            with layer_hooks(model, {lo - 1: lambda h: got0.__setitem__("h", h)}), _stop_after(model, lo - 1):
                try:
                    model.model(input_ids=ids_t)
                except _Stop:
                    pass
            base = got0["h"]
    out = {l: torch.zeros(d, d) for l in layers}
    for start in range(0, d, dim_batch):
        n = min(dim_batch, d - start)
        root = base.detach().expand(n, -1, -1).clone().requires_grad_(True)
        got: dict[int, torch.Tensor] = {}

        def grab(l):
            def fn(h):
                got[l] = h
            return fn

        fns = {l: grab(l) for l in set(layers) | {last}}
        with torch.enable_grad():
            if lo == 0:
                with layer_hooks(model, fns):
                    model.model(inputs_embeds=root)
            else:   # replace layer lo-1's output by the batch-n root; masks and rotary tables broadcast
                fns_root = {lo - 1: lambda h: root, **fns}
                with layer_hooks(model, fns_root):
                    model.model(input_ids=ids_t)
        target = got[last]
        cot = torch.zeros_like(target)
        b = torch.arange(n, device=lm.device)
        cot[b[:, None], valid[None, :], (start + b)[:, None]] = 1.0
        grads = torch.autograd.grad(target, [got[l] for l in layers], cot)
        for l, g in zip(layers, grads):
            out[l][start:start + n] = g[:, valid, :].mean(1).cpu()
    return out


def brute_force_jacobian(lm: LoadedModel, ids: list[int], layer: int, skip_first: int = 0) -> torch.Tensor:
    """The same quantity from the full autograd Jacobian of h_final (T, d) w.r.t. h_layer (T, d)
    (tests: tiny models only)."""
    model = lm.model
    last = len(decoder_layers(model)) - 1
    res, _ = residuals(lm, ids, [layer])
    h0 = res[layer]
    T, d = h0.shape

    def f(h):
        got = {}
        with layer_hooks(model, {layer: lambda _h: h[None], last: lambda _h: got.__setitem__("t", _h)}):
            model(input_ids=lm.ids(ids))
        return got["t"][0]

    full = torch.autograd.functional.jacobian(f, h0)          # (T, d, T, d): [t, i, s, j]
    v = list(range(skip_first, T - 1))
    sub = full[v][:, :, v, :]                                  # targets x i x sources x j
    return sub.sum(0).mean(1)                                  # sum over targets, mean over sources


def fit_key(lm: LoadedModel, corpus_sha: str, layers: Sequence[int], skip_first: int, max_seq_len: int,
            n_prompts: int) -> str:
    blob = json.dumps({"weights": lm.weights_sha256, "corpus": corpus_sha, "layers": sorted(layers),
                       "skip_first": skip_first, "max_seq_len": max_seq_len, "n_prompts": n_prompts},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def fit_lens(lm: LoadedModel, texts: Sequence[str], layers: Sequence[int], out_dir: Path, *,
             max_seq_len: int = 64, skip_first: int = 16, dim_batch: int = 64,
             metadata: Optional[dict] = None, desc: str = "Jacobian lens") -> Lens:
    """Fit (or resume, or load) the lens on ``texts``; ``out_dir`` holds the checkpoint and the
    final ``lens.pt``. Each finished prompt is checkpointed, so an interrupted fit resumes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / LENS_FILE
    if final.is_file():
        return load_lens(final)
    ck = out_dir / CHECKPOINT_FILE
    layers = sorted(int(l) for l in layers)
    if ck.is_file():
        state = torch.load(ck, map_location="cpu", weights_only=True)
    else:
        state = {"jacobian_sum": {l: torch.zeros(lm.d_model, lm.d_model) for l in layers}, "n_done": 0,
                 "n_seen": 0}
    seqs = [lm.encode_text(t, max_seq_len) for t in texts]
    seqs = [s for s in seqs if len(s) > skip_first + 1]
    if not seqs:
        raise LensError(f"no fit text is longer than skip_first + 1 = {skip_first + 1} tokens")
    t0 = time.time()
    for i in range(state["n_seen"], len(seqs)):
        per = jacobian_for_prompt(lm, seqs[i], layers, dim_batch, skip_first)
        for l in layers:
            state["jacobian_sum"][l] += per[l]
        state["n_done"] += 1
        state["n_seen"] = i + 1
        _atomic_save(state, ck)
        progress.report(desc, i + 1, len(seqs), t0, unit="prompts")
    meta = dict(metadata or {})
    meta.update({"estimator": "jacobian_lens", "skip_first_positions": skip_first, "max_seq_len": max_seq_len,
                 "n_tokens": int(sum(len(s) for s in seqs)), "writer": "memtoc.stages.probes.lens"})
    n = state["n_done"]
    lens = Lens({l: state["jacobian_sum"][l] / n for l in layers}, n, lm.d_model, meta)
    save_lens(lens, final)
    return lens


def save_lens(lens: Lens, path: Path) -> None:
    """The reference artifact layout (float32; the reference writes float16 by default)."""
    _atomic_save({"J": {int(l): m.float() for l, m in lens.J.items()}, "n_prompts": int(lens.n_prompts),
                  "source_layers": lens.source_layers, "d_model": int(lens.d_model),
                  "metadata": _plain(lens.metadata)}, Path(path))


def _plain(meta: dict) -> dict:
    return json.loads(json.dumps(meta, default=str))


def load_lens(path: str | os.PathLike) -> Lens:
    """A lens artifact (``J``) or a fit checkpoint (``jacobian_sum`` / ``n_done``), ours or published."""
    path = Path(path)
    if not path.is_file():
        raise LensError(f"lens file {path} does not exist; fit one (notebook 05) or give the path of a "
                        "published artifact (probes.lens_files.<model>)")
    try:
        p = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file
        raise LensError(f"{path}: not a readable torch file ({type(e).__name__}: {e})") from None
    if "J" in p:
        J = {int(l): m.float() for l, m in p["J"].items()}
        return Lens(J, int(p.get("n_prompts", 0)), int(p["d_model"]), dict(p.get("metadata") or {}))
    if "jacobian_sum" in p:
        n = int(p.get("n_done", p.get("n_prompts", 0)))
        if n < 1:
            raise LensError(f"{path}: a fit checkpoint with no finished prompt")
        J = {int(l): m.float() / n for l, m in p["jacobian_sum"].items()}
        d = next(iter(J.values())).shape[0]
        return Lens(J, n, d, dict(p.get("metadata") or {}))
    raise LensError(f"{path}: neither a lens artifact (key 'J') nor a fit checkpoint (key 'jacobian_sum')")


def check_lens(lens: Lens, lm: LoadedModel, source: str) -> None:
    if lens.d_model != lm.d_model:
        raise LensError(f"{source}: lens d_model {lens.d_model} != model {lm.name}'s {lm.d_model}")
    bad = [l for l in lens.source_layers if l >= lm.n_layers - 1]
    if bad:
        raise LensError(f"{source}: source layers {bad} are not below {lm.name}'s last layer {lm.n_layers - 1}")


def lens_logits(lm: LoadedModel, h: torch.Tensor, J: Optional[torch.Tensor]) -> torch.Tensor:
    """unembed(J h) for residual vectors h (..., d); J None = the logit lens (identity)."""
    with torch.no_grad():
        return unembed(lm.model, h if J is None else h @ J.to(h.device, h.dtype).T)


def ranks_of(logits: torch.Tensor, token_ids: Sequence[int]) -> list[int]:
    """1-based rank of each token in one logit vector (1 = top; ties count in the token's favour)."""
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)
    vals = logits[ids]
    return [int((logits > v).sum()) + 1 for v in vals]


def readout_ranks(lm: LoadedModel, ids: list[int], lens: Lens, layers: Sequence[int],
                  targets: dict[str, list[int]]) -> dict[str, dict[str, dict[int, list[int]]]]:
    """Ranks at the final input position: ``{readout: {target name: {layer: [rank per token]}}}``
    for the Jacobian lens and the logit lens."""
    res, _ = residuals(lm, ids, list(layers))
    out: dict[str, dict[str, dict[int, list[int]]]] = {r: {k: {} for k in targets} for r in READOUTS}
    for l in layers:
        h = res[l][-1]
        for r in READOUTS:
            logit = lens_logits(lm, h, lens.J[l] if r == "jacobian" else None)
            for k, toks in targets.items():
                out[r][k][l] = ranks_of(logit, toks) if toks else []
    return out


def lens_quality(lm: LoadedModel, seqs: Sequence[list[int]], lens: Lens, layers: Sequence[int],
                 skip_first: int = 1) -> dict[str, dict[int, dict[str, float]]]:
    """Per readout and layer: how often the read-out's top-1 equals the model's own top-1 next-token
    prediction, over the positions ``skip_first..`` of held-out sequences (``top1``), and ``n``."""
    hits = {r: {l: 0 for l in layers} for r in READOUTS}
    n = 0
    for ids in seqs:
        res, logits = residuals(lm, ids, list(layers))
        own = logits[skip_first:].argmax(-1)
        n += len(own)
        for l in layers:
            h = res[l][skip_first:]
            for r in READOUTS:
                top = lens_logits(lm, h, lens.J[l] if r == "jacobian" else None).argmax(-1)
                hits[r][l] += int((top == own).sum())
    return {r: {l: {"top1": hits[r][l] / n if n else None, "n": n} for l in layers} for r in READOUTS}
