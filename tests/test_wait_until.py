"""The shared wait (tests/conftest.py): it polls until the condition holds, returns what the
condition gave, and a timeout fails the test naming what it waited for. On trio's MockClock."""
from __future__ import annotations

import pytest
import trio
import trio.testing

from tests.conftest import MAX_WAIT_S, wait_until, wait_until_blocking


def _run(fn):
    return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def test_returns_the_first_truthy_value_once_another_task_makes_it_true():
    async def main():
        box: list[str] = []

        async def later():
            await trio.sleep(5)
            box.append("ready")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(later)
            got = await wait_until(lambda: box and box[0], 10, "the box filled")
            return got, trio.current_time()

    got, at = _run(main)
    assert got == "ready" and 5 <= at < 5.1   # polled, not slept past it


def test_an_async_predicate_is_awaited():
    async def main():
        calls = []

        async def third_time() -> bool:
            calls.append(1)
            return len(calls) >= 3

        assert await wait_until(third_time, 1, "three calls") is True
        return len(calls)

    assert _run(main) == 3


def test_a_timeout_fails_the_test_with_what_it_waited_for():
    async def main():
        await wait_until(lambda: False, 7, "a condition that never holds")

    with pytest.raises(pytest.fail.Exception, match="timed out after 7 s waiting for a condition that never holds"):
        _run(main)


def test_the_timeout_is_bounded():
    for bad in (0, -1, MAX_WAIT_S + 1):
        with pytest.raises(ValueError, match="timeout must be in"):
            _run(lambda bad=bad: wait_until(lambda: True, bad, "anything"))


def test_the_blocking_face_runs_the_same_loop():
    seen = iter([None, 0, "", "done"])
    assert wait_until_blocking(lambda: next(seen), 5, "the fourth value") == "done"
    with pytest.raises(pytest.fail.Exception, match="waiting for nothing"):
        wait_until_blocking(lambda: None, 0.05, "nothing")
