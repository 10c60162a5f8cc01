"""The deterministic, stratified and nested question selection every stage draws its questions with."""
from __future__ import annotations

import random
from typing import Iterable

from .config import PAPER_SEED
from .records import Question


def select_questions(questions: Iterable[Question], n: int, seed: int = PAPER_SEED) -> list[Question]:
    """``n`` questions, deterministic for ``seed``, stratified by ``gold_kind`` and nested.

    Each answer type's questions (sorted by id) are shuffled with ``random.Random(f"{seed}|{kind}")``;
    the types are then interleaved so that every prefix keeps the pool's proportions as closely as
    possible (at each step the type furthest below its quota is drawn; ties by type name). The
    selection is the first ``n`` of that order, so a smaller selection is a prefix of a larger one.
    ``n`` at or above the pool size returns the whole pool (in selection order).
    """
    pool = sorted(questions, key=lambda q: (q.instance_id, q.hop_idx, q.id))
    by_kind: dict[str, list[Question]] = {}
    for q in pool:
        by_kind.setdefault(q.gold_kind, []).append(q)
    for kind, lst in by_kind.items():
        random.Random(f"{seed}|{kind}").shuffle(lst)
    total = len(pool)
    taken = {k: 0 for k in by_kind}
    order: list[Question] = []
    for step in range(1, min(n, total) + 1):
        kind = max((k for k in sorted(by_kind) if taken[k] < len(by_kind[k])),
                   key=lambda k: (step * len(by_kind[k]) / total - taken[k], -sorted(by_kind).index(k)))
        order.append(by_kind[kind][taken[kind]])
        taken[kind] += 1
    return order
