"""A swarm of real ``meshd join`` daemons on loopback (``meshd demo``, benchmarks, slow tests).

Each ``LocalDaemon`` is a subprocess ``python -m meshd join --layers auto``
(or a fixed range) with its own data dir under one root, listening on
127.0.0.1 with an OS-chosen port; the first one is every other's bootstrap
peer. Every worker gets ``--threads 1`` unless told otherwise (``THREADS``):
several daemons share this machine's cores fairly, and each decode step
computes on one core like the single-threaded reference beside them. Its
workers are its children (they die with it). ``LocalSwarm.close``
stops every daemon it started -- SIGTERM, then SIGKILL after a grace period
-- so nothing outlives the caller.

Blocking code (subprocess + the control socket); bounded waits only.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from meshd.daemon.control import request, stream_events
from proto.errors import MeshdError

REPO_ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.25
STOP_GRACE_S = 15.0
# The demo's swarm (``meshd demo``, ``meshd bench swarm``): three joiners, and a
# KV budget per node that a short answer fills little, which keeps each node's
# declared memory (weights + KV) modest.
DEMO_NODES = 3
DEMO_KV_TOKENS = 1024
# Compute threads per worker in a local swarm (see the module docstring).
THREADS = 1
T = TypeVar("T")


class SwarmTimeout(MeshdError):
    """A local swarm did not reach a state in time; the message carries the daemon's log tail."""


def child_env(torch_threads: int = THREADS) -> dict[str, str]:
    """The environment of a daemon of this checkout: PYTHONPATH from its root (a clean clone runs
    without an install), unbuffered output, no model hub, ``torch_threads`` torch/BLAS threads."""
    env = dict(os.environ)
    paths = [str(REPO_ROOT), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(torch_threads)
    return env


class LocalDaemon:
    def __init__(self, root: Path, name: str, model: Path, *, layers: str | None = "auto", memory: int | None = None,
                 bootstrap: str | None = None, record_ttl_s: float = 8.0, kv_budget_tokens: int | None = None,
                 threads: int = THREADS, backend: str | None = None, extra: tuple[str, ...] = ()) -> None:
        self.name = name
        self.data_dir = root / name
        self.log = root / f"{name}.log"
        args = [sys.executable, "-m", "meshd", "join", "--model", str(model),
                *(["--layers", layers] if layers else []),   # None: an expert peer (extra has --experts)
                "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(self.data_dir),
                "--record-ttl", str(record_ttl_s), "--api-listen", "127.0.0.1:0", "--threads", str(threads), *extra]
        if backend is not None:
            args += ["--backend", backend]
        if memory is not None:
            args += ["--memory", str(memory)]
        if kv_budget_tokens is not None:
            args += ["--kv-budget-tokens", str(kv_budget_tokens)]
        if bootstrap:
            args += ["--bootstrap", bootstrap]
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(args, cwd=REPO_ROOT, env=child_env(threads), stdout=self._log_file,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def control_socket(self) -> Path:
        return self.data_dir / "control.sock"

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def address(self, timeout_s: float = 60.0) -> str:
        def find():
            m = re.search(r"listening on (\S+/p2p/\S+)", self.text())
            return m.group(1) if m else None
        return wait_for(find, f"{self.name}'s libp2p address", timeout_s, self)

    def api_url(self, timeout_s: float = 60.0) -> str:
        """The base URL of this daemon's HTTP API (it listens on a free loopback port)."""
        def find():
            m = re.search(r"api: serving (http://\S+)", self.text())
            return m.group(1) if m else None
        return wait_for(find, f"{self.name}'s API address", timeout_s, self)

    def query(self, op: str) -> dict | None:
        try:
            return request(self.control_socket, op, timeout_s=30.0)
        except (MeshdError, OSError, ValueError):
            return None

    def swarm(self) -> dict | None:
        return self.query("swarm")

    def generate(self, prompt: str, **params) -> Iterator[dict]:
        yield from stream_events(self.control_socket, {"op": "generate", "prompt": prompt, **params})

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_GRACE_S) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self._log_file.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: no withdrawal, no goodbye (its worker follows within its 1 s shutdown grace)."""
        self.stop(signal.SIGKILL)

    def worker_pids(self) -> list[int]:
        """The daemon's children (its worker)."""
        kids: list[int] = []
        try:
            for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
                kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
        return kids

    def kill_node(self) -> float:
        """SIGKILL the daemon and its worker at once: the machine is gone (no grace anywhere).
        Returns the monotonic time of the first SIGKILL (what a recovery time counts from)."""
        pids = self.worker_pids()
        killed_at = time.monotonic()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.kill()
        return killed_at


def wait_for(fn: Callable[[], T | None], what: str, timeout_s: float, daemon: LocalDaemon | None = None) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        got = fn()
        if got:
            return got
        if daemon is not None and not daemon.alive():
            raise SwarmTimeout(f"{daemon.name} exited while waiting for {what}:\n{daemon.text()[-3000:]}")
        if time.monotonic() >= deadline:
            tail = f"\n{daemon.name} log:\n{daemon.text()[-3000:]}" if daemon is not None else ""
            raise SwarmTimeout(f"timed out after {timeout_s:g} s waiting for {what}{tail}")
        time.sleep(POLL_S)


class LocalSwarm:
    def __init__(self, root: Path, model: Path, *, record_ttl_s: float = 8.0, kv_budget_tokens: int | None = None,
                 extra: tuple[str, ...] = (), threads: int = THREADS, backend: str | None = None):
        """``extra``: more ``meshd join`` flags for every daemon (e.g. ``("--experts", ...)``)."""
        self.root, self.model = root, model
        self.record_ttl_s, self.kv_budget_tokens, self.extra = record_ttl_s, kv_budget_tokens, tuple(extra)
        self.threads, self.backend = threads, backend
        self.daemons: list[LocalDaemon] = []
        self.bootstrap: str | None = None

    def add(self, *, memory: int | None = None, layers: str | None = "auto", name: str | None = None,
            model: Path | None = None, extra: tuple[str, ...] = ()) -> LocalDaemon:
        """Start a daemon; ``model`` overrides the swarm's file (e.g. a GGUF slice of it),
        ``extra`` adds join flags to the swarm's own."""
        d = LocalDaemon(self.root, name or f"node{len(self.daemons)}", model or self.model, layers=layers,
                        memory=memory, bootstrap=self.bootstrap, record_ttl_s=self.record_ttl_s,
                        kv_budget_tokens=self.kv_budget_tokens, threads=self.threads, backend=self.backend,
                        extra=(*self.extra, *extra))
        self.daemons.append(d)
        if self.bootstrap is None:
            self.bootstrap = d.address()
        return d

    def wait_serving(self, daemon: LocalDaemon, timeout_s: float) -> dict:
        """Until ``daemon`` advertises its range and another daemon sees it."""
        def ready():
            v = daemon.swarm()
            return v if v and v.get("serving") and v.get("layers") else None
        view = wait_for(ready, f"{daemon.name} serving", timeout_s, daemon)
        return view

    def wait_covered(self, timeout_s: float, *, peers: int | None = None, via: LocalDaemon | None = None) -> dict:
        via = via or self.daemons[0]

        def covered():
            v = via.swarm()
            if not v or not v.get("coverage") or not v["coverage"]["fully_covered"]:
                return None
            return v if peers is None or len(v["ads"]) >= peers else None
        return wait_for(covered, "full coverage" + (f" by {peers} peers" if peers else ""), timeout_s, via)

    def close(self) -> None:
        for d in self.daemons:
            if d.alive():
                d.proc.send_signal(signal.SIGTERM)
        for d in self.daemons:
            d.stop()

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
