"""MemToC as an Inspect task: any model Inspect can call, with the controlled return as a real tool call.

    pip install 'memtoc[inspect]'
    inspect eval memtoc/memtoc --model openai/gpt-4o-mini -T n_questions=60
    memtoc import-inspect logs/<the .eval file> outputs/gpt-4o-mini     # 03's analyses, 08's report
    memtoc verify outputs/gpt-4o-mini

One Inspect sample is one memtoc episode (:func:`memtoc.data.episodes.build_episodes`: a question, a
formulation, a condition, an arm), so ``inspect view`` shows each episode's conversation. For every
(question, formulation) the model first answers the forced closed-book prompt (its memory *m*,
generated once per model and shared by that question's episodes, kept in the sample's store as
``memtoc_closed_book``); the ``no_tool`` episode is that closed-book reply itself, as in memtoc's
notebook 03.

A with-tool episode is a chat in which the tool was executed (the paper's "You called the tool below;
its output is shown" frame, delivered the way tool-calling models receive it):

1. user: the question, in the formulation's wording (:data:`memtoc.core.prompts.QUESTION_LABEL`);
2. assistant: a call of the question's tool (its schema: the ToolHop schema or memtoc's synthesized one),
   with the question as the argument;
3. tool: the controlled return, serialised as the release serialises it (``{"result": value}``, the error
   payload, the no-op return);
4. user: the rest of the formulation's header (no further call; use the output with your judgment), the
   arm's mitigation sentence, and the FINAL-line instruction.

The reply is generated with the tool declared and ``tool_choice="none"`` at temperature 0 (Inspect passes
the definition on only to providers that need one beside tool messages). This is a
departure from the paper, which shows the same parts as one user turn (``docs/departures.md``).

Scoring is memtoc's own (:func:`memtoc.stages.evaluation.score_episodes`: the FINAL-line extractor, the
paper's matcher or the strict one, the memory status of the closed-book reply, the source-correctness
cell). :func:`headline` reports the four headline metrics pooled over the formulations with their
question-cluster bootstrap intervals (:func:`memtoc.stages.evaluation.analyses.headline.headline_metrics`).
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional, Sequence, Union

import pandas as pd
from inspect_ai import Task, task
from inspect_ai.dataset import MemoryDataset, Sample
from inspect_ai.model import (
    ChatMessage,
    ChatMessageAssistant,
    ChatMessageTool,
    ChatMessageUser,
    GenerateConfig,
    Model,
    ModelOutput,
    get_model,
)
from inspect_ai.scorer import Metric, SampleScore, Score, Target, metric, scorer
from inspect_ai.solver import Generate, TaskState, solver
from inspect_ai.tool import ToolCall, ToolInfo, ToolParams

from memtoc.config.params import PAPER_SEED, resolve_release_dir
from memtoc.core import prompts
from memtoc.core.errors import ConfigError, check_choice, check_choices
from memtoc.core.io import plain
from memtoc.core.records import Episode
from memtoc.core.vocab import (
    ALL_CONDITIONS,
    ARM_CONDITIONS,
    ARMS,
    BASELINE_ARM,
    CORE_CONDITIONS,
    DEFAULT_FRAME,
    FORMULATIONS,
    HEADLINE_METRICS,
    MATCHERS,
)
from memtoc.data.benchmark import load_benchmark
from memtoc.data.episodes import build_episodes
from memtoc.data.selection import select_questions
from memtoc.stages.evaluation import score_episodes
from memtoc.stages.evaluation.analyses.headline import headline_metrics

TASK_NAME = "memtoc"
CLOSED_BOOK_KEY = "memtoc_closed_book"          # the sample store's key of the closed-book reply
CALL_ID = "call_memtoc_0"
MAX_TOKENS = 128                                 # the release's client default (params/paper.yaml)
N_BOOT = 2000                                    # the bootstrap replicates of the interval metric


def _names(value: Union[str, Sequence[str]], kind: str, valid: Sequence[str]) -> list[str]:
    """A task option given as a list or as comma-separated text (``-T formulations=reference,paraphrase_a``)."""
    items = [s.strip() for s in value.split(",")] if isinstance(value, str) else [str(s).strip() for s in value]
    items = [s for s in items if s]
    if not items:
        raise ConfigError(f"memtoc task: option {kind}s is empty; give one or more of {', '.join(valid)}")
    return check_choices(kind, items, valid)


def task_episodes(release: Optional[str] = None, n_questions: int = 0, seed: int = PAPER_SEED,
                  formulations: Union[str, Sequence[str]] = FORMULATIONS,
                  conditions: Union[str, Sequence[str]] = CORE_CONDITIONS,
                  arms: Union[str, Sequence[str]] = (BASELINE_ARM,)) -> list[Episode]:
    """The task's episodes: the first ``n_questions`` of the analysis set in memtoc's stratified, nested
    selection order for ``seed`` (0: all of them), crossed with formulations, conditions and arms, in the
    schema frame with the paper's error payload (the same episodes, ids and tool returns as notebook 01). As
    in a memtoc run, an arm other than untreated applies to tool_right, tool_wrong and tool_error only."""
    forms = _names(formulations, "formulation", FORMULATIONS)
    conds = _names(conditions, "condition", ALL_CONDITIONS)
    arm_list = _names(arms, "arm", ARMS)
    if int(n_questions) < 0:
        raise ConfigError(f"memtoc task: n_questions must be 0 (all) or positive, got {n_questions!r}")
    bench = load_benchmark(resolve_release_dir(release))
    analysis = list(bench.analysis)
    questions = select_questions(analysis, int(n_questions) or len(analysis), int(seed))
    out = build_episodes(questions, forms, conds) if BASELINE_ARM in arm_list else []
    treated = [a for a in arm_list if a != BASELINE_ARM]
    arm_conds = [c for c in conds if c in ARM_CONDITIONS]
    if treated and arm_conds:
        out += build_episodes(questions, forms, arm_conds, arms=treated)
    if not out:
        raise ConfigError(f"memtoc task: arms {arm_list} with conditions {conds} give no episode; an arm other than "
                          f"untreated needs one of {', '.join(ARM_CONDITIONS)}")
    return out


# ------------------------------------------------------------------------------------------------
# the chat of an episode (pure)

def tool_info(schema: dict[str, Any]) -> ToolInfo:
    """The episode's tool as Inspect declares it to a provider (name, description, JSON-schema parameters)."""
    return ToolInfo(name=schema["name"], description=schema.get("description", ""),
                    parameters=ToolParams.model_validate(schema.get("parameters") or {"type": "object"}))


def closed_book_messages(ep: Episode) -> list[ChatMessage]:
    """The forced closed-book prompt as one user turn (byte for byte memtoc's)."""
    return [ChatMessageUser(content=prompts.closed_book_prompt(ep.question, ep.formulation, "forced"))]


def tool_messages(ep: Episode) -> list[ChatMessage]:
    """The with-tool chat (module docstring): question, executed call, controlled return, instruction."""
    if ep.condition == "no_tool":
        raise ConfigError(f"episode {ep.episode_id}: a no_tool episode has no tool messages")
    if ep.frame != DEFAULT_FRAME or ep.schema is None:
        raise ConfigError(f"episode {ep.episode_id}: the Inspect task delivers the schema frame only (frame "
                          f"{ep.frame!r}); drop the other frames")
    form = ep.formulation
    _, protocol, last = prompts.TOOL_HEADER[form]
    instruction = [" ".join(s for s in ((None if ep.arm == prompts.PROTOCOL_ARM else protocol), last) if s)]
    if ep.arm in prompts.MITIGATION:
        instruction.append(prompts.MITIGATION[ep.arm])
    instruction.append(prompts.FINAL_LINE[form])
    params = ep.schema.get("parameters") or {}
    arg = (params.get("required") or list(params.get("properties") or {}) or ["query"])[0]
    call = ToolCall(id=CALL_ID, function=ep.schema["name"], arguments={arg: ep.question})
    return [ChatMessageUser(content=prompts.QUESTION_LABEL[form] + ep.question),
            ChatMessageAssistant(content="", tool_calls=[call]),
            ChatMessageTool(content=prompts.to_json(ep.tool_output), tool_call_id=CALL_ID,
                            function=ep.schema["name"]),
            ChatMessageUser(content="\n".join(s for s in instruction if s))]


def sample_of(ep: Episode) -> Sample:
    """An Inspect sample carrying the whole episode (its id, the question, gold and tool value)."""
    return Sample(id=ep.episode_id, input=ep.question, target=ep.gold, metadata={"episode": plain(ep.to_dict())})


# ------------------------------------------------------------------------------------------------
# solver, scorer, metric

class _ClosedBook:
    """One closed-book generation per (model, question, formulation), shared by that question's episodes
    (concurrent samples wait for the same call; a failed call is tried again by the next one)."""

    def __init__(self) -> None:
        self._calls: dict[tuple[str, str, str], asyncio.Future] = {}

    async def reply(self, model: Model, ep: Episode, config: GenerateConfig) -> ModelOutput:
        key = (str(model), ep.qkey, ep.formulation)
        fut = self._calls.get(key)
        if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            fut = asyncio.ensure_future(model.generate(closed_book_messages(ep), config=config))
            self._calls[key] = fut
        return await asyncio.shield(fut)


@solver
def memtoc_episode():
    """Answer the closed-book prompt (once per question and formulation), then the episode's chat, with the
    eval's generation settings (the task's temperature 0 and ``max_tokens``, under Inspect's own
    ``--temperature`` / ``--max-tokens`` where given)."""
    config = GenerateConfig()          # nothing over the active config: the task's, then the command line's
    closed_book = _ClosedBook()

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        ep = Episode.from_dict(state.metadata["episode"])
        model = get_model()
        memory = await closed_book.reply(model, ep, config)
        state.store.set(CLOSED_BOOK_KEY, memory.completion)
        if ep.condition == "no_tool":
            state.messages = closed_book_messages(ep)
            out = memory
        else:
            state.messages = tool_messages(ep)
            out = await model.generate(state.messages, tools=[tool_info(ep.schema)], tool_choice="none",
                                       config=config)
        state.messages.append(out.message)
        state.output = out
        return state

    return solve


def score_sample(episode: dict[str, Any], reply: str, closed_book: str, matcher: str = "paper") -> dict[str, Any]:
    """memtoc's scored row of one episode (decision fields, memory status, cell): pure."""
    memory = pd.DataFrame([{"formulation": episode["formulation"], "qkey": episode["qkey"], "response": closed_book}])
    row = score_episodes([Episode.from_dict(episode)], [reply], memory, matcher=matcher).iloc[0].to_dict()
    row.pop("schema", None)
    return plain(row)


@metric
def headline(n_boot: int = N_BOOT, seed: int = 0) -> Metric:
    """The four headline metrics pooled over the formulations (unweighted mean), each with its 95%
    question-cluster bootstrap interval (``<metric>_lo`` / ``<metric>_hi``); NaN where a cell is empty."""

    def compute(scores: list[SampleScore]) -> dict[str, float]:
        rows = [s.score.metadata["row"] for s in scores if s.score.metadata and "row" in s.score.metadata]
        pooled = (headline_metrics(pd.DataFrame(rows), n_boot=int(n_boot), seed=int(seed)) or {}).get("pooled", {})
        out: dict[str, float] = {}
        for name in HEADLINE_METRICS:
            e = pooled.get(name) or {}
            lo, hi = e.get("ci95") or (None, None)
            for suffix, v in (("", e.get("value")), ("_lo", lo), ("_hi", hi)):
                out[name + suffix] = float("nan") if v is None else float(v)
        return out

    return compute


@scorer(metrics=[headline()])
def memtoc_scorer(matcher: str = "paper"):
    """Score the final reply with memtoc's extractor and matcher against the gold, the tool value and the
    closed-book answer; the value is 1 when the final answer is correct, the metadata the scored row."""
    check_choice("matcher", matcher, MATCHERS)

    async def score(state: TaskState, target: Target) -> Score:
        row = score_sample(state.metadata["episode"], state.output.completion,
                           state.store.get(CLOSED_BOOK_KEY, ""), matcher)
        return Score(value=1 if row.get("final_correct") else 0, answer=row.get("extracted"),
                     explanation=f"cell {row.get('cell')}, outcome {row.get('outcome')}", metadata={"row": row})

    return score


@task(name=TASK_NAME)
def memtoc(n_questions: int = 0, formulations: Union[str, Sequence[str]] = FORMULATIONS,
           conditions: Union[str, Sequence[str]] = CORE_CONDITIONS, arms: Union[str, Sequence[str]] = BASELINE_ARM,
           seed: int = PAPER_SEED, matcher: str = "paper", max_tokens: int = MAX_TOKENS,
           release: Optional[str] = None) -> Task:
    """MemToC's episodes on any model (module docstring).

    Args:
        n_questions: the first questions of memtoc's stratified, nested selection (0: all 542).
        formulations: reference, paraphrase_a, paraphrase_b (comma-separated or a list).
        conditions: tool_right, tool_wrong, tool_error, no_tool (the core four), tool_far, noop.
        arms: untreated, warn, prior, flag, no_protocol_sentence.
        seed: the selection seed (the paper's by default).
        matcher: paper (the published scorer) or strict.
        max_tokens: the reply budget (the release's client default, 128).
        release: the MemToC release folder (default: memtoc's resolution, ``memtoc data where``).
    """
    episodes = task_episodes(release, n_questions, seed, formulations, conditions, arms)
    return Task(dataset=MemoryDataset([sample_of(e) for e in episodes], name=TASK_NAME),
                solver=memtoc_episode(), scorer=memtoc_scorer(matcher), epochs=1,
                config=GenerateConfig(temperature=0.0, max_tokens=int(max_tokens)),
                metadata={"memtoc_task": {"n_questions": int(n_questions), "seed": int(seed), "matcher": matcher,
                                          "max_tokens": int(max_tokens)}})
