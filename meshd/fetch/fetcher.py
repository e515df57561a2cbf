"""One fetch: every provider in parallel, each chunk checked on arrival, written in place, resumable.

    Fetch(manifest, sink, wanted)          sink: a store.Target (disk) or a MemorySink (BLOBs)
      .add_provider(Provider)              any time, from any thread: a thread per provider
      .run(stop)                           until every chunk is verified, or ``stop`` is set
      .progress()                          bytes, rate, ETA, peers, blamed (meshd status)

Per provider, one thread owns one link (links.py) and loops: take runs from
the scheduler (sans-I/O core, scheduler.py) to keep ``PIPELINE_DEPTH``
requests in flight, read each chunk, hash it (outside the lock: hashlib and
the socket release the GIL, so providers hash in parallel), write it to its
final place, then count it under the lock. The first chunk that fails its
hash ends that provider: it is blamed (the ``on_blame`` callback logs it and
the daemon never asks it again for this model), its unfinished runs go back
to the others. A transport failure backs the provider off and retries; a
protocol violation drops it.

When no provider can supply what is missing (all blamed, dropped, or none
holds it), ``run`` waits for ``add_provider`` (the daemon keeps looking in
the DHT) rather than failing; ``stop`` ends it (the daemon's cancellation).

Threads: one ThreadGroup per ``run`` (proto/threads.py), a thread per
provider started by ``add_provider`` while ``run`` is active; ``run`` closes
the group before it returns (every thread joined, also on stop or error;
a thread blocked on its socket ends within the link's timeouts).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from meshd.fetch import wire
from meshd.fetch.links import CONNECT_TIMEOUT_S, IO_TIMEOUT_S, Link, LinkError, NotHeld
from meshd.fetch.scheduler import Run, Scheduler
from proto.errors import MeshdError, ProtocolError
from proto.threads import ThreadGroup
from shard.model.manifest import Manifest

log = logging.getLogger(__name__)

__all__ = ["Fetch", "Provider", "MemorySink", "WAIT_S"]

# A provider thread with nothing to do looks again after this (work comes back when
# another provider fails; the condition wakes it sooner).
WAIT_S = 0.5
# A provider thread told to stop ends between chunks, or when its blocking connect / read / send
# times out: the group's join waits that long (and a margin) before it names a thread left.
JOIN_TIMEOUT_S = CONNECT_TIMEOUT_S + IO_TIMEOUT_S + 5.0
# Rate and ETA: bytes over the last window of this many seconds.
RATE_WINDOW_S = 5.0


@dataclass(frozen=True, slots=True)
class Provider:
    peer: str
    connect: Callable[[], Link]              # -> a link (links.TlsLink / LocalLink), not yet connected
    entries: frozenset[int] | None = None    # what it holds (None: all)
    local: bool = False


class MemorySink:
    """Chunks of BLOB entries gathered in memory (the metadata a node needs before planning)."""

    def __init__(self, manifest: Manifest, entries: list[int]) -> None:
        self.manifest = manifest
        self.data = {i: bytearray(manifest.entries[i].size) for i in entries}
        self.marked: set[tuple[int, int]] = set()

    def put(self, entry: int, chunk: int, data) -> None:
        off, length = self.manifest.chunk_span(entry, chunk)
        self.data[entry][off:off + length] = data

    def mark(self, entry: int, chunk: int) -> None:
        self.marked.add((entry, chunk))

    def verified(self, entry: int, chunk: int) -> bool:
        return (entry, chunk) in self.marked

    def result(self) -> dict[int, bytes]:
        return {i: bytes(d) for i, d in self.data.items()}


@dataclass(slots=True)
class _Peer:
    provider: Provider
    started: bool = False
    link: Link | None = None
    state: str = "starting"
    detail: str = ""


@dataclass(slots=True)
class _Window:
    samples: deque = field(default_factory=deque)

    def add(self, t: float, total: int) -> None:
        self.samples.append((t, total))
        while len(self.samples) > 2 and t - self.samples[0][0] > RATE_WINDOW_S:
            self.samples.popleft()

    def rate(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self.samples[0], self.samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


class Fetch:
    def __init__(self, manifest: Manifest, sink, wanted: list[tuple[int, int]],
                 verified: Sequence[tuple[int, int]] = (), *, label: str = "",
                 on_blame: Callable[[str, str, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, run_bytes: int = wire.RUN_BYTES) -> None:
        self.manifest, self.sink, self.label = manifest, sink, label
        self.sched = Scheduler(manifest, wanted, verified, run_bytes=run_bytes)
        self.cond = threading.Condition()
        self.clock = clock
        self.on_blame = on_blame
        self.peers: dict[str, _Peer] = {}
        self.stop = threading.Event()
        self.running = False
        self.threads: ThreadGroup | None = None   # the providers' threads while ``run`` is active
        self.started = clock()
        self.window = _Window()
        self.errors: list[str] = []

    # ------------------------------------------------------------------ providers
    def add_provider(self, provider: Provider) -> None:
        with self.cond:
            if provider.peer in self.peers:
                return
            self.sched.add_provider(provider.peer, provider.entries)
            peer = _Peer(provider)
            self.peers[provider.peer] = peer
            if self.running:
                self._start(peer)
            self.cond.notify_all()

    def _start(self, peer: _Peer) -> None:
        if self.threads is not None and not peer.started:
            self.threads.start(self._loop, peer, name=peer.provider.peer[:12])
            peer.started = True

    @property
    def blamed(self) -> list[str]:
        with self.cond:
            return self.sched.blamed

    # ------------------------------------------------------------------ driving
    def run(self, stop: threading.Event | None = None) -> bool:
        """Fetch until done (True) or ``stop`` / ``self.stop`` is set (False). Joins every thread."""
        stop = stop or self.stop
        threads = ThreadGroup(f"fetch-{self.label or 'run'}"[:40], join_timeout_s=JOIN_TIMEOUT_S)
        with self.cond:
            self.running, self.threads = True, threads
            self.started = self.clock()
            for peer in self.peers.values():
                self._start(peer)
        try:
            with self.cond:
                while not self.sched.done and not stop.is_set():
                    self.cond.wait(WAIT_S)
                return self.sched.done
        finally:
            self.stop.set()
            with self.cond:
                self.cond.notify_all()
            try:
                threads.close()
            except Exception as exc:  # noqa: BLE001 - a provider thread's bug: logged, the fetch's verdict stands
                log.error("fetch %s: a provider thread failed: %r", self.label, exc)
                self.errors.append(f"provider thread: {exc!r}"[:300])
            with self.cond:
                self.running, self.threads = False, None
                for peer in self.peers.values():
                    peer.started = False

    def _loop(self, peer: _Peer) -> None:
        p = peer.provider
        link = peer.link = p.connect()
        pending: deque[Run] = deque()
        sent = 0
        try:
            while not self.stop.is_set():
                with self.cond:
                    if self.sched.done or not self.sched.usable(p.peer):
                        return
                    while len(pending) < wire.PIPELINE_DEPTH:
                        run = self.sched.next_run(p.peer, self.clock())
                        if run is None:
                            break
                        pending.append(run)
                    if not pending:
                        peer.state = "idle"
                        self.cond.wait(WAIT_S)
                        continue
                peer.state = "fetching"
                try:
                    while sent < len(pending):
                        link.send(pending[sent])
                        sent += 1
                    run = pending[0]
                    if not self._receive(peer, link, run):
                        return                                   # blamed
                    pending.popleft()
                    sent -= 1
                except NotHeld as exc:
                    with self.cond:
                        self.sched.not_held(p.peer, pending.popleft())
                        sent -= 1
                        peer.detail = str(exc)
                        self.cond.notify_all()
                except LinkError as exc:
                    link.close()
                    with self.cond:
                        for r in pending:
                            self.sched.run_failed(p.peer, r, self.clock(), str(exc))
                        pending.clear()
                        sent = 0
                        peer.state, peer.detail = "retrying", str(exc)
                        self.cond.notify_all()
                    log.info("fetch %s: %s", self.label, exc)
                except (ProtocolError, MeshdError) as exc:      # a broken peer (incl. a certificate mismatch)
                    with self.cond:
                        self.sched.drop(p.peer)
                        pending.clear()
                        peer.state, peer.detail = "dropped", str(exc)
                        self.errors.append(f"{p.peer[:16]}: {exc}")
                        self.cond.notify_all()
                    log.warning("fetch %s: dropping %s: %s", self.label, p.peer[:16], exc)
                    return
        finally:
            link.close()
            with self.cond:
                for r in pending:
                    self.sched.run_failed(p.peer, r, self.clock(), "stopped")
                if peer.state not in ("blamed", "dropped"):
                    peer.state = "done" if self.sched.done else "stopped"
                self.cond.notify_all()

    def _receive(self, peer: _Peer, link, run: Run) -> bool:
        """Read, check, write and count the run's chunks; False when a chunk was bad (blamed)."""
        m, p = self.manifest, peer.provider
        for chunk, data in link.receive(run, m):
            if self.stop.is_set():
                raise LinkError("stopped")
            if not m.chunk_ok(run.entry, chunk, data):
                with self.cond:
                    self.sched.chunk_bad(p.peer, run.entry, chunk)
                    peer.state = "blamed"
                    peer.detail = f"chunk {chunk} of {m.entries[run.entry].name} failed its hash"
                    self.cond.notify_all()
                log.warning("fetch %s: chunk %d of %s from %s does not match the root: %s blamed, never asked "
                            "again for this model; fetching it elsewhere", self.label, chunk,
                            m.entries[run.entry].name, p.peer[:16], p.peer[:16])
                if self.on_blame is not None:
                    self.on_blame(p.peer, m.entries[run.entry].name, chunk)
                return False
            self.sink.put(run.entry, chunk, data)
            with self.cond:
                self.sched.chunk_ok(p.peer, run.entry, chunk)
                self.sink.mark(run.entry, chunk)
                self.window.add(self.clock(), self.sched.verified_bytes)
                if self.sched.done:
                    self.cond.notify_all()
        return True

    # ------------------------------------------------------------------ status
    def progress(self) -> dict:
        with self.cond:
            s = self.sched
            rate = self.window.rate()
            left = s.total_bytes - s.verified_bytes
            return {
                "label": self.label, "bytes_done": s.verified_bytes, "bytes_total": s.total_bytes,
                "bytes_resumed": s.resumed_bytes, "rate_mb_s": round(rate / 1e6, 1),
                "eta_s": round(left / rate, 1) if rate > 0 else None,
                "elapsed_s": round(self.clock() - self.started, 1),
                "peers": {pid: {"state": p.state, "bytes": s.providers[pid].bytes, "detail": p.detail[:200]}
                          for pid, p in self.peers.items()},
                "blamed": s.blamed, "done": s.done, "stuck": s.stuck(),
            }

    def received_bytes(self) -> int:
        """Bytes read from peers' links (reply heads and chunks: what crossed the network)."""
        with self.cond:
            return sum(getattr(p.link, "received", 0) for p in self.peers.values() if not p.provider.local)
