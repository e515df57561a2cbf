"""relay.handoff: credits that wake a waiter only when it waits, and the trio -> thread inbox."""
from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proto.errors import LocalError
from relay.handoff import Credits, Inbox


def test_credits_hand_out_capacity_then_a_waiter_that_the_next_give_returns():
    credits = Credits(2)
    assert credits.take(object) is None and credits.take(object) is None
    waiter = credits.take(lambda: "waiter")
    assert waiter == "waiter" and credits.free == 0
    assert credits.give() == "waiter"        # the producer is waiting: wake it
    assert credits.give() is None            # nobody waits: no wakeup
    with pytest.raises(LocalError):
        credits.give()
    with pytest.raises(LocalError):
        Credits(0)


@given(st.lists(st.booleans(), max_size=60))
def test_credits_never_exceed_capacity_in_any_order(ops):
    credits, held = Credits(3), 0
    for take in ops:
        if take:
            if credits.take(object) is None:
                held += 1
            else:
                assert held == 3
        elif held:
            credits.give()
            held -= 1
        assert 0 <= credits.free == 3 - held


def test_inbox_delivers_in_order_to_a_blocked_thread_and_returns_credits():
    inbox: Inbox = Inbox(2)
    got = []

    def reader():
        for _ in range(5):
            item, waiter = inbox.get(timeout=10)
            got.append(item)
            if waiter is not None:
                waiter.set()

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(5):
        while (waiter := inbox.credits.take(threading.Event)) is not None:
            assert waiter.wait(10)
        inbox.put(i)
    thread.join(10)
    assert got == [0, 1, 2, 3, 4] and inbox.credits.free == 2
    with pytest.raises(TimeoutError):
        inbox.get(timeout=0.01)
