"""Held-out evaluation: episodes, scoring against each checkpoint's own closed-book answers, and
the paired deltas adapter - untreated."""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Optional, Sequence

from memtoc.config.params import DEFAULTS
from memtoc.config.runconfig import RunConfig, expect_config
from memtoc.core import intervals, stats
from memtoc.core.io import plain
from memtoc.core.metrics import metric_units, paired_units
from memtoc.core.records import Episode, Question
from memtoc.core.vocab import FORMULATIONS
from memtoc.data.episodes import build_episodes
from memtoc.core.errors import ConfigError
from memtoc.generation import models
from memtoc.generation.backends.hf import TransformersGenerator
from memtoc.generation.backends.vllm import VLLMGenerator, served_rank
from memtoc.stages import elicitation, evaluation
from memtoc.stages.finetune.common import (
    EVAL_CONDITIONS,
    METRICS,
    SHARED_BACKEND_OPTIONS,
    FinetuneError,
    close_generator,
)


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
                  n_boot: int = DEFAULTS["n_boot"], n_perm: int = DEFAULTS["n_perm"], seed: int = 0,
                  alpha: float = DEFAULTS["alpha"]) -> dict[str, Any]:
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
            c = intervals.contrast(t, b, n_boot=n_boot, n_perm=n_perm, seed=seed,
                                    treatment="adapter", baseline="untreated")
            pu = paired_units(t, b)
            if len(pu):
                rates = pu.groupby("formulation")[["t", "b"]].mean()
                c["treated"], c["untreated"] = float(rates["t"].mean()), float(rates["b"].mean())
            else:
                c["treated"] = c["untreated"] = None
            deltas[m][form] = c
    intervals.apply_holm({m: deltas[m]["pooled"] for m in metrics if "pooled" in deltas[m]})
    intervals.apply_holm({f"{m}/{f}": deltas[m][f] for m in metrics for f in deltas[m] if f != "pooled"})
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


def eval_generator_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """``models.load_generator`` keyword arguments of this stage's generators (the untreated model
    and every adapter), on ``finetune.eval_backend`` (transformers by default, whatever the run's
    ``backend``; or vllm: one engine per model started with LoRA serving at the rank of this stage's
    adapters, ``lora_r`` rounded up to a rank vLLM accepts).

    Options: the run's ``backend_options`` when the run itself uses that backend; otherwise only
    the options every backend shares (:data:`SHARED_BACKEND_OPTIONS`, e.g. ``stop_at_final``, so that
    04 extracts from replies generated like 03's) -- a vLLM run's engine options such as
    ``gpu_memory_utilization`` / ``max_model_len`` mean nothing to TransformersGenerator. Then
    ``finetune.backend_options`` over them. dtype: ``finetune.eval_dtype``, else the run's ``dtype``.
    Pure: loads nothing. ``cfg``: the run configuration (a dict is refused)."""
    cfg = expect_config(cfg, "finetune.eval_generator_kwargs")
    ft = cfg.finetune
    run_opts = dict(cfg.backend_options or {})
    if cfg.backend != ft.eval_backend:
        run_opts = {k: v for k, v in run_opts.items() if k in SHARED_BACKEND_OPTIONS}
    opts = {**run_opts, **ft.backend_options}
    if ft.eval_backend == "vllm":
        bad = sorted(set(ft.backend_options) & _transformers_only_options())
        if bad:
            raise ConfigError(f"field 'finetune.backend_options': {bad} are options of the transformers backend, and "
                              "finetune.eval_backend is vllm; remove them (vLLM takes vllm.LLM's arguments, e.g. "
                              "{max_model_len: 4096})")
        opts = {"enable_lora": True, "max_lora_rank": served_rank(ft.lora_r, "finetune.lora_r"), **opts}
    return dict(backend=ft.eval_backend, batch_size=cfg.batch_size, dtype=ft.eval_dtype or cfg.dtype,
                max_new_tokens=cfg.max_new_tokens, model_cache_dir=cfg.model_cache_dir, **opts)


def _transformers_only_options() -> set[str]:
    return set(inspect.signature(TransformersGenerator.__init__).parameters) - \
        set(inspect.signature(VLLMGenerator.__init__).parameters)


def shares_engine(gen_kw: dict[str, Any]) -> bool:
    """True where the adapters are served on the untreated model's engine (vLLM's LoRA serving)
    instead of each loading (and merging) its own model."""
    return gen_kw.get("backend") == "vllm"


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
                     matcher: str = "paper", base=None):
    """(scored episodes, closed-book memory) of the adapter at ``adapter``: its *own* closed-book
    answers to ``questions`` (written to ``<adapter>/closed_book_<variant>.jsonl``), then ``episodes``
    scored against them (:func:`score_with`), so that a paired delta with the untreated model
    (:func:`paired_deltas`) counts the units in a cell for one side only. ``gen_kw``:
    ``models.load_generator`` keywords; generations are cached under ``label``. ``base``: the untreated
    model's generator, whose engine serves the adapter (:func:`models.adapter_generator`) instead of
    a model loaded for it."""
    agen = (models.adapter_generator(base, adapter) if base is not None
            else models.load_generator(model, adapter=adapter, **gen_kw))
    try:
        memory = elicitation.elicit(agen, label, questions, formulations, variant, run_dir, matcher=matcher,
                                    scored_file=Path(adapter) / f"closed_book_{variant}.jsonl")
        return score_with(agen, label, episodes, memory, run_dir, matcher), memory
    finally:
        close_generator(agen)
