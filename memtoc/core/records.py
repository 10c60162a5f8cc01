"""The typed records that flow through the pipeline: Question -> Episode -> (reply) -> scored row.

Kept dependency-free so that every stage can import them.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Iterable, Optional, TypeVar

from memtoc.core.io import json_line

T = TypeVar("T")


@dataclass(frozen=True)
class Question:
    """One benchmark question (a ToolHop hop), with the repair overlay already applied."""

    id: str                     # "instance.hop"
    instance_id: int            # the ToolHop chain: the cross-fitting unit
    hop_idx: int
    qkey: str                   # join key (from the data, never recomputed)
    question: str
    gold: str                   # verified answer
    gold_kind: str              # person, place, organization, work, year, date, timezone, other_string
    family: str
    near: str                   # near incorrect value used for tool_wrong (repaired where applicable)
    near_original: str          # the table's final_near before the repair overlay
    far: Optional[str]          # far incorrect value or None
    source: str = ""
    method: str = ""
    validation_status: str = ""
    excluded: bool = False      # removed by the blinded semantic review (not in the 542 analysis set)
    repaired: bool = False      # near value replaced by the repair overlay
    fold: Optional[int] = None  # chain-level cross-fitting fold (0 or 1)
    schema: Optional[dict] = None  # the real ToolHop tool schema when the release carries it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def arm_key(arm: str, frame: str, formulation: str) -> str:
    """File stem of an (arm, frame, formulation): ``arm[__frame]__formulation`` (the schema frame,
    the default, is left out)."""
    return "__".join([arm] + ([frame] if frame != "schema" else []) + [formulation])


@dataclass(frozen=True)
class Episode:
    """One prompt shown to a model: a question, a condition, a formulation, a frame and an arm."""

    episode_id: str
    question_id: str
    qkey: str
    instance_id: int
    formulation: str            # reference | paraphrase_a | paraphrase_b
    condition: str              # tool_right | tool_wrong | tool_far | tool_error | no_tool | noop
    frame: str                  # schema | no_schema | passage
    arm: str                    # untreated | warn | prior | flag | no_protocol_sentence
    payload_kind: Optional[str]  # error payload kind for tool_error, else None
    tool_value: Optional[str]   # the competing factual value in the tool return (None: error/no_tool/noop)
    tool_correct: Optional[bool]  # True: tool_right; False: tool_wrong/far/error; None: no_tool/noop
    tool_output: Optional[dict]
    schema: Optional[dict]
    schema_kind: str            # toolhop | synthesized | none
    prompt: str                 # the single user-turn message
    question: str
    gold: str
    gold_kind: str
    fold: Optional[int] = None

    @property
    def arm_key(self) -> str:
        """File stem used for generations/scored files: one file per (arm, frame, formulation)."""
        return arm_key(self.arm, self.frame, self.formulation)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Episode":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def dumps(obj: Any) -> str:
    """One JSON line (:func:`memtoc.core.io.json_line`: what every JSONL file of a run uses)."""
    if hasattr(obj, "to_dict"):
        obj = obj.to_dict()
    return json_line(obj)


def unique_by(items: Iterable[T], key: Callable[[T], Any]) -> list[T]:
    """The items in order, keeping the first occurrence of each key."""
    seen: set = set()
    out: list[T] = []
    for item in items:
        k = key(item)
        if k not in seen:
            seen.add(k)
            out.append(item)
    return out
