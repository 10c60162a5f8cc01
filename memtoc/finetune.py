"""Fine-tuning: SFT and DPO LoRA adapters with chain-level cross-fitting, and their held-out
evaluation against the untreated model.

Training data (the paper's rule, :func:`training_examples`)
    For every training question two examples per training formulation (``train_formulations``;
    default the Reference formulation only, as in the paper), both on the untreated, schema-frame
    with-tool prompt: under ``tool_wrong`` the verified answer is preferred over the tool's near
    value; under ``tool_right`` the tool value (= the verified answer) is preferred over the near
    distractor. So chosen = ``"FINAL: <gold>"`` and rejected = ``"FINAL: <near>"`` in both. DPO
    trains on (prompt, chosen, rejected); SFT on (prompt, chosen) with the loss on the completion
    tokens only (trl prompt-completion format). Only near distractors are used (far ones stay held
    out for evaluation). Prompts are rendered exactly as the generator renders them
    (``models.render_prompt``: one user turn, no system turn for the embedded model), minus the
    template's leading BOS text when trl's plain-text tokenization adds one itself
    (:func:`training_prompt`; checked token for token against inference by
    :func:`check_training_tokens`); trl appends the EOS token to every completion. Excluded questions
    (outside the 542) may be trained on.

Cross-fitting (:func:`crossfit_plan`)
    The two chain-level folds of the 575-question pool (``Question.fold``: the release's frozen split,
    ``crossfit_folds.json``, see ``benchmark``). ``exclude_linked`` (default off) drops from each
    fold's training data the questions linked to the other fold (``construct.related_links``). The adapter trained on
    fold k is evaluated only on analysis-set questions of the *other* fold, taken from the run's
    headline selection (``select_questions(analysis, n_questions)``, so the untreated replies of
    notebook 03 are reused from the cache). :func:`check_no_leakage` refuses a plan in which an
    evaluated question's chain is in its adapter's training data. Matched SFT and DPO runs share
    the base checkpoint, hyper-parameters, LoRA configuration, seed and data order.

Evaluation (all generation of this stage: transformers backend, :func:`eval_generator_kwargs`)
    Each adapter first answers the forced closed-book prompts of its held-out questions (same
    formulations, ``elicitation.elicit``), then the held-out episodes (conditions ``eval_conditions``,
    default tool_right, tool_wrong, tool_error; untreated arm, schema frame, the default error
    payload), through the generation cache (``generations/<model>__<objective>__fold<k>/``). Its
    replies are scored with ``evaluation.score_episodes`` against its *own* closed-book answers (its
    own cells and kept-memory flags, as in the paper); the untreated model likewise against its own,
    elicited by the same generator settings. The two folds together give one cross-fitted prediction
    per held-out question. Paired changes adapter − untreated use ``analyses.contrast`` on the
    case-stable common support (units (formulation, qkey) in the metric's cell for both
    checkpoints; ``n_treated_only`` / ``n_untreated_only`` count the rest), question-cluster bootstrap
    CI, sign-flip p; Holm inside the paper's families (``stats.FAMILIES``: retention, and correct-tool
    following, each over models × objectives in every slice; applied by
    ``analyses.apply_finetune_families``; the other metrics are uncorrected diagnostics); the
    asymmetric success criterion is
    ``stats.success_criterion``.

Files
    ``adapters/<model>/<objective>/fold<k>/``  peft adapter (``adapter_model.safetensors``,
        ``adapter_config.json``), ``training.json`` (resolved config, config hash, data hash, sizes,
        timings, versions; written last, so its presence marks a finished adapter), ``loss_curve.json``
        and ``loss_curve.png``, ``closed_book_<variant>.jsonl`` (the adapter's own closed-book answers),
        ``scored.jsonl`` (the held-out scored episodes).
    ``adapters/<model>/untreated_closed_book_<variant>.jsonl``  the untreated model's, by this stage's generator
    Training is skipped when ``training.json`` exists with the same config hash (resume).

``summaries/finetuning.json`` — structure (stable; claims cite it by JSON pointer)
-----------------------------------------------------------------------------------
A *delta object* is ``{"delta", "ci95", "p", "p_holm", "n_units", "n_clusters", "n_treated_only",
"n_untreated_only", "treatment", "baseline", "treated", "untreated"}``: ``delta`` = mean paired
difference adapter − untreated over the units (formulation, qkey) of the case-stable common support
(in the metric's cell for both checkpoints, each with its own closed-book answers; per formulation:
that formulation's units;
``pooled``: all units, clustered by qkey), ``ci95`` a question-cluster bootstrap interval, ``p`` the
sign-flip permutation p-value, ``p_holm`` Holm-adjusted within the family named below, and
``treated`` / ``untreated`` the two rates on that support (pooled: unweighted mean of the
formulation rates); ``n_treated_only`` / ``n_untreated_only`` = units in the cell for the adapter
only / the untreated model only. Rates in [0, 1]. ``<form>`` is a formulation or ``pooled``. A
*closed-book count object* is ``{<form> | "all": {"n", "n_correct", "n_incorrect", "n_absent",
"untreated_n_correct", "untreated_n_incorrect", "untreated_n_absent", "n_changed"}}``
(:func:`closed_book_counts`; the untreated model's own has no ``untreated_*`` / ``n_changed``). ::

    /schema_version                                     2
    /run_name, /alpha, /n_boot, /n_perm, /matcher, /formulations
    /config                                             resolved finetune parameters (+ defaults)
    /closed_book_variant, /support                      the memory variant; how deltas are supported
    /folds                                              {"mode", "file", "frozen_chains", "rule_chains",
                                                        "related_cross_fold_links", "exclude_linked"}
    /eval_generator                                     load_generator arguments of this stage
    /metrics                                            {metric: definition} (retention, tool_follow,
                                                        wrong_follow, err_abstain)
    /holm_families                                      {"pooled": ..., "per_formulation": ...} (text)
    /models/<model>/base                                prepared base checkpoint path
    /models/<model>/folds/fold<k>                       {"train_questions", "train_chains",
                                                        "train_examples", "train_excluded",
                                                        "train_linked_excluded",
                                                        "eval_questions", "eval_chains",
                                                        "leakage_checked": true}
    /models/<model>/adapters/<objective>/fold<k>        {"path", "config_hash", "resumed", "steps",
                                                        "examples", "seconds", "seconds_per_step",
                                                        "first_loss", "final_loss",
                                                        "closed_book": closed-book count object}
    /models/<model>/untreated_closed_book               closed-book count object (held-out questions)
    /models/<model>/objectives/<objective>/deltas/<metric>/<form>   delta object; ``family`` names its
                                                        Holm family (retention / tool_follow over
                                                        models x objectives, per slice); None for the
                                                        diagnostics (p_holm None)
    /models/<model>/objectives/<objective>/criterion    stats.success_criterion on the pooled
                                                        retention and tool_follow deltas (Holm p):
                                                        {"passed", "retention_up", "tool_drop",
                                                        "retention_delta", "tool_delta", "reason", ...}
    /models/<model>/objectives/<objective>/criterion_by_formulation/<form>   same, per formulation
    /models/<model>/objectives/<objective>/n_episodes   held-out episodes scored for this objective
    /models/<model>/objectives/<objective>/closed_book  closed-book count object, both folds' adapters

Claims: e.g. ``/models/smollm2-135m-instruct/objectives/sft/deltas/retention/pooled/delta`` and
``/models/smollm2-135m-instruct/objectives/dpo/criterion/passed``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import pandas as pd
from packaging.version import Version

from . import analyses, elicitation, evaluation, models, stats
from .benchmark import load_benchmark, select_questions
from .config import (FORMULATIONS, PAPER_SEED, ConfigError, MemtocError, check_choice, ordered_subset,
                     section_params)
from .construct import related_links, related_summary
from .episodes import build_episodes
from .models import ModelError, attention_implementation, get_model
from .io import plain, sha256_json, write_json, write_jsonl
from .metrics import definitions, metric_units, paired_units
from .records import Episode, Question
from .runconfig import RunConfig
from .vocab import ARM_CONDITIONS, CONFLICT_CONDITIONS, HEADLINE_METRICS

SCHEMA_VERSION = 2
OBJECTIVES = ("sft", "dpo")
TRAIN_CONDITIONS = CONFLICT_CONDITIONS            # the DPO/SFT pairs: tool_right, tool_wrong
EVAL_CONDITIONS = ARM_CONDITIONS                  # tool_right, tool_wrong, tool_error
METRICS = HEADLINE_METRICS

#: Every key of the ``finetune`` parameter, with its default (see params/finetune.yaml).
FT_DEFAULTS: dict[str, Any] = {
    "enabled": True,
    "models": None,                        # None: the run's instruction-tuned (chat) models, as the paper's
                                           # Table 1 (the base model is not fine-tuned); or a list of run models
    "objectives": ["sft", "dpo"],          # subset of sft, dpo
    "folds": [0, 1],                       # training folds; each adapter is evaluated on the other fold
    "train_formulations": ["reference"],   # paper: the Reference formulation only (574/576 pairs per fold);
                                           # None: the run's formulations
    "train_questions_per_fold": None,      # None: every question of the fold (575 pool, excluded too)
    "eval_questions_per_fold": None,       # None: every held-out question of the run's headline selection
    "eval_conditions": list(EVAL_CONDITIONS),
    "epochs": 1,                           # paper: 1 epoch
    "max_steps": -1,                       # > 0 caps the optimizer steps (fast slices); -1: epochs
    "learning_rate": 1e-5,                 # paper: 1e-5 (the embedded model's params use the measured 1e-4:
                                           # params/finetune.yaml)
    "lr_scheduler": "linear",
    "warmup_ratio": 0.0,                   # share of the optimizer steps (reaches trl as a ratio: warmup_kwargs)
    "lora_r": 16,                          # paper: r 16 on q/k/v/o, alpha 32
    "lora_alpha": 32,
    "lora_dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "dpo_beta": 0.1,                       # paper: beta 0.1
    "batch_size": 8,
    "grad_accum": 1,
    "max_length": 512,                     # tokens of prompt + completion (the with-tool prompts are ~170)
    "train_dtype": "bfloat16",             # base weights during training (LoRA weights stay fp32)
    "seed": None,                          # None: the run's seed
    "threads": None,                       # torch threads during training (None: torch default)
    "gradient_checkpointing": False,       # trl's default is True; off is ~1.3x faster (memory is no issue at 135M);
                                           # params/paper.yaml turns it on (8-9B DPO on a 40 GB GPU)
    "eval_dtype": None,                    # dtype of the untreated AND adapter replies in this stage (None: the
                                           # run's dtype). bf16 rounding noise is as large as a small adapter's
                                           # effect on the logits; float32 isolates the adapter (see finetune.yaml)
    "backend_options": {},                 # options of this stage's transformers generators (untreated and
                                           # adapters), e.g. {token_budget: 32768}; with backend transformers they
                                           # are laid over the run's backend_options, otherwise used alone (04
                                           # always generates with transformers: eval_generator_kwargs)
    "exclude_linked": False,               # true: drop from each fold's training data the questions linked to a
                                           # question of the other fold (one's gold is the other's subject:
                                           # construct.related_links). false = the paper's folds as released
}

#: Generator options that mean the same on every backend (carried from a vLLM / openai run's
#: backend_options to 04's transformers generators).
SHARED_BACKEND_OPTIONS = ("stop_at_final",)

_TRAINING_KEYS = ("epochs", "max_steps", "learning_rate", "lr_scheduler", "warmup_ratio", "lora_r",
                  "lora_alpha", "lora_dropout", "target_modules", "dpo_beta", "batch_size", "grad_accum",
                  "max_length", "train_dtype", "seed")


class FinetuneError(MemtocError):
    """Fine-tuning inputs are inconsistent (a leaking plan, no training data, a bad adapter dir)."""


# ==================================================================================================
# parameters

def finetune_params(P: dict[str, Any], source: str = "<params>") -> dict[str, Any]:
    """The resolved ``finetune`` mapping: FT_DEFAULTS overlaid with ``P["finetune"]``, validated.

    ``None`` defaults are resolved from the run (``train_formulations`` -> ``P["formulations"]``,
    ``seed`` -> ``P["seed"]``). Errors name the field (``finetune.<key>``) and the fix.
    """
    f = section_params(P, "finetune", FT_DEFAULTS, source, see="params/finetune.yaml")
    cfg = RunConfig.of(P, source)

    def fail(key: str, msg: str) -> None:
        raise ConfigError(f"{source}: field 'finetune.{key}': {msg}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def is_num(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if not isinstance(f["enabled"], bool):
        fail("enabled", f"must be true or false, got {f['enabled']!r}")
    run_models = list(cfg.models)
    if f["models"] is None:
        f["models"] = [m for m in run_models if _is_chat(m)]
    if isinstance(f["models"], str):
        f["models"] = [f["models"]]
    if not isinstance(f["models"], list) or any(m not in run_models for m in f["models"]):
        fail("models", f"must be null (the run's instruction-tuned models) or a list drawn from the run's models "
             f"{run_models}, got {f['models']!r}")
    if isinstance(f["objectives"], str):
        f["objectives"] = [f["objectives"]]
    if not isinstance(f["objectives"], list) or not f["objectives"]:
        fail("objectives", f"must be a non-empty list drawn from {list(OBJECTIVES)}")
    for o in f["objectives"]:
        if o not in OBJECTIVES:
            fail("objectives", f"unknown objective {o!r}; valid objectives are: {', '.join(OBJECTIVES)}")
    f["objectives"] = [o for o in OBJECTIVES if o in f["objectives"]]
    if not isinstance(f["folds"], list) or not f["folds"] or not all(k in (0, 1) and is_int(k) for k in f["folds"]):
        fail("folds", f"must be a non-empty list drawn from [0, 1] (the two chain-level folds), got {f['folds']!r}")
    f["folds"] = sorted(set(f["folds"]))
    forms = f["train_formulations"]
    if forms is None:
        forms = list(cfg.formulations)
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
    if not is_num(f["epochs"]) or f["epochs"] <= 0:
        fail("epochs", f"must be a positive number, got {f['epochs']!r}")
    if not is_int(f["max_steps"]) or f["max_steps"] == 0 or f["max_steps"] < -1:
        fail("max_steps", f"must be -1 (train `epochs` epochs) or a positive integer, got {f['max_steps']!r}")
    if not is_num(f["learning_rate"]) or not (0 < f["learning_rate"] < 1):
        fail("learning_rate", f"must be a number in (0, 1), e.g. 1e-4, got {f['learning_rate']!r}")
    f["learning_rate"] = float(f["learning_rate"])
    check = {"lr_scheduler": ["linear", "constant", "cosine", "constant_with_warmup"]}
    if f["lr_scheduler"] not in check["lr_scheduler"]:
        fail("lr_scheduler", f"must be one of {check['lr_scheduler']}, got {f['lr_scheduler']!r}")
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
    tm = f["target_modules"]
    if isinstance(tm, str):
        tm = [tm]
    if not isinstance(tm, list) or not tm or not all(isinstance(x, str) and x for x in tm):
        fail("target_modules", f"must be a non-empty list of module names (e.g. q_proj), got {tm!r}")
    f["target_modules"] = list(tm)
    if f["train_dtype"] not in ("bfloat16", "float32"):
        fail("train_dtype", f"must be bfloat16 or float32, got {f['train_dtype']!r}")
    if f["seed"] is None:
        f["seed"] = cfg.seed
    if not is_int(f["seed"]) or f["seed"] < 0:
        fail("seed", f"must be null (the run's seed) or a non-negative integer, got {f['seed']!r}")
    if not isinstance(f["gradient_checkpointing"], bool):
        fail("gradient_checkpointing", f"must be true or false, got {f['gradient_checkpointing']!r}")
    if f["eval_dtype"] not in (None, "auto", "bfloat16", "float32", "float16"):
        fail("eval_dtype", f"must be null (the run's dtype), auto, bfloat16, float32 or float16, got {f['eval_dtype']!r}")
    if f["backend_options"] is None:
        f["backend_options"] = {}
    if not isinstance(f["backend_options"], dict):
        fail("backend_options", "must be a mapping of transformers backend options (e.g. {token_budget: 32768}), "
             f"got {f['backend_options']!r}")
    if not isinstance(f["exclude_linked"], bool):
        fail("exclude_linked", f"must be true or false (false: the paper's folds), got {f['exclude_linked']!r}")
    if f["threads"] is not None and (not is_int(f["threads"]) or f["threads"] < 1):
        fail("threads", f"must be null or a positive integer, got {f['threads']!r}")
    return f


def _is_chat(model: str) -> bool:
    """True for instruction-tuned (chat) registry models and for names the registry does not know."""
    try:
        return bool(get_model(model).chat)
    except ModelError:
        return True


# ==================================================================================================
# training data (pure)

@dataclass(frozen=True)
class TrainExample:
    """One training prompt with its preferred (chosen) and dispreferred (rejected) completion."""

    question_id: str
    qkey: str
    instance_id: int
    fold: Optional[int]
    excluded: bool
    formulation: str
    condition: str          # tool_right | tool_wrong
    tool_value: str
    prompt: str             # the with-tool user turn (not yet chat-rendered)
    chosen: str             # "FINAL: <gold>"
    rejected: str           # "FINAL: <near>"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def completion(answer: str) -> str:
    """The protocol's final line for ``answer`` (the whole training completion)."""
    return f"FINAL: {answer}"


def training_examples(questions: Iterable[Question], formulations: Sequence[str] = FORMULATIONS) -> list[TrainExample]:
    """The paper's training pairs: per question and formulation, a tool_wrong example (gold over
    the tool's near value) and a tool_right example (the tool value = gold over the near value).

    Prompts are the untreated, schema-frame with-tool prompts of ``episodes.build_episodes``.
    Questions whose near value equals the gold (no contrast) are skipped.
    """
    questions = list(questions)
    by_id = {q.id: q for q in questions}
    out: list[TrainExample] = []
    for ep in build_episodes(questions, list(formulations), TRAIN_CONDITIONS):
        q = by_id[ep.question_id]
        if not q.near or q.near.strip() == q.gold.strip():
            continue
        out.append(TrainExample(
            question_id=q.id, qkey=q.qkey, instance_id=q.instance_id, fold=q.fold, excluded=q.excluded,
            formulation=ep.formulation, condition=ep.condition, tool_value=ep.tool_value, prompt=ep.prompt,
            chosen=completion(q.gold), rejected=completion(q.near)))
    return out


def sft_rows(examples: Sequence[TrainExample], render: Callable[[str], str]) -> list[dict[str, str]]:
    """trl prompt-completion rows (completion-only loss): the rendered prompt and the chosen line."""
    return [{"prompt": render(e.prompt), "completion": e.chosen} for e in examples]


def dpo_rows(examples: Sequence[TrainExample], render: Callable[[str], str]) -> list[dict[str, str]]:
    """trl preference rows: the rendered prompt, the chosen and the rejected line."""
    return [{"prompt": render(e.prompt), "chosen": e.chosen, "rejected": e.rejected} for e in examples]


# ==================================================================================================
# cross-fitting plan (pure)

@dataclass(frozen=True)
class FoldPlan:
    """Training questions of fold ``train_fold`` and the held-out questions its adapter is scored on."""

    train_fold: int
    train_questions: tuple[Question, ...]
    eval_questions: tuple[Question, ...]
    train_linked_excluded: tuple[str, ...] = ()    # ids dropped by exclude_linked

    @property
    def name(self) -> str:
        return f"fold{self.train_fold}"

    def describe(self, n_train_examples: Optional[int] = None) -> dict[str, Any]:
        return {"train_fold": self.train_fold,
                "train_questions": len(self.train_questions),
                "train_chains": len({q.instance_id for q in self.train_questions}),
                "train_excluded": sum(q.excluded for q in self.train_questions),
                "train_linked_excluded": len(self.train_linked_excluded),
                "train_examples": n_train_examples,
                "eval_questions": len(self.eval_questions),
                "eval_chains": len({q.instance_id for q in self.eval_questions})}


def crossfit_plan(pool: Sequence[Question], eval_pool: Sequence[Question], folds: Sequence[int] = (0, 1),
                  train_questions_per_fold: Optional[int] = None, eval_questions_per_fold: Optional[int] = None,
                  seed: int = PAPER_SEED, exclude_linked: bool = False) -> list[FoldPlan]:
    """One :class:`FoldPlan` per training fold.

    ``pool``: the 575-question construction pool (``Benchmark.questions``; ``fold`` set). Training
    questions of fold k: the pool's fold-k questions (excluded ones included), the first
    ``train_questions_per_fold`` of ``select_questions`` (stratified, nested) when set.
    ``eval_pool``: the analysis questions the run evaluates (in selection order); evaluation
    questions of the fold-k adapter: those of another fold, not excluded, the first
    ``eval_questions_per_fold`` when set.

    ``exclude_linked``: drop from fold k's training questions every question linked
    (``construct.related_links``, either direction) to a question of another fold of the pool, before
    the slice is taken, so no adapter is trained on a question about its held-out questions' answers
    (or the reverse). Off by default: the paper's folds as released.
    """
    missing = [q.id for q in list(pool) + list(eval_pool) if q.fold is None]
    if missing:
        raise FinetuneError(f"questions without a cross-fitting fold (e.g. {missing[:3]}); load them with "
                            "benchmark.load_benchmark, which assigns the chain-level folds")
    cross = [r for r in related_links(pool) if r["cross_fold"]] if exclude_linked else []
    plans = []
    for k in folds:
        train = [q for q in pool if q.fold == k]
        if not train:
            raise FinetuneError(f"fold {k} has no questions in the pool; nothing to train on")
        linked = {r["gold_id"] if r["gold_fold"] == k else r["subject_id"] for r in cross
                  if k in (r["gold_fold"], r["subject_fold"])}
        dropped = tuple(sorted(q.id for q in train if q.id in linked))
        train = [q for q in train if q.id not in linked]
        if train_questions_per_fold is not None:
            train = select_questions(train, train_questions_per_fold, seed)
        held = [q for q in eval_pool if q.fold != k and not q.excluded]
        if eval_questions_per_fold is not None:
            held = held[:eval_questions_per_fold]
        plans.append(FoldPlan(k, tuple(train), tuple(held), dropped))
    return plans


def check_no_leakage(plans: Sequence[FoldPlan], examples: Optional[dict[int, Sequence[TrainExample]]] = None) -> None:
    """Raise FinetuneError if any evaluated question's chain (ToolHop instance) is in the training
    data of the adapter that evaluates it, or if an excluded question would be scored.

    ``examples`` (optional): the built training examples per training fold, checked as well."""
    for p in plans:
        train_chains = {q.instance_id for q in p.train_questions}
        if examples is not None:
            train_chains |= {e.instance_id for e in examples.get(p.train_fold, ())}
        leak = sorted({q.instance_id for q in p.eval_questions} & train_chains)
        if leak:
            raise FinetuneError(f"{p.name}: {len(leak)} evaluated chain(s) are in the adapter's training "
                                f"data (e.g. instance {leak[:5]}); cross-fitting must evaluate on the other fold")
        excl = [q.id for q in p.eval_questions if q.excluded]
        if excl:
            raise FinetuneError(f"{p.name}: excluded question(s) {excl[:5]} would be scored; they may be "
                                "trained on but never evaluated")


# ==================================================================================================
# training

def adapter_dir(run_dir, model_label: str, objective: str, fold: int) -> Path:
    return Path(run_dir) / "adapters" / model_label / objective / f"fold{fold}"


def training_config(ft: dict[str, Any]) -> dict[str, Any]:
    """The hyper-parameters that define an adapter (shared by matched SFT and DPO runs)."""
    return {k: ft[k] for k in _TRAINING_KEYS}


def config_hash(objective: str, ft: dict[str, Any], base_weights: str, rows: Sequence[dict]) -> str:
    """Hash of everything an adapter depends on: objective, hyper-parameters, base weights, data."""
    return sha256_json({"objective": objective, "training": training_config(ft), "base_weights": base_weights,
                 "data": sha256_json(list(rows))})[:16]


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


def plot_loss_curve(curve: Sequence[dict], path, title: str = "") -> Path:
    """Seaborn line plot of the training loss per step (``path``: .png)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    if curve:
        sns.lineplot(data=pd.DataFrame(curve), x="step", y="loss", marker="o", ax=ax)
    ax.set_title(title or "training loss")
    ax.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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


def training_arguments(ft: dict[str, Any], out_dir, *, progress: bool = True, cuda: bool = False,
                       transformers_version: Optional[str] = None,
                       arg_names: Optional[set[str]] = None) -> dict[str, Any]:
    """Keyword arguments shared by trl's SFTConfig and DPOConfig. ``arg_names``: the field names of
    ``transformers.TrainingArguments`` (default: the installed one's); checkpointing goes under
    ``activation_checkpointing`` where it exists (transformers >= 5.24; ``gradient_checkpointing``
    is its deprecated alias there), else ``gradient_checkpointing``. trl's configs default it to on;
    it is always passed explicitly."""
    if arg_names is None:

        from transformers import TrainingArguments
        arg_names = {f.name for f in dataclasses.fields(TrainingArguments)}
    ckpt = "activation_checkpointing" if "activation_checkpointing" in arg_names else "gradient_checkpointing"
    out = dict(
        output_dir=str(Path(out_dir) / "_trainer"), num_train_epochs=float(ft["epochs"]),
        max_steps=int(ft["max_steps"]), learning_rate=ft["learning_rate"], lr_scheduler_type=ft["lr_scheduler"],
        per_device_train_batch_size=ft["batch_size"], gradient_accumulation_steps=ft["grad_accum"],
        max_length=ft["max_length"], seed=ft["seed"], data_seed=ft["seed"], logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=not cuda, disable_tqdm=not progress,
        dataloader_num_workers=0, **{ckpt: bool(ft["gradient_checkpointing"])},
        **warmup_kwargs(ft["warmup_ratio"], transformers_version),
    )
    if ft["gradient_checkpointing"]:
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


def load_train_model(base_path, ft: dict[str, Any]):
    """The base model for training (``train_dtype``; eager attention for soft-capping models)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[ft["train_dtype"]]
    attn = attention_implementation(AutoConfig.from_pretrained(base_path), "auto",
                                    "cuda" if torch.cuda.is_available() else "cpu", training=True)
    return AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype, attn_implementation=attn)


def make_trainer(model, tokenizer, rows: Sequence[dict], objective: str, ft: dict[str, Any], out_dir,
                 *, progress: bool = True):
    """trl's SFTTrainer (prompt-completion rows, completion-only loss) or DPOTrainer (preference
    rows) with the LoRA configuration of ``ft``; the dataset is tokenized on construction."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig

    check_choice("objective", objective, OBJECTIVES)
    lora = LoraConfig(r=ft["lora_r"], lora_alpha=ft["lora_alpha"], lora_dropout=ft["lora_dropout"],
                      target_modules=list(ft["target_modules"]), task_type="CAUSAL_LM", bias="none")
    common = training_arguments(ft, out_dir, progress=progress, cuda=torch.cuda.is_available())
    ds = Dataset.from_list(list(rows))
    if objective == "sft":
        from trl import SFTConfig, SFTTrainer
        return SFTTrainer(model=model, args=SFTConfig(completion_only_loss=True, **common), train_dataset=ds,
                          processing_class=tokenizer, peft_config=lora)
    from trl import DPOConfig, DPOTrainer
    return DPOTrainer(model=model, args=DPOConfig(beta=float(ft["dpo_beta"]), **common), train_dataset=ds,
                      processing_class=tokenizer, peft_config=lora)


def train_adapter(base_path, spec, examples: Sequence[TrainExample], objective: str, ft: dict[str, Any],
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
    chash = config_hash(objective, ft, models.weights_hash(base_path), rows)
    done = finished_adapter(out_dir, chash)
    if done is not None and not force:
        return {**done, "resumed": True}

    if ft.get("threads"):
        torch.set_num_threads(int(ft["threads"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("training.json", "adapter_model.safetensors", "adapter_config.json"):
        (out_dir / stale).unlink(missing_ok=True)
    model = load_train_model(base_path, ft)
    t0 = time.time()
    trainer = make_trainer(model, tok, rows, objective, ft, out_dir, progress=progress)
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
        "gradient_checkpointing": bool(ft["gradient_checkpointing"]),
        "peak_gpu_memory_gib": round(peak, 2) if peak is not None else None,
        "versions": _versions(), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out_dir / "training.json").write_text(json.dumps(info, indent=1))
    shutil.rmtree(out_dir / "_trainer", ignore_errors=True)
    del trainer, model
    return {**info, "resumed": False}


def pair_preference(base_path, spec, examples: Sequence[TrainExample], adapter=None, dtype: str = "float32",
                    batch_size: int = 8) -> dict[str, Any]:
    """Held-out diagnostic without generation: for each pair, the summed log-probability of the
    chosen and of the rejected completion (+ EOS) after the rendered prompt, with the base model or
    base + ``adapter`` (unmerged). Returns ``{"n", "accuracy" (share chosen > rejected),
    "margin" (mean logp chosen − rejected), "chosen_nll" (mean per-token NLL of the chosen line)}``.
    Used to compare learning rates on a slice (see params/finetune.yaml)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_path)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=getattr(torch, dtype))
    if adapter is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    eos = tok.eos_token or ""

    def logps(pairs: list[tuple[str, str]]) -> list[tuple[float, int]]:
        out = []
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i:i + batch_size]
            ids, lens = [], []
            for prompt, comp in chunk:
                p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
                c_ids = tok(prompt + comp + eos, add_special_tokens=False)["input_ids"][len(p_ids):]
                ids.append(p_ids + c_ids)
                lens.append((len(p_ids), len(c_ids)))
            width = max(map(len, ids))
            pad = tok.pad_token_id if tok.pad_token_id is not None else 0
            x = torch.tensor([r + [pad] * (width - len(r)) for r in ids])
            att = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=x, attention_mask=att).logits.float(), -1)
            for j, (pl, cl) in enumerate(lens):
                tgt = x[j, pl:pl + cl]
                out.append((float(lp[j, pl - 1:pl + cl - 1].gather(-1, tgt[:, None]).sum()), cl))
        return out

    rendered = [models.render_prompt(tok, spec, e.prompt)[0] for e in examples]
    ch = logps([(r, e.chosen) for r, e in zip(rendered, examples)])
    rj = logps([(r, e.rejected) for r, e in zip(rendered, examples)])
    margins = [c[0] - r[0] for c, r in zip(ch, rj)]
    return {"n": len(examples), "accuracy": sum(m > 0 for m in margins) / max(1, len(margins)),
            "margin": sum(margins) / max(1, len(margins)),
            "chosen_nll": sum(-c[0] / c[1] for c in ch) / max(1, len(ch))}


# ==================================================================================================
# evaluation and paired deltas

def eval_episodes(questions: Sequence[Question], formulations: Sequence[str],
                  conditions: Sequence[str] = EVAL_CONDITIONS) -> list[Episode]:
    """Held-out episodes: untreated arm, schema frame, the default error payload."""
    return build_episodes(list(questions), list(formulations), list(conditions))


def score_with(generator, label: str, episodes: Sequence[Episode], memory, run_dir, matcher: str = "paper"):
    """Generate (through the cache ``generations/<label>/``) and score ``episodes`` with the cells of
    ``memory``; no scored file is written (the caller decides where)."""
    replies = evaluation.generate_replies(generator, label, list(episodes), run_dir)
    df = evaluation.score_episodes(list(episodes), [getattr(r, "text", r) for r in replies], memory,
                                   matcher=matcher, model_label=label)
    df["cached"] = [getattr(r, "cached", None) for r in replies]
    return df


def paired_deltas(treated, untreated, formulations: Sequence[str], metrics: Sequence[str] = METRICS,
                  n_boot: int = 2000, n_perm: int = 10000, seed: int = 0, alpha: float = 0.05) -> dict[str, Any]:
    """Paired changes adapter − untreated per metric, per formulation and pooled, with Holm and the
    success criterion. ``treated`` / ``untreated``: scored frames of the same episodes.

    Returns ``{"deltas": {metric: {form: delta object}}, "criterion": ..., "criterion_by_formulation": ...}``.
    """
    deltas: dict[str, dict[str, Any]] = {}
    for m in metrics:
        tu, bu = metric_units(treated, m), metric_units(untreated, m)
        deltas[m] = {}
        for form in list(formulations) + ["pooled"]:
            t = tu if form == "pooled" else tu[tu["formulation"] == form]
            b = bu if form == "pooled" else bu[bu["formulation"] == form]
            if form != "pooled" and len(t) == 0 and len(b) == 0:
                continue
            c = analyses.contrast(t, b, n_boot=n_boot, n_perm=n_perm, seed=seed,
                                    treatment="adapter", baseline="untreated")
            pu = paired_units(t, b)
            if len(pu):
                rates = pu.groupby("formulation")[["t", "b"]].mean()
                c["treated"], c["untreated"] = float(rates["t"].mean()), float(rates["b"].mean())
            else:
                c["treated"] = c["untreated"] = None
            deltas[m][form] = c
    analyses.apply_holm({m: deltas[m]["pooled"] for m in metrics if "pooled" in deltas[m]})
    analyses.apply_holm({f"{m}/{f}": deltas[m][f] for m in metrics for f in deltas[m] if f != "pooled"})
    for m in metrics:
        for f, c in deltas[m].items():
            c["family"] = "pooled" if f == "pooled" else "per_formulation"

    def crit(form: str) -> Optional[dict]:
        r, t = deltas["retention"].get(form), deltas["tool_follow"].get(form)
        if not r or not t:
            return None
        return plain(stats.success_criterion(r, t, alpha=alpha))

    out = {"deltas": plain(deltas)}
    if "retention" in metrics and "tool_follow" in metrics:
        out["criterion"] = crit("pooled")
        out["criterion_by_formulation"] = {f: crit(f) for f in formulations if crit(f) is not None}
    return out


# ==================================================================================================
# the stage

def eval_generator_kwargs(P: dict[str, Any], ft: dict[str, Any]) -> dict[str, Any]:
    """``models.load_generator`` keyword arguments of this stage's generators (the untreated model
    and every adapter): always the transformers backend, whatever the run's ``backend``.

    Options: the run's ``backend_options`` when the run itself uses transformers; otherwise only
    the options every backend shares (:data:`SHARED_BACKEND_OPTIONS`, e.g. ``stop_at_final``, so that
    04 extracts from replies generated like 03's) -- a vLLM run's engine options such as
    ``gpu_memory_utilization`` / ``max_model_len`` mean nothing to TransformersGenerator. Then
    ``finetune.backend_options`` over them. dtype: ``finetune.eval_dtype``, else the run's ``dtype``.
    Pure: loads nothing."""
    cfg = RunConfig.of(P)
    run_opts = dict(cfg.backend_options or {})
    if cfg.backend != "transformers":
        run_opts = {k: v for k, v in run_opts.items() if k in SHARED_BACKEND_OPTIONS}
    opts = {**run_opts, **(ft.get("backend_options") or {})}
    return dict(backend="transformers", batch_size=cfg.batch_size, dtype=ft["eval_dtype"] or cfg.dtype,
                max_new_tokens=cfg.max_new_tokens, model_cache_dir=cfg.model_cache_dir, **opts)


def _memory_status(mem) -> dict[tuple[str, str], str]:
    out = {}
    for f, k, absent, correct in zip(mem["formulation"], mem["qkey"], mem["mem_absent"], mem["memory_correct"]):
        out[(f, k)] = "absent" if bool(absent) else ("correct" if correct is True or correct == 1 else "incorrect")
    return out


def closed_book_counts(memory, untreated=None) -> dict[str, Any]:
    """Counts of one checkpoint's forced closed-book answers (``elicitation.elicit`` frame), per
    formulation and ``all``: n, n_correct, n_incorrect, n_absent; with ``untreated`` (the untreated
    model's frame), the same counts of the untreated on the same (formulation, question) pairs
    (``untreated_*``) and ``n_changed`` (pairs whose status correct / incorrect / absent differs)."""
    own = _memory_status(memory)
    base = _memory_status(untreated) if untreated is not None else None
    forms = [f for f in FORMULATIONS if any(k[0] == f for k in own)] + ["all"]
    out: dict[str, Any] = {}
    for f in forms:
        keys = [k for k in own if f == "all" or k[0] == f]
        row = {"n": len(keys), **{f"n_{st}": sum(own[k] == st for k in keys) for st in ("correct", "incorrect", "absent")}}
        if base is not None:
            missing = [k for k in keys if k not in base]
            if missing:
                raise FinetuneError(f"no untreated closed-book answer for {missing[:3]}")
            row.update({f"untreated_n_{st}": sum(base[k] == st for k in keys) for st in ("correct", "incorrect", "absent")})
            row["n_changed"] = sum(own[k] != base[k] for k in keys)
        out[f] = row
    return out


def evaluate_adapter(model: str, adapter, label: str, questions: Sequence[Question], episodes: Sequence[Episode],
                     formulations: Sequence[str], run_dir, gen_kw: dict[str, Any], variant: str = "forced",
                     matcher: str = "paper"):
    """(scored episodes, closed-book memory) of the adapter at ``adapter``: its *own* closed-book
    answers to ``questions`` (written to ``<adapter>/closed_book_<variant>.jsonl``), then ``episodes``
    scored against them (:func:`score_with`), so that a paired delta with the untreated model
    (:func:`paired_deltas`) counts the units in a cell for one side only. ``gen_kw``:
    ``models.load_generator`` keywords; generations are cached under ``label``."""
    agen = models.load_generator(model, adapter=adapter, **gen_kw)
    try:
        memory = elicitation.elicit(agen, label, questions, formulations, variant, run_dir, matcher=matcher,
                                    scored_file=Path(adapter) / f"closed_book_{variant}.jsonl")
        return score_with(agen, label, episodes, memory, run_dir, matcher), memory
    finally:
        close_generator(agen)


def run(P: dict[str, Any], progress: bool = True, force_train: bool = False) -> dict[str, Any]:
    """Train every adapter (model × objective × fold; resumed when finished), evaluate each on its
    held-out fold against its *own* closed-book answers, compute the paired deltas on the
    case-stable common support and write ``summaries/finetuning.json``. Returns the summary dict.

    Every reply of this stage (untreated and adapters, closed-book and with-tool) is generated by the
    transformers backend with :func:`eval_generator_kwargs`, through the generation cache (the
    untreated replies of notebooks 02/03 are reused when their generator settings are the same)."""

    ft = finetune_params(P)
    P = cfg = RunConfig.of(P)
    run_dir = cfg.run_dir
    bench = load_benchmark(cfg.release_dir)
    forms = list(cfg.formulations)
    plans, examples = plan(cfg, bench)
    n_boot, n_perm, alpha = cfg.n_boot, cfg.n_perm, cfg.alpha
    matcher = cfg.matcher
    variant = cfg.closed_book_variant
    gen_kw = eval_generator_kwargs(cfg, ft)
    related = related_summary(bench.questions)

    summary: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "run_name": cfg.run_name, "alpha": alpha, "n_boot": n_boot,
        "n_perm": n_perm, "matcher": matcher, "formulations": forms, "config": ft,
        "closed_book_variant": variant,
        "metrics": definitions(METRICS),
        "support": ("each checkpoint is scored against its own closed-book answers; a delta compares the units "
                    "(formulation, question) in the metric's cell for both checkpoints (case-stable common "
                    "support); n_treated_only / n_untreated_only count the units in the cell for one side only"),
        "holm_families": {"pooled": "per model x objective: the four metrics' pooled deltas",
                          "per_formulation": "per model x objective: the four metrics x the formulations"},
        "folds": {**bench.folds_source, "related_cross_fold_links": related["n_cross_fold"],
                  "exclude_linked": ft["exclude_linked"]},
        "eval_generator": {k: v for k, v in gen_kw.items() if k != "model_cache_dir"},
        "models": {},
    }
    for model in ft["models"]:
        spec = models.get_model(model)
        base = models.prepare_model(model, cache_dir=cfg.model_cache_dir)
        label = model
        msum: dict[str, Any] = {"base": str(base), "folds": {}, "adapters": {}, "objectives": {}}
        for p in plans:
            msum["folds"][p.name] = {**p.describe(len(examples[p.train_fold])), "leakage_checked": True}
        # 1. train
        for obj in ft["objectives"]:
            for p in plans:
                path = adapter_dir(run_dir, label, obj, p.train_fold)
                if progress:
                    print(f"[finetune] {label} {obj} {p.name}: {len(examples[p.train_fold])} examples -> {path}")
                rec = train_adapter(base, spec, examples[p.train_fold], obj, ft, path, progress=progress,
                                    force=force_train)
                msum["adapters"].setdefault(obj, {})[p.name] = {
                    "path": str(path), "config_hash": rec["config_hash"], "resumed": rec["resumed"],
                    "steps": rec["steps"], "examples": rec["examples"], "seconds": rec["seconds"],
                    "seconds_per_step": rec["seconds_per_step"], "first_loss": rec["first_loss"],
                    "final_loss": rec["final_loss"]}
        # 2. the untreated model on every held-out episode, with its closed-book answers elicited by the
        #    same generator (served from 02/03's cache when the settings are the same)
        eps_by_fold = {p.train_fold: eval_episodes(p.eval_questions, forms, ft["eval_conditions"]) for p in plans}
        q_by_fold = {p.train_fold: list(p.eval_questions) for p in plans}
        all_eps = list({e.episode_id: e for eps in eps_by_fold.values() for e in eps}.values())
        if not all_eps:
            raise FinetuneError("no held-out questions to evaluate (n_questions / eval_questions_per_fold too small)")
        all_qs = list({q.id: q for qs in q_by_fold.values() for q in qs}.values())
        gen = models.load_generator(model, **gen_kw)
        try:
            memory = elicitation.elicit(gen, label, all_qs, forms, variant, run_dir, matcher=matcher,
                                        scored_file=run_dir / "adapters" / label / f"untreated_closed_book_{variant}.jsonl")
            untreated = score_with(gen, label, all_eps, memory, run_dir, matcher)
        finally:
            close_generator(gen)
        msum["untreated_closed_book"] = closed_book_counts(memory)
        # 3. each adapter: its own closed-book answers, then its held-out episodes scored against them
        for obj in ft["objectives"]:
            parts, mems = [], []
            for p in plans:
                path = adapter_dir(run_dir, label, obj, p.train_fold)
                if not eps_by_fold[p.train_fold]:
                    print(f"[finetune] {label} {obj} {p.name}: no held-out questions in this slice; not evaluated")
                    continue
                df, amem = evaluate_adapter(model, path, f"{label}__{obj}__{p.name}", q_by_fold[p.train_fold],
                                            eps_by_fold[p.train_fold], forms, run_dir, gen_kw, variant, matcher)
                msum["adapters"][obj][p.name]["closed_book"] = closed_book_counts(amem, memory)
                df["train_fold"] = p.train_fold
                write_jsonl(path / "scored.jsonl",
                            df.drop(columns=["schema"], errors="ignore").to_dict("records"))
                parts.append(df)
                mems.append(amem)
            if not parts:
                continue
            treated = pd.concat(parts, ignore_index=True)
            res = paired_deltas(treated, untreated, forms, METRICS, n_boot=n_boot, n_perm=n_perm, seed=0, alpha=alpha)
            res["n_episodes"] = int(len(treated))
            res["closed_book"] = closed_book_counts(pd.concat(mems, ignore_index=True), memory)
            msum["objectives"][obj] = res
        summary["models"][model] = msum
    # the paper's Holm families (stats.FAMILIES): retention and correct-tool following, each over
    # models x objectives per slice; the other metrics uncorrected; criteria recomputed (H4)
    analyses.apply_finetune_families(summary, alpha)
    write_summary(summary, run_dir)
    return summary


def close_generator(gen) -> None:
    """Release a generator that holds resources (``close()``, when it has one)."""
    close = getattr(gen, "close", None)
    if callable(close):
        close()


def write_stage_summary(summary: dict[str, Any], run_dir, name: str) -> Path:
    """Write ``summaries/<name>`` atomically (JSON-safe values, ``io.plain``)."""
    return write_json(Path(run_dir) / "summaries" / name, summary, indent=1, newline=False)


def read_stage_summary(run_dir, name: str, notebook: str, error: type[MemtocError] = None) -> dict[str, Any]:
    """``summaries/<name>``; ``error`` (default :class:`FinetuneError`) names ``notebook`` when it is absent."""
    path = Path(run_dir) / "summaries" / name
    if not path.is_file():
        raise (error or FinetuneError)(f"{path} does not exist; run notebook {notebook} first")
    return json.loads(path.read_text())


def write_summary(summary: dict[str, Any], run_dir) -> Path:
    return write_stage_summary(summary, run_dir, "finetuning.json")


def read_summary(run_dir) -> dict[str, Any]:
    return read_stage_summary(run_dir, "finetuning.json", "04_finetuning")


# ==================================================================================================
# tables and figures (for the notebook)

def delta_table(summary: dict[str, Any]):
    """Long DataFrame: model, objective, metric, formulation, delta, ci_lo, ci_hi, p, p_holm,
    n_units, n_treated_only, n_untreated_only, treated, untreated."""
    rows = []
    for model, ms in summary.get("models", {}).items():
        for obj, os_ in ms.get("objectives", {}).items():
            for metric, by_form in os_.get("deltas", {}).items():
                for form, c in by_form.items():
                    ci = c.get("ci95") or [None, None]
                    rows.append({"model": model, "objective": obj, "metric": metric, "formulation": form,
                                 "delta": c.get("delta"), "ci_lo": ci[0], "ci_hi": ci[1], "p": c.get("p"),
                                 "p_holm": c.get("p_holm"), "n_units": c.get("n_units"),
                                 "n_treated_only": c.get("n_treated_only"),
                                 "n_untreated_only": c.get("n_untreated_only"),
                                 "treated": c.get("treated"), "untreated": c.get("untreated")})
    return pd.DataFrame(rows)


def closed_book_table(summary: dict[str, Any]):
    """One row per adapter and formulation (+ ``all``): its own forced closed-book counts beside the
    untreated model's on the same questions, and how many answers changed status."""
    rows = []
    for model, ms in summary.get("models", {}).items():
        for obj, by_fold in ms.get("adapters", {}).items():
            for fold, a in by_fold.items():
                for form, c in (a.get("closed_book") or {}).items():
                    rows.append({"model": model, "objective": obj, "fold": fold, "formulation": form, **c})
    return pd.DataFrame(rows)


def criterion_table(summary: dict[str, Any]):
    """DataFrame: model, objective, formulation (pooled + each), passed, retention/tool deltas, reason."""
    rows = []
    for model, ms in summary.get("models", {}).items():
        for obj, os_ in ms.get("objectives", {}).items():
            items = [("pooled", os_.get("criterion"))] + list((os_.get("criterion_by_formulation") or {}).items())
            for form, c in items:
                if c:
                    rows.append({"model": model, "objective": obj, "formulation": form, "passed": c["passed"],
                                 "retention_delta": c["retention_delta"], "retention_p": c["retention_p"],
                                 "tool_delta": c["tool_delta"], "tool_p": c["tool_p"], "reason": c["reason"]})
    return pd.DataFrame(rows)


def plan(P: dict[str, Any], bench=None):
    """(plans, examples per training fold) for the run's parameters, leakage-checked (no training).
    ``bench``: the loaded benchmark, if the caller has it (else it is loaded from the run's release)."""
    ft = finetune_params(P)
    cfg = RunConfig.of(P)
    if bench is None:
        bench = load_benchmark(cfg.release_dir)
    seed = cfg.seed
    plans = crossfit_plan(bench.questions, select_questions(bench.analysis, cfg.n_questions, seed), ft["folds"],
                          ft["train_questions_per_fold"], ft["eval_questions_per_fold"], seed,
                          exclude_linked=ft["exclude_linked"])
    examples = {p.train_fold: training_examples(p.train_questions, ft["train_formulations"]) for p in plans}
    check_no_leakage(plans, examples)
    return plans, examples


def plan_table(P: dict[str, Any]):
    """One row per training fold: training questions / chains / excluded / examples and the held-out
    questions / chains its adapters are scored on."""
    plans, examples = plan(P)
    return pd.DataFrame([p.describe(len(examples[p.train_fold])) for p in plans]).set_index("train_fold")


def adapters_table(summary: dict[str, Any]):
    """One row per adapter: model, objective, fold, steps, examples, seconds, s/step, first/final loss, resumed."""
    rows = []
    for model, ms in summary.get("models", {}).items():
        for obj, by_fold in ms.get("adapters", {}).items():
            for fold, a in by_fold.items():
                rows.append({"model": model, "objective": obj, "fold": fold,
                             **{k: a.get(k) for k in ("steps", "examples", "seconds", "seconds_per_step",
                                                      "first_loss", "final_loss", "resumed")}})
    return pd.DataFrame(rows)


def plot_deltas(summary: dict[str, Any], path) -> Path:
    """Paired deltas (adapter − untreated) with 95% CIs: one panel per metric, objectives as colours,
    formulations (and pooled) on the x axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    t = delta_table(summary).dropna(subset=["delta"])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metrics = [m for m in METRICS if m in set(t["metric"])] or list(METRICS)
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.3 * len(metrics), 3.4), sharey=True, squeeze=False)
    pal = dict(zip(OBJECTIVES, sns.color_palette("deep", len(OBJECTIVES))))
    for ax, m in zip(axes[0], metrics):
        d = t[t["metric"] == m]
        forms = [f for f in list(FORMULATIONS) + ["pooled"] if f in set(d["formulation"])]
        objs = [o for o in OBJECTIVES if o in set(d["objective"])]
        for j, o in enumerate(objs):
            for i, f in enumerate(forms):
                r = d[(d["objective"] == o) & (d["formulation"] == f)]
                if r.empty:
                    continue
                r = r.iloc[0]
                x = i + (j - (len(objs) - 1) / 2) * 0.25
                lo = r["delta"] - r["ci_lo"] if r["ci_lo"] is not None and not np.isnan(r["ci_lo"]) else 0
                hi = r["ci_hi"] - r["delta"] if r["ci_hi"] is not None and not np.isnan(r["ci_hi"]) else 0
                ax.errorbar(x, r["delta"], yerr=[[lo], [hi]], fmt="o", color=pal[o], capsize=3,
                            label=o.upper() if i == 0 else None)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(forms)))
        ax.set_xticklabels(forms, rotation=30, ha="right")
        ax.set_title(m)
    axes[0][0].set_ylabel("adapter − untreated")
    axes[0][0].legend(frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
