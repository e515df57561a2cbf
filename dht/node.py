"""DhtNode: our Kademlia node (py-libp2p KadDHT) with meshd's validator and store.

Data flow:
* ``publish(record)``: store the record locally under every key it belongs
  to (dht/keys.py), then PUT it -- just this one record, wrapped in a
  one-record set for index keys -- to the closest peers of each key. Each
  receiving peer validates it and merges it into what it holds.
* ``fetch(key)``: ask the closest peers of ``key`` for their value, keep the
  records that validate (dropping expired ones), and merge them with the
  local copy. py-libp2p's ``get_value`` returns the local copy as soon as
  there is one, which would freeze an index, hence our own read.
* ``publish_relay`` / ``fetch_relays``: the same for relay records under
  the one ``/meshd/relays/v1`` index (dht/relay_records.py).
* ``publish_experts`` / ``fetch_experts``: the same for expert placement
  records under ``/meshd/experts/<digest>`` (dht/expert_records.py).
* ``sync_peers()``: add every connected peer to the routing table.

Every node holds the keys it is among the closest peers of; in a home swarm
(fewer than REPLICATION peers) that is every node, so a read sees everything.

State: the KadDHT (routing table, value store) is owned here; records are
owned by their signers. Concurrency of network calls is bounded by
``MAX_PARALLEL_RPCS``; each RPC is bounded by ``RPC_TIMEOUT_S``.
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

import trio
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Record
from libp2p.tools.anyio_service import background_trio_service

from dht import keys as K
from dht.records import CapabilityRecord, encode_record_set, merge_records, parse_record_set_lenient, \
    validate_capability
from dht.expert_records import parse_expert_set_lenient
from dht.relay_records import RelayRecord, parse_relay_set_lenient
from dht.validator import MergingValueStore, check_value, namespaced_validator
from dht.errors import RecordRejected

log = logging.getLogger(__name__)

# Kademlia's k: how many closest peers hold each key.
REPLICATION = 20
# One slow peer must not stall a publish or a read for long; a live peer answers
# a DHT RPC in milliseconds on a LAN, well under a second across the internet.
RPC_TIMEOUT_S = 3.0
# Dialing a peer we are not connected to: on loopback or a LAN a live peer
# answers in milliseconds; a gone one would otherwise hold a publish for long.
DIAL_TIMEOUT_S = 2.0
# Concurrent DHT RPCs per operation (Kademlia's alpha is 3; ours is a small swarm).
MAX_PARALLEL_RPCS = 8


class DhtNode:
    def __init__(self, host, clock: Callable[[], int]) -> None:
        self.host = host
        self.clock = clock
        self.kad = KadDHT(host, DHTMode.SERVER, validator=namespaced_validator(clock),
                          validator_changed=True, strict_validation=True)
        self.kad.value_store = MergingValueStore(host, host.get_id(), clock)
        self.store: MergingValueStore = self.kad.value_store

    @asynccontextmanager
    async def running(self) -> AsyncIterator["DhtNode"]:
        async with background_trio_service(self.kad):
            yield self

    async def sync_peers(self) -> int:
        added = 0
        for peer in self.host.get_connected_peers():
            try:
                if await self.kad.add_peer(peer, skip_server_mode_check=True):
                    added += 1
            except Exception as exc:  # routing-table insertion pings the peer
                log.debug("could not add %s to the routing table: %s", peer, exc)
        return added

    def routing_table_size(self) -> int:
        return self.kad.get_routing_table_size()

    # ------------------------------------------------------------------ writes

    def store_locally(self, key: str, value: bytes) -> None:
        """Validate like a remote PUT would, then store or merge."""
        check_value(key, value, self.clock())
        kb = key.encode()
        existing = self.store.get(kb)
        if existing is not None and self.kad.validator.select(key, [existing.value, value]) == 0:
            raise RecordRejected("replayed", "the stored value is newer")
        self.store.put_record(kb, Record(key=kb, value=value))

    async def publish(self, record: CapabilityRecord) -> int:
        """Store ``record`` under all its keys, locally and at the closest peers.

        All local stores happen first (one validation instant), then every
        remote PUT of every key runs concurrently, so a publish takes at most
        about one RPC timeout however many peers are dead. Returns how many
        remote stores were acknowledged (0 in a swarm of one).
        """
        span = None if record.withdrawn else record.span
        puts = []
        for key in K.keys_for(record.peer_id, record.model_artifact_digest, span):
            value = record.raw if key == K.peer_key(record.peer_id) else encode_record_set([record])
            self.store_locally(key, value)
            puts.append((key, value))
        acked = 0

        async def one_key(key: str, value: bytes) -> None:
            nonlocal acked
            acked += await self.put_remote(key, value)

        async with trio.open_nursery() as nursery:
            for key, value in puts:
                nursery.start_soon(one_key, key, value)
        return acked

    async def put_remote(self, key: str, value: bytes) -> int:
        kb = key.encode()
        acked = 0
        limiter = trio.CapacityLimiter(MAX_PARALLEL_RPCS)

        async def one(peer) -> None:
            nonlocal acked
            async with limiter:
                with trio.move_on_after(self._timeout_for(peer)):
                    if await self.kad.value_store._store_at_peer(peer, kb, value,
                                                                 record=Record(key=kb, value=value)):
                        acked += 1

        async with trio.open_nursery() as nursery:
            for peer in await self._closest(kb):
                nursery.start_soon(one, peer)
        return acked

    def _timeout_for(self, peer) -> float:
        """A peer we are connected to gets the full RPC timeout; one we would
        have to dial first gets DIAL_TIMEOUT_S (it is most often gone)."""
        return RPC_TIMEOUT_S if peer in self.host.get_network().connections else DIAL_TIMEOUT_S

    async def _closest(self, kb: bytes) -> list:
        """The REPLICATION closest peers we know, connected ones included.

        py-libp2p answers FIND_NODE only for keys that are peer ids, so an
        iterative network lookup of a /meshd/ key stops at our own routing
        table anyway; we use that table (kept fresh by the DHT's refresh and
        ``sync_peers``) plus every connected peer.
        """
        me = self.host.get_id()
        found = list(self.kad.routing_table.find_local_closest_peers(kb, REPLICATION))
        for peer in self.host.get_connected_peers():
            if peer not in found:
                found.append(peer)
        return [p for p in found if p != me][:REPLICATION * 2]

    # ------------------------------------------------------------------ reads

    async def fetch(self, key: str) -> list[CapabilityRecord]:
        """Every valid, unexpired record under ``key`` that the closest peers and we hold."""
        parsed = K.parse_key(key)
        kb = key.encode()
        values: list[bytes] = []
        local = self.store.get(kb)
        if local is not None:
            values.append(local.value)
        limiter = trio.CapacityLimiter(MAX_PARALLEL_RPCS)

        async def one(peer) -> None:
            async with limiter:
                with trio.move_on_after(self._timeout_for(peer)):
                    got = await self.kad.value_store._get_from_peer(peer, kb, return_record=True)
                    if isinstance(got, Record) and got.value:
                        values.append(got.value)

        async with trio.open_nursery() as nursery:
            for peer in await self._closest(kb):
                nursery.start_soon(one, peer)
        now = self.clock()
        merged: list[CapabilityRecord] = []
        for value in values:
            try:
                recs = self._decode(parsed, value, now)
            except RecordRejected as exc:
                log.info("refused a value for %s from the DHT: %s", key, exc)
                continue
            merged = merge_records(merged, recs, now)
        return merged

    async def publish_relay(self, record: RelayRecord) -> int:
        """Store a relay's record under /meshd/relays/v1, locally and at the closest peers."""
        key, value = K.relays_key(), encode_record_set([record])  # type: ignore[list-item]
        self.store_locally(key, value)
        return await self.put_remote(key, value)

    async def fetch_relays(self) -> list[RelayRecord]:
        """Every live relay record the closest peers and we hold."""
        return await self.fetch(K.relays_key())  # type: ignore[return-value]

    async def publish_experts(self, record) -> int:
        """Store an expert peer's placement record under /meshd/experts/<digest>, here and at the closest peers."""
        key, value = K.experts_key(record.model_artifact_digest), encode_record_set([record])
        self.store_locally(key, value)
        return await self.put_remote(key, value)

    async def fetch_experts(self, digest: str) -> list:
        """Every valid, unexpired expert placement record of one model the closest peers and we hold."""
        return await self.fetch(K.experts_key(digest))

    @staticmethod
    def _decode(parsed: K.ParsedKey, value: bytes, now: int) -> list[CapabilityRecord]:
        if parsed.kind == "relays":
            return parse_relay_set_lenient(value, now)  # type: ignore[return-value]
        if parsed.kind == "experts":
            recs = parse_expert_set_lenient(value, now)
            if any(r.model_artifact_digest != parsed.subject for r in recs):
                raise RecordRejected("key_mismatch", "expert record of another model")
            return recs  # type: ignore[return-value]
        if parsed.kind == "peer":
            rec = validate_capability(value, now)
            if rec.peer_id != parsed.subject:
                raise RecordRejected("key_mismatch", "record of another peer")
            return [rec]
        recs = parse_record_set_lenient(value, now)
        for rec in recs:
            if rec.model_artifact_digest != parsed.subject:
                raise RecordRejected("key_mismatch", "record of another model")
            if parsed.kind == "span" and not rec.withdrawn and rec.span != parsed.span:
                raise RecordRejected("key_mismatch", "record of another span")
        return recs

    def local_models(self) -> list[str]:
        """Artifact digests of the model indexes this node holds."""
        return sorted(K.parse_key(k).subject for k in self.store.index_keys())
