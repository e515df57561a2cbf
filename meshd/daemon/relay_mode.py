"""Relay mode: a meshd on a public host that relays circuits and serves the DHT.

    run_relay(config)
    └── host (libp2p, Noise + yamux; dht/host/build.py)
        └── HopService (circuit relay v2 hop with meshd limits; relay/hop.py)
            └── DHT server (dht/node.py), unless disabled
                └── nursery
                    ├── peer sync (routing table <- connected peers)
                    ├── announce (signed relay record -> /meshd/relays/v1,
                    │   republished every ttl/3 and when a peer connects, so
                    │   it is in that peer's store at once; relay/announce.py)
                    └── control API (meshd/daemon/control.py): `meshd status` gets
                        {"mode": "relay", "peer_id", "addrs", "peers", "swarm" (whose DHT), "relay": {...},
                         "libp2p": {version, adjustments}}

The relay keeps no state beyond the library's reservations and its own
counters (HopService.snapshot). It never runs a worker and never parses a
frame: what it forwards is the end peers' Noise ciphertext.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial

import trio
from libp2p.tools.anyio_service import background_trio_service

from dht.compat.registry import library_status, render_library
from dht.host.bootstrap import connect_bootstrap
from dht.host.build import running_host
from dht.host.conn_watch import ConnectionWatch
from dht.identity import load_or_create_identity
from meshd.config import DaemonConfig
from relay.announce import announce_relay, public_addrs
from relay.hop import DEFAULT_HOP_LIMITS, HopLimits, HopService
from relay.reachability import serve_dialback

log = logging.getLogger(__name__)

__all__ = ["RelayNode", "run_relay", "relay_status", "render_relay_status", "PEER_SYNC_INTERVAL_S"]

# Connected peers join the DHT routing table within this delay (as in the daemon).
PEER_SYNC_INTERVAL_S = 2.0

Progress = Callable[[str], None]


def relay_status(hop: HopService, host) -> dict:
    """The relay section of ``meshd status``: counters and limits, JSON-able."""
    snap = hop.snapshot()
    snap["peers_connected"] = len(host.get_connected_peers())
    return snap


def render_relay_status(s: dict) -> str:
    """Human view of a relay's status reply (``meshd status`` against a relay)."""
    r = s["relay"]
    refused = ", ".join(f"{k} {v}" for k, v in sorted(r["circuits_refused"].items())) or "none"
    lines = [f"relay {s['peer_id']}", "  addrs: " + " ".join(s["addrs"]),
             f"  peers connected: {r['peers_connected']}   DHT routing table: {s['dht_routing_table']}"
             + (f"   swarm: {s['swarm']['name']}" if s.get("swarm") else ""),
             f"  reservations: {r['reservations_active']} / {r['limits']['reservations_total']}",
             f"  circuits: {r['circuits_active']} active / {r['limits']['circuits_total']}, "
             f"{r['circuits_opened']} opened, refused: {refused}",
             f"  bytes forwarded: {r['bytes_forwarded']}"]
    announced = s.get("announced")
    lines.append(f"  DHT relay record: seq {announced['sequence']}, {announced['acks']} remote stores acked"
                 if announced else "  DHT relay record: not published (no public address or no DHT)")
    lines += ["  " + line for line in render_library(s.get("libp2p"))]
    return "\n".join(lines) + "\n"


class RelayNode:
    """Composition root of relay mode: answers the control API."""

    def __init__(self, peer_id: str, host, hop: HopService, dht) -> None:
        self.peer_id = peer_id
        self.host = host
        self.hop = hop
        self.dht = dht
        self.announced: dict | None = None   # the relay record last published (status)
        self.peer_arrived = trio.Event()     # set when a peer connects: publish again
        ConnectionWatch(host).on_connect(self._on_connect)

    def _on_connect(self, peer_id: str) -> None:
        self.peer_arrived.set()

    def arrival(self) -> trio.Event:
        """A fresh event, set by the next peer that connects (the announcer asks before each publish)."""
        self.peer_arrived = trio.Event()
        return self.peer_arrived

    def on_announced(self, record, acks: int) -> None:
        self.announced = {"sequence": record.sequence, "addrs": list(record.addrs), "acks": acks,
                          "expires_at_ms": record.expires_at_ms}

    def addrs(self) -> list[str]:
        return [str(a) for a in self.host.get_addrs()]

    async def handle(self, request: dict) -> dict:
        if request["op"] == "ping":
            return {"peer_id": self.peer_id}
        return {"mode": "relay", "peer_id": self.peer_id, "addrs": self.addrs(),
                "dht_routing_table": self.dht.routing_table_size() if self.dht else None,
                "swarm": self.dht.scope.status() if self.dht else None,
                "relay": relay_status(self.hop, self.host), "announced": self.announced,
                "libp2p": library_status()}

    async def peer_sync(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while self.dht is not None:
            await self.dht.sync_peers()
            await trio.sleep(PEER_SYNC_INTERVAL_S)


def _wall_ms() -> int:
    return int(time.time() * 1000)


async def run_relay(config: DaemonConfig, progress: Progress, *, limits: HopLimits = DEFAULT_HOP_LIMITS,
                    with_dht: bool = True, control: bool = True,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run relay mode until cancelled; ``task_status.started(RelayNode)`` once serving."""
    from dht.node import DhtNode
    from meshd.daemon.control import serve_control

    identity = load_or_create_identity(config.data_dir)
    progress(f"peer id {identity.peer_id}")
    async with running_host(identity, config.listen) as host:
        hop = HopService(host, limits)
        serve_dialback(host)   # home nodes ask us whether they can be dialed
        async with background_trio_service(hop):
            await hop.event_started.wait()
            dht = DhtNode(host, _wall_ms, config.scope) if with_dht else None   # records its library adjustments
            async with (dht.running() if dht is not None else nullcontext()):
                node = RelayNode(identity.peer_id, host, hop, dht)
                progress("relay listening on " + " ".join(node.addrs()))
                if config.bootstrap:
                    reached = await connect_bootstrap(host, config.bootstrap, config.bootstrap_timeout_s)
                    progress(f"bootstrap: connected to {len(reached)} of {len(config.bootstrap)} peers")
                async with trio.open_nursery() as nursery:
                    await nursery.start(node.peer_sync)
                    if dht is not None:
                        await nursery.start(partial(
                            announce_relay, identity,
                            lambda: public_addrs(node.addrs(), identity.peer_id, config.advertise_host),
                            dht.publish_relay, ttl_s=config.record_ttl_s, wall_ms=_wall_ms,
                            on_published=node.on_announced, wake=node.arrival))
                    if control:
                        await nursery.start(serve_control, config.control_socket, node.handle)
                    progress(f"relaying: up to {limits.circuits_total} circuits, "
                             f"{limits.reservations_total} reservations")
                    task_status.started(node)
    progress("stopped")
