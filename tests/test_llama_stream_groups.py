"""``native.llama_engine.stream_groups``: how a batch over per-session KV streams is cut into
``llama_decode`` calls (pure; no llama.cpp needed). llama.cpp's ``split_equal(sequential)`` keeps
a ubatch whole and in batch order only for sequences with consecutive ids and equal token counts
taken in id order; every other row must run in a group of its own."""
from __future__ import annotations

import numpy as np

from native.llama_engine import stream_groups


def _rows(*spec):
    return [(seq, 0, np.zeros(count, np.int32)) for seq, count in spec]


def test_consecutive_decode_rows_are_one_group_in_id_order():
    assert stream_groups(_rows((2, 1), (0, 1), (1, 1), (3, 1))) == [[1, 2, 0, 3]]


def test_a_gap_in_ids_or_a_different_count_starts_a_new_group():
    rows = _rows((0, 1), (1, 1), (3, 1), (4, 1), (2, 40), (5, 40))
    assert stream_groups(rows) == [[0, 1], [4], [2, 3], [5]]


def test_every_row_is_in_exactly_one_group():
    rng = np.random.default_rng(3)
    for _ in range(200):
        seqs = rng.permutation(16)[: rng.integers(1, 9)]
        rows = _rows(*((int(s), int(rng.choice([1, 1, 1, 7]))) for s in seqs))
        groups = stream_groups(rows)
        assert sorted(i for g in groups for i in g) == list(range(len(rows)))
        for g in groups:
            ids = [rows[i][0] for i in g]
            assert ids == list(range(ids[0], ids[0] + len(g)))
            assert len({rows[i][2].shape[0] for i in g}) == 1
