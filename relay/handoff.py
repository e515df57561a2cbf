"""Bounded hand-offs between threads that wake the other side only when it waits.

A frame crossing from one thread to another costs a wakeup (a sizeable
share of a relayed step on a small VM: docs/measurements/2026-11-29.md). A
bounded queue needs a second signal the other way (a credit back) -- but
that one is only needed when the producer is actually blocked on a full
queue. ``Credits`` is that rule, sans-I/O:

    producer: waiter = credits.take(make_waiter)   None -> go; else wait on it and retry
    consumer: waiter = credits.give()              not None -> wake that waiter

Waiters are whatever the producer's world uses (a trio.Event set through
``TrioToken.run_sync_soon``, an asyncio.Event set through
``loop.call_soon_threadsafe``, a threading.Event); ``Credits`` never touches them
beyond storing one. ``Inbox`` is the trio -> plain-thread direction built on it:
trio appends without blocking while there is room; the thread blocks on a
condition; trio is woken only after it found the inbox full.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from proto.errors import LocalError

__all__ = ["Credits", "Inbox"]

W = TypeVar("W")
T = TypeVar("T")


class Credits(Generic[W]):
    """``capacity`` items may be in flight; at most one producer waits for a credit."""

    __slots__ = ("_lock", "_free", "_waiter", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise LocalError("credits need a positive capacity")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._free = capacity
        self._waiter: W | None = None

    @property
    def free(self) -> int:
        return self._free

    def take(self, make_waiter: Callable[[], W]) -> W | None:
        """Take a credit (None), or register and return a waiter to wait on before retrying."""
        with self._lock:
            if self._free > 0:
                self._free -= 1
                return None
            self._waiter = make_waiter()
            return self._waiter

    def give(self) -> W | None:
        """Return a credit; the waiter to wake, if a producer is waiting."""
        with self._lock:
            if self._free >= self.capacity:
                raise LocalError("more credits given back than taken")
            self._free += 1
            waiter, self._waiter = self._waiter, None
            return waiter


class Inbox(Generic[T]):
    """Items from a trio task to one plain thread, at most ``capacity`` waiting."""

    __slots__ = ("_cond", "_items", "credits")

    def __init__(self, capacity: int) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._items: deque[T] = deque()
        self.credits: Credits = Credits(capacity)

    def put(self, item: T) -> None:
        """Append (the producer holds a credit from ``credits.take``) and wake the reader."""
        with self._cond:
            self._items.append(item)
            self._cond.notify()

    def get(self, timeout: float | None = None) -> tuple[T, object | None]:
        """Block for the next item; returns it and the producer's waiter to wake (or None).

        TimeoutError after ``timeout`` seconds without an item."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                raise TimeoutError("no item arrived in time")
            item = self._items.popleft()
        return item, self.credits.give()
