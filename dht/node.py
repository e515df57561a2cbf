"""DhtNode: our Kademlia node (py-libp2p KadDHT) with meshd's validator and store.

Data flow:
* ``lookup(key)``: an iterative Kademlia lookup (dht/lookup.py: alpha
  parallel GET_VALUE asks per round, a final round over the k closest,
  bounded rounds) from our routing table's closest peers and the connected
  ones; every answer brings the answering peer's closest peers to the key.
* ``publish(record)``: store the record locally under every key it belongs
  to (dht/keys.py), then PUT it -- just this one record, wrapped in a
  one-record set for index keys -- to the k closest peers of each key that
  a lookup finds (``put_remote``). Each receiving peer validates it and
  merges it into what it holds. The owner republishes (meshd/daemon/
  advertiser.py: every ttl/3), which re-replicates to the k closest after
  churn.
* ``fetch(key)``: a lookup that keeps every answering peer's value; the
  records that validate (dropping expired ones) are merged with the local
  copy. py-libp2p's ``get_value`` returns the local copy as soon as there
  is one, which would freeze an index, hence our own read.
* ``publish_relay`` / ``fetch_relays``: the same for relay records under
  the one ``/meshd/relays/v1`` index (dht/relay_records.py).
* ``publish_experts`` / ``fetch_experts``: the same for expert placement
  records under ``/meshd/experts/<digest>`` (dht/expert_records.py).
* ``sync_peers()``: add every connected peer to the routing table; ``join()``:
  that, then a lookup of our own id (after bootstrap).

In a home swarm (fewer than k peers) the k closest peers of every key are
every node, so a read sees everything; beyond, lookups route (measured by
``meshd bench dht``: 200 nodes).

State: the KadDHT (routing table, value store) is owned here; records are
owned by their signers. Concurrency of network calls is bounded by
``MAX_PARALLEL_RPCS`` and the lookup's alpha; each RPC is bounded by
``RPC_TIMEOUT_S`` (``DIAL_TIMEOUT_S`` for a peer we must dial first).
"""
from __future__ import annotations

import logging
import random
from contextlib import asynccontextmanager
from dataclasses import dataclass
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
from dht.lookup import K_CLOSEST, SEED_PEERS, Lookup


log = logging.getLogger(__name__)

# Kademlia's k: how many closest peers hold each key.
REPLICATION = K_CLOSEST
# One slow peer must not stall a publish or a read for long; a live peer answers
# a DHT RPC in milliseconds on a LAN, well under a second across the internet.
RPC_TIMEOUT_S = 3.0
# Dialing a peer we are not connected to: on loopback or a LAN a live peer
# answers in milliseconds; a gone one would otherwise hold a publish for long.
DIAL_TIMEOUT_S = 2.0
# Concurrent DHT RPCs per operation (Kademlia's alpha is 3; ours is a small swarm).
MAX_PARALLEL_RPCS = 8
# py-libp2p 0.8.1's KadDHT serves at most 12 inbound DHT streams at once and
# resets any stream beyond (``KadDHT._inbound_limiter``, "the remote will
# retry"). The k closest peers of a busy index key take PUTs from every
# publisher of a model at once, so 12 loses replicas: meshd serves up to
# DHT_INBOUND_HANDLERS (each a task holding one stream; bounded) and retries
# a refused PUT at a live peer (PUT_ATTEMPTS, after a short random pause).
# The adjustment is version-gated (``widen_inbound_handlers``) and listed in
# ``meshd status`` as ``dht_inbound_handlers`` (relay/adjustments.py).
DHT_INBOUND_HANDLERS = 64
LIBRARY_INBOUND_HANDLERS = 12
DHT_TESTED_LIBP2P_VERSION = "0.8.1"
PUT_ATTEMPTS = 3
PUT_RETRY_PAUSE_S = (0.05, 0.4)


def widen_inbound_handlers(kad, version: str) -> str | None:
    """Raise ``kad``'s inbound stream cap; None when done, else why not (left untouched)."""
    if version != DHT_TESTED_LIBP2P_VERSION:
        return f"off: libp2p {version or '(none)'} is installed, written for {DHT_TESTED_LIBP2P_VERSION} only"
    limiter = getattr(kad, "_inbound_limiter", None)
    if not isinstance(limiter, trio.CapacityLimiter) or limiter.total_tokens not in (
            LIBRARY_INBOUND_HANDLERS, DHT_INBOUND_HANDLERS):
        return "off: the library's KadDHT has no 12-stream inbound limiter to widen"
    limiter.total_tokens = DHT_INBOUND_HANDLERS
    return None


@dataclass(frozen=True, slots=True)
class LookupResult:
    closest: tuple        # the k closest peers that answered, nearest first (PUT targets)
    rounds: int           # rounds of parallel asks the lookup took
    asked: int            # peers asked in all


class DhtNode:
    def __init__(self, host, clock: Callable[[], int]) -> None:
        self.host = host
        self.clock = clock
        self.kad = KadDHT(host, DHTMode.SERVER, validator=namespaced_validator(clock),
                          validator_changed=True, strict_validation=True)
        self.kad.value_store = MergingValueStore(host, host.get_id(), clock)
        self.store: MergingValueStore = self.kad.value_store
        self.last_lookup: LookupResult | None = None
        import importlib.metadata

        try:
            version = importlib.metadata.version("libp2p")
        except importlib.metadata.PackageNotFoundError:
            version = ""
        self.inbound_handlers_off = widen_inbound_handlers(self.kad, version)   # None: widened

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

    async def join(self) -> int:
        """Kademlia's join: the connected peers (bootstrap) into the table, then a lookup of our own
        id, which fills our neighbourhood and makes the peers it asks add us to theirs.
        Returns the routing table's size."""
        await self.sync_peers()
        if self.host.get_connected_peers():
            await self.lookup(self.host.get_id().to_bytes())
        return self.routing_table_size()

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
            stored = await self.put_remote(key, value)   # not ``acked += await``: that reads acked first
            acked += stored

        async with trio.open_nursery() as nursery:
            for key, value in puts:
                nursery.start_soon(one_key, key, value)
        return acked

    async def put_remote(self, key: str, value: bytes) -> int:
        """PUT ``value`` at the k closest peers of ``key`` that a network lookup finds."""
        kb = key.encode()
        targets = (await self.lookup(kb)).closest
        acked = 0
        limiter = trio.CapacityLimiter(MAX_PARALLEL_RPCS)

        network = self.host.get_network()

        async def one(peer) -> None:
            nonlocal acked
            for attempt in range(PUT_ATTEMPTS):
                if attempt:   # refused (a busy peer resets) but still connected: it is alive
                    await trio.sleep(random.uniform(*PUT_RETRY_PAUSE_S))
                stored = False
                async with limiter:
                    with trio.move_on_after(self._timeout_for(peer)):
                        stored = await self.kad.value_store._store_at_peer(peer, kb, value,
                                                                           record=Record(key=kb, value=value))
                if stored:
                    acked += 1
                    return
                if peer not in network.connections:
                    return

        async with trio.open_nursery() as nursery:
            for peer in targets:
                nursery.start_soon(one, peer)
        return acked

    def _timeout_for(self, peer) -> float:
        """A peer we are connected to gets the full RPC timeout; one we would
        have to dial first gets DIAL_TIMEOUT_S (it is most often gone)."""
        return RPC_TIMEOUT_S if peer in self.host.get_network().connections else DIAL_TIMEOUT_S

    def _seeds(self, kb: bytes) -> list:
        """A lookup's first candidates: the routing table's closest, then every connected peer."""
        found = list(self.kad.routing_table.find_local_closest_peers(kb, SEED_PEERS))
        for peer in self.host.get_connected_peers():
            if peer not in found:
                found.append(peer)
        return found

    async def lookup(self, kb: bytes, *, values: list[bytes] | None = None) -> LookupResult:
        """Iterative Kademlia lookup of ``kb`` (dht/lookup.py) over GET_VALUE.

        Every answering peer's value is appended to ``values`` when given.
        A peer that fails leaves our routing table; one that answers joins it.
        """
        me = self.host.get_id()
        lk = Lookup(kb, self._seeds(kb), to_bytes=lambda p: p.to_bytes(), exclude=me)
        network = self.host.get_network()

        async def ask(peer) -> None:
            got, closer = None, []
            with trio.move_on_after(self._timeout_for(peer)) as scope:
                got, closer = await self.kad.value_store._get_from_peer(
                    peer, kb, return_record=True, return_closer_peers=True)
            # py-libp2p answers (None, []) for a failed dial too: a peer we are
            # not connected to after the RPC did not answer. Only a dial that
            # failed (not one cut by our deadline: a busy peer) leaves the table.
            if scope.cancelled_caught or (got is None and not closer and peer not in network.connections):
                lk.failed(peer)
                if not scope.cancelled_caught:
                    self.kad.routing_table.remove_peer(peer)
                return
            lk.answered(peer, closer)
            if isinstance(got, Record) and got.value and values is not None:
                values.append(got.value)
            if not self.kad.routing_table.peer_in_table(peer):
                with trio.move_on_after(DIAL_TIMEOUT_S):
                    try:
                        await self.kad.add_peer(peer, skip_server_mode_check=True)
                    except Exception as exc:  # a full bucket pings its oldest peer
                        log.debug("could not add %s to the routing table: %s", peer, exc)

        while batch := lk.next_batch():
            async with trio.open_nursery() as nursery:
                for peer in batch:
                    nursery.start_soon(ask, peer)
            lk.round_done()
        result = LookupResult(closest=tuple(lk.answered_closest()), rounds=lk.rounds,
                              asked=sum(s != "new" for s in lk.state.values()))
        self.last_lookup = result
        return result

    # ------------------------------------------------------------------ reads

    async def fetch(self, key: str) -> list[CapabilityRecord]:
        """Every valid, unexpired record under ``key`` that we and the peers a lookup asks hold."""
        parsed = K.parse_key(key)
        kb = key.encode()
        values: list[bytes] = []
        local = self.store.get(kb)
        if local is not None:
            values.append(local.value)
        await self.lookup(kb, values=values)
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
