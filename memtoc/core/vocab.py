"""The vocabulary of memtoc: every name a run, an episode, a scored row or a summary uses.

One place for each list; every other module imports it from here (never re-types it). Each group
is a ``Literal`` type (for annotations) and the tuple of its values in their canonical order (for
loops, validation and the order of tables and files).

Adding a value here is the first step of the recipes in ``docs/architecture.md`` ("add an arm",
"add a metric", "add a backend"); the registries that give it meaning (``memtoc.core.metrics.METRICS``,
``EXTRA_ARM_SPECS`` below, ``memtoc.core.prompts.MITIGATION``) are checked against these tuples by the
tests, so a value missing in one of them fails loudly instead of vanishing from a summary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# -- question formulations (PROTOCOL §7): pv0, pv1, pv2 ----------------------------------------
Formulation = Literal["reference", "paraphrase_a", "paraphrase_b"]
FORMULATIONS: tuple[Formulation, ...] = get_args(Formulation)
REFERENCE_FORMULATION: Formulation = "reference"
POOLED = "pooled"                     # the key of the unweighted mean over formulations

# -- closed-book prompts ------------------------------------------------------------------------
ClosedBookVariant = Literal["forced", "permissive"]
CLOSED_BOOK_VARIANTS: tuple[ClosedBookVariant, ...] = get_args(ClosedBookVariant)

# -- episode conditions (memtoc.data.episodes) -------------------------------------------------------
Condition = Literal["tool_right", "tool_wrong", "tool_far", "tool_error", "no_tool", "noop"]
ALL_CONDITIONS: tuple[Condition, ...] = get_args(Condition)
CORE_CONDITIONS: tuple[Condition, ...] = ("tool_right", "tool_wrong", "tool_error", "no_tool")
VALUE_CONDITIONS: tuple[Condition, ...] = ("tool_right", "tool_wrong", "tool_far")
CONFLICT_CONDITIONS: tuple[Condition, ...] = ("tool_right", "tool_wrong")     # value-carrying, near
ARM_CONDITIONS: tuple[Condition, ...] = ("tool_right", "tool_wrong", "tool_error")  # prompting arms' conditions

# -- source-correctness cells (PROTOCOL §5; memtoc.core.metrics.assign_cell) -------------------------
Cell = Literal["agree", "arb", "tool_gold", "both_wrong", "mem_absent"]
CELLS: tuple[Cell, ...] = get_args(Cell)
FOUR_CELLS: tuple[Cell, ...] = ("agree", "arb", "tool_gold", "both_wrong")

# -- prompting arms (memtoc.core.prompts) ------------------------------------------------------------
Arm = Literal["untreated", "warn", "prior", "flag", "no_protocol_sentence"]
ARMS: tuple[Arm, ...] = get_args(Arm)
BASELINE_ARM: Arm = "untreated"
PROMPTING_ARMS: tuple[Arm, ...] = ("warn", "prior", "flag")        # the mitigation sentences
PROTOCOL_ARM: Arm = "no_protocol_sentence"                           # the protocol-sentence ablation

# -- presentation frames ------------------------------------------------------------------------
Frame = Literal["schema", "no_schema", "passage"]
FRAMES: tuple[Frame, ...] = get_args(Frame)
DEFAULT_FRAME: Frame = "schema"
ALT_FRAMES: tuple[Frame, ...] = ("no_schema", "passage")

# -- tool_error payload kinds -------------------------------------------------------------------
PayloadKind = Literal["service_unavailable", "timeout", "permission_denied"]
PAYLOAD_KINDS: tuple[PayloadKind, ...] = get_args(PayloadKind)
DEFAULT_PAYLOAD: PayloadKind = "service_unavailable"
ALT_PAYLOADS: tuple[PayloadKind, ...] = ("timeout", "permission_denied")

# -- metrics (definitions: memtoc.core.metrics.METRICS, one spec each) -------------------------------
Metric = Literal["retention", "keep_flag", "cra_arb", "tool_follow", "wrong_follow", "bw_gold", "err_abstain",
                 "cra_conflict", "agree_acc", "nc_acc", "correct_value_follow", "incorrect_value_follow",
                 "accuracy", "abstain"]
METRIC_NAMES: tuple[Metric, ...] = get_args(Metric)
HEADLINE_METRICS: tuple[Metric, ...] = ("retention", "tool_follow", "wrong_follow", "err_abstain")
SECONDARY_METRICS: tuple[Metric, ...] = ("cra_arb", "cra_conflict", "agree_acc", "nc_acc")
CELL_SIZES: tuple[str, ...] = ("n_arb", "n_tool_gold", "n_both_wrong", "n_agree", "n_mem_absent", "n_err",
                               "n_both_in_arb")

# -- generation backends (memtoc.generation.backends) ------------------------------------------------------
Backend = Literal["transformers", "vllm", "openai"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)
LOCAL_BACKENDS: tuple[Backend, ...] = ("transformers", "vllm")     # weights loaded in this process

# -- scoring ------------------------------------------------------------------------------------
Matcher = Literal["paper", "strict"]
MATCHERS: tuple[Matcher, ...] = get_args(Matcher)
DType = Literal["auto", "bfloat16", "float32", "float16"]
DTYPES: tuple[DType, ...] = get_args(DType)


# -- the run's extra arms (param ``extra_arms``): which episodes each adds --------------------------
ExtraArm = Literal["far", "payloads", "noop", "prompting", "frames", "no_protocol_sentence"]


@dataclass(frozen=True)
class ExtraArmSpec:
    """The episodes an entry of ``extra_arms`` adds on the extra questions (memtoc.data.episodes.run_episodes)
    and the ``summaries/evaluation.json`` section that analyses them (memtoc.stages.evaluation.analyses)."""
    name: ExtraArm
    conditions: tuple[Condition, ...]
    arms: tuple[Arm, ...] = (BASELINE_ARM,)
    frames: tuple[Frame, ...] = (DEFAULT_FRAME,)
    payload_kinds: tuple[PayloadKind, ...] = (DEFAULT_PAYLOAD,)
    section: str = ""


EXTRA_ARM_SPECS: tuple[ExtraArmSpec, ...] = (
    ExtraArmSpec("far", ("tool_far",), section="far"),
    ExtraArmSpec("payloads", ("tool_error",), payload_kinds=ALT_PAYLOADS, section="payloads"),
    ExtraArmSpec("noop", ("noop",), section="noop"),
    ExtraArmSpec("prompting", ARM_CONDITIONS, arms=PROMPTING_ARMS, section="prompting"),
    ExtraArmSpec("frames", CONFLICT_CONDITIONS, frames=ALT_FRAMES, section="frames"),
    ExtraArmSpec("no_protocol_sentence", ARM_CONDITIONS, arms=(PROTOCOL_ARM,), section="protocol"),
)
EXTRA_ARMS: tuple[ExtraArm, ...] = tuple(s.name for s in EXTRA_ARM_SPECS)
assert set(EXTRA_ARMS) == set(get_args(ExtraArm)), "EXTRA_ARM_SPECS must cover ExtraArm"


# -- the stage blocks' choices (memtoc.config.blocks checks them; the stage modules use them) --------
#: the name that selects memtoc's shipped source: the probes' corpus (memtoc.stages.probes.corpus) and the
#: transfer dataset (memtoc.stages.transfer.data)
BUILTIN = "builtin"
#: the transfer dataset imported from the Hugging Face Hub (FaithEval x ARC-Challenge, memtoc.stages.transfer.source)
HUB = "hub"

# notebook 04 (finetune): the training objectives
Objective = Literal["sft", "dpo"]
OBJECTIVES: tuple[Objective, ...] = get_args(Objective)

# notebook 05 (probes): steering directions and positions; the SAE quality gate
Direction = Literal["to_memory", "to_tool"]
DIRECTIONS: tuple[Direction, ...] = get_args(Direction)
Position = Literal["last", "tool_span"]
POSITIONS: tuple[Position, ...] = get_args(Position)
FVU_GATE = 0.5                        # an SAE passes when its held-out fraction of variance unexplained is below
#: the episodes features are mined on: the mining fold's tool-wrong episodes, or (App. C) those of them that
#: underlie notebook 04's DPO pair set of that fold
MiningSet = Literal["fold", "dpo_pairs"]
MINING_SETS: tuple[MiningSet, ...] = get_args(MiningSet)
#: the stopping bar: half the pooled prompting effect of notebook 03, or (App. C) half the prompting
#: effect on the dev flip (the steered episodes' own flip under the strongest prompt sentence)
SteerBar = Literal["pooled", "dev_flip"]
STEER_BARS: tuple[SteerBar, ...] = get_args(SteerBar)
#: an arm's layer list that means every source layer of the model's band
BAND = "band"
#: a probes.lens_files value: the model's published Jacobian lens (``models.ModelSpec.jacobian_lens``)
PUBLISHED_LENS = "published"

# notebook 06 (transfer): the presentation pools; the matcher's unmatched-answer gap; the forward
# adapters (04's fold adapters, or adapters 06 trains on the whole pool, as the paper's Table 6)
ForwardPool = Literal["fold", "full"]
FORWARD_POOLS: tuple[ForwardPool, ...] = get_args(ForwardPool)
Pool = Literal["value", "passage"]
POOLS: tuple[Pool, ...] = get_args(Pool)
UNMATCHED_GAP = 0.03                  # the transfer block's default unmatched_gap

# notebook 07 (agent): loop protocols, reporting slices, tool-schema variants, runtimes, bootstraps
Protocol = Literal["guided", "auto", "two_stage", "oracle", "auto_constrained"]
PROTOCOLS: tuple[Protocol, ...] = get_args(Protocol)
Slice = Literal["memory_right", "all"]
SLICES: tuple[Slice, ...] = get_args(Slice)
SchemaVariant = Literal["release", "typed"]
SCHEMA_VARIANTS: tuple[SchemaVariant, ...] = get_args(SchemaVariant)
AgentRuntime = Literal["transformers", "openai"]
AGENT_RUNTIMES: tuple[AgentRuntime, ...] = get_args(AgentRuntime)   # memtoc.stages.agent.runtime.RUNTIMES (tested equal)
Bootstrap = Literal["percentile", "cluster"]
BOOTSTRAPS: tuple[Bootstrap, ...] = get_args(Bootstrap)
