"""The swarm as the planner sees it: live shard ads of one model, from the DHT.

``fetch_snapshot(dht, model_digest, now_ms)`` reads the model's index key
(dht/keys.py ``/meshd/model/<digest>``), keeps the live records (validated,
signed, unexpired and not withdrawn -- dht/ already enforces that) and turns
each payload into a planner ``ShardAd``; an ad the planner refuses is the
advertiser's fault and is skipped. Alongside the ads it keeps, per peer,
what the edges need to reach it: the TLS certificate pin for gRPC, the
libp2p addresses for the control protocols and, for a node behind NAT, its
relayed (p2p-circuit) addresses for relayed hops (meshd/reach/relay_dial.py).

``pool_status(snap, footprint, kv, now_ms, tracker=...)`` is what every node
says about layers without a server -- in ``meshd status``, on the dashboard
and in the API's 503 -- from the same signed records with the same pure
planner the tracker uses (meshd/plan/layout.py): either the tracker is
moving ranges to cover them, or the pool is short and by how much.

State: none; a ``SwarmSnapshot`` is an immutable value.
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from dht import keys as K
from dht.records import CapabilityRecord, live
from meshd.plan.adverts import ShardAd, Span
from meshd.plan.assignment import ModelFootprint
from meshd.plan.errors import AdvertRejected
from meshd.plan.layout import gaps_of, members_from_ads, pool_shortfall

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SwarmSnapshot:
    model_digest: str
    ads: tuple[ShardAd, ...] = ()
    pins: dict[str, bytes] = field(default_factory=dict)            # peer id -> TLS cert SHA-256
    addrs: dict[str, tuple[str, ...]] = field(default_factory=dict)  # peer id -> libp2p multiaddrs
    relayed: dict[str, tuple[str, ...]] = field(default_factory=dict)  # peer id -> p2p-circuit multiaddrs
    frames: dict[str, str] = field(default_factory=dict)  # peer id -> framed TLS fast path (same pin)
    fetch: dict[str, str] = field(default_factory=dict)   # peer id -> fetch port (same pin), meshd/fetch/

    def ad_of(self, peer_id: str) -> ShardAd | None:
        return next((a for a in self.ads if a.peer_id == peer_id), None)


def snapshot_from_records(model_digest: str, records: list[CapabilityRecord], now_ms: int) -> SwarmSnapshot:
    ads, pins, addrs, relayed, frames, fetch = [], {}, {}, {}, {}, {}
    for rec in live(records, now_ms):
        try:
            ad = ShardAd.from_payload(rec.payload)
        except AdvertRejected as exc:
            log.info("skipping an advert: %s", exc)
            continue
        ads.append(ad)
        reach = rec.payload.reachability
        if reach.tls_cert_sha256:
            pins[ad.peer_id] = bytes(reach.tls_cert_sha256)
            if reach.frames_endpoint:
                frames[ad.peer_id] = reach.frames_endpoint
            if reach.fetch_endpoint:
                fetch[ad.peer_id] = reach.fetch_endpoint
        addrs[ad.peer_id] = tuple(reach.direct_addrs)
        if reach.relayed_addrs:
            relayed[ad.peer_id] = tuple(reach.relayed_addrs)
    return SwarmSnapshot(model_digest, tuple(ads), pins, addrs, relayed, frames, fetch)


async def fetch_snapshot(dht, model_digest: str, now_ms: int) -> SwarmSnapshot:
    records = await dht.fetch(K.model_key(model_digest))
    return snapshot_from_records(model_digest, records, now_ms)


def pool_status(snap: SwarmSnapshot, footprint: ModelFootprint | None, kv_budget_tokens: int, now_ms: int, *,
                num_layers: int, tracker: str | None, pending: Mapping[str, Span] | None = None,
                exclude: Collection[str] = ()) -> dict | None:
    """None when every layer is served (or being loaded); else the gaps and what closes them:
    ``{"gaps", "short", "need_bytes", "node_memory_bytes", "message"}``. ``exclude``: peers known dead
    before their records expire; ``footprint`` None (a client-only node): the gaps alone."""
    ads = [a for a in snap.ads if a.peer_id not in exclude]
    members = members_from_ads(ads, model_digest=snap.model_digest, num_layers=num_layers, now_ms=now_ms,
                               tracker=tracker, pending=pending)
    gaps = gaps_of(num_layers, members)
    if not gaps:
        return None
    layers = ", ".join(f"{g.start}:{g.end}" for g in gaps)
    out = {"gaps": [[g.start, g.end] for g in gaps], "short": None, "need_bytes": None, "node_memory_bytes": None}
    if footprint is None:
        return {**out, "message": f"layers {layers} have no server"}
    short = pool_shortfall(footprint, members, kv_budget_tokens)
    if short is None:
        return {**out, "short": False, "message": f"layers {layers} have no server; the pool has the memory "
                                                  "for them: the tracker moves ranges to cover them"}
    return {**short.as_dict(), "short": True}
