"""Owned threads: every thread a meshd process starts belongs to a group its owner stops and joins.

Why: a thread nobody joins outlives the work it was for -- it holds a socket,
a session's KV or the interpreter's exit (a worker that could only leave with
``os._exit``). The rule in every process (the daemon's route driver threads,
the worker's servers and push streams): start a thread only through a
``ThreadGroup``, and its owner ends the group before the owner itself ends.

    owner ── start(fn, *args) ──▶ thread: fn(*args); an exception is kept (bounded) and logged
      ├── stop()      ``stopping`` is set; the wake-ups given to ``on_stop`` run once
      │               (close the socket a thread blocks on, end a queue): threads return
      └── join(t)     every thread joined against ONE deadline; ThreadsLeft names those
                      still alive; else the first error a thread raised is raised here
                      (several: an ExceptionGroup)

``close()`` is stop + join; ``with ThreadGroup(...) as group:`` closes on exit.
A finished thread leaves the group at once, so a long-lived group (a server's
connections) holds live threads only. The threads are daemon threads -- never
as a way to end them (join is the rule), only so that one that outlived its
bound (join reported it) cannot hold the interpreter's exit hostage.

This module sits in proto/ because it is the floor every folder of the house
may import (shard, relay and meshd all start threads). It opens no socket and
imports no trio or grpc; proto's codec modules never import it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from proto.errors import LocalError

__all__ = ["ThreadGroup", "ThreadsLeft", "GroupStopped", "DEFAULT_JOIN_TIMEOUT_S", "MAX_KEPT_ERRORS"]

log = logging.getLogger(__name__)

# A group's threads are told to stop before they are joined, so each ends within one blocking
# call it was woken from; 10 s covers a forward finishing on a busy 2-core machine.
DEFAULT_JOIN_TIMEOUT_S = 10.0
# Errors kept for ``join`` (all are logged and counted): a server's group may see many
# connections fail over its life; the first few say what went wrong.
MAX_KEPT_ERRORS = 16


class ThreadsLeft(LocalError):
    """Threads of a group were still alive when its join deadline passed (a bug to fix here)."""

    def __init__(self, group: str, names: list[str], errors: list[BaseException]) -> None:
        super().__init__(f"{len(names)} thread(s) of {group} still alive after the join deadline: "
                         + ", ".join(names[:8]))
        self.names = names
        self.errors = errors


class GroupStopped(LocalError):
    """``start`` after ``stop``: the owner is ending, nothing new begins."""


class ThreadGroup:
    """Threads started, stopped and joined together (see the module docstring)."""

    def __init__(self, name: str, *, join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S) -> None:
        self.name = name
        self.join_timeout_s = join_timeout_s
        self.stopping = threading.Event()
        self.started = 0                   # threads ever started
        self.failed = 0                    # threads that raised (only MAX_KEPT_ERRORS are kept)
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._wakeups: list[Callable[[], object]] = []
        self._errors: list[BaseException] = []

    def __enter__(self) -> ThreadGroup:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:                # the body's own error wins; the group's is logged, not lost
            self.close()
        except Exception as group_exc:
            log.error("closing thread group %s after an error", self.name, exc_info=group_exc)

    # -- starting -----------------------------------------------------------------------------
    def start(self, fn: Callable[..., object], *args: Any, name: str = "") -> threading.Thread:
        """Run ``fn(*args)`` in a new thread of this group (GroupStopped once stopping)."""
        label = f"{self.name}:{name or getattr(fn, '__name__', 'thread')}"
        with self._lock:
            if self.stopping.is_set():
                raise GroupStopped(f"thread group {self.name} is stopping; not starting {label}")
            thread = threading.Thread(target=self._run, args=(fn, args), name=label, daemon=True)
            self._threads.add(thread)
            try:
                thread.start()
            except BaseException:
                self._threads.discard(thread)
                raise
            self.started += 1
        return thread

    def _run(self, fn: Callable[..., object], args: tuple) -> None:
        try:
            fn(*args)
        except BaseException as exc:
            log.error("thread %s failed", threading.current_thread().name, exc_info=exc)
            with self._lock:
                self.failed += 1
                if len(self._errors) < MAX_KEPT_ERRORS:
                    self._errors.append(exc)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    # -- ending -------------------------------------------------------------------------------
    def on_stop(self, wake: Callable[[], object]) -> None:
        """Call ``wake()`` when the group stops (at once if it already has): for wake-ups that live
        as long as the group, e.g. closing a listener its accept thread blocks on."""
        with self._lock:
            if not self.stopping.is_set():
                self._wakeups.append(wake)
                return
        self._wake(wake)

    def stop(self) -> None:
        """Tell every thread to end: ``stopping`` is set, the ``on_stop`` wake-ups run (once)."""
        with self._lock:
            if self.stopping.is_set():
                return
            self.stopping.set()
            wakeups, self._wakeups = self._wakeups, []
        for wake in wakeups:
            self._wake(wake)

    def _wake(self, wake: Callable[[], object]) -> None:
        try:
            wake()
        except Exception as exc:  # noqa: BLE001 - one failed wake-up must not skip the others
            log.warning("thread group %s: a stop wake-up failed: %r", self.name, exc)

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for every thread (the caller, if it is one of them, excepted) against one deadline.

        ThreadsLeft if some are still alive then; else the threads' errors are raised here."""
        deadline = time.monotonic() + (self.join_timeout_s if timeout_s is None else timeout_s)
        me = threading.current_thread()
        while True:
            with self._lock:
                threads = [t for t in self._threads if t is not me]
            if not threads or time.monotonic() >= deadline:
                break
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            left = sorted(t.name for t in self._threads if t is not me and t.is_alive())
            errors, self._errors = self._errors, []
        if left:
            raise ThreadsLeft(self.name, left, errors)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise BaseExceptionGroup(f"{len(errors)} threads of {self.name} failed", errors)

    def close(self, timeout_s: float | None = None) -> None:
        """``stop()`` then ``join(timeout_s)``."""
        self.stop()
        self.join(timeout_s)

    # -- looking ------------------------------------------------------------------------------
    @property
    def alive(self) -> list[str]:
        """Names of the threads running now."""
        with self._lock:
            return sorted(t.name for t in self._threads)

    def __len__(self) -> int:
        with self._lock:
            return len(self._threads)

    def __repr__(self) -> str:
        return f"ThreadGroup({self.name!r}, alive={len(self)}, started={self.started}, failed={self.failed})"
