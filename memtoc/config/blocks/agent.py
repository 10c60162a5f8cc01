"""The ``agent`` block (notebook 07; params/agent.yaml documents the paper-size run)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from memtoc.config.blocks.base import Block, Fail, as_list, is_int, is_num
from memtoc.core.errors import ordered_subset
from memtoc.core.vocab import (
    AGENT_RUNTIMES,
    ARM_CONDITIONS,
    BOOTSTRAPS,
    FORMULATIONS,
    OBJECTIVES,
    PROTOCOLS,
    SCHEMA_VARIANTS,
    SLICES,
)


@dataclass(frozen=True)
class AgentConfig(Block):
    """Every key of the ``agent`` block with its default; ``resolve`` fills the run-dependent ones."""
    BLOCK = "agent"
    SEE = "params/agent.yaml"

    enabled: bool = True
    models: Optional[tuple[str, ...]] = None   # None: the run's models
    protocols: tuple[str, ...] = PROTOCOLS
    slices: tuple[str, ...] = SLICES
    n_questions: Optional[int] = None          # first n of the run's stratified selection (None: n_questions;
                                               # 0 with memory_right_questions: only the memory-right slice)
    memory_right_questions: int = 0            # plus up to k more per model: questions of the run's headline
                                               # selection whose forced closed-book answer (02's file, first agent
                                               # formulation) is correct - the paper's slice, tiny on small models
    formulations: Optional[tuple[str, ...]] = None   # None: the run's (base models: the run's base_formulations)
    schema_variants: tuple[str, ...] = ("release", "typed")
    conditions: tuple[str, ...] = ("tool_right",)   # the tool's return; the first is the reported one, the rest
                                               # extra arms. tool_right (the gold value) is the paper's: on its
                                               # memory-right slice the return and the model's own answer coincide;
                                               # tool_wrong (the near distractor) measures arbitration instead
    max_calls: int = 1                         # the paper's a1/a2/o1: one call
    max_tokens_per_call: int = 384             # the release's agentic client default
    max_tokens_per_episode: int = 1536         # the release's agentic output-token budget
    runtime: str = "transformers"              # transformers (in-process) | openai (any OpenAI-compatible server)
    runtime_options: dict = field(default_factory=dict)   # transformers: device, dtype, batch_size, tool_format,
                                               # ...; openai: base_url, api_key, served_model, server, ...,
                                               # or launch: vllm (memtoc starts vLLM's server per model on a free
                                               # port; launch_options: extra server arguments)
    n_boot: Optional[int] = None               # None: the run's n_boot (the paper: B = 2,000)
    bootstrap: str = "percentile"              # percentile: the paper's (episodes of one question resampled,
                                               # B = n_boot); cluster: memtoc's question-cluster bootstrap
    adapters: tuple = ()                       # notebook 04's adapters run through the loop: [{objective, fold}]
                                               # read from adapters/<model>/<objective>/fold<k>/ (absent: a notice)
    sampling: Optional[dict] = None            # the paper's T = 0.7 rerun: {temperature: 0.7, seeds: [0, 1, 2]}
                                               # (closed-book answers stay greedy); None: greedy only

    @classmethod
    def check(cls, values: dict[str, Any], run: Mapping[str, Any], fail: Fail, **context: Any) -> None:
        _choices(values, run, fail)
        _sizes(values, run, fail)


def _choices(a: dict, run: Mapping[str, Any], fail: Fail) -> None:
    run_models = list(run["models"])
    a["models"] = run_models if a["models"] is None else as_list(a["models"])
    if not isinstance(a["models"], list) or not a["models"] or any(m not in run_models for m in a["models"]):
        fail("models", f"must be null (the run's models) or a non-empty list drawn from the run's models {run_models}")
    for key, valid in (("protocols", PROTOCOLS), ("slices", SLICES), ("schema_variants", SCHEMA_VARIANTS)):
        got = ordered_subset(a[key], valid)
        if got is None:
            fail(key, f"must be a non-empty list drawn from {list(valid)}, got {a[key]!r}")
        a[key] = got
    forms = a["formulations"] if a["formulations"] is not None else list(run["formulations"])
    got = ordered_subset(forms, FORMULATIONS)
    if got is None:
        fail("formulations", f"must be null (the run's) or a non-empty list drawn from {list(FORMULATIONS)}")
    a["formulations"] = got
    conds = as_list(a["conditions"])
    if (not isinstance(conds, list) or not conds or any(c not in ARM_CONDITIONS for c in conds)
            or len(set(conds)) != len(conds)):
        fail("conditions", f"must be a non-empty list of distinct values from {list(ARM_CONDITIONS)} (the first is "
                           f"reported, the rest are extra arms), got {a['conditions']!r}")
    a["conditions"] = conds
    if a["bootstrap"] not in BOOTSTRAPS:
        fail("bootstrap", f"must be one of {list(BOOTSTRAPS)}, got {a['bootstrap']!r}")
    if a["runtime"] not in AGENT_RUNTIMES:
        fail("runtime", f"must be one of {list(AGENT_RUNTIMES)}, got {a['runtime']!r}")
    if not isinstance(a["runtime_options"], dict):
        fail("runtime_options", "must be a mapping (e.g. {base_url: http://127.0.0.1:8000/v1, server: vllm})")
    _launch(a, fail)
    _arms(a, fail)


def _launch(a: dict, fail: Fail) -> None:
    """``runtime_options.launch``: memtoc starts the runtime's server itself (``vllm``, one per model)."""
    opts = a["runtime_options"]
    launch = opts.get("launch")
    if launch is None:
        if "launch_options" in opts:
            fail("runtime_options", "launch_options needs launch: vllm (memtoc starts the server); remove it, or "
                                    "add launch: vllm")
        return
    if launch != "vllm":
        fail("runtime_options", f"launch must be vllm (memtoc starts vLLM's OpenAI server per model), got {launch!r}")
    if a["runtime"] != "openai":
        fail("runtime_options", "launch: vllm starts a server for the openai runtime; set agent.runtime: openai")
    if "base_url" in opts:
        fail("runtime_options", "launch: vllm starts the server on a free port of 127.0.0.1, so base_url cannot "
                                "be given as well; remove one of them")
    if not isinstance(opts.get("launch_options") or {}, dict):
        fail("runtime_options", f"launch_options must be a mapping of server arguments (e.g. {{max_model_len: "
                                f"4096}}), got {opts['launch_options']!r}")


def _arms(a: dict, fail: Fail) -> None:
    """``adapters`` and ``sampling``: the extra arms of the loop."""
    ads = a["adapters"]
    if not isinstance(ads, (list, tuple)):
        fail("adapters", f"must be a list of {{objective, fold}} mappings, got {ads!r}")
    out = []
    for ad in ads:
        if (not isinstance(ad, dict) or set(ad) != {"objective", "fold"} or ad["objective"] not in OBJECTIVES
                or not is_int(ad["fold"]) or ad["fold"] not in (0, 1)):
            fail("adapters", f"each entry must be {{objective: one of {list(OBJECTIVES)}, fold: 0 or 1}}, "
                             f"got {ad!r}")
        out.append({"objective": ad["objective"], "fold": int(ad["fold"])})
    a["adapters"] = out
    if out and a["runtime"] != "transformers":
        fail("adapters", "run in-process only (agent.runtime: transformers loads the LoRA adapter on the weights); "
                         "set adapters: [] for a server runtime")
    sm = a["sampling"]
    if sm is None:
        return
    if (not isinstance(sm, dict) or set(sm) != {"temperature", "seeds"} or not is_num(sm["temperature"])
            or sm["temperature"] <= 0 or not isinstance(sm["seeds"], list) or not sm["seeds"]
            or not all(is_int(x) for x in sm["seeds"]) or len(set(sm["seeds"])) != len(sm["seeds"])):
        fail("sampling", f"must be null (greedy only) or {{temperature: > 0, seeds: [distinct integers]}} such as "
                         f"{{temperature: 0.7, seeds: [0, 1, 2]}}, got {sm!r}")
    if a["runtime"] != "openai":
        fail("sampling", "needs agent.runtime: openai (a server that takes a per-request seed, as vLLM, the paper's "
                         "stack); the in-process runtime decodes greedily only - set sampling: null, or serve the "
                         "model with vllm serve and set agent.runtime: openai")
    a["sampling"] = {"temperature": float(sm["temperature"]), "seeds": [int(x) for x in sm["seeds"]]}


def _sizes(a: dict, run: Mapping[str, Any], fail: Fail) -> None:
    n = a["n_questions"]
    if n is None:
        a["n_questions"] = int(run["n_questions"])
    elif not is_int(n) or n < 0:
        fail("n_questions", f"must be null (the run's n_questions) or a non-negative integer, got {n!r}")
    k = a["memory_right_questions"]
    if not is_int(k) or k < 0:
        fail("memory_right_questions", f"must be a non-negative integer, got {k!r}")
    if a["n_questions"] + k < 1:
        fail("n_questions", "and memory_right_questions are both 0: no question to run (n_questions 0 with "
                            "memory_right_questions k runs only the paper's memory-right slice)")
    for key in ("max_calls", "max_tokens_per_call", "max_tokens_per_episode"):
        v = a[key]
        if not is_int(v) or v < 1:
            fail(key, f"must be a positive integer, got {v!r}")
    if a["max_tokens_per_episode"] < a["max_tokens_per_call"]:
        fail("max_tokens_per_episode", f"must be at least max_tokens_per_call ({a['max_tokens_per_call']})")
    nb = a["n_boot"]
    if nb is None:
        a["n_boot"] = int(run["n_boot"])
    elif not is_int(nb) or nb < 1:
        fail("n_boot", f"must be null (the run's n_boot) or a positive integer, got {nb!r}")
