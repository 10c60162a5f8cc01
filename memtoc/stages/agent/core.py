"""The agent-loop stage (notebook 07, paper App. G): episodes, the run, the summary (the ``agent``
block: ``memtoc.config.blocks.AgentConfig``, read as ``cfg.agent``).

``run(cfg)`` for every model of ``agent.models`` (default: the run's): the first ``agent.n_questions``
questions of the run's stratified selection (plus up to ``agent.memory_right_questions`` of the
run's questions that 02 found memory-right for the model: :func:`questions_for`), their forced closed-book answers (through the run's
generator and generation cache: served by notebook 02's cache when it ran; written to
``agent/<model>/closed_book_forced.jsonl``, never over 02's file), one episode per question ×
formulation × schema variant × protocol × condition of ``agent.conditions`` (default ``tool_right``,
the paper's: the tool returns the gold value, so on the memory-right slice the return and the model's
own answer coincide; the first condition is reported, the rest are extra arms), run by the runtime
(``agent.runtime``) and logged to ``agent/<model>/traces.jsonl`` (resumable; the runtime's replies are
cached under ``agent/<model>/cache/``), then ``summaries/agent.json`` and
``figures/agent_agreement_execution.png``. Extra arms (:mod:`memtoc.stages.agent.arms`): 04's adapters
(``agent.adapters``) and the sampling rerun (``agent.sampling``), each logged to
``agent/<model>/arms/<arm>/traces.jsonl``.

``summaries/agent.json`` (``schema_version`` 1)::

    /caveat, /config (resolved agent parameters), /metrics {name: definition}
    /constrained_decoding   {library, version, json_options}
    /models/<model>/runtime   what ran (kind, tool format, prompt layout, capabilities)
    /models/<model>/support   {questions, memory_right_added, formulations, memory_right: {form: n}, episodes}
    /models/<model>/resumed   {finished, ran, dropped_events, ...} (the trace on open)
    /models/<model>/slices/<memory_right|all>/<schema_variant>/protocols/<protocol>/   (the first condition)
        answer_agreement | tool_execution_rate | agreement_minus_execution | kept_memory | final_correct
                                 /<formulation|pooled> {value, ci95, n[, n_boot_used | n_questions]}
        terminations/<final|invalid_call|max_calls|max_tokens> {count, rate}
        mechanisms/<T1|T2|T3|T4|other_invalid> {count, rate}
        type_errors {total, calls_validated, per_call_mean, max_per_call, coercible, calls_with_type_errors}
        n_episodes, n_questions, tokens_mean
    /models/<model>/slices/<slice>/<schema_variant>/repair/<answer_agreement|tool_execution_rate>
                                 contrast (auto_constrained − auto): delta, ci95, p, n_units, bootstrap, ...
    /models/<model>/slices/<slice>/<schema_variant>/contrasts/<guided_to_auto|guided_to_two_stage|
                                 auto_to_two_stage>/<answer_agreement|tool_execution_rate>   (the same form)
    /models/<model>/conditions/<condition>/slices/...   every further condition (extra arms)
    /models/<model>/adapters/<objective>/{folds, slices, versus_base}   04's adapters in the loop
    /models/<model>/sampling/{temperature, seeds/<seed>/slices}          the sampling rerun
    /models/<model>/notices   arms skipped (an adapter 04 did not write), with the reason
    /published   the paper's Table 7 block (release file), for comparison only
    /timing      seconds per model {closed_book, episodes (runtime load included), total}, and
                 /timing/constrained_decoding/<model>: the grammar's measured cost (mask_ms_per_token,
                 ms_per_token_all_in, mask_share, tokens, ...); machine-dependent, like every timing
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import matplotlib.pyplot as plt
import pandas as pd

from memtoc.config.blocks import AgentConfig
from memtoc.config.params import resolve_release_dir
from memtoc.config.runconfig import RunConfig, RunPaths, expect_config
from memtoc.core.errors import MemtocError
from memtoc.core.figures import save as save_figure
from memtoc.core.prompts import error_payload, value_output
from memtoc.data.selection import run_selection
from memtoc.generation import models
from memtoc.generation.cache import canonical_json, sha256_text
from memtoc.stages import elicitation
from memtoc.stages.agent.metrics import METRIC_DOC, episodes_frame, in_slice, summarize_model, summary_table
from memtoc.stages.agent.protocols import PROTOCOLS, EpisodeSpec
from memtoc.stages.agent.runtime import JSON_OPTIONS, Runtime, constrained_library, make_runtime
from memtoc.stages.agent.tools import episode_schema
from memtoc.stages.agent.traces import Trace

SCHEMA_VERSION = 1
PUBLISHED_FILE = "published_probes_agent_transfer.json"

EMBEDDED_NOTES = {
    "smollm2-135m-instruct": "smollm2-135m-instruct (135M parameters, chat, on a documented tool format it rarely follows)",
    "gemma-3-270m": "gemma-3-270m (268M parameters, a base model continuing a raw transcript)",
}
CAVEAT_EMBEDDED = ("EMBEDDED-MODEL NUMBERS: {models} {verb} tiny and not trained for this agent loop. Every rate "
                   "below checks the pipeline - rendering, parsing, constrained decoding, validation, execution, "
                   "terminations, mechanisms, intervals - and says nothing about the paper's Table 7 (7-8B models "
                   "on vLLM).")
CAVEAT_GENERAL = ("Numbers of this run's models under memtoc's agent runtime; the paper's Table 7 is "
                  "Llama-3.1-8B / Qwen2.5 / Mistral / Hermes-3 on vLLM 0.8.5 (see /published).")
EMBEDDED_MODELS = tuple(EMBEDDED_NOTES)


class AgentError(MemtocError):
    """The agent stage cannot run as configured."""


# ==================================================================================================
# parameters

#: model requests per episode at most (guided: call + answer; two_stage: decision + call + answer; oracle:
#: the answer; auto_constrained shares auto's free turn, plus its constrained call and answer)
REQUESTS_MAX = {"guided": 2, "auto": 2, "two_stage": 3, "oracle": 1, "auto_constrained": 2}


def planned_requests(cfg: RunConfig, model: str) -> dict[str, int]:
    """Notebook 07's work for ``model`` without running it (``memtoc run --dry-run``): episodes and
    model requests at most (every memory-right addition counted; 02's cached closed-book answers not).
    ``cfg``: the run configuration (a dict is refused)."""
    cfg = expect_config(cfg, "agent.planned_requests")
    a = cfg.agent
    if model not in a.models:
        return {"episodes": 0, "requests_max": 0}
    per_q = len(formulations_of(cfg, model)) * len(a.schema_variants)
    n = a.n_questions + min(a.memory_right_questions, cfg.n_questions)   # at most
    passes = len(a.conditions) + len(a.adapters) + (len(a.sampling["seeds"]) if a.sampling else 0)
    return {"episodes": passes * n * per_q * len(a.protocols),
            "requests_max": passes * n * per_q * sum(REQUESTS_MAX[p] for p in a.protocols)}


def formulations_of(cfg: RunConfig, model: str) -> list[str]:
    """The agent formulations a model runs on (base models: the run's base_formulations)."""
    base = None if cfg.base_formulations is None else list(cfg.base_formulations)
    return models.formulations_for(model, list(cfg.agent.formulations), base)


# ==================================================================================================
# episodes

def observation(question, condition: str) -> tuple[Optional[str], Any]:
    """(tool value, frozen tool return) of a question under a condition (PROTOCOL §7)."""
    if condition == "tool_wrong":
        return question.near, value_output(question.near)
    if condition == "tool_right":
        return question.gold, value_output(question.gold)
    return None, error_payload()


def questions_for(cfg: RunConfig, model: str, bench, formulations: Sequence[str]) -> list:
    """The agent questions of a model: the first ``agent.n_questions`` of the run's stratified
    selection, then up to ``agent.memory_right_questions`` further questions of the run's headline
    selection that notebook 02 found memory-right for this model (forced, the first agent
    formulation), in selection order; none when 02's file is absent (``selection.run_selection``)."""
    a = cfg.agent
    sel = run_selection(cfg, bench)
    base = sel.first(a.n_questions)
    k = a.memory_right_questions
    if not k:
        return base
    try:
        mem = elicitation.load_memory(cfg.run_dir, model, "forced")
    except MemtocError:
        return base
    mem = mem[mem["formulation"] == formulations[0]]
    right = {q for q, c, ab in zip(mem["qkey"], mem["memory_correct"], mem["mem_absent"])
             if c is not None and not pd.isna(c) and bool(c) and not bool(ab)}
    have = {q.qkey for q in base}
    pool = sel.first(max(cfg.n_questions, a.n_questions))
    return base + [q for q in pool if q.qkey in right and q.qkey not in have][:k]


def memory_for(cfg: RunConfig, model: str, questions, formulations: Sequence[str]) -> pd.DataFrame:
    """Forced closed-book answers of ``model`` on the agent's questions, through the run's generator
    and cache (served by notebook 02's cache when it ran); written under ``agent/<model>/``."""
    gen = models.load_generator(model, **cfg.generator_kwargs())
    try:
        return elicitation.elicit(gen, model, questions, formulations, "forced", cfg.run_dir, matcher=cfg.matcher,
                                  scored_file=cfg.paths.agent_closed_book(model))
    finally:
        gen.close()


def runtime_key(rt: Runtime) -> str:
    """What the runtime's replies depend on (a changed runtime makes new episode keys)."""
    if hasattr(rt, "gen"):
        ident: Any = {"generator": rt.gen.identity, "tool_format": rt.format.name, "chat": rt.chat_model,
                      "constrained": constrained_library(), "json_options": JSON_OPTIONS}
    else:
        ident = getattr(rt, "identity", rt.describe())
    return sha256_text(canonical_json(ident))[:16]


def build_specs(model: str, questions, memory: pd.DataFrame, a: AgentConfig, formulations: Sequence[str],
                runtime: str, matcher: str = "paper", condition: Optional[str] = None) -> list[EpisodeSpec]:
    """One EpisodeSpec per question × formulation × schema variant × protocol (that order), on
    ``condition`` (default: the reported one, ``agent.conditions[0]``)."""
    condition = condition or a.conditions[0]
    mem = {(r.formulation, r.qkey): r for r in memory.itertuples()}
    specs = []
    for q in questions:
        tool_value, obs = observation(q, condition)
        for form in formulations:
            m = mem.get((form, q.qkey))
            span = "" if m is None or not isinstance(m.span, str) else m.span
            mc = None if m is None or pd.isna(m.memory_correct) else bool(m.memory_correct)
            absent = True if m is None else bool(m.mem_absent)
            for variant in a.schema_variants:
                schema, kind = episode_schema(q, variant)
                for p in a.protocols:
                    specs.append(EpisodeSpec(
                        model=model, protocol=p, formulation=form, schema_variant=variant, schema_kind=kind,
                        question_id=q.id, qkey=q.qkey, instance_id=q.instance_id, question=q.question, gold=q.gold,
                        gold_kind=q.gold_kind, condition=condition, tool_value=tool_value, observation=obs,
                        schema=schema, memory_span=span, memory_correct=mc, mem_absent=absent,
                        max_calls=a.max_calls, max_tokens_per_call=a.max_tokens_per_call,
                        max_tokens_per_episode=a.max_tokens_per_episode, matcher=matcher, runtime=runtime))
    return specs


def runtime_for(cfg: RunConfig, model: str, adapter: Optional[Path] = None, seed: Optional[int] = None) -> Runtime:
    """The agent runtime of ``model`` (``agent.runtime`` with ``agent.runtime_options``; the transformers
    runtime takes the run's model cache, batch size and dtype unless the options set them). ``adapter``:
    a LoRA adapter directory (in-process only); ``seed``: a sampling seed of ``agent.sampling``."""
    a = cfg.agent
    opts = dict(a.runtime_options)
    if a.runtime == "transformers":
        opts.setdefault("model_cache_dir", cfg.model_cache_dir)
        opts.setdefault("batch_size", cfg.batch_size)
        opts.setdefault("dtype", cfg.dtype)
    if adapter is not None:
        opts["adapter"] = adapter
    if seed is not None:
        opts.update(seed=seed, temperature=a.sampling["temperature"])
    rt = make_runtime(a.runtime, model, a.max_tokens_per_call, cache_dir=cfg.paths.agent_cache(model), **opts)
    rt.check_protocols(list(a.protocols))
    return rt


def published_block(release_dir: Optional[str]) -> Optional[dict]:
    """The paper's App. G block (Table 7, mechanisms, repair) from the release, or None."""
    try:
        path = resolve_release_dir(release_dir) / PUBLISHED_FILE
        return json.loads(path.read_text(encoding="utf-8")).get("agent_table7")
    except (MemtocError, OSError, ValueError):
        return None


def caveat(model_names: Sequence[str]) -> str:
    """What the run's numbers are (the embedded models' caveat, printed with every number of 07)."""
    emb = [EMBEDDED_NOTES[m] for m in model_names if m in EMBEDDED_NOTES]
    if not emb:
        return CAVEAT_GENERAL
    out = CAVEAT_EMBEDDED.format(models=" and ".join(emb), verb="are" if len(emb) > 1 else "is")
    return out + (" " + CAVEAT_GENERAL if len(emb) < len(model_names) else "")


# ==================================================================================================
# the stage

def summary_head(a: AgentConfig) -> dict[str, Any]:
    """The summary document before any model: caveat, config, metric definitions."""
    return {"schema_version": SCHEMA_VERSION, "caveat": caveat(a.models), "config": a.to_dict(), "metrics": METRIC_DOC,
            "constrained_decoding": None, "models": {}, "timing": {}}


def slices_of(records: list[dict], a: AgentConfig, formulations: Sequence[str], n_perm: int = 10000) -> dict[str, Any]:
    """``slices/<slice>/<schema_variant>/...`` of a set of episode records (the block's bootstrap)."""
    return summarize_model(episodes_frame(records), formulations, list(a.slices), list(a.protocols), n_boot=a.n_boot,
                           n_perm=n_perm, seed=0, bootstrap=a.bootstrap)


def model_block(records: list[dict], a: AgentConfig, formulations: Sequence[str], n_questions: int,
                runtime: dict[str, Any], resume: dict[str, Any], n_perm: int = 10000) -> dict[str, Any]:
    """``/models/<model>`` of the summary from a model's episode records on the reported condition
    (``agent.conditions[0]``; see the module docstring)."""
    df = episodes_frame(records)
    right = in_slice(df, "memory_right") if len(df) else df
    mr = {f: int(right.loc[right["formulation"] == f, "qkey"].nunique()) if len(right) else 0 for f in formulations}
    return {"runtime": runtime,
            "support": {"questions": n_questions, "memory_right_added": n_questions - a.n_questions,
                        "formulations": list(formulations), "memory_right": mr, "episodes": len(records),
                        "condition": a.conditions[0], "protocols": list(a.protocols),
                        "schema_variants": list(a.schema_variants)},
            "resumed": resume,
            "slices": slices_of(records, a, formulations, n_perm)}


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    path = RunPaths(Path(run_dir)).summary("agent")
    if not path.is_file():
        raise AgentError(f"{path} does not exist: run notebook 07_agent_loop first")
    return json.loads(path.read_text(encoding="utf-8"))


def episodes(run_dir: str | Path, model: str) -> pd.DataFrame:
    """The run's episode records of a model (the trace's termination events)."""
    return episodes_frame(Trace(RunPaths(Path(run_dir)).agent_traces(model)).terminations())


# ==================================================================================================
# the figure

def plot(summary: dict, path: str | Path, slice_name: str = "memory_right") -> Path:
    """Agreement vs execution per protocol (pooled over formulations; 95% intervals), one panel per
    schema variant, one marker per model; the diagonal is agreement = execution."""
    tab = summary_table(summary, slice_name)
    variants = sorted(tab["schema"].unique()) if len(tab) else ["release"]
    fig, axes = plt.subplots(1, len(variants), figsize=(5.2 * len(variants), 4.6), squeeze=False)
    markers = ["o", "s", "^", "D", "v", "P"]
    colors = dict(zip(PROTOCOLS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, variant in zip(axes[0], variants):
        sub = tab[tab["schema"] == variant] if len(tab) else tab
        ax.plot([0, 1], [0, 1], color="0.8", lw=1, zorder=0)
        for k, model in enumerate(sub["model"].unique() if len(sub) else []):
            for _, r in sub[sub["model"] == model].iterrows():
                if r["agreement"] is None or r["execution"] is None:
                    continue
                xe = [[max(0, r["execution"] - (r["exe_lo"] if r["exe_lo"] is not None else r["execution"]))],
                      [max(0, (r["exe_hi"] if r["exe_hi"] is not None else r["execution"]) - r["execution"])]]
                ye = [[max(0, r["agreement"] - (r["agr_lo"] if r["agr_lo"] is not None else r["agreement"]))],
                      [max(0, (r["agr_hi"] if r["agr_hi"] is not None else r["agreement"]) - r["agreement"])]]
                dx = 0.012 * (PROTOCOLS.index(r["protocol"]) - 2) if r["protocol"] in PROTOCOLS else 0.0
                ax.errorbar(r["execution"] + dx, r["agreement"] + dx, xerr=xe, yerr=ye, fmt=markers[k % len(markers)],
                            color=colors.get(r["protocol"]), ms=7, capsize=2, alpha=0.85,
                            label=f"{model} · {r['protocol']}")
        ax.set_xlim(-0.05, 1.05)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("tool-execution rate")
        ax.set_ylabel("answer agreement with the executed return")
        ax.set_title(f"schema: {variant} · slice: {slice_name}", fontsize=10)
        ax.grid(alpha=0.3)
    h, lab = axes[0][0].get_legend_handles_labels()
    if h:
        fig.legend(h, lab, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.suptitle("Agent loop: agreement vs execution per protocol (pooled, 95% question-cluster intervals)",
                 fontsize=11)
    note = "points offset by up to ±0.024 per protocol so that equal values stay visible"
    if any(m in EMBEDDED_NOTES for m in (summary.get("models") or {})):
        note += "; embedded models: a pipeline check, not the paper's Table 7 (see the caveat)"
    fig.text(0.01, -0.02, note, fontsize=7, color="0.35")
    fig.tight_layout()
    return save_figure(fig, path)
