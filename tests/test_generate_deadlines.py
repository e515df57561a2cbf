"""Step deadlines from a hop's own measured step times (pure, no clock)."""
from __future__ import annotations

import pytest

from meshd.generate.deadlines import (
    DECODE_FLOOR_S,
    FACTOR,
    FIRST_CHUNK_DEADLINE_S,
    MAX_PATIENCE,
    OPEN_DEADLINE_S,
    PREFILL_FLOOR_S,
    RECENT,
    StepDeadlines,
)


def test_nothing_measured_gets_the_generous_first_bound():
    d = StepDeadlines()
    assert d.open_s() == OPEN_DEADLINE_S
    assert d.chunk_s(128) == FIRST_CHUNK_DEADLINE_S
    assert d.decode_s() == FIRST_CHUNK_DEADLINE_S


def test_fast_decode_steps_are_cut_at_the_floor():
    d = StepDeadlines()
    d.chunk_done(40, 0.05)
    assert d.decode_s() == DECODE_FLOOR_S                      # 10 x 50 ms < floor
    for _ in range(5):
        d.decode_done(0.012)
    assert d.decode_s() == DECODE_FLOOR_S


def test_slow_steps_scale_the_deadline_and_old_ones_are_forgotten():
    d = StepDeadlines()
    d.chunk_done(128, 4.0)
    assert d.decode_s() == pytest.approx(FACTOR * 4.0)           # before the first decode step
    d.decode_done(0.9)
    assert d.decode_s() == pytest.approx(FACTOR * 0.9)
    for _ in range(RECENT):
        d.decode_done(0.1)
    assert d.decode_s() == DECODE_FLOOR_S                      # the slow one left the window


def test_prefill_chunks_scale_with_tokens_and_the_measured_rate():
    d = StepDeadlines()
    d.chunk_done(128, 6.4)                                     # 50 ms per token
    assert d.chunk_s(128) == pytest.approx(FACTOR * 6.4)
    assert d.chunk_s(4) == PREFILL_FLOOR_S


def test_patience_multiplies_every_deadline_and_is_bounded():
    d = StepDeadlines(patience=2.0)
    assert d.open_s() == 2 * OPEN_DEADLINE_S and d.chunk_s(8) == 2 * FIRST_CHUNK_DEADLINE_S
    d.decode_done(0.01)
    assert d.decode_s() == 2 * DECODE_FLOOR_S
    assert StepDeadlines(patience=1e9).patience == MAX_PATIENCE
    assert StepDeadlines(patience=0.1).patience == 1.0
