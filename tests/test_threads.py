"""proto.threads: a group's threads are stopped, joined against one bound, and their errors raised."""
from __future__ import annotations

import threading

import pytest

from proto.threads import MAX_KEPT_ERRORS, GroupStopped, ThreadGroup, ThreadsLeft


def test_join_waits_for_every_thread_and_a_finished_thread_leaves_the_group():
    results = []
    group = ThreadGroup("t")
    for i in range(5):
        group.start(results.append, i, name=f"n{i}")
    group.join()
    assert sorted(results) == [0, 1, 2, 3, 4]
    assert len(group) == 0 and group.alive == [] and group.started == 5 and group.failed == 0


def test_a_thread_still_blocked_at_the_deadline_is_named_and_joined_once_it_ends():
    release = threading.Event()
    group = ThreadGroup("stuck")
    group.start(release.wait, name="waiter")
    with pytest.raises(ThreadsLeft) as caught:
        group.join(timeout_s=0.05)        # the thread cannot end before ``release``: the bound passes
    assert caught.value.names == ["stuck:waiter"]
    assert "stuck:waiter" in str(caught.value)
    release.set()
    group.join()                          # once it can end, the same group joins cleanly
    assert group.alive == []


def test_stop_runs_the_wake_ups_that_unblock_the_threads():
    wake = threading.Event()
    seen = []

    def worker() -> None:
        wake.wait()                       # blocks until stop() runs the wake-up
        seen.append(group.stopping.is_set())

    group = ThreadGroup("w")
    group.on_stop(wake.set)
    group.start(worker)
    group.close()
    assert seen == [True]
    late = threading.Event()
    group.on_stop(late.set)               # registered after the stop: runs at once
    assert late.is_set()


def test_an_error_in_a_thread_is_raised_by_join_in_the_owner():
    def boom() -> None:
        raise ValueError("bad frame")

    group = ThreadGroup("e")
    group.start(boom)
    with pytest.raises(ValueError, match="bad frame"):
        group.join()
    assert group.failed == 1
    group.join()                          # raised once: the errors were handed over


def test_several_errors_come_as_one_group_bounded_in_what_is_kept():
    group = ThreadGroup("many")
    count = MAX_KEPT_ERRORS + 4
    for i in range(count):
        group.start(_raise, i)
    with pytest.raises(ExceptionGroup) as caught:
        group.join()
    assert len(caught.value.exceptions) == MAX_KEPT_ERRORS
    assert all(isinstance(e, KeyError) for e in caught.value.exceptions)
    assert group.failed == count


def _raise(i: int) -> None:
    raise KeyError(i)


def test_nothing_starts_once_the_group_is_stopping():
    group = ThreadGroup("s")
    group.stop()
    with pytest.raises(GroupStopped):
        group.start(lambda: None)
    group.join()


def test_the_context_manager_closes_and_a_thread_of_the_group_may_join_it():
    inner_done, inner_started = threading.Event(), threading.Event()
    with ThreadGroup("ctx") as group:
        def joins_its_own_group() -> None:
            group.start(inner_done.wait, name="inner")
            inner_started.set()
            group.join()                  # skips itself, waits for "inner"
        group.start(joins_its_own_group, name="outer")
        inner_started.wait()
        inner_done.set()
    assert group.alive == [] and group.started == 2 and group.stopping.is_set()


def test_the_body_error_wins_over_the_groups_own():
    with pytest.raises(RuntimeError, match="body"):
        with ThreadGroup("both") as group:
            group.start(_raise, 1)
            raise RuntimeError("body")
