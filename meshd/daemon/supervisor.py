"""Worker supervision: restart the shard worker with exponential backoff, withdraw meanwhile.

``Supervisor.run`` loops over worker *lives* (meshd/daemon/worker_process.py runs
the real one): after a death it calls ``on_down`` (the daemon withdraws its
records), records the failure, waits the backoff and starts again. The
backoff doubles from ``initial`` up to ``cap`` (about 5 minutes by default:
a crash loop costs little, a fixed file is picked up within minutes) and
starts over once a worker had served (been ready) for ``reset_after`` seconds.
A worker that fails before it was ever ready (a model that cannot be loaded)
is retried the same way, and ``meshd status`` says why it failed; only a
supervisor built with ``give_up_before_ready`` (the ``--layers auto`` slot,
which asks the tracker for another range instead) ends with ``WorkerFailed``.

The life is injected, so the timing is tested under trio's MockClock.
State: ``WorkerState`` (owned here, read by ``meshd status``), including the
last failure: when, exit code or signal, the last lines of the worker's
stderr, and when the next start is due.
"""
from __future__ import annotations

import collections
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import trio

from meshd.errors import WorkerFailed
from proto import shard_runtime_pb2 as pb

log = logging.getLogger(__name__)

# Lines of worker stderr kept for error messages and `meshd status`.
STDERR_TAIL_LINES = 20
# Of those, the lines a failure record keeps (status shows them).
FAILURE_TAIL_LINES = 6


@dataclass(frozen=True, slots=True)
class WorkerReady:
    listen: str
    tls_listen: str
    pid: int
    report: pb.CapabilityReport = field(compare=False, repr=False)
    unix: str = ""          # ``unix:/path`` of the worker's frame socket ("" if it has none)
    frames: str = ""        # HOST:PORT of its framed TLS fast path for peers ("" if none)


def describe_exit(code: int | None) -> tuple[str, str | None]:
    """(what happened, the signal's name or None) for a Popen return code."""
    if code is None:
        return "the worker failed", None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the worker was killed by {name}", name
    return f"the worker exited with code {code}", None


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """One death of the worker, as ``meshd status`` shows it."""

    at_unix_s: float
    message: str
    exit_code: int | None          # None: it did not exit by itself (not ready in time, bad report)
    signal: str | None             # e.g. "SIGKILL" when a signal ended it
    was_ready: bool
    stderr_tail: tuple[str, ...]
    next_restart_at: float | None  # trio time of the next start; None when not restarting

    def as_dict(self, now: float | None) -> dict:
        due = None if self.next_restart_at is None or now is None else max(0.0, self.next_restart_at - now)
        return {"at_unix_s": round(self.at_unix_s, 3), "message": self.message, "exit_code": self.exit_code,
                "signal": self.signal, "was_ready": self.was_ready, "stderr_tail": list(self.stderr_tail),
                "next_restart_in_s": None if due is None else round(due, 1)}


def _trio_now() -> float | None:
    try:
        return trio.current_time()
    except RuntimeError:        # outside a trio run (tests, renderers)
        return None


@dataclass(slots=True)
class WorkerState:
    """Mutable, owned by the Supervisor; read by status."""

    state: str = "stopped"  # stopped | starting | ready | restarting | failed
    pid: int | None = None
    restarts: int = 0
    endpoint: str = ""
    tls_endpoint: str = ""
    unix: str = ""          # the worker's frame socket (``unix:/path``), "" if none
    frames_endpoint: str = ""   # its framed TLS fast path (HOST:PORT), "" if none
    last_exit: int | None = None
    log_path: str = ""      # the worker's log file (its stdout and stderr)
    health: dict = field(default_factory=dict)
    stderr_tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=STDERR_TAIL_LINES))
    last_failure: WorkerFailure | None = None

    def as_dict(self, now: float | None = None) -> dict:
        now = _trio_now() if now is None else now
        health = dict(self.health)
        checked = health.pop("checked_monotonic_s", None)
        if checked is not None:   # health is polled: say how old this view of it is
            health["age_s"] = round(max(0.0, time.monotonic() - checked), 1)
        return {"state": self.state, "pid": self.pid, "restarts": self.restarts, "endpoint": self.endpoint,
                "tls_endpoint": self.tls_endpoint, "last_exit": self.last_exit, "health": health,
                "last_message": self.stderr_tail[-1] if self.stderr_tail else "", "log": self.log_path,
                "last_failure": self.last_failure.as_dict(now) if self.last_failure else None}


class Backoff:
    """Doubling restart delay from ``initial_s`` to ``cap_s``; back to ``initial_s`` after a
    life that served at least ``reset_after_s`` (pure)."""

    def __init__(self, initial_s: float, cap_s: float, reset_after_s: float | None = None) -> None:
        if not 0 < initial_s <= cap_s:
            raise ValueError("need 0 < initial_s <= cap_s")
        self.initial_s, self.cap_s = initial_s, cap_s
        self.reset_after_s = cap_s if reset_after_s is None else reset_after_s
        if self.reset_after_s <= 0:
            raise ValueError("reset_after_s must be positive")
        self._next = initial_s

    def after_death(self, served_s: float) -> float:
        """The delay before the next start, given how long the life that ended was ready."""
        if served_s >= self.reset_after_s:
            self._next = self.initial_s
        delay = self._next
        self._next = min(self._next * 2, self.cap_s)
        return delay


OnReady = Callable[[WorkerReady], Awaitable[None]]
Life = Callable[[OnReady, WorkerState], Awaitable[int]]


class Supervisor:
    def __init__(self, life: Life, *, on_ready: OnReady, on_down: Callable[[], Awaitable[None]],
                 backoff: Backoff, give_up_before_ready: bool = False,
                 wall: Callable[[], float] = time.time) -> None:
        self._life = life
        self._on_ready = on_ready
        self._on_down = on_down
        self.backoff = backoff
        self.give_up_before_ready = give_up_before_ready
        self._wall = wall
        self.state = WorkerState()
        self.ever_ready = False
        self._ready_at: float | None = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                self._ready_at = None
                self.state.state = "starting"
                self.state.stderr_tail.clear()
                try:
                    code = await self._life(self._ready, self.state)
                    failure, sig = describe_exit(code)
                except WorkerFailed as exc:
                    code, failure, sig = None, str(exc), None
                now = trio.current_time()
                was_ready = self._ready_at is not None
                served = now - self._ready_at if self._ready_at is not None else 0.0
                self.state.last_exit = code
                self.state.pid = None
                tail = tuple(self.state.stderr_tail)[-FAILURE_TAIL_LINES:]
                await self._on_down()
                if not self.ever_ready and self.give_up_before_ready:
                    self.state.state = "failed"
                    self._record(failure, code, sig, False, tail, None)
                    raise WorkerFailed(f"{failure} before it was ready" + (f": {tail[-1]}" if tail else ""))
                delay = self.backoff.after_death(served)
                self._record(failure, code, sig, was_ready, tail, now + delay)
                self.state.state = "restarting"
                why = "" if was_ready else " before it was ready" + (f" ({tail[-1]})" if tail else "")
                where = f"; worker log: {self.state.log_path}" if self.state.log_path else ""
                log.warning("%s%s; restarting in %.0f s%s", failure, why, delay, where)
                await trio.sleep(delay)
                self.state.restarts += 1
                if self.state.last_failure is not None:   # recorded above
                    self.state.last_failure = replace(self.state.last_failure, next_restart_at=None)
        finally:
            if self.state.state != "failed":
                self.state.state = "stopped"

    def _record(self, message: str, code: int | None, sig: str | None, was_ready: bool,
                tail: tuple[str, ...], next_restart_at: float | None) -> None:
        self.state.last_failure = WorkerFailure(self._wall(), message, code, sig, was_ready, tail, next_restart_at)

    async def _ready(self, ready: WorkerReady) -> None:
        self.ever_ready = True
        self._ready_at = trio.current_time()
        self.state.state = "ready"
        await self._on_ready(ready)
