"""The daemon's API part: the entry (admission, metrics) and the HTTP server, wired to the node.

    ApiPart.run  (child of the daemon's nursery; meshd/daemon/node.py starts it)
    ├── serve_api   Hypercorn on this loop (meshd/api/server.py), app from meshd/api/app.py,
    │               over the connection slots (meshd/api/connections.py; their counts in meshd status)
    ├── PeerWatch   each peer's worker Health every second, liveness (meshd/daemon/peer_watch.py)
    └── model card  the model's files read once (Ollama's /api/show, /api/tags)

``entry`` is the one door of every generation on this node: the HTTP routes
and the control socket's ``generate`` op both go through it, and it calls
the generate core (meshd/generate/service.py ``generate``) on the node's
swarm part. ``status()`` is the dashboard's JSON: the model's coverage
(layers x peers, gaps; a peer the watch found gone no longer counts), every
peer's range and budget from its signed record beside what its worker says
now (RSS, KV, cores, RAM, recent speed, liveness, history), relays and
reachability, the memory shortfall when layers are unserved, our worker's
health and the generations running here and lately with their routes. ``probe()`` feeds the metrics'
node gauges (KV, coverage per layer, tracker role).

The default listen address is forgiving: if 127.0.0.1:8080 is taken (a
second daemon on this host) the node runs without its API and says so; an
address the operator gave must bind, or the daemon does not start.

State: the entry and metrics; a cached swarm snapshot for the status JSON
(the swarm part refreshes its own every few seconds; we read a fresh one at
most every STATUS_REFRESH_S).
"""
from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import trio

from meshd.api import hypercorn_compat
from meshd.api.app import ApiContext, build_app
from meshd.api.connections import ConnectionTable
from meshd.api.entry import Entry, EntryLimits
from meshd.api.metrics import ApiMetrics
from meshd.api.model_card import ModelCard
from meshd.api.server import bind_socket, serve_api
from meshd.daemon.peer_watch import PeerWatch
from meshd.errors import DaemonError
from meshd.generate.service import embed, generate
from meshd.plan.adverts import CoverageMap

# The dashboard polls about every 2 s; a DHT read at most this often.
STATUS_REFRESH_S = 2.0
STATUS_FETCH_TIMEOUT_S = 5.0
# Peers listed in the status JSON (the model index holds at most 128).
MAX_STATUS_PEERS = 128


def wall_ms() -> int:
    return int(time.time() * 1000)


def _relays_of(addrs) -> list[str]:
    """Relay peer ids named in p2p-circuit addresses (/.../p2p/RELAY/p2p-circuit/...)."""
    out = []
    for addr in addrs:
        parts = addr.split("/")
        if "p2p-circuit" in parts:
            i = parts.index("p2p-circuit")
            if i >= 2 and parts[i - 2] == "p2p" and parts[i - 1] not in out:
                out.append(parts[i - 1])
    return out


class ApiPart:
    def __init__(self, node) -> None:
        self.node = node
        api = node.config.api
        self.metrics = ApiMetrics(probe=self.probe)
        self.entry = Entry(self._core, EntryLimits(api.max_running, api.max_deferred, api.deadline_s), self.metrics,
                           embed_core=self._embed_core)
        self.card: ModelCard | None = None     # the model's files, read once (Ollama's /api/show, /api/tags)
        self.watch = PeerWatch(node)           # the peers' health and liveness (meshd/daemon/peer_watch.py)
        self.url: str | None = None
        self.connections = ConnectionTable(api.max_connections)   # the HTTP slots (meshd/api/connections.py)
        self._snap_at = -1e9
        self._snap_lock = trio.Lock()

    async def _core(self, params, send, *, observer=None) -> None:
        swarm = self.node.swarm
        if swarm is None:
            raise DaemonError("this daemon serves no model: nothing to generate with")
        await generate(swarm, params, send, observer=observer)

    async def _embed_core(self, texts, *, truncate: bool, normalize: bool, observer=None):
        swarm = self.node.swarm
        if swarm is None:
            raise DaemonError("this daemon serves no model: nothing to embed with")
        return await embed(swarm, texts, truncate=truncate, normalize=normalize, observer=observer)

    async def _read_card(self) -> None:
        config, swarm = self.node.config, self.node.swarm
        if not config.has_model:
            return
        while swarm is None or not swarm.digest or swarm.tokenizer_path is None:   # the swarm part's to find
            await trio.sleep(0.5)
            swarm = self.node.swarm
        path = swarm.tokenizer_path
        name = Path(config.model).name if config.model is not None else (config.model_name or config.model_root)
        try:
            self.card = await trio.to_thread.run_sync(ModelCard.read, path, name, swarm.digest)
        except Exception as exc:  # noqa: BLE001 - Ollama's model routes then answer 503; generation is unaffected
            self.node.progress(f"api: cannot read the model card of {config.model}: {exc}")

    def loaded(self) -> dict:
        """/api/ps: the model is loaded when every layer is served; its bytes and when its records expire."""
        cmap, ads = self._coverage(), self._live_ads() or []
        if cmap is None or not cmap.fully_covered or self.card is None:
            return {}
        expires = max(a.expires_at_ms for a in ads) / 1000
        held = sum((life.health or {}).get("rss_bytes", 0) for life in self.watch.lives.values() if life.state == "ok")
        return {"size_bytes": held or self.card.size_bytes,
                "expires_at": datetime.fromtimestamp(expires, UTC).isoformat().replace("+00:00", "Z")}

    # ------------------------------------------------------------------ views
    def model(self) -> dict:
        config, swarm = self.node.config, self.node.swarm
        if not config.has_model:
            return {}
        name = Path(config.model).name if config.model is not None else (config.model_name or config.model_root)
        info = {"id": name, "digest": swarm.digest if swarm else None, "root": swarm.digest if swarm else None,
                "sha256": self.node.fetch.artifact_sha256() or None,
                "num_layers": swarm.num_layers if swarm else None,
                "serving": bool(self.node.advertiser.claim), "role": config.role, "coverage": None}
        cmap = self._coverage()
        if cmap is not None:
            info["coverage"] = {"fully_covered": cmap.fully_covered, "counts": list(cmap.counts),
                                "gaps": [[g.start, g.end] for g in cmap.gaps()]}
        return info

    def _live_ads(self, *, with_gone: bool = False):
        """The model's records that have not expired -- without the peers the watch found gone."""
        swarm = self.node.swarm
        snap = swarm.snapshot if swarm is not None else None
        if snap is None:
            return None
        now, gone = wall_ms(), set() if with_gone else self.watch.gone()
        return [a for a in snap.ads if a.expires_at_ms > now and a.peer_id not in gone]

    def _coverage(self) -> CoverageMap | None:
        swarm, ads = self.node.swarm, self._live_ads()
        if swarm is None or ads is None or not swarm.digest or not swarm.num_layers:
            return None
        return CoverageMap.build(ads, model_digest=swarm.digest, num_layers=swarm.num_layers)

    def _on_duty(self) -> tuple[str | None, bool]:
        swarm = self.node.swarm
        if swarm is None or not swarm.digest or swarm.snapshot is None:
            return None, False
        tracker = swarm.tracker(swarm.snapshot, wall_ms())
        return tracker, tracker == self.node.identity.peer_id

    def probe(self) -> dict:
        sup = self.node.supervisor
        health = sup.state.health if sup is not None else {}
        cmap = self._coverage()
        swarm = self.node.swarm
        return {"kv_ratio": health.get("kv_pressure", 0.0), "kv_tokens": health.get("kv_tokens_used", 0),
                "coverage": list(cmap.counts) if cmap is not None else [], "on_duty": self._on_duty()[1],
                "audits": swarm.audit_book.snapshot() if swarm is not None else {}}

    def _peer_view(self, ad, me: str, now: int, snap) -> dict:
        """One peer as the dashboard shows it: its record's claims beside what its worker says now."""
        layers = ad.end - ad.start
        relayed = list(snap.relayed.get(ad.peer_id, ())) if snap is not None else []
        life = self.watch.lives.get(ad.peer_id)
        live: dict[str, Any] = life.view() if life is not None else {
            "state": "unknown", "since_ms": 0, "connected": False, "checked_ms": 0, "health": None, "history": []}
        health = live.pop("health") or {}
        recent_ms = health.get("recent_decode_ms_per_layer") or 0.0
        return {
            "peer_id": ad.peer_id, "start": ad.start, "end": ad.end, "self": ad.peer_id == me,
            "live": live, "memory_budget_bytes": ad.memory_budget_bytes, "rss_bytes": health.get("rss_bytes"),
            "cpu_cores": health.get("cpu_cores"), "machine_memory_bytes": health.get("machine_memory_bytes"),
            "kv_tokens_used": health.get("kv_tokens_used"), "kv_budget_tokens": health.get("kv_budget_tokens"),
            "active_sessions": health.get("active_sessions"), "free_kv_tokens": ad.free_kv_tokens,
            # the record's numbers: one validation pass when the worker started
            "validation": {"decode_ms_per_layer": round(ad.decode_ms_per_layer, 3),
                           "decode_tokens_per_s": round(1000.0 / (ad.decode_ms_per_layer * layers), 1)
                           if ad.decode_ms_per_layer > 0 else None,
                           "prefill_tokens_per_s": round(ad.prefill_tokens_per_s, 1)},
            # the worker's own average over its recent real steps (shard/session/step_meter.py)
            "recent": {"decode_ms_per_layer": recent_ms or None,
                       "decode_tokens_per_s": round(1000.0 / (recent_ms * layers), 1) if recent_ms else None,
                       "prefill_tokens_per_s": health.get("recent_prefill_tokens_per_s") or None,
                       "decode_positions": health.get("decode_positions", 0)},
            "relayed": ad.relayed, "relays": _relays_of(relayed), "endpoint": ad.grpc_endpoint,
            "expires_in_s": round((ad.expires_at_ms - now) / 1000, 1)}

    def _shortfall(self) -> dict | None:
        """When layers have no server: whether the tracker can move ranges over them or how much memory
        the pool lacks (meshd/swarm/view.py ``pool_status``; the peers the watch found gone left out)."""
        swarm = self.node.swarm
        if swarm is None:
            return None
        return swarm.pool_status(exclude=self.watch.gone())

    async def _fresh(self) -> None:
        swarm = self.node.swarm
        if swarm is None or not swarm.digest:
            return
        async with self._snap_lock:
            if time.monotonic() - self._snap_at < STATUS_REFRESH_S:
                return
            with trio.move_on_after(STATUS_FETCH_TIMEOUT_S):
                await swarm.fresh_snapshot()
            self._snap_at = time.monotonic()

    async def status(self) -> dict:
        await self._fresh()
        node, swarm = self.node, self.node.swarm
        me = node.identity.peer_id
        now = wall_ms()
        snap = swarm.snapshot if swarm is not None else None
        peers = [self._peer_view(ad, me, now, snap) for ad in
                 sorted(self._live_ads(with_gone=True) or [], key=lambda a: (a.start, a.end, a.peer_id))
                 [:MAX_STATUS_PEERS]]
        tracker, on_duty = self._on_duty()
        sup = node.supervisor
        metrics = self.metrics
        return {
            "peer_id": me, "time_ms": now, "model": self.model(), "tracker": tracker, "on_duty": on_duty,
            "peers": peers,
            "node": {"role": node.config.role,
                     "worker": sup.state.as_dict() if sup is not None else {"state": "none"},
                     "layers": list(swarm.slot.layers) if swarm and swarm.slot and swarm.slot.layers else
                     (list(node.config.layers) if node.config.layers else None),
                     "reachability": node.relaying.status(), "direct_upgrades": node.upgrader.snapshot(),
                     "connected_peers": len(node.host.get_connected_peers()), "api": self.url},
            "generations": self.entry.snapshot(),
            "gone": sorted(self.watch.gone()),
            "shortfall": self._shortfall(),
            "throughput": metrics.totals(),
        }

    def http_status(self) -> dict:
        """The ``http`` section of ``meshd status``: Hypercorn's adjustment and the connection slots."""
        return {**hypercorn_compat.status(), "url": self.url, "connections": self.connections.snapshot()}

    # ------------------------------------------------------------------ task
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        api = self.node.config.api
        bind = api.bind
        if bind is None:
            task_status.started(None)
            return
        try:
            sock = bind_socket(*bind)
        except DaemonError as exc:
            if api.explicit:
                raise
            self.node.progress(f"api: not started ({exc})")
            task_status.started(None)
            return
        app = build_app(ApiContext(self.entry, self.model, self.status, api.key, card=lambda: self.card,
                                   loaded=self.loaded, allowed_hosts=api.allowed_hosts, cors_origins=api.cors_origins))
        await self._serve(app, sock, api.max_connections, task_status)

    async def _serve(self, app, sock, max_connections: int, task_status) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_card)
            if self.node.config.has_model:
                await nursery.start(self.watch.run)
            url = await nursery.start(lambda task_status: serve_api(app, sock, max_connections=max_connections,
                                                                   table=self.connections, task_status=task_status))
            self.url = url
            self.node.progress(f"api: serving {url} (OpenAI /v1, Ollama /api, /metrics, dashboard at /)"
                               + (" with a bearer key" if self.node.config.api.key else ""))
            task_status.started(url)

