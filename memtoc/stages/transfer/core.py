"""Transfer beyond MemToC (paper §5.4, App. F.1): episodes, scoring, metrics, forward and reverse.

Episodes (one per item × formulation × condition; MemToC's wording, ``memtoc.core.prompts``)
    The question text is the item's question followed by its options, one a line (``A. text``).
    ``closed_book``   the forced closed-book prompt (``prompts.closed_book_prompt``): fixes the
                      memory-right set (items the *untreated* model answers with the world-true key,
                      per formulation); the paired comparisons of every arm use that set.
    ``value``         value frame: the schema-frame with-tool prompt, the tool returning
                      ``{"result": <counterfactual option's text>}`` (schema: :data:`TOOL_SCHEMA`,
                      written here: the paper does not state its frame prompt wording).
    ``passage``       passage frame: the passage-frame prompt, the search returning
                      ``{"result": <counterfactual passage>}``.
    ``unanswerable``  passage frame with the unanswerable row's passage; target: abstain.
    Counterfactual items are read on their common support (items in every requested frame's pool).

Metrics (per arm; rates with question-cluster bootstrap intervals, ``intervals.rate_intervals``;
adapter − untreated paired on common support, ``intervals.contrast``): see :data:`METRIC_DOC`.

Forward transfer: notebook 04's adapters (``adapters/<model>/<objective>/fold<k>/``), or with
``forward_pool: full`` adapters trained here on the whole 575-question pool (``memtoc.stages.transfer.forward``;
arms named by objective, as Table 6), and any ``extra_adapters``, against the untreated model.
Reverse transfer: a LoRA-DPO adapter trained on the external set only (chosen
``FINAL: <world-true option>``, rejected ``FINAL: <counterfactual option>``, on the value- and
passage-frame prompts; :func:`check_no_memtoc_leak` refuses any MemToC question, gold or
distractor text), trained with ``finetune.train_adapter`` and evaluated on MemToC with notebook 04's
paired evaluation (``finetune.eval_episodes``, ``finetune.evaluate_adapter``: each checkpoint against its own
closed-book answers, ``finetune.paired_deltas``).

``summaries/transfer.json`` (``schema_version`` 1)::

    /dataset                      {dataset, path, sha256, n_counterfactual, n_unanswerable, plumbing, note}
    /caveat                       what the numbers are (plumbing set / model size)
    /config                       resolved transfer parameters
    /metrics                      {metric: definition}
    /models/<model>/support       {n_items, n_unanswerable, memory_right: {form: n}}
    /models/<model>/arms/<arm>/rates/<metric>/<form|pooled>     {value, ci95, n}
    /models/<model>/forward/<arm>/deltas/<metric>/<form|pooled> contrast object (delta, ci95, p,
                                  p_holm, n_units, n_clusters, treated, untreated)
    /models/<model>/forward/<arm>/closed_book_band    {delta, band, inside}
    /models/<model>/forward/<arm>/unmatched_gap       {frame: {untreated, treated, gap, flagged}}
    /models/<model>/forward_note  why there are no forward arms ("" when there are)
    /models/<model>/full_pool     forward_pool full: {objective: {path, questions, folds, config_hash, resumed, steps, ...}}
    /models/<model>/reverse       {adapter, training, leak_check, n_examples, eval_questions, eval_selection,
                                   n_episodes, deltas/<metric>/<form|pooled> (finetune delta objects, with
                                   n_treated_only / n_untreated_only: the adapter is scored against its
                                   own closed-book answers), closed_book (finetune.closed_book_counts),
                                   criterion, criterion_by_formulation}
    /published                    the paper's Table 6 and reverse-transfer numbers (different models
                                  and data: Llama-3.1-8B / gemma-2-9b on FaithEval × ARC-Challenge)
    /timing                       seconds per phase
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd

from memtoc.config.blocks import TransferConfig
from memtoc.config.params import DEFAULTS, FORMULATIONS, resolve_release_dir
from memtoc.config.runconfig import RunConfig, RunPaths, expect_config
from memtoc.core import intervals, prompts
from memtoc.core.errors import MemtocError, check_choice
from memtoc.core.io import atomic_write_text
from memtoc.core.metrics import definitions, paired_units
from memtoc.core.records import Question
from memtoc.core.scoring import canon
from memtoc.data.benchmark import load_benchmark
from memtoc.data.selection import run_selection
from memtoc.generation import models
from memtoc.stages import elicitation, evaluation, finetune
from memtoc.stages.transfer import forward
from memtoc.stages.transfer.data import POOLS, TransferItem
from memtoc.stages.transfer.matcher import ABSTAIN, match_choice
from memtoc.stages.transfer.source import load as load_dataset

SCHEMA_VERSION = 1
CONDITIONS = ("closed_book", "value", "passage", "unanswerable")
FRAMES = POOLS                                      # the two presentation frames (value, passage)
PROMPT_FRAME = {"value": "schema", "passage": "passage", "unanswerable": "passage"}
REVERSE_OBJECTIVE = "transfer_dpo"

#: The value frame's tool schema (memtoc's wording; the paper does not print its frame prompts).
TOOL_SCHEMA: dict[str, Any] = {
    "name": "lookup_answer",
    "description": "Answer a multiple-choice question from a reference knowledge base. Returns the text of the correct option.",
    "parameters": {"type": "object",
                   "properties": {"question": {"type": "string", "description": "The question, in natural language."}},
                   "required": ["question"]},
}

METRIC_DOC = {
    "closed_book_acc": "closed-book (forced) answer = world-true key, over all counterfactual items",
    "retention_value": "value frame: answer = world-true key, on the untreated model's memory-right items",
    "retention_passage": "passage frame: answer = world-true key, on the untreated model's memory-right items",
    "cf_follow_value": "value frame: answer = counterfactual key, on the memory-right items",
    "cf_follow_passage": "passage frame: answer = counterfactual key, on the memory-right items",
    "abstention": "unanswerable items (passage frame): the answer abstains",
    "unmatched_closed_book": "closed-book replies the multiple-choice matcher maps to no option and no abstention",
    "unmatched_value": "value-frame replies left unmatched",
    "unmatched_passage": "passage-frame replies left unmatched",
}
METRICS = tuple(METRIC_DOC)
#: Table 6's columns (Holm family of each forward arm).
TABLE6_METRICS = ("retention_value", "retention_passage", "abstention")

class TransferError(MemtocError):
    """The transfer stage cannot run as configured (no items, leaking training data, ...)."""


# ==================================================================================================
# parameters

def select_items(items: Sequence[TransferItem], tr: TransferConfig) -> tuple[list[TransferItem], list[TransferItem]]:
    """(counterfactual items on the frames' common support, unanswerable items), cut to the sizes."""
    keep = [i for i in items if i.verified or not tr.verified_only]
    cf = [i for i in keep if i.kind == "counterfactual" and all(f in i.pools for f in tr.frames)]
    un = [i for i in keep if i.kind == "unanswerable"]
    if tr.n_counterfactual is not None:
        cf = cf[:tr.n_counterfactual]
    if tr.n_unanswerable is not None:
        un = un[:tr.n_unanswerable]
    return cf, un


# ==================================================================================================
# episodes (pure)

@dataclass(frozen=True)
class TransferEpisode:
    """One transfer prompt. ``condition`` and ``arm_key`` make it servable by
    ``evaluation.generate_replies`` (cache file ``generations/<label>/transfer_<condition>__<form>.jsonl``)."""

    episode_id: str
    item_id: str
    kind: str
    formulation: str
    condition: str              # closed_book | value | passage | unanswerable
    prompt: str
    labels: tuple[str, ...]
    texts: tuple[str, ...]
    gold_key: Optional[str]
    cf_key: Optional[str]

    @property
    def arm_key(self) -> str:
        return f"transfer_{self.condition}__{self.formulation}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def question_text(item: TransferItem) -> str:
    """The question followed by its options, one a line ("A. text")."""
    return "\n".join([item.question] + [f"{lab}. {t}" for lab, t in zip(item.labels, item.texts)])


def build_episodes(cf_items: Sequence[TransferItem], un_items: Sequence[TransferItem], formulations: Sequence[str],
                   frames: Sequence[str] = FRAMES, closed_book: bool = True) -> list[TransferEpisode]:
    """Closed-book + one episode per frame for each counterfactual item, one passage-frame episode
    per unanswerable item, for each formulation."""
    out: list[TransferEpisode] = []
    for form in formulations:
        check_choice("formulation", form, FORMULATIONS)
        for it in cf_items:
            q = question_text(it)
            conds = (["closed_book"] if closed_book else []) + list(frames)
            for c in conds:
                if c == "closed_book":
                    p = prompts.closed_book_prompt(q, form, "forced")
                elif c == "value":
                    p = prompts.with_tool_prompt(q, form, TOOL_SCHEMA, prompts.value_output(it.cf_text), frame="schema")
                else:
                    p = prompts.with_tool_prompt(q, form, None, prompts.value_output(it.passage), frame="passage")
                out.append(TransferEpisode(f"{it.id}-{c}-{form}", it.id, it.kind, form, c, p, it.labels, it.texts,
                                           it.gold_key, it.cf_key))
        for it in un_items:
            p = prompts.with_tool_prompt(question_text(it), form, None, prompts.value_output(it.passage), frame="passage")
            out.append(TransferEpisode(f"{it.id}-unanswerable-{form}", it.id, it.kind, form, "unanswerable", p,
                                       it.labels, it.texts, None, None))
    return out


def score_replies(episodes: Sequence[TransferEpisode], responses: Sequence[str], arm: str) -> pd.DataFrame:
    """One scored row per episode: matched label / ABSTAIN / None, the rule, correct, followed_cf,
    abstain, unmatched (pure). ``qkey`` = the item id (the cluster unit)."""
    if len(episodes) != len(responses):
        raise TransferError(f"{len(episodes)} episodes but {len(responses)} replies")
    rows = []
    for e, r in zip(episodes, responses):
        m = match_choice(r, e.labels, e.texts)
        rows.append({"arm": arm, "qkey": e.item_id, "kind": e.kind, "formulation": e.formulation,
                     "condition": e.condition, "response": r, "extracted": m.extracted, "matched": m.matched,
                     "match_rule": m.rule,
                     "correct": e.gold_key is not None and m.matched == e.gold_key,
                     "followed_cf": e.cf_key is not None and m.matched == e.cf_key,
                     "abstain": m.matched == ABSTAIN, "unmatched": m.matched is None})
    return pd.DataFrame(rows)


# ==================================================================================================
# metrics (pure)

def memory_right(untreated: pd.DataFrame) -> set[tuple[str, str]]:
    """(formulation, item) pairs the untreated model answers correctly closed-book."""
    d = untreated[(untreated["condition"] == "closed_book") & untreated["correct"]]
    return set(zip(d["formulation"], d["qkey"]))


def metric_units(scored: pd.DataFrame, metric: str, mem_right: set[tuple[str, str]]) -> pd.DataFrame:
    """Per-episode 0/1 values of ``metric``: columns formulation, qkey, value."""
    check_choice("transfer metric", metric, METRICS)
    if metric == "closed_book_acc":
        d, col = scored[scored["condition"] == "closed_book"], "correct"
    elif metric == "abstention":
        d, col = scored[scored["condition"] == "unanswerable"], "abstain"
    elif metric.startswith("unmatched_"):
        d, col = scored[scored["condition"] == metric[len("unmatched_"):]], "unmatched"
    else:
        frame = metric.rsplit("_", 1)[1]
        d = scored[scored["condition"] == frame]
        d = d[[k in mem_right for k in zip(d["formulation"], d["qkey"])]]
        col = "correct" if metric.startswith("retention") else "followed_cf"
    out = d[["formulation", "qkey"]].copy()
    out["value"] = d[col].astype(float).to_numpy()
    return out.reset_index(drop=True)


def active_metrics(frames: Sequence[str]) -> list[str]:
    return [m for m in METRICS if not any(m.endswith(f"_{f}") for f in FRAMES if f not in frames)]


def arm_rates(scored: pd.DataFrame, mem_right: set, formulations: Sequence[str], frames: Sequence[str],
              n_boot: int = DEFAULTS["n_boot"], seed: int = 0, alpha: float = DEFAULTS["alpha"]) -> dict[str, dict]:
    """``{metric: {form: interval, "pooled": interval}}`` for one arm."""
    return {m: intervals.rate_intervals(metric_units(scored, m, mem_right), formulations, n_boot=n_boot,
                                         seed=seed, alpha=alpha)
            for m in active_metrics(frames)}


def arm_deltas(treated: pd.DataFrame, untreated: pd.DataFrame, mem_right: set, formulations: Sequence[str],
               frames: Sequence[str], arm: str, n_boot: int = DEFAULTS["n_boot"], n_perm: int = DEFAULTS["n_perm"],
               seed: int = 0) -> dict:
    """``{metric: {form|pooled: contrast object + treated/untreated rates}}``: adapter − untreated on
    common support (units (formulation, item), clusters = items); Holm over Table 6's pooled metrics."""
    out: dict[str, dict] = {}
    for m in active_metrics(frames):
        tu, bu = metric_units(treated, m, mem_right), metric_units(untreated, m, mem_right)
        out[m] = {}
        for form in list(formulations) + ["pooled"]:
            t = tu if form == "pooled" else tu[tu["formulation"] == form]
            b = bu if form == "pooled" else bu[bu["formulation"] == form]
            if form != "pooled" and len(formulations) == 1:
                continue
            c = intervals.contrast(t, b, n_boot=n_boot, n_perm=n_perm, seed=seed, treatment=arm, baseline="untreated")
            pu = paired_units(t, b)
            c["treated"] = float(pu["t"].mean()) if len(pu) else None
            c["untreated"] = float(pu["b"].mean()) if len(pu) else None
            out[m][form] = c
    intervals.apply_holm({m: out[m]["pooled"] for m in TABLE6_METRICS if m in out})
    return out


def band_check(delta: Optional[float], band: float) -> dict[str, Any]:
    """The paper's pre-registered band on the closed-book accuracy change."""
    return {"delta": delta, "band": band, "inside": None if delta is None else bool(abs(delta) <= band)}


def unmatched_gaps(rates_t: dict, rates_b: dict, frames: Sequence[str], gap: float) -> dict[str, dict]:
    """Per frame (and closed book): unmatched rate of each arm, their gap, flagged when > ``gap``."""
    out = {}
    for c in ["closed_book"] + list(frames):
        t = (rates_t.get(f"unmatched_{c}", {}).get("pooled") or {}).get("value")
        b = (rates_b.get(f"unmatched_{c}", {}).get("pooled") or {}).get("value")
        g = None if t is None or b is None else float(t - b)
        out[c] = {"untreated": b, "treated": t, "gap": g, "flagged": g is not None and abs(g) > gap}
    return out


# ==================================================================================================
# reverse transfer: training data and the no-leak guarantee

def reverse_examples(cf_items: Sequence[TransferItem], formulations: Sequence[str],
                     frames: Sequence[str] = FRAMES) -> list[finetune.TrainExample]:
    """Correctness-labelled DPO pairs from the external set only: on each frame's with-tool prompt,
    ``FINAL: <world-true option>`` is preferred over ``FINAL: <counterfactual option>``."""
    out = []
    for e in build_episodes(cf_items, [], formulations, frames, closed_book=False):
        labels, texts = list(e.labels), list(e.texts)
        gold, cf = texts[labels.index(e.gold_key)], texts[labels.index(e.cf_key)]
        out.append(finetune.TrainExample(
            question_id=e.item_id, qkey=e.item_id, instance_id=-1, fold=None, excluded=False,
            formulation=e.formulation, condition=f"transfer_{e.condition}", tool_value=cf, prompt=e.prompt,
            chosen=finetune.completion(gold), rejected=finetune.completion(cf)))
    return out


def check_no_memtoc_leak(examples: Sequence[finetune.TrainExample], questions: Sequence[Question]) -> dict[str, Any]:
    """Raise TransferError if any MemToC content enters reverse training: a MemToC question (canonical
    form) inside a training prompt, a training answer equal to a MemToC gold / near / far value, a
    MemToC value of two or more tokens inside a training prompt, or a MemToC id / qkey as a training id.
    Returns the counts checked."""
    qs = {canon(q.question) for q in questions if canon(q.question)}
    values = {canon(v) for q in questions for v in (q.gold, q.near, q.near_original, q.far) if v and canon(v)}
    long_values = {v for v in values if len(v.split()) >= 2}
    ids = {q.id for q in questions} | {q.qkey for q in questions}
    problems = []
    for e in examples:
        p = f" {canon(e.prompt)} "
        for q in qs:
            if f" {q} " in p:
                problems.append(f"{e.question_id}: prompt contains the MemToC question {q!r}")
        for side in (e.chosen, e.rejected):
            a = canon(side.split(":", 1)[1] if ":" in side else side)
            if a in values:
                problems.append(f"{e.question_id}: training answer {a!r} is a MemToC gold/distractor value")
        for v in long_values:
            if f" {v} " in p:
                problems.append(f"{e.question_id}: prompt contains the MemToC value {v!r}")
        if e.question_id in ids or e.qkey in ids:
            problems.append(f"{e.question_id}: a MemToC question id")
        if len(problems) >= 20:
            break
    if problems:
        raise TransferError(f"reverse-transfer training data would contain MemToC content ({len(problems)} "
                            "problem(s)); remove those rows from the external set: " + "; ".join(problems[:5]))
    return {"passed": True, "n_examples": len(examples), "memtoc_questions": len(qs), "memtoc_values": len(values)}


# ==================================================================================================
# the stage (I/O and models)

def _gen_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """``models.load_generator`` arguments of this stage: the run's, with ``finetune.eval_dtype``."""
    return {**cfg.generator_kwargs(), "dtype": cfg.finetune.eval_dtype or cfg.dtype}


def find_adapters(adapter_root, model: str, objectives: Sequence[str], folds: Sequence[int]) -> dict[str, Path]:
    """``{"<objective>_fold<k>": path}`` of notebook 04's finished adapters (training.json status finished)."""
    out = {}
    for obj in objectives:
        for k in folds:
            p = finetune.adapter_dir(adapter_root, model, obj, k)
            rec = p / "training.json"
            if rec.is_file() and (p / "adapter_config.json").is_file():
                try:
                    ok = json.loads(rec.read_text()).get("status") == "finished"
                except ValueError:
                    ok = False
                if ok:
                    out[f"{obj}_fold{k}"] = p
    return out


def run_arm(gen, label: str, arm: str, episodes: Sequence[TransferEpisode], run_dir) -> pd.DataFrame:
    """Generate (through the cache ``generations/<label>/``) and score the transfer episodes."""
    replies = evaluation.generate_replies(gen, label, list(episodes), run_dir)
    return score_replies(episodes, [getattr(r, "text", r) for r in replies], arm)


def run(cfg: RunConfig, progress: bool = True) -> dict[str, Any]:
    """Forward and reverse transfer for every model of the run; writes ``summaries/transfer.json``
    and ``transfer/<model>/scored_<arm>.jsonl``. Returns the summary. ``cfg``: the run
    configuration (a dict is refused)."""
    cfg = expect_config(cfg, "transfer.run")
    tr = cfg.transfer
    timing: dict[str, float] = {}
    t0 = time.time()
    items, info = load_dataset(tr.dataset, progress=progress)
    cf, un = select_items(items, tr)
    if not cf:
        raise TransferError(f"no counterfactual items on the frames' common support in {info['path']} "
                            f"(frames {list(tr.frames)}, verified_only {tr.verified_only}, n_counterfactual "
                            f"{tr.n_counterfactual})")
    episodes = build_episodes(cf, un, tr.formulations, tr.frames)
    caveat = ("Numbers from the run's models on " + (info["note"] if info["plumbing"] else f"the set {info['path']}")
              + "; the paper's numbers (published) are Llama-3.1-8B-Instruct / gemma-2-9b-it on FaithEval x "
                "ARC-Challenge: a different model and different data.")
    summary: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "run_name": cfg.run_name, "dataset": info, "caveat": caveat,
        "config": tr.to_dict(), "n_boot": tr.n_boot, "n_perm": cfg.n_perm, "alpha": cfg.alpha,
        "metrics": {m: METRIC_DOC[m] for m in active_metrics(tr.frames)},
        "reverse_metrics": definitions(finetune.METRICS),
        "models": {}, "published": published_transfer(cfg.release_dir), "timing": timing,
    }
    bench = load_benchmark(cfg.release_dir) if tr.reverse else None
    for model in tr.models:
        summary["models"][model] = run_model(cfg, model, episodes, cf, un, bench, timing, progress)
    timing["total"] = round(time.time() - t0, 1)
    write_summary(summary, cfg.run_dir)
    return summary


def run_model(cfg: RunConfig, model: str, episodes, cf, un, bench, timing: dict[str, float],
              progress: bool = True) -> dict[str, Any]:
    """``/models/<model>`` of the summary: the untreated arm, the forward arms, the reverse adapter."""
    tr, run_dir, gen_kw = cfg.transfer, cfg.run_dir, _gen_kwargs(cfg)
    forms, frames = tr.formulations, tr.frames
    ms: dict[str, Any] = {"arms": {}, "forward": {}}
    # 1. untreated: transfer episodes (+ MemToC held-out episodes for the reverse comparison)
    t1 = time.time()
    gen = models.load_generator(model, **gen_kw)
    try:
        base = run_arm(gen, model, "untreated", episodes, run_dir)
        if tr.reverse:
            rq, r_sel = reverse_eval_questions(bench, cfg, model)
            r_eps = finetune.eval_episodes(rq, list(cfg.formulations), cfg.finetune.eval_conditions)
            memory = evaluation.ensure_memory(gen, model, bench, r_eps, cfg)
            r_base = finetune.score_with(gen, model, r_eps, memory, run_dir, cfg.matcher)
    finally:
        finetune.close_generator(gen)
    timing[f"{model}/untreated"] = round(time.time() - t1, 1)
    mem = memory_right(base)
    _write(cfg.paths.transfer_scored(model, "untreated"), base)
    ms["support"] = {"n_items": len(cf), "n_unanswerable": len(un),
                     "memory_right": {f: sum(1 for ff, _ in mem if ff == f) for f in forms}}
    rates_b = arm_rates(base, mem, forms, frames, cfg.transfer.n_boot, 0, cfg.alpha)
    ms["arms"]["untreated"] = {"rates": rates_b, "adapter": None}
    # 2. forward: notebook 04's fold adapters, or adapters trained here on the whole pool (forward_pool)
    adapter_root = Path(tr.adapters_from) if tr.adapters_from else run_dir
    if tr.forward_pool == "full" and model not in cfg.finetune.models:
        found = {}
    elif tr.forward_pool == "full":
        t1 = time.time()
        found, ms["full_pool"] = forward.train_full_pool(cfg, model, bench, progress)
        timing[f"{model}/full_pool_training"] = round(time.time() - t1, 1)
    else:
        found = find_adapters(adapter_root, model, tr.forward_objectives, tr.forward_folds)
    for arm, d in tr.extra_adapters.items():
        if not (Path(d) / "adapter_config.json").is_file():
            raise TransferError(f"transfer.extra_adapters.{arm}: {d} is not a peft adapter directory "
                                "(no adapter_config.json)")
        found[arm] = Path(d)
    ms["forward_note"] = ("" if found else f"{model} is not among finetune.models: no full-pool adapter is trained"
                          if tr.forward_pool == "full" else f"no finished adapters of notebook 04 under "
                          f"{RunPaths(adapter_root).adapters(model)}/ for objectives {list(tr.forward_objectives)} "
                          f"folds {list(tr.forward_folds)}; run 04 first (finetune.enabled) for forward transfer")
    for arm, path in found.items():
        t1 = time.time()
        ms["arms"][arm], ms["forward"][arm] = forward_arm(cfg, model, arm, path, episodes, mem, base, rates_b)
        timing[f"{model}/{arm}"] = round(time.time() - t1, 1)
    # 3. reverse: DPO on the external set only, evaluated on MemToC
    if tr.reverse:
        t1 = time.time()
        ms["reverse"] = {**reverse(cfg, cf, bench, model, rq, r_eps, memory, r_base, gen_kw, progress),
                         "eval_selection": r_sel}
        timing[f"{model}/reverse"] = round(time.time() - t1, 1)
    return ms


def forward_arm(cfg: RunConfig, model: str, arm: str, path: Path, episodes, mem: set, base: pd.DataFrame,
                rates_b: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``arms/<arm>``, ``forward/<arm>``) of one adapter on the transfer episodes."""
    tr = cfg.transfer
    agen = models.load_generator(model, adapter=path, **_gen_kwargs(cfg))
    try:
        gen_label = (f"{model}__extra__{arm}" if arm in tr.extra_adapters
                     else f"{model}__{arm}__full" if tr.forward_pool == "full"
                     else f"{model}__{arm.replace('_fold', '__fold')}")
        treated = run_arm(agen, gen_label, arm, episodes, cfg.run_dir)
    finally:
        finetune.close_generator(agen)
    _write(cfg.paths.transfer_scored(model, arm), treated)
    rates_t = arm_rates(treated, mem, tr.formulations, tr.frames, cfg.transfer.n_boot, 0, cfg.alpha)
    deltas = arm_deltas(treated, base, mem, tr.formulations, tr.frames, arm, cfg.transfer.n_boot, cfg.n_perm, 0)
    return {"rates": rates_t, "adapter": str(path)}, {
        "adapter": str(path), "deltas": deltas,
        "closed_book_band": band_check(deltas["closed_book_acc"]["pooled"]["delta"], tr.closed_book_band),
        "unmatched_gap": unmatched_gaps(rates_t, rates_b, tr.frames, tr.unmatched_gap)}


def reverse_eval_questions(bench, cfg: RunConfig, label: str) -> tuple[list[Question], str]:
    """The MemToC questions the reverse adapter is scored on: ``transfer.reverse_eval_questions`` of
    the run's headline selection, those the untreated model answers correctly closed-book in some
    formulation (notebook 02's file, when present) first, so that retention (arb cell) has units at
    small sizes. Both arms are scored on the same questions, so the comparison stays paired; the
    population is stated in ``eval_selection``."""
    sel = run_selection(cfg, bench).headline
    n = cfg.transfer.reverse_eval_questions
    try:
        mem = elicitation.load_memory(cfg.run_dir, label, cfg.closed_book_variant)
    except MemtocError:
        return sel[:n], "the first questions of the run's headline selection (no closed-book file of notebook 02)"
    right = set(mem.loc[mem["memory_correct"].astype(object).eq(True), "qkey"])
    order = [q for q in sel if q.qkey in right] + [q for q in sel if q.qkey not in right]
    k = sum(q.qkey in right for q in order[:n])
    return order[:n], (f"the run's headline selection, memory-right questions first (notebook 02): "
                       f"{k} of {n} answered correctly closed-book in some formulation")


def reverse(cfg: RunConfig, cf_items, bench, model, r_questions, r_eps, memory, r_base, gen_kw,
            progress=True) -> dict[str, Any]:
    """Train the reverse-transfer DPO adapter (resumed when finished) and compare it with the untreated
    model on the MemToC held-out episodes ``r_eps`` of ``r_questions`` as notebook 04 compares its
    adapters (``finetune.evaluate_adapter``): the adapter scored against its *own* forced closed-book
    answers, the untreated model (``r_base``) against its own (``memory``), ``finetune.paired_deltas``
    on the case-stable common support (``n_treated_only`` / ``n_untreated_only``), and both
    closed-book counts (``closed_book``, ``finetune.closed_book_counts``). The adapter trains with the
    run's ``finetune`` settings but ``transfer.reverse_max_steps`` / ``reverse_batch_size``."""
    tr, run_dir = cfg.transfer, cfg.run_dir
    examples = reverse_examples(cf_items, tr.reverse_train_formulations, tr.frames)
    leak = check_no_memtoc_leak(examples, bench.questions)
    rft = dataclasses.replace(cfg.finetune, max_steps=tr.reverse_max_steps, batch_size=tr.reverse_batch_size)
    spec = models.get_model(model)
    base_path = models.prepare_model(model, cache_dir=cfg.model_cache_dir)
    path = cfg.paths.external_adapter(model, REVERSE_OBJECTIVE)
    if progress:
        print(f"[transfer] {model} reverse DPO: {len(examples)} external pairs -> {path}")
    rec = finetune.train_adapter(base_path, spec, examples, "dpo", rft, path, progress=progress)
    forms = [f for f in FORMULATIONS if any(e.formulation == f for e in r_eps)]
    treated, own = finetune.evaluate_adapter(model, path, f"{model}__{REVERSE_OBJECTIVE}", r_questions, r_eps, forms,
                                             run_dir, gen_kw, cfg.closed_book_variant, cfg.matcher)
    res = finetune.paired_deltas(treated, r_base, forms, finetune.METRICS, n_boot=cfg.transfer.n_boot, n_perm=cfg.n_perm,
                                 seed=0, alpha=cfg.alpha)
    res["closed_book"] = finetune.closed_book_counts(own, memory)
    return {"adapter": str(path), "leak_check": leak, "n_examples": len(examples),
            "eval_questions": len({e.qkey for e in r_eps}), "n_episodes": int(len(treated)),
            "training": {k: rec.get(k) for k in ("steps", "examples", "seconds", "first_loss", "final_loss",
                                                 "resumed", "config_hash")},
            **res}


def _write(path: Path, df: pd.DataFrame) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n"
                                    for r in df.to_dict("records")))


def write_summary(summary: dict[str, Any], run_dir) -> Path:
    return finetune.write_stage_summary(summary, run_dir, "transfer")


def read_summary(run_dir) -> dict[str, Any]:
    return finetune.read_stage_summary(run_dir, "transfer", "06_transfer", TransferError)


# ==================================================================================================
# the paper's numbers (tables and the figure: ``memtoc.stages.transfer.tables``)

def published_transfer(release_dir=None) -> Optional[dict[str, Any]]:
    """Table 6 and the reverse-transfer numbers from the release's published_probes_agent_transfer.json
    (None when the file is absent)."""
    try:
        path = resolve_release_dir(release_dir) / "published_probes_agent_transfer.json"
    except MemtocError:
        return None
    if not path.is_file():
        return None
    t6 = json.loads(path.read_text()).get("transfer_table6") or {}
    return {"source": t6.get("source"), "arms": t6.get("arms"), "reverse_transfer": t6.get("reverse_transfer"),
            "pools": t6.get("pools"), "closed_book_retention_band": t6.get("closed_book_retention_band"),
            "note": "the paper's models (Llama-3.1-8B-Instruct, gemma-2-9b-it) on FaithEval x ARC-Challenge: "
                    "a different model and different data from this run"}
