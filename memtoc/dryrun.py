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
from typing import Any, Optional

from . import finetune, models
from .agent import core as agent_core
from .config import ConfigError
from .episodes import run_episodes
from .pipeline import plan, preflight, resolve_paths
from .runconfig import RunConfig
from .transfer import core as transfer
from .transfer.data import load_items

BYTES_PER_PARAM = {"bfloat16": 2.0, "float16": 2.0, "auto": 2.0, "float32": 4.0, "awq": 0.5625}
GEN_TOKENS_PER_S_8B_BF16 = {"vllm": 2500.0, "transformers": 600.0}   # one A100-80GB, batched (assumed)
TRAIN_TOKENS_PER_EXAMPLE = 200          # with-tool prompt (~170 tokens) + a short completion
GPU_TFLOPS, MFU = 312.0, 0.35           # A100 bf16 peak, assumed utilisation of LoRA training
ACT_GB_PER_TOKEN_PER_B = 0.0004         # activations per token per billion parameters: gives ~43 GB for
                                        # Llama-3.1-8B, batch 8, 512 tokens, no checkpointing (issue 18's
                                        # review estimate: 40-46 GB); not measured here
GPU_CLASSES_GB = (24, 40, 48, 80)       # common single GPUs; beyond 80 GB one GPU does not suffice
GEN_NEW_TOKEN_SHARE = 0.5
KV_CACHE_GB = 16.0


def _quant(spec: models.ModelSpec, options: dict[str, Any], dtype: str) -> str:
    q = str(options.get("quantization") or "").lower()
    if q in ("awq", "awq_marlin") or "awq" in (spec.hub_id or "").lower():
        return "awq"
    return dtype if dtype in BYTES_PER_PARAM else "auto"


def _gpu_class(need_gb: float) -> Optional[int]:
    return next((g for g in GPU_CLASSES_GB if need_gb <= g), None)


def _dur(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def estimate_model(spec: models.ModelSpec, backend: str, dtype: str, options: dict[str, Any]) -> dict[str, Any]:
    """Memory of one model on one GPU (None where the registry has no parameter count)."""
    if backend == "openai" or spec.params_b is None:
        return {"weights_gb": None, "gpu_gb": None, "gpu_class": None, "quant": None}
    quant = _quant(spec, options, dtype)
    w = spec.params_b * BYTES_PER_PARAM[quant]
    if backend == "vllm":
        util = float(options.get("gpu_memory_utilization", 0.9))
        need = (w + KV_CACHE_GB) / util
    else:
        need = w * 1.2
    return {"weights_gb": w, "gpu_gb": need, "gpu_class": _gpu_class(need), "quant": quant}


def gen_seconds(n_requests: int, weights_gb: Optional[float], backend: str, max_new_tokens: int) -> Optional[float]:
    if weights_gb is None or backend not in GEN_TOKENS_PER_S_8B_BF16:
        return None
    rate = GEN_TOKENS_PER_S_8B_BF16[backend] * 16.0 / weights_gb
    return n_requests * GEN_NEW_TOKEN_SHARE * max_new_tokens / rate


def finetune_requests(P: dict[str, Any], ft: dict[str, Any], bench) -> dict[str, int]:
    """Notebook 04's work per fine-tuned model (``finetune.run``): adapters, training examples,
    with-tool evaluation requests (untreated + every adapter on its held-out fold) and the adapters'
    own forced closed-book requests (held-out questions x formulations, per objective)."""
    plans, examples = finetune.plan(P, bench)
    n_forms = len(RunConfig.of(P).formulations)
    n_obj = len(ft["objectives"])
    n_held = sum(len(p.eval_questions) for p in plans)
    with_tool = n_held * len(ft["eval_conditions"]) * n_forms
    return {"adapters": n_obj * len(plans), "train_examples": sum(len(v) for v in examples.values()),
            "with_tool": with_tool * (1 + n_obj), "adapter_closed_book": n_obj * n_held * n_forms}


def transfer_requests(P: dict[str, Any], ft: dict[str, Any], model: str, adapters_of_04: bool) -> dict[str, int]:
    """Notebook 06's requests for ``model`` (``transfer.run``): the transfer episodes for the untreated
    model and each forward arm (``adapters_of_04``: 04's adapters exist or are read from
    ``adapters_from``, for a fine-tuned model), and with ``reverse`` the MemToC held-out episodes for
    the untreated model and the reverse adapter, the reverse adapter's own closed-book prompts, and
    its DPO training examples and steps."""
    tr = transfer.transfer_params(P)
    cf, un = transfer.select_items(load_items(tr["dataset"])[0], tr)
    episodes = len(transfer.build_episodes(cf, un, tr["formulations"], tr["frames"]))
    arms = len(tr["extra_adapters"])
    if model in ft["models"] and (adapters_of_04 or tr["adapters_from"]):
        arms += len(tr["forward_objectives"]) * len(tr["forward_folds"])
    out = {"episodes": episodes, "forward_arms": arms, "forward": episodes * (1 + arms),
           "reverse_with_tool": 0, "reverse_closed_book": 0, "reverse_examples": 0, "reverse_steps": 0}
    if tr["reverse"]:
        cfg = RunConfig.of(P)
        n_forms = len(cfg.formulations)
        n_q = min(tr["reverse_eval_questions"], cfg.n_questions)
        n_ex = len(transfer.reverse_examples(cf, tr["reverse_train_formulations"], tr["frames"]))
        steps = tr["reverse_max_steps"]
        out.update(reverse_with_tool=2 * n_q * n_forms * len(ft["eval_conditions"]),
                   reverse_closed_book=n_q * n_forms, reverse_examples=n_ex,
                   reverse_steps=steps if steps > 0 else math.ceil(n_ex / tr["reverse_batch_size"]))
    out["total"] = out["forward"] + out["reverse_with_tool"] + out["reverse_closed_book"]
    return out


def dpo_seconds(n_examples: float, params_b: float) -> float:
    """Training time of a LoRA DPO run over ``n_examples`` examples (the module's formula)."""
    return n_examples * TRAIN_TOKENS_PER_EXAMPLE * 16 * params_b * 1e9 / (GPU_TFLOPS * 1e12 * MFU)


def judge_memory(params: dict[str, Any], lines: list[str], cannot: list[str]) -> list[dict[str, Any]]:
    """The judge engine's memory line (notebook 03 loads it after closing the run's generators, so
    it needs its own GPU share, not one beside theirs); [] without a judge or a parameter count."""
    j = params.get("judge")
    if not j:
        return []
    try:
        spec = models.get_model(j["model"])
    except models.ModelError:
        spec = models.ModelSpec(j["model"], j["model"], "remote")
    e = estimate_model(spec, j["backend"], params["dtype"], j.get("backend_options") or {})
    if e["weights_gb"] is None:
        lines.append(f"  judge {spec.name:<26} {j['backend']}: memory unknown (no parameter count)")
        return []
    gpu = f"{e['gpu_class']} GB GPU" if e["gpu_class"] else "no single GPU (needs more than 80 GB)"
    lines.append(f"  judge {spec.name:<26} {spec.params_b:g}B params, {e['quant']}: weights ~{e['weights_gb']:.0f} GB, "
                 f"needs ~{e['gpu_gb']:.0f} GB -> {gpu} (loaded in 03 after the run's generators are closed)")
    if e["gpu_class"] is None:
        cannot.append(f"the judge {spec.name} needs ~{e['gpu_gb']:.0f} GB of GPU memory; raise "
                      "judge.backend_options.gpu_memory_utilization or use a smaller judge")
    return [e]


def dry_run(params: dict[str, Any], only: Optional[list[str]] = None, source: str = "<params>") -> str:
    """The plan as text; raises ConfigError (one line) for what cannot run."""
    params = resolve_paths(params)
    steps = plan(params, only)
    facts = preflight(params, steps, source)
    bench, ft = facts["bench"], facts["finetune"]
    P = dict(params)
    episodes = run_episodes(bench, P)
    n_forms = len(params["formulations"])
    variants = 2 if params["elicit_permissive"] else 1
    n02 = params["n_questions"] * n_forms * variants
    n03 = len(episodes)
    specs = []
    for m in params["models"]:
        try:
            spec = models.get_model(m)
        except models.ModelError:
            spec = models.ModelSpec(m, m, "remote")
        specs.append(spec)
    lines = [f"memtoc run {source} --dry-run: run {params['run_name']}, backend {params['backend']}, "
             f"dtype {params['dtype']}, max_new_tokens {params['max_new_tokens']}",
             f"release {params['release_dir']} ({facts['n_analysis']} analysis questions; "
             f"{params['n_questions']} headline, {params['n_questions_extra']} for the extra arms)"]
    lines.append("")
    lines.append("models (memory: weights; smallest single GPU that holds them with the backend's headroom)")
    est = {}
    cannot = []
    for spec in specs:
        e = estimate_model(spec, params["backend"], params["dtype"], params["backend_options"] or {})
        est[spec.name] = e
        if e["weights_gb"] is None:
            lines.append(f"  {spec.name:<32} {params['backend']}: memory unknown (no parameter count)")
            continue
        gpu = f"{e['gpu_class']} GB GPU" if e["gpu_class"] else "no single GPU (needs more than 80 GB)"
        lines.append(f"  {spec.name:<32} {spec.params_b:g}B params, {e['quant']}: weights ~{e['weights_gb']:.0f} GB, "
                     f"needs ~{e['gpu_gb']:.0f} GB -> {gpu}")
        if e["gpu_class"] is None:
            cannot.append(f"{spec.name} in {e['quant']} needs ~{e['gpu_gb']:.0f} GB of GPU memory, more than one "
                          "80 GB GPU; use a quantized checkpoint (e.g. AWQ-int4) or a smaller model")
    judge_est = judge_memory(params, lines, cannot)
    if cannot:
        raise ConfigError(f"{source}: cannot run: " + "; ".join(cannot))

    ft_on = any(s.run and s.number == "04" for s in steps)
    total_s = 0.0
    unknown_time = False
    lines.append("")
    lines.append("notebooks (requests per model; time per model on one A100-80GB, rough)")
    for s in steps:
        if not s.run:
            lines.append(f"  {s.name:<18} skipped ({s.reason})")
            continue
        if s.number == "02":
            n, what = n02, f"closed-book: {params['n_questions']} questions x {n_forms} formulations x {variants} variant(s)"
        elif s.number == "03":
            n, what = n03, "with-tool episodes (core conditions + extra arms), closed-book served by 02"
        elif s.number == "04":
            n, what = None, ""
        elif s.number in ("01", "08", "09"):
            lines.append(f"  {s.name:<18} no generation")
            continue
        elif s.number == "07":
            a = agent_core.agent_params(P)
            lines.append(f"  {s.name:<18} agent episodes per model (questions x formulations x schema variants x "
                         f"{len(a['protocols'])} protocols), model requests at most; runtime {a['runtime']}, "
                         f"{a['max_tokens_per_call']} tokens per call")
            for spec in specs:
                aq = agent_core.planned_requests(P, spec.name)
                if not aq["episodes"]:
                    continue
                what = f"{aq['episodes']} episodes, <= {aq['requests_max']} requests"
                t = (gen_seconds(aq["requests_max"], est[spec.name]["weights_gb"], "transformers", a["max_tokens_per_call"])
                     if a["runtime"] == "transformers" else None)
                if t is None:
                    unknown_time = True
                    lines.append(f"      {spec.name:<28} {what}, time unknown ({a['runtime']} runtime)")
                    continue
                total_s += t
                lines.append(f"      {spec.name:<28} {what} ~{_dur(t)}")
            continue
        elif s.number != "06":
            lines.append(f"  {s.name:<18} requests not estimated here (see its notebook)")
            unknown_time = True
            continue
        if s.number == "04":
            fr = finetune_requests(P, ft, bench)
            n_eval = fr["with_tool"] + fr["adapter_closed_book"]
            n_train = fr["train_examples"]
            lines.append(f"  {s.name:<18} {fr['adapters']} adapter(s) per fine-tuned model ({', '.join(ft['objectives'])} "
                         f"x folds {ft['folds']}), {n_train} training examples over the folds; {n_eval} evaluation "
                         f"requests per model ({fr['with_tool']} with-tool, untreated + adapters; "
                         f"{fr['adapter_closed_book']} the adapters' own closed-book)")
            ft_specs = [spec for spec in specs if spec.name in ft["models"]]
            if not ft_specs:
                lines.append("      no fine-tuned models (finetune.models)")
            for spec in ft_specs:
                e = est[spec.name]
                if e["weights_gb"] is None:
                    unknown_time = True
                    continue
                pb = spec.params_b
                steps_tok = n_train * ft["epochs"] * TRAIN_TOKENS_PER_EXAMPLE
                flops = sum(steps_tok * (6 if o == "sft" else 16) * pb * 1e9 for o in ft["objectives"])
                t_train = flops / (GPU_TFLOPS * 1e12 * MFU)
                t_eval = gen_seconds(n_eval, pb * 2.0, "transformers", params["max_new_tokens"]) or 0.0
                act = ACT_GB_PER_TOKEN_PER_B * ft["batch_size"] * 2 * ft["max_length"] * pb
                if ft["gradient_checkpointing"]:
                    act /= 4
                mem = pb * 2.0 + act
                cls = _gpu_class(mem)
                total_s += t_train + t_eval
                lines.append(f"      {spec.name:<28} training ~{_dur(t_train)}, evaluation ~{_dur(t_eval)} "
                             f"(transformers); DPO memory ~{mem:.0f} GB -> "
                             + (f"{cls} GB GPU" if cls else "more than one 80 GB GPU: enable "
                                "finetune.gradient_checkpointing or lower finetune.batch_size"))
            continue
        if s.number == "06":
            tr = transfer.transfer_params(P)
            lines.append(f"  {s.name:<18} requests per model: the transfer episodes for the untreated model and each "
                         "forward adapter" + ("; the MemToC held-out episodes for the untreated model and the "
                                              "reverse adapter, and the reverse adapter's own closed-book"
                                              if tr["reverse"] else ""))
            for spec in specs:
                tq = transfer_requests(P, ft, spec.name, ft_on)
                what = (f"{tq['total']} requests ({tq['episodes']} episodes x {1 + tq['forward_arms']} arm(s)"
                        + (f"; reverse {tq['reverse_with_tool']} with-tool + {tq['reverse_closed_book']} closed-book, "
                           f"DPO {tq['reverse_steps']} step(s) of {tr['reverse_batch_size']}" if tr["reverse"] else "")
                        + ")")
                t = gen_seconds(tq["total"], est[spec.name]["weights_gb"], params["backend"], params["max_new_tokens"])
                if t is None or spec.params_b is None:
                    unknown_time = True
                    lines.append(f"      {spec.name:<28} {what}, time unknown ({params['backend']})")
                    continue
                t_train = dpo_seconds(tq["reverse_steps"] * tr["reverse_batch_size"], spec.params_b)
                total_s += t + t_train
                lines.append(f"      {spec.name:<28} {what} ~{_dur(t + t_train)}")
            continue
        lines.append(f"  {s.name:<18} {n} requests per model ({what})")
        for spec in specs:
            t = gen_seconds(n, est[spec.name]["weights_gb"], params["backend"], params["max_new_tokens"])
            if t is None:
                unknown_time = True
                lines.append(f"      {spec.name:<28} time unknown ({params['backend']})")
            else:
                total_s += t
                lines.append(f"      {spec.name:<28} ~{_dur(t)}")
    if params.get("judge"):
        lines.append(f"  judged layer: about {n03} judge requests per model with {params['judge']['model']}")
    lines.append("")
    lines.append(f"total generation + training, rough: ~{_dur(total_s)}"
                 + (" (plus the parts whose time is unknown)" if unknown_time else "")
                 + "; statistics (n_boot, n_perm) and the report add minutes")
    need = max((e["gpu_class"] or 0) for e in [*est.values(), *judge_est]) if est or judge_est else 0
    if params["backend"] == "vllm":
        lines.append(f"needs: a CUDA GPU with at least {need} GB and the vllm package (pip install 'memtoc[gpu]')"
                     + ("; 04 trains and evaluates with transformers" if ft_on else ""))
    elif params["backend"] == "transformers":
        lines.append("needs: nothing beyond the CPU install (a GPU only makes it faster; the times above are "
                     "for one A100-80GB)")
    lines.append("estimates use the formulas in memtoc/dryrun.py (assumed constants, not measurements)")
    return "\n".join(lines)
