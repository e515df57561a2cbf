"""dht/peer_health.py (pure): a peer's run of misses, congestion, and peers left out of lookups."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.peer_health import CLOSE, KEEP, WAIT, PeerHealth


def health(**kw) -> PeerHealth:
    args = dict(stuck_after=3, congestion_window_s=30.0, recent=8, unreachable_s=300.0, max_unreachable=4)
    args.update(kw)
    return PeerHealth(**args)


def test_a_lone_peer_missing_stuck_after_times_in_a_row_is_closed_and_its_count_starts_over():
    h = health()
    assert [h.missed("b", t) for t in (0.0, 1.0)] == [WAIT, WAIT] and h.misses("b") == 2
    assert h.missed("b", 2.0) == CLOSE and h.misses("b") == 0


def test_an_answer_or_a_failure_ends_a_run_of_misses():
    h = health()
    h.missed("b", 0.0), h.missed("b", 1.0)
    h.answered("b")
    assert h.misses("b") == 0 and h.missed("b", 2.0) == WAIT
    h.failed("b")
    assert h.misses("b") == 0


def test_a_peer_at_stuck_after_while_another_is_late_is_kept_and_closed_once_the_others_are_quiet():
    h = health()
    h.missed("c", 0.0)                                   # another peer late: congestion
    assert [h.missed("b", t) for t in (1.0, 2.0, 3.0)] == [WAIT, WAIT, KEEP]
    assert h.missed("b", 4.0) == KEEP and h.misses("b") == 4     # still counting: its backoff grows
    assert h.missed("b", 31.0) == CLOSE                  # c's miss is older than the window now


def test_its_own_misses_never_count_as_congestion():
    h = health(stuck_after=2)
    assert [h.missed("b", t) for t in (0.0, 0.1)] == [WAIT, CLOSE]


def test_the_memory_of_misses_is_bounded():
    h = health(recent=3)
    for i in range(100):
        h.missed(f"p{i}", float(i))
    assert len(h.recent) == 3


def test_unreachable_peers_are_skipped_until_they_expire_or_connect():
    h = health()
    h.mark_unreachable("d", 0.0)
    h.mark_unreachable("e", 10.0)
    assert h.skip(100.0, connected=set()) == {"d", "e"}
    assert h.skip(100.0, connected={"e"}) == {"d"}           # e came back
    assert h.skip(300.5, connected=set()) == frozenset()     # d's 300 s are over
    assert h.unreachable == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=200))
def test_the_unreachable_memory_is_bounded_and_keeps_the_latest(peers):
    h = health(max_unreachable=4)
    for t, p in enumerate(peers):
        h.mark_unreachable(p, float(t))
    assert len(h.unreachable) <= 4
    latest = list(dict.fromkeys(reversed(peers)))[:4]
    assert set(h.unreachable) == set(latest)


@pytest.mark.parametrize("kw", [dict(stuck_after=0), dict(recent=0), dict(max_unreachable=0)])
def test_bounds_must_be_positive(kw):
    with pytest.raises(ValueError):
        health(**kw)
