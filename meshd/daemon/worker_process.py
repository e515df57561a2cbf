"""The real life of one shard worker process (injected into meshd.daemon.supervisor).

``WorkerProcess.life``: spawn ``python -m meshd worker`` with a ready file;
wait (bounded) for its "ready" line; ask it for its CapabilityReport over
loopback gRPC -- in a thread, grpc stays out of the trio loop -- and check it
is validated for exactly our range; hand it to ``on_ready``; then poll Health
until the process exits. Cancellation sends SIGTERM (the worker stops its
servers, joins its threads and exits 0), waits ``STOP_GRACE_S``, then SIGKILL;
the worker's last lines still reach its log, and its exit code is the state's
``last_exit``. Worker output goes to
``worker.log`` in the data dir and, line by line, to the progress callback
and the state's stderr tail (``meshd status``) -- except the lines of a
traceback (marked by the worker, shard/session/worklog.py), which stay in the log file.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshd.config import DEFAULT_KV_BUDGET_TOKENS
from meshd.daemon.supervisor import OnReady, WorkerReady, WorkerState
from meshd.errors import WorkerFailed
from meshd.reach.tls import TlsMaterial, loopback_channel
from proto import shard_runtime_pb2 as pb
from proto.receipts import ReceiptSigner
from shard.session.worklog import is_trace_line

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
# SIGTERM lets the worker drain its sessions; after this it is killed.
STOP_GRACE_S = 10.0
# Loopback gRPC calls to our own worker answer in milliseconds when healthy.
CAPABILITY_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 5.0
HEALTH_INTERVAL_S = 5.0
# Three missed health checks in a row: the worker is wedged, restart it.
MAX_HEALTH_FAILURES = 3
# After a stopped worker is gone, its last output is read for at most this long (module docstring).
DRAIN_S = 2.0
# A worker line longer than this is cut (a peer never writes here, but a traceback might).
MAX_LINE_CHARS = 2000


# sun_path is 108 bytes on Linux, with its terminating NUL.
MAX_UNIX_PATH_BYTES = 100
# The worker's receipt key for one run (WorkerSpec.write_receipt_key), in the private run dir.
RECEIPT_KEY_FILE = "worker-receipt.key"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    model: Path
    layers: tuple[int, int]
    run_dir: Path
    tls: TlsMaterial
    tls_host: str = "127.0.0.1"
    dtype: str = "float32"
    backend: str = "torch"
    kv_budget_tokens: int = DEFAULT_KV_BUDGET_TOKENS   # the planner's number: always passed on
    torch_threads: int = 1
    ready_timeout_s: float = 900.0
    # MoE holder: the experts its range holds and the placement file the daemon keeps for the rest.
    experts: str | None = None
    expert_peers: Path | None = None
    expert_act: str = "f32"
    offload_experts: bool = False
    batching: bool = True
    llama_kv_streams: int | str = "auto"   # WorkerConfig.llama_kv_streams
    model_root: str | None = None   # --model ROOT: the root the worker's report must name
    # The node's key: each run of the worker gets a fresh receipt key it certifies (proto/receipts.py),
    # handed over in a 0600 file of the private run dir that the worker unlinks (never argv or env).
    node_key: Ed25519PrivateKey | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of_node(cls, config, layers: tuple[int, int], *, tls: TlsMaterial, tls_host: str,
                node_key: Ed25519PrivateKey | None = None, **moe) -> WorkerSpec:
        """The spec a daemon with ``config`` (meshd.config.Config) starts for ``layers``: the
        ``[worker]`` settings, one place for the fixed-range worker and the assigned slot."""
        w = config.worker
        return cls(model=config.model, layers=layers, run_dir=config.data_dir, tls=tls, tls_host=tls_host,
                   dtype=w.dtype, backend=w.backend, kv_budget_tokens=w.kv_budget_tokens,
                   torch_threads=w.torch_threads, batching=w.batching, llama_kv_streams=w.llama_kv_streams,
                   ready_timeout_s=w.ready_timeout_s, model_root=config.model_root, node_key=node_key, **moe)

    def write_receipt_key(self, now_ms: int) -> Path | None:
        """A fresh receipt key for the next run, certified by the node key, in a new 0600 file of
        the private run dir (None without a node key)."""
        if self.node_key is None:
            return None
        path = self.run_dir / RECEIPT_KEY_FILE
        path.unlink(missing_ok=True)
        signer = ReceiptSigner.fresh("self", self.node_key, now_ms)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, signer.key_file_bytes())
        finally:
            os.close(fd)
        return path

    def command(self, ready_file: Path, receipt_key: Path | None = None) -> list[str]:
        cmd = [sys.executable, "-m", "meshd", "worker", "--model", str(self.model),
               "--layers", f"{self.layers[0]}:{self.layers[1]}", "--listen", "127.0.0.1:0",
               "--dtype", self.dtype, "--backend", self.backend,
               "--tls-listen", f"{self.tls_host}:0", "--tls-cert", str(self.tls.cert_path),
               "--tls-key", str(self.tls.key_path), "--frames-listen", f"{self.tls_host}:0",
               "--ready-file", str(ready_file),
               "--threads", str(self.torch_threads)]
        cmd += ["--kv-budget-tokens", str(self.kv_budget_tokens)]
        if not self.batching:
            cmd += ["--no-batching"]
        if self.llama_kv_streams != "auto":   # the worker's default is auto
            cmd += ["--llama-kv-streams", str(self.llama_kv_streams)]
        if self.backend == "llama.cpp" and not os.environ.get("MESHD_SLICE_CACHE"):
            # the node's own slice: one range's at a time (native/slice.py), inside the node's data
            cmd += ["--slice-dir", str(self.run_dir / "slices")]
        if self.experts is not None or self.offload_experts:
            cmd += ["--expert-act", self.expert_act] + (["--experts", self.experts] if self.experts else [])
            cmd += ["--expert-peers", str(self.expert_peers)] if self.expert_peers else []
            cmd += ["--offload-experts"] if self.offload_experts else []
        cmd += ["--receipt-key", str(receipt_key)] if receipt_key is not None else []
        return cmd + ["--unix-listen", str(self.socket_path())]

    def socket_path(self) -> Path:
        """The worker's frame socket (relayed sessions reach it there): in the private run
        dir, or a private temp dir when that path is too long for AF_UNIX (108 bytes)."""
        path = self.run_dir / "worker.sock"
        if len(str(path).encode()) <= MAX_UNIX_PATH_BYTES:
            return path
        return Path(tempfile.mkdtemp(prefix="meshd-w-")) / "worker.sock"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(self.torch_threads)
        env["PYTHONUNBUFFERED"] = "1"
        return env


def check_report(report: pb.CapabilityReport, layers: tuple[int, int], root: str | None = None) -> None:
    """The worker's report must be validated, for our range and (``root``: --model ROOT) of the model
    the user named -- the worker computed its root from the very bytes it loaded."""
    r = report.shard_range
    if not report.validated:
        raise WorkerFailed(f"the worker's capability is not validated: {report.detail[:200]}")
    if report.schema_version != pb.SCHEMA_VERSION_1:
        raise WorkerFailed(f"the worker speaks schema {report.schema_version}")
    if (r.start_layer, r.end_layer) != tuple(layers) or not r.end_layer <= report.num_layers:
        raise WorkerFailed(f"the worker serves {r.start_layer}:{r.end_layer}, we asked for {layers[0]}:{layers[1]}")
    if not report.fingerprint.model_artifact_digest:
        raise WorkerFailed("the worker's capability has no artifact digest")
    if root is not None and report.fingerprint.model_artifact_digest != root:
        raise WorkerFailed(f"the worker loaded model {report.fingerprint.model_artifact_digest[:23]}..., not the "
                           f"{root[:23]}... this node was asked to serve")


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
        state.log_path = str(log_path)
        ready_line = trio.Event()
        receipt_key = spec.write_receipt_key(time.time_ns() // 1_000_000)
        try:
            proc = ChildProcess.spawn(spec.command(ready_file, receipt_key), spec.env())
        except BaseException:
            if receipt_key is not None:
                receipt_key.unlink(missing_ok=True)
            raise
        state.pid = proc.pid
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, proc.stdout, log_path, state, ready_line)
                nursery.start_soon(self._pump, proc.stderr, log_path, state, None)
                await ready_or_exit(proc, ready_line, spec.ready_timeout_s, "the worker")
                if proc.returncode is not None:
                    await proc.wait()
                    nursery.cancel_scope.cancel()
                    return proc.returncode
                ready = self._read_ready(ready_file, proc.pid)
                report = await trio.to_thread.run_sync(fetch_capability, ready.listen)
                check_report(report, spec.layers, spec.model_root)
                ready = WorkerReady(ready.listen, ready.tls_listen, proc.pid, report, ready.unix, ready.frames)
                state.endpoint, state.tls_endpoint, state.unix = ready.listen, ready.tls_listen, ready.unix
                state.frames_endpoint = ready.frames
                await on_ready(ready)
                nursery.start_soon(self._watch_health, proc, ready.listen, state)
                code = await proc.wait()
                nursery.cancel_scope.cancel()
                return code
        finally:
            if receipt_key is not None:
                receipt_key.unlink(missing_ok=True)   # the worker unlinks it once read; a failed start may not
            with trio.CancelScope(shield=True):
                await self.stop_and_drain(proc, log_path, state)

    async def stop_and_drain(self, proc: ChildProcess, log_path: Path, state: WorkerState) -> None:
        """Stop the child (``stop_child``: SIGTERM, SIGKILL after STOP_GRACE_S) while its last lines
        still reach its log -- "[worker] stopped", or what kept it from stopping cleanly -- and
        keep its exit code in ``state.last_exit``. Bounded: a pipe some grandchild holds open is
        given up DRAIN_S after the child is gone."""
        with trio.move_on_after(STOP_GRACE_S + DRAIN_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, proc.stdout, log_path, state, None)
                nursery.start_soon(self._pump, proc.stderr, log_path, state, None)
                await stop_child(proc, close_pipes=False)
        await _close_pipes(proc)
        state.last_exit = proc.returncode

    @staticmethod
    def _read_ready(path: Path, pid: int) -> WorkerReady:
        try:
            data = json.loads(path.read_text()[:65536])
            return WorkerReady(str(data["listen"]), str(data.get("tls_listen") or ""), pid, pb.CapabilityReport(),
                               str(data.get("unix") or ""), str(data.get("frames_tls") or ""))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WorkerFailed(f"the worker's ready file {path} is unusable: {exc}") from exc

    async def _pump(self, stream, log_path: Path, state: WorkerState, ready_line: trio.Event | None) -> None:
        buf = b""
        # Synchronous writes on purpose: a line is a few bytes, and an awaited write would be one
        # more checkpoint where a cancellation loses the last lines of a dying worker.
        with open(log_path, "ab") as log_file:  # noqa: ASYNC230 - see above
            async for chunk in stream:
                buf += chunk
                while b"\n" in buf:
                    raw, buf = buf.split(b"\n", 1)
                    log_file.write(raw + b"\n")
                    log_file.flush()
                    line = raw.decode("utf-8", "replace").rstrip()[:MAX_LINE_CHARS]
                    if ready_line is not None and (line == "ready" or line.startswith("ready ")):
                        ready_line.set()
                    elif line and not is_trace_line(line):
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
                    # in the tail that status shows: why a SIGTERM ended this life
                    state.stderr_tail.append(f"[daemon] {failures} health checks failed in a row ({exc}); "
                                             "stopping the worker")
                    proc.terminate()
                    return
                continue
            failures = 0
            state.health = {"state": pb.ServingState.Name(report.state).removeprefix("SERVING_STATE_").lower(),
                            "active_sessions": report.active_sessions, "kv_pressure": round(report.kv_pressure, 3),
                            "kv_tokens_used": report.kv_tokens_used, "kv_budget_tokens": report.kv_budget_tokens,
                            "resident_bytes": report.resident_bytes,
                            "checked_monotonic_s": time.monotonic()}   # as_dict turns it into an age
            if report.push_streams_frames or report.push_streams_grpc:   # successor streams, by transport
                state.health["push_streams"] = {"frames": report.push_streams_frames,
                                                "grpc": report.push_streams_grpc}
            if report.expert_positions:   # MoE holder: the expert exchange's bytes per position
                state.health["experts"] = {
                    "bytes_sent_per_position": round(report.expert_bytes_sent / report.expert_positions, 1),
                    "bytes_received_per_position": round(report.expert_bytes_received / report.expert_positions, 1),
                    "positions": report.expert_positions, "failovers": report.expert_failovers}


_PR_SET_PDEATHSIG = 1
if sys.platform.startswith("linux"):
    import ctypes

    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved now, not in the forked child
else:  # pragma: no cover - the parent-death signal is a Linux feature
    _prctl = None


async def ready_or_exit(proc: ChildProcess, ready_line: trio.Event, timeout_s: float, what: str) -> None:
    """Wait until the child printed its ready line or exited; WorkerFailed after ``timeout_s``."""
    with trio.move_on_after(timeout_s) as scope:
        async with trio.open_nursery() as race:
            async def died() -> None:
                await proc.wait()
                race.cancel_scope.cancel()

            async def readied() -> None:
                await ready_line.wait()
                race.cancel_scope.cancel()

            race.start_soon(died)
            race.start_soon(readied)
    if scope.cancelled_caught:
        raise WorkerFailed(f"{what} was not ready within {timeout_s:g} s")


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM me when my parent thread dies."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ChildProcess:
    """A subprocess spawned from the trio thread itself, awaited through a pidfd.

    trio.lowlevel.open_process forks from a worker thread, and Linux delivers
    the parent-death signal when the *thread* that forked exits -- trio's idle
    threads exit after seconds, killing a healthy worker. Forking here, from
    the thread that runs the daemon, ties the worker's life to the daemon's:
    a daemon killed with SIGKILL leaves no orphan worker holding the model.
    Its own session keeps a terminal's Ctrl-C away from the worker; the daemon
    stops it in order.
    """

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid
        assert popen.stdout is not None and popen.stderr is not None   # spawn() pipes both
        self.stdout = trio.lowlevel.FdStream(os.dup(popen.stdout.fileno()))
        self.stderr = trio.lowlevel.FdStream(os.dup(popen.stderr.fileno()))
        popen.stdout.close()
        popen.stderr.close()

    @classmethod
    def spawn(cls, cmd: list[str], env: dict[str, str]) -> ChildProcess:
        popen = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_die_with_parent)
        return cls(popen)

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    async def wait(self) -> int:
        while self.popen.poll() is None:
            try:
                pidfd = os.pidfd_open(self.pid)
            except ProcessLookupError:
                continue  # exited between poll() and pidfd_open(): poll() reaps it
            try:
                await trio.lowlevel.wait_readable(pidfd)
            finally:
                os.close(pidfd)
        return self.popen.returncode

    def send_signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


async def stop_child(proc: ChildProcess, *, close_pipes: bool = True) -> None:
    """SIGTERM (the worker drains), SIGKILL after STOP_GRACE_S; always reaps (and closes the pipes)."""
    try:
        if proc.returncode is None:
            proc.terminate()
            with trio.move_on_after(STOP_GRACE_S):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    finally:
        if close_pipes:
            await _close_pipes(proc)


async def _close_pipes(proc: ChildProcess) -> None:
    await proc.stdout.aclose()
    await proc.stderr.aclose()
