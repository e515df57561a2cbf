"""Worker supervision: start the shard worker, prove its capability, restart it.

One worker *life* (``WorkerProcess.life``): spawn ``python -m meshd worker``
with a ready file; wait (bounded) for its "ready" line; ask it for its
CapabilityReport over loopback gRPC -- in a thread, grpc stays out of the trio
loop -- and check it is validated for exactly our range; hand it to
``on_ready``; then poll Health until the process exits. Stopping (cancel)
sends SIGTERM, waits ``STOP_GRACE_S``, then SIGKILL.

``Supervisor.run`` loops over lives: after a death it calls ``on_down``
(the daemon withdraws its records), waits the backoff and starts again. The
backoff doubles from ``initial`` to ``cap`` and starts over once a worker
lived at least ``cap`` seconds. A worker that fails before its *first*
ready is a configuration problem: ``WorkerFailed`` ends the daemon with the
worker's last message instead of retrying forever.

The life is injectable, so the timing is tested under trio's MockClock.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import trio

from meshd.errors import WorkerFailed
from meshd.tls import TlsMaterial, loopback_channel
from proto import shard_runtime_pb2 as pb

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
# SIGTERM lets the worker drain its sessions; after this it is killed.
STOP_GRACE_S = 10.0
# Loopback gRPC calls to our own worker answer in milliseconds when healthy.
CAPABILITY_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 5.0
HEALTH_INTERVAL_S = 5.0
# Three missed health checks in a row: the worker is wedged, restart it.
MAX_HEALTH_FAILURES = 3
# Lines of worker stderr kept for error messages and `meshd status`.
STDERR_TAIL_LINES = 20
# A worker line longer than this is cut (a peer never writes here, but a traceback might).
MAX_LINE_CHARS = 2000


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    model: Path
    layers: tuple[int, int]
    run_dir: Path
    tls: TlsMaterial
    tls_host: str = "127.0.0.1"
    dtype: str = "float32"
    backend: str = "torch"
    kv_budget_tokens: int | None = None
    torch_threads: int = 1
    ready_timeout_s: float = 900.0

    def command(self, ready_file: Path) -> list[str]:
        cmd = [sys.executable, "-m", "meshd", "worker", "--model", str(self.model),
               "--layers", f"{self.layers[0]}:{self.layers[1]}", "--listen", "127.0.0.1:0",
               "--dtype", self.dtype, "--backend", self.backend,
               "--tls-listen", f"{self.tls_host}:0", "--tls-cert", str(self.tls.cert_path),
               "--tls-key", str(self.tls.key_path), "--ready-file", str(ready_file)]
        if self.kv_budget_tokens is not None:
            cmd += ["--kv-budget-tokens", str(self.kv_budget_tokens)]
        return cmd

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(self.torch_threads)
        env["PYTHONUNBUFFERED"] = "1"
        return env


@dataclass(frozen=True, slots=True)
class WorkerReady:
    listen: str
    tls_listen: str
    pid: int
    report: pb.CapabilityReport = field(compare=False, repr=False)


@dataclass(slots=True)
class WorkerState:
    """Mutable, owned by the Supervisor; read by status."""

    state: str = "stopped"  # stopped | starting | ready | restarting | failed
    pid: int | None = None
    restarts: int = 0
    endpoint: str = ""
    tls_endpoint: str = ""
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


# ---------------------------------------------------------------------- real process


def check_report(report: pb.CapabilityReport, layers: tuple[int, int]) -> None:
    r = report.shard_range
    if not report.validated:
        raise WorkerFailed(f"the worker's capability is not validated: {report.detail[:200]}")
    if report.schema_version != pb.SCHEMA_VERSION_1:
        raise WorkerFailed(f"the worker speaks schema {report.schema_version}")
    if (r.start_layer, r.end_layer) != tuple(layers) or not r.end_layer <= report.num_layers:
        raise WorkerFailed(f"the worker serves {r.start_layer}:{r.end_layer}, we asked for {layers[0]}:{layers[1]}")
    if not report.fingerprint.model_artifact_digest:
        raise WorkerFailed("the worker's capability has no artifact digest")


def fetch_capability(endpoint: str) -> pb.CapabilityReport:
    """Blocking; call through trio.to_thread."""
    import grpc
    from proto import shard_runtime_pb2_grpc as pb_grpc

    try:
        with loopback_channel(endpoint) as channel:
            return pb_grpc.ShardRuntimeStub(channel).GetCapability(
                pb.CapabilityRequest(schema_version=pb.SCHEMA_VERSION_1), timeout=CAPABILITY_TIMEOUT_S)
    except grpc.RpcError as exc:
        raise WorkerFailed(f"GetCapability on {endpoint} failed: {exc.code().name}") from exc


def fetch_health(endpoint: str) -> pb.HealthReport:
    import grpc
    from proto import shard_runtime_pb2_grpc as pb_grpc

    try:
        with loopback_channel(endpoint) as channel:
            return pb_grpc.ShardRuntimeStub(channel).Health(
                pb.HealthRequest(schema_version=pb.SCHEMA_VERSION_1), timeout=HEALTH_TIMEOUT_S)
    except grpc.RpcError as exc:
        raise WorkerFailed(f"Health on {endpoint} failed: {exc.code().name}") from exc


class WorkerProcess:
    """The real life of a worker subprocess (see module docstring)."""

    def __init__(self, spec: WorkerSpec, progress: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.progress = progress or (lambda line: None)

    async def life(self, on_ready: OnReady, state: WorkerState) -> int:
        spec = self.spec
        spec.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        ready_file = spec.run_dir / "worker-ready.json"
        ready_file.unlink(missing_ok=True)
        log_path = spec.run_dir / "worker.log"
        ready_line = trio.Event()
        _keep_spawning_threads()
        # Own session: a terminal's Ctrl-C reaches the daemon, which stops the
        # worker in order. Parent-death signal: a daemon killed with SIGKILL
        # does not leave an orphan worker holding the model in memory.
        proc = await trio.lowlevel.open_process(spec.command(ready_file), env=spec.env(),
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                start_new_session=True, preexec_fn=_die_with_parent)
        state.pid = proc.pid
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, proc.stdout, log_path, state, ready_line)
                nursery.start_soon(self._pump, proc.stderr, log_path, state, None)
                with trio.move_on_after(spec.ready_timeout_s) as ready_scope:
                    async with trio.open_nursery() as race:
                        async def died() -> None:
                            await proc.wait()
                            race.cancel_scope.cancel()

                        async def readied() -> None:
                            await ready_line.wait()
                            race.cancel_scope.cancel()

                        race.start_soon(died)
                        race.start_soon(readied)
                if ready_scope.cancelled_caught:
                    raise WorkerFailed(f"the worker was not ready within {spec.ready_timeout_s:g} s")
                if proc.returncode is not None:
                    await proc.wait()
                    nursery.cancel_scope.cancel()
                    return proc.returncode
                ready = self._read_ready(ready_file, proc.pid)
                report = await trio.to_thread.run_sync(fetch_capability, ready.listen)
                check_report(report, spec.layers)
                ready = WorkerReady(ready.listen, ready.tls_listen, proc.pid, report)
                state.endpoint, state.tls_endpoint = ready.listen, ready.tls_listen
                await on_ready(ready)
                nursery.start_soon(self._watch_health, proc, ready.listen, state)
                code = await proc.wait()
                nursery.cancel_scope.cancel()
                return code
        finally:
            with trio.CancelScope(shield=True):
                await _stop(proc)

    @staticmethod
    def _read_ready(path: Path, pid: int) -> WorkerReady:
        try:
            data = json.loads(path.read_text()[:65536])
            return WorkerReady(str(data["listen"]), str(data.get("tls_listen") or ""), pid, pb.CapabilityReport())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WorkerFailed(f"the worker's ready file {path} is unusable: {exc}") from exc

    async def _pump(self, stream, log_path: Path, state: WorkerState, ready_line: trio.Event | None) -> None:
        buf = b""
        with open(log_path, "ab") as log_file:
            async for chunk in stream:
                buf += chunk
                while b"\n" in buf:
                    raw, buf = buf.split(b"\n", 1)
                    log_file.write(raw + b"\n")
                    log_file.flush()
                    line = raw.decode("utf-8", "replace").rstrip()[:MAX_LINE_CHARS]
                    if ready_line is not None and (line == "ready" or line.startswith("ready ")):
                        ready_line.set()
                    elif line:
                        state.stderr_tail.append(line)
                        self.progress(line)
                if len(buf) > MAX_LINE_CHARS * 4:
                    buf = buf[-MAX_LINE_CHARS:]

    async def _watch_health(self, proc, endpoint: str, state: WorkerState) -> None:
        failures = 0
        while True:
            await trio.sleep(HEALTH_INTERVAL_S)
            try:
                report = await trio.to_thread.run_sync(fetch_health, endpoint)
            except WorkerFailed as exc:
                failures += 1
                state.health = {"error": str(exc), "failures": failures}
                if failures >= MAX_HEALTH_FAILURES:
                    log.warning("worker failed %d health checks; stopping it", failures)
                    proc.terminate()
                    return
                continue
            failures = 0
            state.health = {"state": pb.ServingState.Name(report.state).removeprefix("SERVING_STATE_").lower(),
                            "active_sessions": report.active_sessions, "kv_pressure": round(report.kv_pressure, 3)}


# PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, and
# trio forks in one of its cached worker threads, which exit after 10 s idle:
# the worker got SIGTERM 10 s after a quiet start. Cached threads are kept for
# the daemon's life instead (they are bounded by trio's thread limiter), so
# the signal again means "the daemon died".
KEEP_THREADS_S = 10**6


def _keep_spawning_threads() -> None:
    from trio._core import _thread_cache

    _thread_cache.IDLE_TIMEOUT = max(_thread_cache.IDLE_TIMEOUT, KEEP_THREADS_S)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


async def _stop(proc) -> None:
    if proc.returncode is not None:
        return
    proc.send_signal(signal.SIGTERM)
    with trio.move_on_after(STOP_GRACE_S):
        await proc.wait()
        return
    proc.kill()
    await proc.wait()
