"""The shared-prefix plan (memtoc.generation.backends.engine.prefix): every row covered exactly once, shared tokens
computed once, the last token of each row in its own leaf."""
import random

import pytest

from memtoc.generation.backends.engine.prefix import leaves_by_row, path, prefix_segments


def _check(seqs, segs, min_shared):
    leaves = leaves_by_row(segs, len(seqs))
    for r, seq in enumerate(seqs):
        toks, pos = [], 0
        for i in path(segs, leaves[r]):
            s = segs[i]
            assert s.start == pos and r in s.rows
            toks += s.tokens
            pos = s.end
        assert toks == list(seq)                       # the path spells the row, exactly once
        assert len(segs[leaves[r]].tokens) >= 1        # the last token is in the row's own leaf
    for s in segs:
        if not s.is_leaf:
            assert len(s.rows) >= 2 and len(s.tokens) >= min_shared
            assert all(list(seqs[r][s.start:s.end]) == s.tokens for r in s.rows)
            assert s.children
        if s.parent is not None:
            assert segs[s.parent].end == s.start and s.depth == segs[s.parent].depth + 1
            assert set(s.rows) <= set(segs[s.parent].rows)
        else:
            assert s.start == 0 and s.depth == 0


def test_a_small_tree_by_hand():
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 7, 8], [9]]
    segs = prefix_segments(seqs)
    shared = [(s.start, s.tokens, s.rows) for s in segs if not s.is_leaf]
    assert shared == [(0, [1, 2], [0, 1, 2]), (2, [3, 4], [0, 1])]
    leaves = {s.rows[0]: (s.start, s.tokens) for s in segs if s.is_leaf}
    assert leaves == {0: (4, [5]), 1: (4, [6]), 2: (2, [7, 8]), 3: (0, [9])}
    _check(seqs, segs, 1)


def test_identical_rows_keep_their_last_token_apart():
    seqs = [[5, 6, 7]] * 3
    segs = prefix_segments(seqs)
    assert [s.tokens for s in segs if not s.is_leaf] == [[5, 6]]
    assert [s.tokens for s in segs if s.is_leaf] == [[7], [7], [7]]
    _check(seqs, segs, 1)


def test_short_shared_segments_fold_into_their_children():
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 8, 9, 10, 11, 12], [1, 8, 9, 10, 11, 13]]
    segs = prefix_segments(seqs, min_shared=3)
    # [1] is shared by all four but shorter than 3: it is computed once per child instead
    assert sorted((s.start, s.tokens) for s in segs if not s.is_leaf) == [(0, [1, 2, 3, 4, 5]),
                                                                          (0, [1, 8, 9, 10, 11])]
    _check(seqs, segs, 3)
    # with nothing long enough to share, every row is a single leaf
    segs = prefix_segments([[1, 2, 3], [1, 2, 4]], min_shared=3)
    assert [(s.start, s.tokens) for s in segs] == [(0, [1, 2, 3]), (0, [1, 2, 4])]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("min_shared", [1, 4])
def test_random_batches_are_covered_exactly(seed, min_shared):
    rng = random.Random(seed)
    heads = [[rng.randrange(5) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    seqs = []
    for _ in range(rng.randrange(1, 25)):
        seq = list(rng.choice(heads)) + [rng.randrange(3) for _ in range(rng.randrange(0, 10))]
        seqs.append(seq or [0])
    segs = prefix_segments(seqs, min_shared)
    _check(seqs, segs, min_shared)
    if min_shared == 1:  # every token shared by k rows is computed once: the trie's size
        trie = {tuple(s[:i + 1]) for s in seqs for i in range(len(s) - 1)}
        computed = sum(len(s.tokens) for s in segs)
        assert computed == len(trie) + len(seqs)


def test_an_empty_sequence_is_an_error():
    with pytest.raises(ValueError, match="at least one token"):
        prefix_segments([[1, 2], []])
