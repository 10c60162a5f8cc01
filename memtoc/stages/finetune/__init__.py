"""Fine-tuning: SFT and DPO LoRA adapters with chain-level cross-fitting, and their held-out
evaluation against the untreated model.

Modules: ``data`` (training pairs), ``crossfit`` (the fold plan, :func:`plan`), ``training`` (one
adapter with trl), ``preference`` (log-probability diagnostic), ``evaluate`` (held-out scoring and
paired deltas), ``stage`` (:func:`run`, notebook 04), ``tables`` (tables and figures), ``common``
(errors, constants, summary files). The ``finetune`` block of the params file is
``memtoc.config.blocks.FinetuneConfig`` (``cfg.finetune``); every stage function takes the run's
``RunConfig``.

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
    :func:`check_training_tokens`); trl appends the end-of-turn token the chat template writes after
    an assistant message (:func:`training_eos`; the EOS for base models) to every completion, so the
    rows equal the paper's Trainer recipe token for token (tests/unit/test_finetune_recipe.py). The near
    value is the one before the repair overlay (``near_original``), as in the release's pairs.
    Excluded questions (outside the 542) may be trained on.

Cross-fitting (:func:`crossfit_plan`)
    The two chain-level folds of the 575-question pool (``Question.fold``: the release's frozen split,
    ``crossfit_folds.json``, see ``benchmark``). ``exclude_linked`` (default off) drops from each
    fold's training data the questions linked to the other fold (``construct.related_links``). The adapter trained on
    fold k is evaluated only on analysis-set questions of the *other* fold, taken from the run's
    headline selection (``selection.run_selection(cfg, bench).headline``, so the untreated replies of
    notebook 03 are reused from the cache). :func:`check_no_leakage` refuses a plan in which an
    evaluated question's chain is in its adapter's training data. Matched SFT and DPO runs share
    the base checkpoint, hyper-parameters, LoRA configuration, seed and data order.

Evaluation (all generation of this stage: ``finetune.eval_backend``, :func:`eval_generator_kwargs`;
vLLM serves every adapter on the untreated model's engine through LoRARequest, transformers merges each)
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

from memtoc.config.blocks import FinetuneConfig
from memtoc.stages.finetune.common import (
    EVAL_CONDITIONS,
    METRICS,
    OBJECTIVES,
    SCHEMA_VERSION,
    SHARED_BACKEND_OPTIONS,
    TRAIN_CONDITIONS,
    FinetuneError,
    adapter_dir,
    close_generator,
    read_stage_summary,
    read_summary,
    write_stage_summary,
    write_summary,
)
from memtoc.stages.finetune.crossfit import FoldPlan, check_no_leakage, crossfit_plan, plan, plan_table
from memtoc.stages.finetune.data import TrainExample, completion, dpo_rows, sft_rows, training_examples
from memtoc.stages.finetune.evaluate import (
    closed_book_counts,
    eval_episodes,
    eval_generator_kwargs,
    evaluate_adapter,
    shares_engine,
    paired_deltas,
    score_with,
)
from memtoc.stages.finetune.preference import pair_preference
from memtoc.stages.finetune.stage import run
from memtoc.stages.finetune.tables import (
    adapters_table,
    closed_book_table,
    criterion_table,
    delta_table,
    plot_deltas,
    plot_loss_curve,
)
from memtoc.stages.finetune.training import (
    TRAINING_KEYS,
    check_training_tokens,
    config_hash,
    finished_adapter,
    leading_special_text,
    load_train_model,
    loss_curve,
    make_trainer,
    train_adapter,
    train_dtype,
    training_arguments,
    training_config,
    training_eos,
    training_prompt,
    warmup_kwargs,
)

__all__ = ["EVAL_CONDITIONS", "METRICS", "OBJECTIVES", "SCHEMA_VERSION", "SHARED_BACKEND_OPTIONS",
           "TRAIN_CONDITIONS", "TRAINING_KEYS", "FinetuneConfig", "FinetuneError", "FoldPlan", "TrainExample",
           "adapter_dir", "adapters_table", "check_no_leakage", "check_training_tokens", "close_generator",
           "closed_book_counts", "closed_book_table", "completion", "config_hash", "criterion_table",
           "crossfit_plan", "delta_table", "dpo_rows", "eval_episodes", "eval_generator_kwargs",
           "evaluate_adapter", "shares_engine", "finished_adapter", "leading_special_text", "load_train_model",
           "loss_curve", "make_trainer", "paired_deltas", "pair_preference", "plan", "plan_table", "plot_deltas",
           "plot_loss_curve", "read_stage_summary", "read_summary", "run", "score_with", "sft_rows",
           "train_adapter", "train_dtype", "training_arguments", "training_config", "training_eos", "training_examples",
           "training_prompt", "warmup_kwargs", "write_stage_summary", "write_summary"]
