"""Worker supervision: restart the shard worker with backoff, withdraw meanwhile.

``Supervisor.run`` loops over worker *lives* (meshd/daemon/worker_process.py runs
the real one): after a death it calls ``on_down`` (the daemon withdraws its
records), waits the backoff and starts again. The backoff doubles from
``initial`` to ``cap`` and starts over once a worker lived at least ``cap``
seconds. A worker that fails before its *first* ready is a configuration
problem: ``WorkerFailed`` ends the daemon with the worker's last message
instead of retrying forever.

The life is injected, so the timing is tested under trio's MockClock.
State: ``WorkerState`` (owned here, read by ``meshd status``).
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import trio

from meshd.errors import WorkerFailed
from proto import shard_runtime_pb2 as pb

log = logging.getLogger(__name__)

# Lines of worker stderr kept for error messages and `meshd status`.
STDERR_TAIL_LINES = 20


@dataclass(frozen=True, slots=True)
class WorkerReady:
    listen: str
    tls_listen: str
    pid: int
    report: pb.CapabilityReport = field(compare=False, repr=False)
    unix: str = ""          # ``unix:/path`` of the worker's frame socket ("" if it has none)


@dataclass(slots=True)
class WorkerState:
    """Mutable, owned by the Supervisor; read by status."""

    state: str = "stopped"  # stopped | starting | ready | restarting | failed
    pid: int | None = None
    restarts: int = 0
    endpoint: str = ""
    tls_endpoint: str = ""
    unix: str = ""          # the worker's frame socket (``unix:/path``), "" if none
    last_exit: int | None = None
    health: dict = field(default_factory=dict)
    stderr_tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=STDERR_TAIL_LINES))

    def as_dict(self) -> dict:
        return {"state": self.state, "pid": self.pid, "restarts": self.restarts, "endpoint": self.endpoint,
                "tls_endpoint": self.tls_endpoint, "last_exit": self.last_exit, "health": self.health,
                "last_message": self.stderr_tail[-1] if self.stderr_tail else ""}


class Backoff:
    """Doubling restart delay, reset after a long enough healthy life (pure)."""

    def __init__(self, initial_s: float, cap_s: float) -> None:
        if not 0 < initial_s <= cap_s:
            raise ValueError("need 0 < initial_s <= cap_s")
        self.initial_s, self.cap_s = initial_s, cap_s
        self._next = initial_s

    def after_death(self, lived_s: float) -> float:
        if lived_s >= self.cap_s:
            self._next = self.initial_s
        delay = self._next
        self._next = min(self._next * 2, self.cap_s)
        return delay


OnReady = Callable[[WorkerReady], Awaitable[None]]
Life = Callable[[OnReady, WorkerState], Awaitable[int]]


class Supervisor:
    def __init__(self, life: Life, *, on_ready: OnReady, on_down: Callable[[], Awaitable[None]],
                 backoff: Backoff) -> None:
        self._life = life
        self._on_ready = on_ready
        self._on_down = on_down
        self.backoff = backoff
        self.state = WorkerState()
        self.ever_ready = False

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                started = trio.current_time()
                self.state.state = "starting"
                try:
                    code = await self._life(self._ready, self.state)
                    failure = f"worker exited with code {code}"
                except WorkerFailed as exc:
                    code, failure = None, str(exc)
                self.state.last_exit = code
                self.state.pid = None
                await self._on_down()
                if not self.ever_ready:
                    self.state.state = "failed"
                    tail = self.state.stderr_tail[-1] if self.state.stderr_tail else ""
                    raise WorkerFailed(f"{failure} before it was ready" + (f": {tail}" if tail else ""))
                delay = self.backoff.after_death(trio.current_time() - started)
                self.state.state = "restarting"
                log.warning("%s; restarting in %.1f s", failure, delay)
                await trio.sleep(delay)
                self.state.restarts += 1
        finally:
            self.state.state = "stopped"

    async def _ready(self, ready: WorkerReady) -> None:
        self.ever_ready = True
        self.state.state = "ready"
        await self._on_ready(ready)
