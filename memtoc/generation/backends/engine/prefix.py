"""Shared-prefix plan for a batch of prompts: a radix tree of token segments.

Prompts of one benchmark share long token prefixes: the chat header and the instruction (every
prompt of a formulation), the tool schema (every question of a relation), the question text up to
the tool return (every condition of a question). :func:`prefix_segments` cuts a batch's token
sequences into segments so that each shared run of tokens is one segment computed once:

* a *shared* segment covers tokens ``[start, end)`` of two or more rows, all equal there;
* every row ends in one *leaf* segment of its own (its remaining tokens, at least its last token,
  so each row's last-position logits come from its leaf);
* a segment's ``parent`` is the segment ending where it starts (``None`` at offset 0), so a row's
  prompt is the concatenation of the segments on its path.

Shared segments shorter than ``min_shared`` tokens are folded into their children (a one-token
segment would cost an extra forward call to save one token per row). Pure Python, no torch: the
transformers backend (:mod:`memtoc.generation.backends.hf`) turns the plan into forward calls, one tree depth
at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass
class Segment:
    index: int
    parent: Optional[int]        # the segment ending at ``start`` on the same rows; None at offset 0
    start: int                   # offset of the first token in each of ``rows``
    tokens: list[int]
    rows: list[int]              # the prompts (batch rows) that contain this segment
    depth: int = 0               # number of ancestors
    children: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_leaf(self) -> bool:
        return not self.children and len(self.rows) == 1


def _lcp_end(seqs: Sequence[Sequence[int]], rows: list[int], start: int) -> int:
    """End of the common run of ``rows`` from ``start``, never taking any row's last token."""
    limit = min(len(seqs[r]) - 1 for r in rows)
    first = seqs[rows[0]]
    end = start
    while end < limit and all(seqs[r][end] == first[end] for r in rows):
        end += 1
    return end


def prefix_segments(seqs: Sequence[Sequence[int]], min_shared: int = 1) -> list[Segment]:
    """The segments of ``seqs`` (see the module docstring); leaves of rows in row order last.

    Every row is covered exactly once by the segments on its path; each shared segment has at
    least two rows and at least ``min_shared`` tokens (after folding); empty sequences are an error.
    """
    if any(len(s) == 0 for s in seqs):
        raise ValueError("prefix_segments: every sequence needs at least one token")
    shared: list[Segment] = []
    leaf_parent: dict[int, tuple[Optional[int], int]] = {}

    def grow(rows: list[int], start: int, parent: Optional[int]) -> None:
        groups: dict[int, list[int]] = {}
        for r in rows:
            if start < len(seqs[r]) - 1:
                groups.setdefault(seqs[r][start], []).append(r)
            else:
                leaf_parent[r] = (parent, start)
        for g in groups.values():
            if len(g) == 1:
                leaf_parent[g[0]] = (parent, start)
                continue
            end = _lcp_end(seqs, g, start)
            seg = Segment(len(shared), parent, start, list(seqs[g[0]][start:end]), sorted(g))
            shared.append(seg)
            grow(g, end, seg.index)

    grow(list(range(len(seqs))), 0, None)

    # fold short shared segments into their children (and their rows' leaves)
    alive = {s.index: s for s in shared}
    for s in shared:                                   # parents before children (creation order)
        if len(s.tokens) >= min_shared:
            continue
        del alive[s.index]
        for c in alive.values():
            if c.parent == s.index:
                c.parent, c.start, c.tokens = s.parent, s.start, s.tokens + c.tokens
        for r, (p, st) in list(leaf_parent.items()):
            if p == s.index:
                leaf_parent[r] = (s.parent, s.start)

    out: list[Segment] = []
    remap: dict[int, int] = {}
    for s in shared:
        if s.index in alive:
            remap[s.index] = len(out)
            out.append(Segment(len(out), None if s.parent is None else remap[s.parent], s.start, s.tokens,
                               s.rows))
    for r in range(len(seqs)):
        p, st = leaf_parent[r]
        out.append(Segment(len(out), None if p is None else remap[p], st, list(seqs[r][st:]), [r]))
    for s in out:
        if s.parent is not None:
            s.depth = out[s.parent].depth + 1
            out[s.parent].children.append(s.index)
    return out


def path(segments: list[Segment], index: int) -> list[int]:
    """Indices of the segments from the root down to ``index`` (inclusive)."""
    p: list[int] = []
    i: Optional[int] = index
    while i is not None:
        p.append(i)
        i = segments[i].parent
    return p[::-1]


def leaves_by_row(segments: list[Segment], n_rows: int) -> list[int]:
    """The leaf segment index of each row."""
    out = [-1] * n_rows
    for s in segments:
        if s.is_leaf:
            out[s.rows[0]] = s.index
    return out
