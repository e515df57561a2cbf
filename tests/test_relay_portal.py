"""relay.portal: credits that wake a waiter only when it waits, the hand-offs both ways, the loop thread."""
from __future__ import annotations

import threading

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from proto.errors import LocalError
from relay.errors import LoopStopped
from relay.portal import Credits, Inbox, LoopThread, Outbox, Portal


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


def test_a_thread_reaches_the_loop_through_the_portal_and_posts_run_in_order():
    seen: list = []

    async def double(x: int) -> int:
        await trio.lowlevel.checkpoint()
        return 2 * x

    async def main():
        portal = Portal.current()

        def in_thread():
            assert portal.run(double, 21) == 42
            assert portal.run_sync(len, "abc") == 3
            for i in range(20):
                portal.post(seen.append, i)
            portal.run_sync(seen.append, "last")   # runs after every post before it
        await trio.to_thread.run_sync(in_thread)
        return portal

    portal = trio.run(main)
    assert seen == [*range(20), "last"]
    with pytest.raises(LoopStopped):           # the loop has ended: every call says so
        portal.run_sync(len, "x")
    with pytest.raises(LoopStopped):
        portal.post(seen.append, 1)


def test_an_outbox_carries_items_in_order_and_its_close_ends_the_iteration():
    async def main():
        outbox: Outbox = Outbox(Portal.current(), 2, poll_s=0.01)

        def producer():
            for i in range(10):                 # more than the capacity: room comes back as read
                assert outbox.put(i)
            outbox.close()

        got = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, producer)
            async with outbox:
                async for item in outbox:
                    got.append(item)
                    outbox.give_back()
        return got

    assert trio.run(main) == list(range(10))


def test_a_producer_waiting_for_room_gives_up_once_gone():
    async def main():
        outbox: Outbox = Outbox(Portal.current(), 1, poll_s=0.01)
        gone = threading.Event()
        first = await trio.to_thread.run_sync(outbox.put, "a")
        assert first and await outbox.receive() == "a"      # held: no give_back, no room

        def second():
            return outbox.put("b", gone=gone.is_set)

        async with trio.open_nursery() as nursery:
            result: list = []

            async def run_second():
                result.append(await trio.to_thread.run_sync(second))
            nursery.start_soon(run_second)
            gone.set()
        assert result == [False]
        outbox.give_back()
        assert await trio.to_thread.run_sync(outbox.put, "c")
        assert await outbox.receive() == "c"
        await trio.to_thread.run_sync(outbox.close)
        with pytest.raises(trio.EndOfChannel):
            await outbox.receive()

    trio.run(main)


def test_a_loop_thread_runs_its_setup_is_reached_through_its_portal_and_is_joined_at_stop():
    async def setup(task_status=trio.TASK_STATUS_IGNORED):
        task_status.started("value")
        await trio.sleep_forever()

    async def where() -> str:
        return threading.current_thread().name

    with LoopThread(setup, name="looptest") as loop:
        assert loop.value == "value"
        assert loop.run(where) == "looptest:loop" == loop.portal.run(where)
    assert not any(t.name.startswith("looptest") for t in threading.enumerate())
    with pytest.raises(LoopStopped):
        loop.run(where)


def test_a_setup_error_is_raised_where_the_loop_thread_is_entered():
    async def setup(task_status=trio.TASK_STATUS_IGNORED):
        raise OSError("cannot listen")

    with pytest.raises(OSError, match="cannot listen"):
        with LoopThread(setup, name="broken"):
            pass
    assert not any(t.name.startswith("broken") for t in threading.enumerate())
