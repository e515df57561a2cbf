"""The entry's live view of its model's peers: their workers' health, whether they are alive, how fast
they run now -- what the dashboard shows (meshd/daemon/api_part.py status), instead of signed records
that say what a node could do at start and linger for a TTL after it died.

    PeerWatch.run   (child of the API part's nursery)
      every WATCH_S, for each peer of the model's live records (MAX_WATCHED_PEERS at most):
        Health of its worker -- over its pinned TLS endpoint, ours over loopback --
        in worker threads, PROBE_TIMEOUT_S each
        whether the daemon holds a libp2p connection to it (the host's connected peers)
      -> PeerLife.note(...) per peer; a history of its decode positions per second

Liveness (``PeerLife.state``), from the daemon's own failure signals:

    unknown       not probed yet
    ok            its last Health answered
    gone          its libp2p connection to us closed (the swarm keeps a full mesh among a model's
                  nodes) and its Health fails -- a killed daemon's worker follows it (PDEATHSIG) --
                  or, for a peer never connected to us, FAILS_FOR_GONE Health failures in a row
    unreachable   its Health fails while it is still connected (a firewall, a wedged worker)

A SIGKILLed node is "gone" at the first probe after its connection dropped: within WATCH_S plus one
probe, not the record's TTL. A gone peer's layers leave the coverage the dashboard draws at once.

State: PeerLife per peer (trio-only), pruned when its record is gone from the view. Pure rules
(``PeerLife``) with a thin trio edge (``PeerWatch``).
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import trio

log = logging.getLogger(__name__)

# How often every watched peer is probed: a dead node shows as gone within about this plus a probe.
WATCH_S = 1.0
PROBE_TIMEOUT_S = 1.5
# Peers probed per round (a home swarm has a handful; the model index holds at most 128).
MAX_WATCHED_PEERS = 32
# Probes running at once (each is a short gRPC call in a worker thread).
MAX_PARALLEL_PROBES = 8
# A peer that was never connected to us is gone after this many failed probes in a row.
FAILS_FOR_GONE = 3
# History: one point of decode positions per second every HISTORY_EVERY_S, HISTORY_POINTS kept (10 min).
HISTORY_EVERY_S = 5.0
HISTORY_POINTS = 120


def health_dict(report) -> dict:
    return {"state": report.state, "rss_bytes": report.resident_bytes, "kv_tokens_used": report.kv_tokens_used,
            "kv_budget_tokens": report.kv_budget_tokens, "active_sessions": report.active_sessions,
            "cpu_cores": report.cpu_cores, "machine_memory_bytes": report.machine_memory_bytes,
            "recent_decode_ms_per_layer": round(report.recent_decode_ms_per_layer, 3),
            "recent_prefill_tokens_per_s": round(report.recent_prefill_tokens_per_s, 1),
            "decode_positions": report.decode_positions, "prefill_positions": report.prefill_positions}


@dataclass
class PeerLife:
    peer_id: str
    health: dict | None = None
    checked_ms: int = 0
    fails: int = 0
    connected: bool = False
    seen_connected: bool = False
    state: str = "unknown"
    since_ms: int = 0                      # when ``state`` began (wall ms)
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=HISTORY_POINTS))
    _last_sample: tuple[float, int] | None = None

    def note(self, *, health: dict | None, connected: bool, now_ms: int) -> None:
        """One probe's outcome: ``health`` None when the Health call failed."""
        self.connected = connected
        self.seen_connected = self.seen_connected or connected
        if health is not None:
            self.health, self.checked_ms, self.fails = health, now_ms, 0
            self._sample(health["decode_positions"], now_ms)
            state = "ok"
        else:
            self.fails += 1
            if self.seen_connected and not connected:
                state = "gone"
            elif connected:
                state = "unreachable"
            else:
                state = "gone" if self.fails >= FAILS_FOR_GONE else self.state if self.state != "ok" else "unknown"
        if state != self.state:
            self.state, self.since_ms = state, now_ms

    def _sample(self, positions: int, now_ms: int) -> None:
        now_s = now_ms / 1000
        last = self._last_sample
        if last is None or positions < last[1]:           # first sample, or the worker restarted
            self._last_sample = (now_s, positions)
            return
        if now_s - last[0] >= HISTORY_EVERY_S:
            self.history.append((now_ms, round((positions - last[1]) / (now_s - last[0]), 2)))
            self._last_sample = (now_s, positions)

    def view(self) -> dict:
        return {"state": self.state, "since_ms": self.since_ms, "connected": self.connected,
                "checked_ms": self.checked_ms, "health": self.health, "history": list(self.history)}


class PeerWatch:
    """Probes the peers of our model's live records (module doc); ``lives`` is read by the status."""

    def __init__(self, node, *, wall_ms=lambda: int(time.time() * 1000)) -> None:
        self.node, self.wall_ms = node, wall_ms
        self.lives: dict[str, PeerLife] = {}
        self._limiter = trio.CapacityLimiter(MAX_PARALLEL_PROBES)

    def gone(self) -> set[str]:
        return {p for p, life in self.lives.items() if life.state == "gone"}

    def _targets(self) -> list:
        swarm = self.node.swarm
        snap = swarm.snapshot if swarm is not None else None
        if snap is None:
            return []
        now = self.wall_ms()
        ads = sorted((a for a in snap.ads if a.expires_at_ms > now), key=lambda a: (a.start, a.peer_id))
        return ads[:MAX_WATCHED_PEERS]

    def _probe_fn(self, ad):
        """A blocking Health call for ``ad``'s worker, or None when it cannot be probed from here."""
        from meshd.daemon.worker_process import fetch_health

        me = self.node.identity.peer_id
        if ad.peer_id == me:
            sup = self.node.supervisor
            endpoint = sup.state.endpoint if sup is not None else None
            return (lambda: fetch_health(endpoint)) if endpoint else None
        pin = (getattr(self.node.swarm, "pins", None) or {}).get(ad.peer_id)
        if not ad.grpc_endpoint or not pin:
            return None

        def probe():
            from meshd.reach.tls import pinned_channel
            from proto import shard_runtime_pb2 as pb
            from proto import shard_runtime_pb2_grpc as pb_grpc

            with pinned_channel(ad.grpc_endpoint, pin) as channel:
                return pb_grpc.ShardRuntimeStub(channel).Health(pb.HealthRequest(schema_version=pb.SCHEMA_VERSION_1),
                                                                 timeout=PROBE_TIMEOUT_S)
        return probe

    async def _probe(self, ad, connected: set[str]) -> None:
        fn = self._probe_fn(ad)
        health = None
        if fn is not None:
            try:
                health = health_dict(await trio.to_thread.run_sync(fn, limiter=self._limiter))
            except Exception:  # noqa: BLE001 - any failure to answer is the signal itself
                health = None
        life = self.lives.setdefault(ad.peer_id, PeerLife(ad.peer_id))
        is_me = ad.peer_id == self.node.identity.peer_id
        if fn is None and health is None and ad.peer_id in connected:
            life.note(health=life.health, connected=True, now_ms=self.wall_ms())   # relayed: the connection is all
            return
        life.note(health=health, connected=is_me or ad.peer_id in connected, now_ms=self.wall_ms())

    async def round(self) -> None:
        targets = self._targets()
        connected = {p.to_base58() for p in self.node.host.get_connected_peers()}
        async with trio.open_nursery() as nursery:
            for ad in targets:
                nursery.start_soon(self._probe, ad, connected)
        keep = {a.peer_id for a in targets}
        for peer in list(self.lives):
            if peer not in keep:
                del self.lives[peer]

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            try:
                await self.round()
            except Exception:  # the dashboard's view must never stop the daemon
                log.exception("peer watch round failed")
            await trio.sleep(WATCH_S)
