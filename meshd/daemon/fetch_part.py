"""The daemon's fetch part: the fetch port (what we hold, served to peers) and fetching our range.

    FetchPart.run  (child of the daemon's nursery; meshd/daemon/node.py starts it)
    ├── the fetch port       meshd/fetch/server.py (its threads; stopped and joined on exit)
    └── provider refresh     while a fetch runs: the model's records from the DHT every
                             PROVIDERS_REFRESH_S -> the providers the fetch may ask

    serve_path(path)         a model file / slice / directory we hold -> served (checked first)
    describe()               --model ROOT: the manifest and metadata (store, else peers)
    ensure(range) -> Path    --model ROOT: a finished slice holding ``range`` (fetched if needed)

Who we ask: every live record of the model with a fetch port and a pin,
except us and the peers that ever sent a chunk failing its hash (the store
keeps them per model: never asked again), for the entries of the layers
its record says it holds; and our own holdings first (a LOAD of a new
range copies what we already hold). Uploads run at ``upload_bytes_per_s``,
and at ``upload_busy_bytes_per_s`` while our worker has sessions.

Blocking work (hashing, the fetch's threads) runs through ``_blocking``: a
thread trio waits for, with a ``threading.Event`` set when trio cancels us,
so a cancelled fetch stops within a moment and every thread is joined.

State: the holdings and the server, the store of the model we fetch, the
current fetch (``meshd status`` shows its progress), what we last fetched.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from meshd.fetch.facts import ModelFacts, meta_entries, model_facts, range_entries
from meshd.fetch.fetcher import Provider
from meshd.fetch.flow import RangeFetch, get_manifest, get_meta
from meshd.fetch.holdings import Holdings, part_source, source_of_path
from meshd.fetch.links import LocalLink, TlsLink
from meshd.fetch.server import ChunkServer
from meshd.fetch.store import ModelStore
from meshd.reach.tls import split_endpoint
from meshd.swarm.view import SwarmSnapshot, fetch_snapshot
from shard.model.backend import LayerRange
from shard.model.manifest import KIND_GGUF, Manifest, parse_root

log = logging.getLogger(__name__)

# The model's records are read this often while a fetch waits for or uses providers.
PROVIDERS_REFRESH_S = 3.0
# A progress line on stderr at most this often while fetching.
PROGRESS_EVERY_S = 2.0


def wall_ms() -> int:
    return int(time.time() * 1000)


async def _blocking(fn: Callable[[threading.Event], Any]) -> Any:
    """Run ``fn(stop)`` in a thread; trio's cancellation sets ``stop`` and waits for the thread."""
    stop = threading.Event()
    result: list[Any] = []

    async def worker() -> None:
        result.append(await trio.to_thread.run_sync(fn, stop))
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker)
        try:
            await trio.sleep_forever()
        finally:
            stop.set()
    return result[0]


class FetchPart:
    def __init__(self, node) -> None:
        self.node = node
        self.config = node.config
        self.holdings = Holdings()
        self.server: ChunkServer | None = None
        self.port = 0
        self.root: str | None = self.config.model_root
        self.store = ModelStore(self.config.data_dir, self.root) if self.root else None
        self.manifest: Manifest | None = None
        self.meta: dict[int, bytes] = {}
        self.facts: ModelFacts | None = None
        self.held: tuple[int, int] | None = None         # what our record says we can serve
        self.current: RangeFetch | None = None
        self.last: dict = {}
        self._providers: list[Provider] = []
        self._snapshot: SwarmSnapshot | None = None
        self._fetching = 0
        self._wake = trio.Event()

    # ------------------------------------------------------------------ life
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        tls = self.node.tls
        self.server = ChunkServer(self.holdings, str(tls.cert_path), str(tls.key_path), self.node.tls_bind_host,
                                  rate=self.upload_rate)
        self.port = self.server.start()
        try:
            task_status.started()
            while True:
                if self._fetching and self.root:
                    await self._refresh_providers()
                    with trio.move_on_after(PROVIDERS_REFRESH_S):
                        await self._wake.wait()
                else:
                    await self._wake.wait()
                self._wake = trio.Event()
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await trio.to_thread.run_sync(self.server.stop)
                except Exception as exc:  # noqa: BLE001 - a thread left or failed: a bug, logged; the daemon leaves
                    log.error("fetch port: stopping: %r", exc)
                finally:
                    self.holdings.close()

    @property
    def endpoint(self) -> str:
        """Our fetch port as peers dial it (what the record carries), or "" when we serve nothing."""
        if not self.port or not self.holdings.roots():
            return ""
        return f"{self.node.advertise_host}:{self.port}"

    def upload_rate(self) -> float:
        sup = self.node.supervisor
        busy = sup is not None and int(sup.state.health.get("active_sessions", 0) or 0) > 0
        return float(self.config.upload_busy_bytes_per_s if busy else self.config.upload_bytes_per_s)

    def artifact_sha256(self) -> str:
        if self.manifest is not None and self.manifest.kind == KIND_GGUF and self.manifest.files:
            return "sha256:" + self.manifest.files[0].sha256.hex()
        return ""

    # ------------------------------------------------------------------ serving what we hold
    async def serve_path(self, path: Path) -> None:
        """Serve a model file or directory we hold (its bytes checked against its root first)."""
        try:
            source = await trio.to_thread.run_sync(source_of_path, path, self.node.progress)
        except Exception as exc:  # noqa: BLE001 - serving our copy to peers is optional; the worker reports a bad file
            self.node.progress(f"fetch port: not serving {path.name}: {exc}")
            return
        self.holdings.add(source)
        if self.manifest is None:
            self.manifest = source.manifest
        if source.held is not None:
            self.held = source.held if self.held is None else (min(self.held[0], source.held[0]),
                                                               max(self.held[1], source.held[1]))
        self.node.refresh_claim()

    def held_for_claim(self, serving: tuple[int, int]) -> tuple[int, int] | None:
        """The layers our record offers: what we hold, if it covers what we serve (else what we serve)."""
        if self.held is not None and self.held[0] <= serving[0] and serving[1] <= self.held[1]:
            return self.held
        return serving if self.holdings.roots() else None

    # ------------------------------------------------------------------ providers
    async def _refresh_providers(self) -> None:
        if self.root is None:
            return
        try:
            snap = await fetch_snapshot(self.node.dht, self.root, wall_ms())
        except Exception as exc:  # noqa: BLE001 - the DHT may be briefly unreachable; try again next time
            log.info("fetch: reading the model's records failed: %s", exc)
            return
        self.update(snap)

    def update(self, snap: SwarmSnapshot) -> None:
        """The providers the model's live records name (called with every fresh snapshot)."""
        self._snapshot = snap
        me = self.node.identity.peer_id
        blamed = self.store.blamed() if self.store is not None else set()
        root = parse_root(self.root) if self.root else b""
        out: list[Provider] = []
        if self.root and self.holdings.sources(root):
            out.append(Provider("local", lambda: LocalLink(self.holdings, root), None, local=True))
        for ad in snap.ads:
            endpoint, pin = snap.fetch.get(ad.peer_id), snap.pins.get(ad.peer_id)
            if ad.peer_id == me or ad.peer_id in blamed or not endpoint or not pin or ad.held is None:
                continue
            try:
                split_endpoint(endpoint)
            except Exception:  # noqa: BLE001 - a malformed endpoint in someone's record: skip that peer
                continue
            out.append(Provider(ad.peer_id, _tls_factory(ad.peer_id, endpoint, pin, root),
                                self._entries_of(ad.held.start, ad.held.end, ad.num_layers)))
        self._providers = out

    def _entries_of(self, start: int, end: int, num_layers: int) -> frozenset[int] | None:
        if self.manifest is None or self.facts is None or num_layers != self.facts.num_layers:
            return None        # unknown yet: anything may be asked (a NOT_HELD answer narrows it)
        held = range_entries(self.manifest, self.facts, LayerRange(start, end, num_layers))
        return frozenset(held) | frozenset(meta_entries(self.manifest))

    def providers(self) -> list[Provider]:
        return list(self._providers)

    def _on_blame(self, peer: str, entry: str, chunk: int) -> None:
        if self.store is not None:
            self.store.blame(peer)
        self.node.progress(f"fetch: chunk {chunk} of {entry} from {peer[:16]} failed its hash: {peer[:16]} is "
                           "blamed and never asked again for this model; fetching it elsewhere")

    # ------------------------------------------------------------------ --model ROOT
    async def describe(self) -> ModelFacts:
        """The model's manifest, metadata and facts (from our store, else from peers); serves what we hold."""
        store, root = self.store, self.root
        assert store is not None and root is not None, "describe() is for --model ROOT"
        self._fetching += 1
        self._wake.set()
        try:
            self.node.progress(f"model {root[:23]}...: its manifest and metadata (from our store, or peers "
                               "found in the DHT)")
            manifest = self.manifest = await _blocking(lambda stop: get_manifest(store, self.providers, stop,
                                                                                 self.node.progress))
            self.meta = await _blocking(lambda stop: get_meta(store, manifest, self.providers, stop,
                                                              self._on_blame))
        finally:
            self._fetching -= 1
        self.facts = model_facts(manifest, self.meta)
        for _, path in store.finished(manifest):
            await self.serve_path(path)
        return self.facts

    def prefer(self) -> tuple[int, int] | None:
        """The largest range we already hold (the tracker prefers to give it to us)."""
        if self.store is None or self.manifest is None:
            return None
        held = self.store.finished(self.manifest)
        if not held:
            return None
        best = max(held, key=lambda rp: rp[0].count)[0]
        return best.start, best.end

    async def ensure(self, layers: tuple[int, int]) -> Path:
        """A finished slice holding ``layers``: ours already, or fetched now (from every provider)."""
        assert self.store is not None and self.manifest is not None and self.facts is not None
        layer_range = LayerRange(layers[0], layers[1], self.facts.num_layers)
        path = self.store.holding(self.manifest, layer_range)
        if path is not None:
            return path
        rf = RangeFetch(self.store, self.manifest, self.meta, layer_range, on_blame=self._on_blame)
        fetch = await trio.to_thread.run_sync(rf.open)
        part = part_source(rf.target, self.meta)
        self.holdings.add(part)                 # peers may fetch what we verified already (swarming)
        self.current = rf
        self._fetching += 1
        self._wake.set()
        if rf.resumed_chunks:
            self.node.progress(f"fetch layers {layers[0]}:{layers[1]}: resuming, {rf.resumed_chunks} chunks "
                               f"({fetch.sched.resumed_bytes / 1e6:.1f} MB) already verified on disk")
        started = time.monotonic()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._report, rf)
                path = await _blocking(lambda stop: rf.run(self.providers, stop))
                nursery.cancel_scope.cancel()
        finally:
            self._fetching -= 1
            self.holdings.remove(part)
            self.current = None
        p = fetch.progress()
        took = time.monotonic() - started
        self.last = {"layers": list(layers), "bytes": p["bytes_total"], "resumed_bytes": p["bytes_resumed"],
                     "network_bytes": fetch.received_bytes(), "seconds": round(took, 1),
                     "peers": {k: v["bytes"] for k, v in p["peers"].items()}, "blamed": p["blamed"], "path": str(path)}
        self.node.progress(f"fetch layers {layers[0]}:{layers[1]}: done, {p['bytes_total'] / 1e6:.1f} MB verified "
                           f"in {took:.1f} s ({fetch.received_bytes() / 1e6:.1f} MB from peers, "
                           f"{p['bytes_resumed'] / 1e6:.1f} MB resumed) -> {path.name}")
        await self.serve_path(path)
        return path

    async def _report(self, rf: RangeFetch) -> None:
        while True:
            await trio.sleep(PROGRESS_EVERY_S)
            fetch = rf.fetch
            if fetch is None:
                continue
            p = fetch.progress()
            active = [k[:8] for k, v in p["peers"].items() if v["state"] == "fetching"]
            known = len(p["peers"])
            eta = f", ETA {p['eta_s']:.0f} s" if p["eta_s"] is not None else ""
            waiting = " (waiting for a provider)" if p["stuck"] or not p["peers"] else ""
            self.node.progress(f"fetch {p['label']}: {p['bytes_done'] / 1e6:.1f} of {p['bytes_total'] / 1e6:.1f} MB "
                               f"({p['bytes_done'] * 100 // max(1, p['bytes_total'])}%), {p['rate_mb_s']} MB/s{eta}, "
                               f"peers {len(active)} of {known}: {' '.join(active)}{waiting}")

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        holds = []
        for root in self.holdings.roots():
            for s in self.holdings.sources(root):
                holds.append({"root": "merkle:" + root.hex(), "what": s.label,
                              "layers": list(s.held) if s.held else None, "fetching": s.verified is not None})
        out: dict = {"endpoint": self.endpoint, "holds": holds,
                     "upload_limit_mb_s": round(self.upload_rate() / 1e6, 1) or "unlimited",
                     "server": self.server.status() if self.server else {}}
        if self.root:
            out["root"] = self.root
            out["blamed"] = sorted(self.store.blamed()) if self.store else []
        if self.current is not None and self.current.fetch is not None:
            out["fetching"] = self.current.fetch.progress()
        if self.last:
            out["last_fetch"] = self.last
        return out


def _tls_factory(peer: str, endpoint: str, pin: bytes, root: bytes) -> Callable[[], TlsLink]:
    return lambda: TlsLink(peer, endpoint, pin, root)
