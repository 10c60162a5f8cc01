"""Episodes: one prompt per (question, formulation, condition, frame, arm, payload kind).

Conditions (PROTOCOL.md §7, plus memtoc's controls):

| condition  | tool output                         | tool_value | tool_correct |
|------------|-------------------------------------|------------|--------------|
| tool_right | ``{"result": gold}``                 | gold       | True         |
| tool_wrong | ``{"result": near}`` (repaired)      | near       | False        |
| tool_far   | ``{"result": far}`` (far exists)     | far        | False        |
| tool_error | error payload of ``payload_kind``    | None       | False        |
| no_tool    | none; prompt = forced closed-book    | None       | None         |
| noop       | ``prompts.NOOP_OUTPUT``              | None       | None         |

Rules: ``tool_far`` is built only for questions with a far value. Frames other than ``schema``
apply only to the value-carrying conditions (tool_right, tool_wrong, tool_far); other conditions
are skipped for those frames. Payload kinds apply only to ``tool_error``. Arms change with-tool
prompts only; a ``no_tool`` episode keeps the closed-book prompt whatever the arm.

Episode ids follow the release, ``"{instance}-{hop}-{condition}-v{pv}"`` (pv = 0, 1, 2 for
reference, paraphrase A, paraphrase B), with ``-{payload_kind}``, ``-{frame}`` and ``-{arm}``
appended when they differ from the defaults (service_unavailable, schema, untreated).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from memtoc.config.runconfig import RunConfig
from memtoc.core.errors import ConfigError, DataError, check_choices
from memtoc.core.prompts import (
    NOOP_OUTPUT,
    closed_book_prompt,
    error_payload,
    synthesize_schema,
    value_output,
    with_tool_prompt,
)
from memtoc.core.records import Episode, Question, dumps, unique_by
from memtoc.core.vocab import (
    ALL_CONDITIONS,
    ARMS,
    BASELINE_ARM,
    CORE_CONDITIONS,
    DEFAULT_FRAME,
    DEFAULT_PAYLOAD,
    EXTRA_ARM_SPECS,
    FORMULATIONS,
    FRAMES,
    PAYLOAD_KINDS,
    VALUE_CONDITIONS,
)
from memtoc.data.selection import run_selection

PV = {f: i for i, f in enumerate(FORMULATIONS)}

__all__ = ["CORE_CONDITIONS", "ALL_CONDITIONS", "VALUE_CONDITIONS", "FRAMES", "ARMS", "PAYLOAD_KINDS",
           "build_episodes", "write_episodes", "read_episodes", "run_episodes", "episode_id"]


def episode_id(q: Question, formulation: str, condition: str, frame: str = "schema", arm: str = "untreated",
               payload_kind: Optional[str] = None) -> str:
    eid = f"{q.instance_id}-{q.hop_idx}-{condition}-v{PV[formulation]}"
    if payload_kind and payload_kind != DEFAULT_PAYLOAD:
        eid += f"-{payload_kind}"
    if frame != DEFAULT_FRAME:
        eid += f"-{frame}"
    if arm != BASELINE_ARM:
        eid += f"-{arm}"
    return eid


def _schema_of(q: Question) -> tuple[dict, str]:
    if q.schema is not None:
        return q.schema, "toolhop"
    return synthesize_schema(q), "synthesized"


def _one(q: Question, formulation: str, condition: str, frame: str, arm: str,
         payload_kind: Optional[str], schema: dict, schema_kind: str) -> Episode:
    tool_value: Optional[str] = None
    tool_correct: Optional[bool] = None
    tool_output: Optional[dict[str, Any]] = None
    if condition == "no_tool":
        prompt = closed_book_prompt(q.question, formulation, "forced")
        schema, schema_kind = None, "none"
    else:
        if condition == "tool_right":
            tool_value, tool_correct = q.gold, True
        elif condition == "tool_wrong":
            tool_value, tool_correct = q.near, False
        elif condition == "tool_far":
            tool_value, tool_correct = q.far, False
        if condition in VALUE_CONDITIONS:
            tool_output = value_output(tool_value)
        elif condition == "tool_error":
            tool_output, tool_correct = error_payload(payload_kind), False
        elif condition == "noop":
            tool_output = dict(NOOP_OUTPUT)
        prompt = with_tool_prompt(q.question, formulation, schema, tool_output, frame=frame, arm=arm)
    return Episode(
        episode_id=episode_id(q, formulation, condition, frame, arm, payload_kind),
        question_id=q.id, qkey=q.qkey, instance_id=q.instance_id, formulation=formulation,
        condition=condition, frame=frame, arm=arm, payload_kind=payload_kind, tool_value=tool_value,
        tool_correct=tool_correct, tool_output=tool_output,
        schema=schema,
        schema_kind=schema_kind, prompt=prompt, question=q.question, gold=q.gold, gold_kind=q.gold_kind,
        fold=q.fold,
    )


def build_episodes(questions: Iterable[Question], formulations: Sequence[str], conditions: Sequence[str],
                   frames: Sequence[str] = (DEFAULT_FRAME,), arms: Sequence[str] = (BASELINE_ARM,),
                   payload_kinds: Sequence[str] = (DEFAULT_PAYLOAD,)) -> list[Episode]:
    """All episodes of the cross product, in the order formulation, question, condition, payload
    kind, frame, arm (see the module docstring for which combinations exist)."""
    formulations = check_choices("formulation", _as_list(formulations, "formulations"), FORMULATIONS)
    conditions = check_choices("condition", _as_list(conditions, "conditions"), ALL_CONDITIONS)
    frames = check_choices("frame", _as_list(frames, "frames"), FRAMES)
    arms = check_choices("arm", _as_list(arms, "arms"), ARMS)
    payload_kinds = check_choices("payload kind", _as_list(payload_kinds, "payload_kinds"), PAYLOAD_KINDS)
    questions = list(questions)
    out: list[Episode] = []
    for form in formulations:
        for q in questions:
            schema, schema_kind = _schema_of(q)
            for cond in conditions:
                if cond == "tool_far" and q.far is None:
                    continue
                for pk in (payload_kinds if cond == "tool_error" else (None,)):
                    for frame in frames:
                        if frame != "schema" and cond not in VALUE_CONDITIONS:
                            continue
                        for arm in arms:
                            out.append(_one(q, form, cond, frame, arm, pk, schema, schema_kind))
    ids = [e.episode_id for e in out]
    if len(set(ids)) != len(ids):
        raise DataError("duplicate episode ids: the question list contains the same question twice")
    return out


def _as_list(v: Any, name: str) -> list:
    if isinstance(v, str):
        return [v]
    try:
        return list(v)
    except TypeError:
        raise ConfigError(f"{name} must be a list, got {v!r}") from None


def write_episodes(episodes: Iterable[Episode], path) -> Path:
    """Write episodes as JSONL (one ``records.dumps`` line each); creates parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for e in episodes:
            fh.write(dumps(e) + "\n")
    tmp.replace(path)
    return path


def read_episodes(path) -> list[Episode]:
    """Read an episodes JSONL file; a malformed line raises a DataError naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"episode file {path} does not exist; notebook 01_construction writes "
                        "<run_dir>/episodes/<formulation>.jsonl")
    out = []
    required = {"episode_id", "formulation", "condition", "prompt", "qkey"}
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {lineno}: not valid JSON ({e.msg})") from None
            missing = sorted(required - set(d)) if isinstance(d, dict) else ["<object>"]
            if missing:
                raise DataError(f"{path}, line {lineno}: missing field(s) {missing}")
            try:
                out.append(Episode.from_dict(d))
            except TypeError as e:
                raise DataError(f"{path}, line {lineno}: {e}") from None
    return out


def run_episodes(benchmark, cfg: RunConfig) -> list[Episode]:
    """The episodes of a run (used by notebooks 01 and 03).

    Headline: the run's headline questions (``selection.run_selection(cfg, benchmark).headline``, the
    first ``cfg.n_questions`` of the stratified selection) with CORE_CONDITIONS, for every
    formulation in ``cfg.formulations``. Extra arms, on the first ``cfg.n_questions_extra`` of the
    same selection (``.extra``, so they are a subset of the headline questions), as listed in
    ``cfg.extra_arms`` (each adds the episodes of its ``vocab.EXTRA_ARM_SPECS`` entry, in that order):

    * ``far``: tool_far (schema frame, untreated) where a far value exists;
    * ``payloads``: tool_error with the ``timeout`` and ``permission_denied`` payloads;
    * ``noop``: the NoopTool interface control;
    * ``prompting``: the warn / prior / flag arms on tool_right, tool_wrong and tool_error;
    * ``frames``: no_schema and passage frames on tool_right and tool_wrong;
    * ``no_protocol_sentence``: the ablation on tool_right, tool_wrong and tool_error.

    The untreated core conditions are also built for the extra questions (a no-op when
    ``n_questions_extra <= n_questions``), so every extra arm has its untreated baseline.
    Episodes are deduplicated by id (first kept), in a stable order.
    """
    forms = list(cfg.formulations)
    sel = run_selection(cfg, benchmark)
    head, extra = sel.headline, sel.extra
    eps = build_episodes(head, forms, CORE_CONDITIONS)
    arms = set(cfg.extra_arms)
    if extra:
        eps += build_episodes(extra, forms, CORE_CONDITIONS)
        for spec in EXTRA_ARM_SPECS:
            if spec.name in arms:
                eps += build_episodes(extra, forms, spec.conditions, frames=spec.frames, arms=spec.arms,
                                      payload_kinds=spec.payload_kinds)
    return unique_by(eps, lambda e: e.episode_id)
