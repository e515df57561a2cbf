"""Start and stop ``meshd worker`` subprocesses (tests and benchmarks).

The child runs ``[sys.executable, "-m", "meshd", "worker", ...]`` with a
PYTHONPATH that starts at this checkout's root (computed from ``__file__``),
so a clean clone works without an install. Readiness is the worker's
``--ready-file`` (written once its capability is validated); the wait is
bounded and fails early if the child exits. ``stop()`` sends SIGTERM, then
SIGKILL after a grace period, to that one process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Loading SmolLM2 on a busy 2-core machine can take a minute; never wait forever.
READY_TIMEOUT_S = 300.0
STOP_GRACE_S = 10.0
POLL_S = 0.05


def child_env(threads: int | None = None) -> dict[str, str]:
    """The environment of a child of this checkout: PYTHONPATH from its root, unbuffered output,
    no model hub, and (when given) ``threads`` torch/BLAS threads."""
    env = dict(os.environ)
    inherited = (p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *inherited])
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def stop_process(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> int | None:
    """SIGTERM, then SIGKILL after ``grace_s``; the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace_s)
    return proc.returncode


@dataclass
class WorkerProcess:
    proc: subprocess.Popen
    endpoint: str
    pid: int
    tls_endpoint: str | None = None
    unix_endpoint: str | None = None
    frames_endpoint: str | None = None      # the framed fast path (TLS), with --frames-listen

    def stop(self) -> int:
        return stop_process(self.proc)


@dataclass
class PendingWorker:
    proc: subprocess.Popen
    ready: Path
    layers: str

    def wait(self, timeout_s: float = READY_TIMEOUT_S) -> WorkerProcess:
        deadline = time.monotonic() + timeout_s
        try:
            while not self.ready.exists():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker {self.layers} exited with {self.proc.returncode} before it was ready")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {self.layers} not ready after {timeout_s:.0f}s")
                time.sleep(POLL_S)
            info = json.loads(self.ready.read_text())
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            if self.ready.exists():
                self.ready.unlink()
            self.ready.parent.rmdir()
        return WorkerProcess(proc=self.proc, endpoint=info["listen"], pid=info["pid"],
                             tls_endpoint=info.get("tls_listen"), unix_endpoint=info.get("unix"),
                             frames_endpoint=info.get("frames_tls"))


def start_worker(model: str | os.PathLike, layers: str, *, dtype: str = "float32", threads: int = 2,
                 extra: Sequence[str] = (), stderr=None) -> PendingWorker:
    """Start ``meshd worker``; call ``.wait()`` for the ready WorkerProcess."""
    ready = Path(tempfile.mkdtemp(prefix="meshd-worker-")) / "ready.json"
    cmd = [sys.executable, "-m", "meshd", "worker", "--model", str(model), "--layers", layers,
           "--listen", "127.0.0.1:0", "--dtype", dtype, "--threads", str(threads),
           "--ready-file", str(ready), *extra]
    proc = subprocess.Popen(cmd, env=child_env(threads), stdout=subprocess.DEVNULL,
                            stderr=stderr if stderr is not None else subprocess.DEVNULL)
    return PendingWorker(proc, ready, layers)


def spawn_workers(model: str | os.PathLike, layer_specs: Sequence[str], **kwargs) -> list[WorkerProcess]:
    """Start several workers at once (they load in parallel) and wait for all."""
    pending = [start_worker(model, spec, **kwargs) for spec in layer_specs]
    ready: list[WorkerProcess] = []
    try:
        for p in pending:
            ready.append(p.wait())
    except BaseException:
        for w in ready:
            w.stop()
        for p in pending[len(ready):]:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        raise
    return ready


def spawn_worker(model: str | os.PathLike, layers: str, **kwargs) -> WorkerProcess:
    return start_worker(model, layers, **kwargs).wait()
