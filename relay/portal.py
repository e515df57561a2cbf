"""The one way between a trio loop and plain threads: a portal, and bounded hand-offs both ways.

trio owns the daemon. Blocking work leaves the loop with trio's own
``trio.to_thread.run_sync`` (the calling task waits for it, so its nursery
does); a plain thread comes back into the loop only through this module:

    Portal(token)        a thread's handle on one running loop (``Portal.current()`` in the loop)
      run(afn, *a)       await afn(*a) in the loop; the thread waits for the result
      run_sync(fn, *a)   fn(*a) in the loop; the thread waits for the result
      post(fn, *a)       fn(*a) in the loop soon, in call order; the thread does not wait
    LoopThread(setup)    a trio loop in an owned, joined thread, for sync programs with no loop
                         of their own (tests, the relay benchmark's entry); never the daemon
    Outbox               thread -> trio: items to one task, ``capacity`` at most in flight
    Inbox                trio -> thread: items to one thread, ``capacity`` at most waiting
    Credits              the sans-I/O credit rule both are built on

Every thread-to-loop hand-off of the daemon goes through here (route driver
-> generate service's tokens, driver -> relayed hops' frames, driver -> DCUtR
upgrades, driver -> DHT snapshots); ``trio.from_thread`` and
``TrioToken.run_sync_soon`` appear nowhere else (tests/test_concurrency_rules.py).
A loop that has stopped is ``LoopStopped`` (a RelayUnreachable: a relayed
hop whose loop is gone has failed) from every call.

Why hand-offs with credits: a frame crossing from one thread to another costs
a wakeup (a sizeable share of a relayed step on a small VM:
docs/measurements/2026-11-29.md). A bounded queue needs a second signal the
other way (a credit back), but only when the producer is actually blocked on
a full queue:

    producer: waiter = credits.take(make_waiter)   None -> go; else wait on it and retry
    consumer: waiter = credits.give()              not None -> wake that waiter

Waiters are whatever the producer's world uses (a trio.Event set through the
portal's ``post``, a threading.Event); ``Credits`` never touches them beyond
storing one. The Outbox's thread waits on a semaphore instead, polling a
``gone()`` check so that a cancelled producer never waits for room forever.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

import trio

from proto.errors import LocalError
from proto.threads import ThreadGroup
from relay.errors import LoopStopped

log = logging.getLogger(__name__)

__all__ = ["Portal", "LoopThread", "Outbox", "Inbox", "Credits", "LOOP_STOP_TIMEOUT_S", "OUTBOX_POLL_S"]

W = TypeVar("W")
T = TypeVar("T")

# Joining a LoopThread after its cancel: a libp2p host closes its listeners and connections first.
LOOP_STOP_TIMEOUT_S = 30.0
# How often a producer waiting for room in an Outbox checks whether it should give up.
OUTBOX_POLL_S = 0.25


class Portal:
    """A plain thread's handle on one running trio loop (module docstring)."""

    __slots__ = ("_token",)

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token

    @classmethod
    def current(cls) -> Portal:
        """The portal of the loop we are running in (call from a trio task)."""
        return cls(trio.lowlevel.current_trio_token())

    def run(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await afn(*args)`` in the loop; the calling thread waits (LoopStopped if it has ended)."""
        try:
            return trio.from_thread.run(afn, *args, trio_token=self._token)
        except trio.RunFinishedError as exc:
            raise LoopStopped("the trio loop has stopped") from exc

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the loop; the calling thread waits (LoopStopped if it has ended)."""
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=self._token)
        except trio.RunFinishedError as exc:
            raise LoopStopped("the trio loop has stopped") from exc

    def post(self, fn: Callable[..., object], *args: Any) -> None:
        """``fn(*args)`` in the loop soon, after everything posted before it; no wait. ``fn`` runs
        as a loop callback: it must not block or raise (LoopStopped if the loop has ended)."""
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError as exc:
            raise LoopStopped("the trio loop has stopped") from exc


class LoopThread:
    """A trio loop in one owned thread, running ``setup(task_status)`` until ``stop()``.

    ``with LoopThread(setup) as loop:`` starts the thread and waits until ``setup`` called
    ``task_status.started(value)`` (``loop.value``); an error before that is raised here.
    ``loop.portal`` reaches the loop (the loop thread has the portal's calls too). ``stop()`` cancels the loop and joins
    the thread (ThreadsLeft past LOOP_STOP_TIMEOUT_S; an error of the loop is raised)."""

    def __init__(self, setup: Callable[..., Awaitable[None]], *, name: str = "trio-loop",
                 stop_timeout_s: float = LOOP_STOP_TIMEOUT_S) -> None:
        self._setup = setup
        self._threads = ThreadGroup(name, join_timeout_s=stop_timeout_s)
        self._ready = threading.Event()
        self._scope: trio.CancelScope | None = None
        self.portal: Portal | None = None
        self.value: Any = None

    def __enter__(self) -> LoopThread:
        self._threads.start(self._main, name="loop")
        self._ready.wait()
        if self.portal is None:             # the loop ended before its setup was done
            self._threads.join()            # raises the setup's error
            raise LocalError("the trio loop ended before its setup had started")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.stop()
            return
        try:
            self.stop()
        except Exception as stop_exc:
            log.error("stopping the trio loop thread after an error", exc_info=stop_exc)

    def _main(self) -> None:
        async def main() -> None:
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                self.value = await nursery.start(self._setup)
                self.portal = Portal.current()
                self._ready.set()

        try:
            trio.run(main)
        except BaseExceptionGroup as group:   # the nursery's: one error is that error, as raised
            sole = _sole(group)
            if sole is group:
                raise
            raise sole from None
        finally:
            self._ready.set()

    # The portal's calls, so the loop thread itself can be handed where a portal is expected.
    def run(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return self._portal().run(afn, *args)

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        return self._portal().run_sync(fn, *args)

    def post(self, fn: Callable[..., object], *args: Any) -> None:
        self._portal().post(fn, *args)

    def _portal(self) -> Portal:
        if self.portal is None:
            raise LoopStopped("the trio loop thread is not running")
        return self.portal

    def stop(self) -> None:
        """Cancel the loop, then join its thread (bounded)."""
        if self.portal is not None and self._scope is not None:
            try:
                self.portal.run_sync(self._scope.cancel)
            except LoopStopped:
                pass
        self._threads.close()


def _sole(exc: BaseException) -> BaseException:
    """The one error inside nested one-error groups (the group itself when it holds several)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


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
    """Items from a trio task to one plain thread, at most ``capacity`` waiting.

    trio appends without blocking while there is room (``credits.take``); the thread blocks on a
    condition; trio is woken (through the portal) only after it found the inbox full."""

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


class Outbox(Generic[T]):
    """Items from one plain thread to one trio task, at most ``capacity`` in flight.

    The thread's ``put`` waits only for room (never for the loop: the item is ``post``-ed) and
    gives up once ``gone()`` says so; ``close()`` ends the stream of items. The task iterates
    (``async for``) and calls ``give_back()`` once it is done with an item, which makes room."""

    def __init__(self, portal: Portal, capacity: int, *, poll_s: float = OUTBOX_POLL_S) -> None:
        if capacity <= 0:
            raise LocalError("an outbox needs a positive capacity")
        self._portal = portal
        self._poll_s = poll_s
        self._room = threading.BoundedSemaphore(capacity)
        # capacity items and the end: a delivery never finds the channel full
        self._send, self._receive = trio.open_memory_channel(capacity + 1)

    # -- the thread's side --------------------------------------------------------------------
    def put(self, item: T, gone: Callable[[], bool] = lambda: False) -> bool:
        """Hand ``item`` to the task once there is room; False (nothing sent) once ``gone()``.
        LoopStopped if the loop has ended."""
        while not self._room.acquire(timeout=self._poll_s):
            if gone():
                return False
        if gone():
            self._room.release()
            return False
        self._portal.post(self._deliver, item)
        return True

    def close(self) -> None:
        """No more items: the task's iteration ends after those already sent (LoopStopped if the
        loop has ended)."""
        self._portal.post(self._send.close)

    def _deliver(self, item: T) -> None:
        try:
            self._send.send_nowait(item)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass    # the task stopped reading (its side closed): the item goes nowhere

    # -- the task's side ----------------------------------------------------------------------
    async def receive(self) -> T:
        """The next item (trio.EndOfChannel once the thread closed and everything was taken)."""
        return await self._receive.receive()

    def give_back(self) -> None:
        """The task is done with one item: room for the next."""
        self._room.release()

    def __aiter__(self) -> AsyncIterator[T]:
        return self._receive.__aiter__()

    async def aclose(self) -> None:
        """The task reads no more: later deliveries are dropped."""
        await self._receive.aclose()

    async def __aenter__(self) -> Outbox[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
