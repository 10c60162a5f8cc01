"""Training one LoRA adapter with trl (SFT or DPO), resumable by config hash."""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Optional, Sequence

from packaging.version import Version

from memtoc.config.blocks import FinetuneConfig
from memtoc.core.errors import check_choice
from memtoc.core.io import sha256_json
from memtoc.generation import models
from memtoc.generation.hardware import auto_dtype_name, placement, release_memory, warn_emulated_bf16
from memtoc.generation.models import attention_implementation
from memtoc.stages.finetune.common import OBJECTIVES, FinetuneError
from memtoc.stages.finetune.data import TrainExample, dpo_rows, sft_rows
from memtoc.stages.finetune.tables import plot_loss_curve

#: The hyper-parameters that define an adapter (shared by matched SFT and DPO runs).
TRAINING_KEYS = ("epochs", "max_steps", "learning_rate", "lr_scheduler", "warmup_ratio", "lora_r",
                 "lora_alpha", "lora_dropout", "target_modules", "dpo_beta", "batch_size", "grad_accum",
                 "max_length", "train_dtype", "seed")


def train_dtype(ft: FinetuneConfig, cuda: Optional[bool] = None) -> str:
    """``ft.train_dtype`` resolved on this machine (``auto``: bfloat16 on a GPU or a CPU with bf16
    instructions, float32 elsewhere, a GPU without bf16 (T4, V100) included: float16 weights would need
    loss scaling, which memtoc's trainer does not set up); warns once when bfloat16 is asked for on a CPU
    that emulates it. ``cuda``: whether training runs on a GPU (default: torch's answer)."""
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    if ft.train_dtype == "auto":
        name = auto_dtype_name(cuda)
        return name if name == "bfloat16" else "float32"
    warn_emulated_bf16(ft.train_dtype, cuda, "finetune.train_dtype")
    return ft.train_dtype


def training_config(ft: FinetuneConfig, cuda: Optional[bool] = None) -> dict[str, Any]:
    """The hyper-parameters that define an adapter (shared by matched SFT and DPO runs), with the
    training dtype resolved on this machine (so an adapter's identity names what it computed in)."""
    resolved = ft.to_dict()
    return {**{k: resolved[k] for k in TRAINING_KEYS}, "train_dtype": train_dtype(ft, cuda)}


def config_hash(objective: str, ft: FinetuneConfig, base_weights: str, rows: Sequence[dict],
                eos_token: Optional[str] = None) -> str:
    """Hash of everything an adapter depends on: objective, hyper-parameters, base weights, data
    (``eos_token``: the completions' end token, when it is not the tokenizer's own EOS)."""
    extra = {"eos_token": eos_token} if eos_token is not None else {}
    return sha256_json({"objective": objective, "training": training_config(ft), "base_weights": base_weights,
                 "data": sha256_json(list(rows)), **extra})[:16]


def finished_adapter(path: Path, chash: str) -> Optional[dict[str, Any]]:
    """The training record of a finished adapter with config hash ``chash`` at ``path`` (else None)."""
    rec = path / "training.json"
    if not rec.is_file() or not (path / "adapter_config.json").is_file():
        return None
    try:
        info = json.loads(rec.read_text())
    except ValueError:
        return None
    if info.get("config_hash") != chash or info.get("status") != "finished":
        return None
    if not any((path / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        return None
    return info


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("torch", "transformers", "trl", "peft"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def loss_curve(log_history: Sequence[dict]) -> list[dict[str, Any]]:
    """Per logged step: step, loss, learning rate (+ DPO reward accuracy / margin when logged)."""
    keep = ("loss", "learning_rate", "grad_norm", "rewards/accuracies", "rewards/margins",
            "mean_token_accuracy", "epoch")
    out = []
    for h in log_history:
        if "loss" in h and "step" in h:
            out.append({"step": int(h["step"]), **{k: float(h[k]) for k in keep if k in h}})
    return out


def warmup_kwargs(ratio: float, transformers_version: Optional[str] = None) -> dict[str, Any]:
    """The TrainingArguments keyword that makes ``ratio`` (share of the optimizer steps) a *ratio*.

    transformers >= 5.0 reads a float ``warmup_steps`` below 1 as a ratio and removed
    ``warmup_ratio`` in 5.2 (deprecated in 5.0; huggingface/transformers#41326); before 5.0
    ``warmup_steps`` is a step count (0.1 would mean 0.1 steps, i.e. no warm-up) and the ratio goes
    in ``warmup_ratio``. ``transformers_version``: default the installed one."""
    if transformers_version is None:
        transformers_version = metadata.version("transformers")
    ratio = float(ratio)
    if not 0 <= ratio < 1:
        raise FinetuneError(f"finetune.warmup_ratio must be in [0, 1), got {ratio!r}")
    if Version(transformers_version) >= Version("5.0.0"):
        return {"warmup_steps": ratio if ratio > 0 else 0}
    return {"warmup_ratio": ratio, "warmup_steps": 0}


def training_arguments(ft: FinetuneConfig, out_dir, *, progress: bool = True, cuda: bool = False,
                       transformers_version: Optional[str] = None,
                       arg_names: Optional[set[str]] = None) -> dict[str, Any]:
    """Keyword arguments shared by trl's SFTConfig and DPOConfig. ``arg_names``: the field names of
    ``transformers.TrainingArguments`` (default: the installed one's); checkpointing goes under
    ``activation_checkpointing`` where it exists (transformers >= 5.24; ``gradient_checkpointing``
    is its deprecated alias there), else ``gradient_checkpointing``. trl's configs default it to on;
    it is always passed explicitly. So is the mixed precision: trl's configs default to ``bf16=True``
    even on a CPU, which autocasts every step to bfloat16 (emulated, ~30x slower, on a CPU without bf16
    instructions); here ``bf16`` is on exactly when the resolved training dtype is bfloat16."""
    if arg_names is None:

        from transformers import TrainingArguments
        arg_names = {f.name for f in dataclasses.fields(TrainingArguments)}
    ckpt = "activation_checkpointing" if "activation_checkpointing" in arg_names else "gradient_checkpointing"
    out = dict(
        output_dir=str(Path(out_dir) / "_trainer"), num_train_epochs=float(ft.epochs),
        max_steps=int(ft.max_steps), learning_rate=ft.learning_rate, lr_scheduler_type=ft.lr_scheduler,
        per_device_train_batch_size=ft.batch_size, gradient_accumulation_steps=ft.grad_accum,
        max_length=ft.max_length, seed=ft.seed, data_seed=ft.seed, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=not cuda, disable_tqdm=not progress,
        dataloader_num_workers=0, **{ckpt: bool(ft.gradient_checkpointing)},
        bf16=train_dtype(ft, cuda) == "bfloat16", fp16=False,
        **warmup_kwargs(ft.warmup_ratio, transformers_version),
    )
    if ft.gradient_checkpointing:
        out[f"{ckpt}_kwargs"] = {"use_reentrant": False}
    return out


def leading_special_text(tokenizer) -> str:
    """The text of the special tokens a plain ``tokenizer(text)`` call puts in front (a BOS for
    Llama-3 / gemma-2 / Mistral tokenizers; "" for SmolLM2 and Qwen). Raises FinetuneError when the
    tokenizer also appends special tokens (trl's plain-text rows could not match inference then)."""
    probe = "FINAL: x"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    special = tokenizer(probe)["input_ids"]
    n = len(special)
    start = next((i for i in range(n - len(plain) + 1) if special[i:i + len(plain)] == plain), None)
    if start is None or start + len(plain) != n:
        raise FinetuneError(f"the tokenizer {type(tokenizer).__name__} appends special tokens to every text; "
                            "memtoc's training rows cannot reproduce the inference token ids with it")
    return "".join(tokenizer.convert_ids_to_tokens(special[:start])) if start else ""


def training_prompt(tokenizer, spec, prompt: str) -> str:
    """The prompt text for trl's plain-text rows, such that trl's tokenization (``tokenizer(text)``,
    special tokens added) gives exactly the ids the generator feeds at inference.

    Chat models: the generator renders the chat template (which already starts with the BOS text
    for Llama-3.1 / gemma-2 / Mistral) and tokenizes it without special tokens; trl would add a
    second BOS, so the template's leading BOS text is removed here. Base models: the raw prompt,
    special tokens added on both sides."""
    text, special = models.render_prompt(tokenizer, spec, prompt)
    if special:
        return text
    lead = leading_special_text(tokenizer)
    if not lead:
        return text
    if not text.startswith(lead):
        raise FinetuneError(f"{spec.name}: the tokenizer adds {lead!r} in front of every text but the chat "
                            "template does not start with it; training would see a token inference does not")
    return text[len(lead):]


def check_training_tokens(tokenizer, spec, prompts: Sequence[str]) -> None:
    """Raise FinetuneError unless trl's tokenization of :func:`training_prompt` equals the
    generator's tokenization of the rendered prompt (one BOS where inference has one)."""
    for p in prompts:
        text, special = models.render_prompt(tokenizer, spec, p)
        want = tokenizer(text, add_special_tokens=special)["input_ids"]
        got = tokenizer(training_prompt(tokenizer, spec, p))["input_ids"]
        if got != want:
            raise FinetuneError(f"{spec.name}: training prompt tokens differ from inference ({got[:6]}... vs "
                                f"{want[:6]}...); refusing to train on a context the model never sees")


def training_eos(tokenizer, spec) -> str:
    """The token every training completion ends with: for chat models the special token the chat
    template writes right after an assistant message (``<end_of_turn>`` for gemma-2, while its
    ``eos_token`` is ``<eos>``), else the tokenizer's ``eos_token``."""
    _, special = models.render_prompt(tokenizer, spec, "x")
    if special:
        return tokenizer.eos_token
    answer = "FINAL: \u2063x"
    full = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": answer}],
                                         tokenize=False)
    after = full[full.rindex(answer) + len(answer):] if answer in full else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(ids[0]) if ids else None
    if ids and (ids[0] in tokenizer.all_special_ids or getattr(added, "special", False)):
        return tokenizer.convert_ids_to_tokens(ids[0])
    return tokenizer.eos_token


def load_train_model(base_path, ft: FinetuneConfig):
    """The base model for training (``train_dtype``; eager attention for soft-capping models), loaded
    straight onto the GPU when there is one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cuda = torch.cuda.is_available()
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[train_dtype(ft, cuda)]
    attn = attention_implementation(AutoConfig.from_pretrained(base_path), "auto",
                                    "cuda" if cuda else "cpu", training=True)
    return AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype, attn_implementation=attn,
                                                **placement("cuda" if cuda else None))


def make_trainer(model, tokenizer, rows: Sequence[dict], objective: str, ft: FinetuneConfig, out_dir,
                 *, progress: bool = True, eos_token: Optional[str] = None):
    """trl's SFTTrainer (prompt-completion rows, completion-only loss) or DPOTrainer (preference
    rows) with the LoRA configuration of ``ft``; the dataset is tokenized on construction.

    trl appends ``tokenizer.eos_token`` to every completion; ``eos_token`` (:func:`training_eos`),
    when given, is ``tokenizer.eos_token`` while the rows are tokenized (then restored), so
    completions end with the chat template's end-of-turn token, as at inference."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig

    check_choice("objective", objective, OBJECTIVES)
    lora = LoraConfig(r=ft.lora_r, lora_alpha=ft.lora_alpha, lora_dropout=ft.lora_dropout,
                      target_modules=list(ft.target_modules), task_type="CAUSAL_LM", bias="none")
    common = training_arguments(ft, out_dir, progress=progress, cuda=torch.cuda.is_available())
    ds = Dataset.from_list(list(rows))
    own_eos = tokenizer.eos_token
    if eos_token is not None:
        tokenizer.eos_token = eos_token
    try:
        if objective == "sft":
            from trl import SFTConfig, SFTTrainer
            return SFTTrainer(model=model, args=SFTConfig(completion_only_loss=True, **common), train_dataset=ds,
                              processing_class=tokenizer, peft_config=lora)
        from trl import DPOConfig, DPOTrainer
        return DPOTrainer(model=model, args=DPOConfig(beta=float(ft.dpo_beta), **common), train_dataset=ds,
                          processing_class=tokenizer, peft_config=lora)
    finally:
        tokenizer.eos_token = own_eos


def train_adapter(base_path, spec, examples: Sequence[TrainExample], objective: str, ft: FinetuneConfig,
                  out_dir, *, progress: bool = True, force: bool = False) -> dict[str, Any]:
    """Train one LoRA adapter with trl (SFTTrainer or DPOTrainer) and write it to ``out_dir``.

    ``spec``: the ``models.ModelSpec`` of the base (for prompt rendering). Returns the training
    record (also written to ``out_dir/training.json``). When a finished adapter with the same config
    hash exists, nothing is trained and its record is returned with ``resumed = True``.
    """
    check_choice("objective", objective, OBJECTIVES)
    if not examples:
        raise FinetuneError(f"{out_dir}: no training examples")
    import torch
    from transformers import AutoTokenizer

    base_path = Path(base_path)
    out_dir = Path(out_dir)
    tok = AutoTokenizer.from_pretrained(base_path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def render(p: str) -> str:
        return training_prompt(tok, spec, p)

    check_training_tokens(tok, spec, [e.prompt for e in examples[:4]])
    rows = sft_rows(examples, render) if objective == "sft" else dpo_rows(examples, render)
    eos = training_eos(tok, spec)
    chash = config_hash(objective, ft, models.weights_hash(base_path), rows, eos if eos != tok.eos_token else None)
    done = finished_adapter(out_dir, chash)
    if done is not None and not force:
        return {**done, "resumed": True}

    if ft.threads:
        torch.set_num_threads(int(ft.threads))
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("training.json", "adapter_model.safetensors", "adapter_config.json"):
        (out_dir / stale).unlink(missing_ok=True)
    model = load_train_model(base_path, ft)
    t0 = time.time()
    trainer = make_trainer(model, tok, rows, objective, ft, out_dir, progress=progress, eos_token=eos)
    t_setup = time.time() - t0
    t1 = time.time()
    trainer.train()
    seconds = time.time() - t1
    trainer.model.save_pretrained(str(out_dir))
    curve = loss_curve(trainer.state.log_history)
    (out_dir / "loss_curve.json").write_text(json.dumps(curve, indent=1))
    plot_loss_curve(curve, out_dir / "loss_curve.png", f"{spec.label} {objective.upper()} {out_dir.name}")
    steps = int(trainer.state.global_step)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    info = {
        "status": "finished", "config_hash": chash, "objective": objective, "base": str(base_path),
        "model": spec.name, "training": training_config(ft), "data_sha256": sha256_json(rows),
        "examples": len(rows), "questions": len({e.question_id for e in examples}),
        "chains": sorted({e.instance_id for e in examples}), "formulations": sorted({e.formulation for e in examples}),
        "steps": steps, "seconds": round(seconds, 2), "setup_seconds": round(t_setup, 2),
        "seconds_per_step": round(seconds / steps, 3) if steps else None,
        "first_loss": curve[0]["loss"] if curve else None, "final_loss": curve[-1]["loss"] if curve else None,
        "gradient_checkpointing": bool(ft.gradient_checkpointing),
        "peak_gpu_memory_gib": round(peak, 2) if peak is not None else None,
        "versions": _versions(), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out_dir / "training.json").write_text(json.dumps(info, indent=1))
    shutil.rmtree(out_dir / "_trainer", ignore_errors=True)
    # the trainer keeps the model in reference cycles (trl binds model.forward): collect them and hand
    # the GPU's cached blocks back before any generator or engine of the run starts
    device = str(next(model.parameters()).device)
    del trainer, model
    release_memory(device)
    return {**info, "resumed": False}
