"""The ``finetune`` block (notebook 04; params/finetune.yaml documents it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from memtoc.config.blocks.base import Block, Fail, as_list, is_int, is_num
from memtoc.core.errors import ordered_subset
from memtoc.core.vocab import ARM_CONDITIONS, FORMULATIONS, OBJECTIVES
from memtoc.generation.models import ModelError, get_model

EVAL_CONDITIONS = ARM_CONDITIONS                  # tool_right, tool_wrong, tool_error
LR_SCHEDULERS = ("linear", "constant", "cosine", "constant_with_warmup")
TRAIN_DTYPES = ("auto", "bfloat16", "float32")
EVAL_DTYPES = (None, "auto", "bfloat16", "float32", "float16")
EVAL_BACKENDS = ("transformers", "vllm")


@dataclass(frozen=True)
class FinetuneConfig(Block):
    """Every key of the ``finetune`` block with its default; ``resolve`` fills the run-dependent
    ``None`` defaults (models, train_formulations, seed) and checks every value."""
    BLOCK = "finetune"
    SEE = "params/finetune.yaml"

    enabled: bool = True
    models: Optional[tuple[str, ...]] = None   # None: the run's instruction-tuned (chat) models, as the paper's
                                               # Table 1 (the base model is not fine-tuned); or a list of run models
    objectives: tuple[str, ...] = OBJECTIVES   # subset of sft, dpo
    folds: tuple[int, ...] = (0, 1)            # training folds; each adapter is evaluated on the other fold
    train_formulations: Optional[tuple[str, ...]] = ("reference",)   # paper: the Reference formulation only
                                               # (574/576 pairs per fold); None: the run's formulations
    train_questions_per_fold: Optional[int] = None   # None: every question of the fold (575 pool, excluded too)
    eval_questions_per_fold: Optional[int] = None    # None: every held-out question of the run's headline selection
    eval_conditions: tuple[str, ...] = EVAL_CONDITIONS
    epochs: float = 1                          # paper: 1 epoch
    max_steps: int = -1                        # > 0 caps the optimizer steps (fast slices); -1: epochs
    learning_rate: float = 1e-5                # paper: 1e-5 (the embedded model's params use the measured 1e-4:
                                               # params/finetune.yaml)
    lr_scheduler: str = "linear"
    warmup_ratio: float = 0.0                  # share of the optimizer steps (reaches trl as a ratio: warmup_kwargs)
    lora_r: int = 16                           # paper: r 16 on q/k/v/o, alpha 32
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    dpo_beta: float = 0.1                      # paper: beta 0.1
    batch_size: int = 8
    grad_accum: int = 1
    max_length: int = 512                      # tokens of prompt + completion (the with-tool prompts are ~170)
    train_dtype: str = "auto"                  # base weights AND the trainer's mixed precision during training (LoRA
                                               # weights stay fp32). auto: bfloat16 on a GPU or a CPU with bf16
                                               # instructions, float32 elsewhere (emulated bf16 costs ~30x there)
    seed: Optional[int] = None                 # None: the run's seed
    threads: Optional[int] = None              # torch threads during training (None: torch default)
    gradient_checkpointing: bool = False       # trl's default is True; off is ~1.3x faster (memory is no issue at
                                               # 135M); params/paper.yaml turns it on (8-9B DPO on a 40 GB GPU)
    eval_dtype: Optional[str] = None           # dtype of the untreated AND adapter replies in this stage (None: the
                                               # run's dtype). bf16 rounding noise is as large as a small adapter's
                                               # effect on the logits; float32 isolates the adapter (finetune.yaml)
    eval_backend: str = "transformers"         # the backend of this stage's replies (untreated and adapters):
                                               # transformers (each adapter merged into its own model) or vllm (one
                                               # engine per model serves the base model and every adapter through
                                               # LoRARequest, no merge; 03's untreated replies are reused from the cache)
    backend_options: dict = field(default_factory=dict)   # options of this stage's generators (untreated and
                                               # adapters), e.g. {token_budget: 32768}; laid over the run's
                                               # backend_options when the run uses the same backend, else used
                                               # alone (eval_generator_kwargs)
    exclude_linked: bool = False               # true: drop from each fold's training data the questions linked to a
                                               # question of the other fold (one's gold is the other's subject:
                                               # construct.related_links). false = the paper's folds as released

    @classmethod
    def check(cls, f: dict[str, Any], run: Mapping[str, Any], fail: Fail, **context: Any) -> None:
        _models(f, list(run["models"]), fail)
        _choices(f, list(run["formulations"]), fail)
        _training(f, fail)
        if f["seed"] is None:
            f["seed"] = run["seed"]
        if not is_int(f["seed"]) or f["seed"] < 0:
            fail("seed", f"must be null (the run's seed) or a non-negative integer, got {f['seed']!r}")
        _evaluation(f, fail)


def is_chat(model: str) -> bool:
    """True for instruction-tuned (chat) registry models and for names the registry does not know."""
    try:
        return bool(get_model(model).chat)
    except ModelError:
        return True


def _models(f: dict, run_models: list[str], fail: Fail) -> None:
    if f["models"] is None:
        f["models"] = [m for m in run_models if is_chat(m)]
    f["models"] = as_list(f["models"])
    if not isinstance(f["models"], list) or any(m not in run_models for m in f["models"]):
        fail("models", f"must be null (the run's instruction-tuned models) or a list drawn from the run's models "
             f"{run_models}, got {f['models']!r}")


def _choices(f: dict, run_forms: list[str], fail: Fail) -> None:
    f["objectives"] = as_list(f["objectives"])
    if not isinstance(f["objectives"], list) or not f["objectives"]:
        fail("objectives", f"must be a non-empty list drawn from {list(OBJECTIVES)}")
    for o in f["objectives"]:
        if o not in OBJECTIVES:
            fail("objectives", f"unknown objective {o!r}; valid objectives are: {', '.join(OBJECTIVES)}")
    f["objectives"] = [o for o in OBJECTIVES if o in f["objectives"]]
    if not isinstance(f["folds"], list) or not f["folds"] or not all(k in (0, 1) and is_int(k) for k in f["folds"]):
        fail("folds", f"must be a non-empty list drawn from [0, 1] (the two chain-level folds), got {f['folds']!r}")
    f["folds"] = sorted(set(f["folds"]))
    forms = f["train_formulations"] if f["train_formulations"] is not None else run_forms
    chosen = ordered_subset(forms, FORMULATIONS)
    if chosen is None:
        fail("train_formulations", f"must be null or a non-empty list drawn from {list(FORMULATIONS)}, got {forms!r}")
    f["train_formulations"] = chosen
    for key in ("train_questions_per_fold", "eval_questions_per_fold"):
        v = f[key]
        if v is not None and (not is_int(v) or v < 1):
            fail(key, f"must be null (all) or a positive integer, got {v!r}")
    conds = ordered_subset(f["eval_conditions"], EVAL_CONDITIONS)
    if conds is None:
        fail("eval_conditions", f"must be a non-empty list drawn from {list(EVAL_CONDITIONS)}, "
                                f"got {f['eval_conditions']!r}")
    f["eval_conditions"] = conds


def _training(f: dict, fail: Fail) -> None:
    if not is_num(f["epochs"]) or f["epochs"] <= 0:
        fail("epochs", f"must be a positive number, got {f['epochs']!r}")
    if not is_int(f["max_steps"]) or f["max_steps"] == 0 or f["max_steps"] < -1:
        fail("max_steps", f"must be -1 (train `epochs` epochs) or a positive integer, got {f['max_steps']!r}")
    if not is_num(f["learning_rate"]) or not (0 < f["learning_rate"] < 1):
        fail("learning_rate", f"must be a number in (0, 1), e.g. 1e-4, got {f['learning_rate']!r}")
    f["learning_rate"] = float(f["learning_rate"])
    if f["lr_scheduler"] not in LR_SCHEDULERS:
        fail("lr_scheduler", f"must be one of {list(LR_SCHEDULERS)}, got {f['lr_scheduler']!r}")
    if not is_num(f["warmup_ratio"]) or not (0 <= f["warmup_ratio"] < 1):
        fail("warmup_ratio", f"must be a number in [0, 1), got {f['warmup_ratio']!r}")
    for key in ("lora_r", "lora_alpha", "batch_size", "grad_accum"):
        if not is_int(f[key]) or f[key] < 1:
            fail(key, f"must be a positive integer, got {f[key]!r}")
    if not is_int(f["max_length"]) or f["max_length"] < 32:
        fail("max_length", f"must be an integer >= 32 (tokens), got {f['max_length']!r}")
    if not is_num(f["lora_dropout"]) or not (0 <= f["lora_dropout"] < 1):
        fail("lora_dropout", f"must be a number in [0, 1), got {f['lora_dropout']!r}")
    if not is_num(f["dpo_beta"]) or f["dpo_beta"] <= 0:
        fail("dpo_beta", f"must be a positive number (paper: 0.1), got {f['dpo_beta']!r}")
    tm = as_list(f["target_modules"])
    if not isinstance(tm, list) or not tm or not all(isinstance(x, str) and x for x in tm):
        fail("target_modules", f"must be a non-empty list of module names (e.g. q_proj), got {tm!r}")
    f["target_modules"] = list(tm)
    if f["train_dtype"] not in TRAIN_DTYPES:
        fail("train_dtype", f"must be auto (bf16 where the hardware computes it, else float32), bfloat16 or "
                            f"float32, got {f['train_dtype']!r}")
    if f["threads"] is not None and (not is_int(f["threads"]) or f["threads"] < 1):
        fail("threads", f"must be null or a positive integer, got {f['threads']!r}")


def _evaluation(f: dict, fail: Fail) -> None:
    if f["eval_backend"] not in EVAL_BACKENDS:
        fail("eval_backend", f"must be transformers (merged adapters) or vllm (LoRA serving on one engine), "
                             f"got {f['eval_backend']!r}")
    if f["eval_dtype"] not in EVAL_DTYPES:
        fail("eval_dtype", f"must be null (the run's dtype), auto, bfloat16, float32 or float16, got {f['eval_dtype']!r}")
    if f["backend_options"] is None:
        f["backend_options"] = {}
    if not isinstance(f["backend_options"], dict):
        fail("backend_options", "must be a mapping of backend options (e.g. {token_budget: 32768}), "
             f"got {f['backend_options']!r}")
