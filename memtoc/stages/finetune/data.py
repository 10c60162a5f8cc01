"""Training pairs (pure): the paper's rule (:func:`training_examples`) and trl's row formats."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterable, Optional, Sequence

from memtoc.core.records import Question
from memtoc.core.vocab import FORMULATIONS
from memtoc.data.episodes import build_episodes
from memtoc.stages.finetune.common import TRAIN_CONDITIONS


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
    Questions whose near value equals the gold (no contrast) are skipped. The near value is the
    table's, before the repair overlay (``Question.near_original``), as in the release's training
    pairs (built from the unrepaired mapping); the 39 repaired questions are evaluated on the
    repaired value.
    """
    questions = [replace(q, near=q.near_original) for q in questions]
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
