"""DhtNode: our Kademlia node (py-libp2p KadDHT) with meshd's validator and store.

The decisions live in the sans-I/O core (dht/kademlia/): every operation
below is a step generator of dht/kademlia/ops.py that this node carries out
over py-libp2p streams (``_drive``: GET/PUT under the deadline of
dht/kademlia/book.py's ``RpcBook``, pauses, concurrent sub-steps in a
nursery); the simulation (dht/kademlia/sim.py) runs the same steps on an
in-memory network. What stays here is I/O: the library's KadDHT (its routing
table and its GET_VALUE/PUT_VALUE server, around dht/validator.py), streams,
connections, background table insertions.

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
  copy (dht/kademlia/values.py). py-libp2p's ``get_value`` returns the local copy as soon as there
  is one, which would freeze an index, hence our own read.
* ``publish_relay`` / ``fetch_relays``: the same for relay records under
  the one ``/meshd/relays/v1`` index (dht/relay_records.py).
* ``publish_experts`` / ``fetch_experts``: the same for expert placement
  records under ``/meshd/experts/<digest>`` (dht/expert_records.py).
* ``sync_peers()``: add every connected peer that speaks our swarm's DHT
  protocol to the routing table (``speaks_dht``: identify's list, else a
  probe stream); ``join()``: that, then a lookup of our own id and one per
  bucket beyond our neighbourhood (after bootstrap).
* ``refresh()``: every REFRESH_INTERVAL_S at a random phase (``_maintain``, in
  place of the library's maintenance loop: see LIBRARY_MAINTENANCE below), lookups
  of our own id and of one random key, then the store's expiry sweep.

Swarm scope (dht/host/swarm_scope.py): the KadDHT serves, and our RPCs ask,
on the swarm's protocol id ``/meshd/kad/<tag>/1.0.0`` -- the library's
``/ipfs/kad/1.0.0`` handler is removed (host's public stream-handler API;
``KadDHT.handle_stream`` does not look at the protocol id). A connected peer
of another swarm (or another libp2p program) cannot answer our lookups nor
store with us, and is kept out of our routing table and lookup seeds for
FOREIGN_RECHECK_S after a check found it does not speak our protocol (the
check is I/O, here; what is remembered, and for how long, is the RpcBook's
``ForeignPeers``, dht/kademlia/book.py).

In a home swarm (fewer than k peers) the k closest peers of every key are
every node, so a read sees everything; beyond, lookups route: the simulation
(``meshd bench dht --sim``, tests/test_dht_sim.py) checks 1,000 nodes with
NAT'd and slow peers and 20% churn; ``meshd bench dht`` runs real hosts.

RPCs: GET_VALUE and PUT_VALUE go through dht/rpc.py (the library's wire,
but a stream cut by our deadline is reset, not left open at the peer). Each
is bounded by a deadline derived from the latencies this node measured
(dht/kademlia/book.py: one estimator for peers we are connected to, one for
peers we must dial first; a connected peer that misses deadlines doubles
only its own, and after STUCK_AFTER misses in a row its connection is closed
and it leaves the routing table -- unless other connected peers are late
too: congestion, and the peer is kept, ``stuck_kept``). For
the same reason a PUT is sent again only when the peer refused it (reset the
stream), never when our deadline cut it. Within one lookup,
connected peers cut by the deadline are asked once more when several were
(congestion; ``Lookup.late``); a lone late peer is given up at once. A peer
whose dial failed (no connection) is left out of every lookup for
UNREACHABLE_S unless it connects again (``Lookup``'s ``skip``).

State: the KadDHT (routing table, value store), the record cache and the
RpcBook (two RPC timers, peer health, foreign peers, counts) are owned here; records are
owned by their signers. Concurrency
of network calls is bounded by ``MAX_PARALLEL_RPCS`` and the lookup's alpha.
"""
from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, nullcontext
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.common import PROTOCOL_ID as LIBRARY_DHT_PROTOCOL
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Record
from libp2p.tools.anyio_service import background_trio_service

from dht import keys as K
from dht import rpc
from dht.compat.gate import gate, installed_version
from dht.compat.registry import decide
from dht.errors import RecordRejected
from dht.host.swarm_scope import DEFAULT_SCOPE, SwarmScope
from dht.kademlia import ops
from dht.kademlia.book import DIAL_TIMEOUT_S, STUCK_AFTER, RpcBook
from dht.kademlia.ops import REFRESH_INTERVAL_S, LookupResult
from dht.lookup import K_CLOSEST, SEED_PEERS, peer_hash
from dht.peer_health import CLOSE, PeerHealth
from dht.records import CapabilityRecord, RecordCache, encode_record_set
from dht.relay_records import RelayRecord
from dht.rpc import RpcTimer
from dht.validator import MergingValueStore, check_value, namespaced_validator

log = logging.getLogger(__name__)

# Kademlia's k: how many closest peers hold each key.
REPLICATION = K_CLOSEST
# Routing-table insertions of answering peers running at once in the background (``_learn``).
MAX_PENDING_INSERTS = 4
# py-libp2p 0.8.1's KadDHT serves at most 12 inbound DHT streams at once and
# resets any stream beyond (``KadDHT._inbound_limiter``, "the remote will
# retry"). The k closest peers of a busy index key take PUTs from every
# publisher of a model at once, so 12 loses replicas: meshd serves up to
# DHT_INBOUND_HANDLERS (each a task holding one stream; bounded) and retries
# a refused PUT at a live peer (PUT_ATTEMPTS, after a short random pause).
# The adjustment is version-gated (``widen_inbound_handlers``) and listed in
# ``meshd status`` as ``dht_inbound_handlers`` (dht/compat/; no upstream issue found).
DHT_INBOUND_HANDLERS = 64
LIBRARY_INBOUND_HANDLERS = 12
# LIBRARY_MAINTENANCE: py-libp2p 0.8.1's KadDHT runs a maintenance loop (``KadDHT._run_main_loop``): at its start and
# every 600 s a routing-table refresh -- a lookup of its own id, then one per non-empty bucket,
# one after another, through the library's own RPCs (not cancel-safe, see dht/rpc.py) -- and
# republishes of values stored with ``put`` (meshd stores with ``put_record``: there are none).
# Nodes started together refresh together: in ``meshd bench dht`` 200 nodes' ~1,800 library
# lookups landed at once 600 s after the start, and whatever phase the bench was in collapsed
# (a CI run: 52,598 RPCs cut after the kill, the survivors' views never complete again).
# meshd replaces that loop with ``DhtNode._maintain``: a lookup of our own id and of one random
# key (a far bucket) through meshd's lookup, and the store's expiry sweep, every
# REFRESH_INTERVAL_S at a random phase (x uniform REFRESH_JITTER; dht/kademlia/ops.py).
# Version-gated (``replace_maintenance``), shown in ``meshd status`` as ``dht_maintenance``
# (dht/compat/; no upstream issue found).


def widen_inbound_handlers(kad, version: str) -> str | None:
    """Raise ``kad``'s inbound stream cap; None when done, else why not (left untouched)."""
    refused = gate(version)
    if refused is not None:
        return refused
    limiter = getattr(kad, "_inbound_limiter", None)
    if not isinstance(limiter, trio.CapacityLimiter) or limiter.total_tokens not in (
            LIBRARY_INBOUND_HANDLERS, DHT_INBOUND_HANDLERS):
        return "off: the library's KadDHT has no 12-stream inbound limiter to widen"
    limiter.total_tokens = DHT_INBOUND_HANDLERS
    return None


def replace_maintenance(kad, version: str, loop) -> str | None:
    """Run ``loop`` in place of ``kad``'s maintenance loop; None when done, else why not (left untouched)."""
    refused = gate(version)
    if refused is not None:
        return refused
    if not callable(getattr(type(kad), "_run_main_loop", None)):
        return "off: the library's KadDHT has no maintenance loop to replace"
    kad._run_main_loop = loop        # KadDHT.run starts ``self._run_main_loop``: the instance's wins
    return None


class DhtNode:
    def __init__(self, host, clock: Callable[[], int], scope: SwarmScope = DEFAULT_SCOPE) -> None:
        self.host = host
        self.clock = clock
        self.scope = scope
        self.protocol = TProtocol(scope.dht_protocol)
        self.records = RecordCache()     # records whose signatures this node checked (dht/records.py)
        self.validator = namespaced_validator(clock, self.records)
        self.kad = KadDHT(host, DHTMode.SERVER, validator=self.validator,
                          validator_changed=True, strict_validation=True)
        # serve on our swarm's protocol, not the library's (see the module docstring)
        host.remove_stream_handler(LIBRARY_DHT_PROTOCOL)
        host.set_stream_handler(self.protocol, self.kad.handle_stream)
        self.kad.value_store = MergingValueStore(host, host.get_id(), clock, self.records)
        self.store: MergingValueStore = self.kad.value_store
        self.last_lookup: LookupResult | None = None
        # deadlines of RPCs to connected peers and to peers dialed first (measured), per-peer
        # health (misses, congestion, unreachable peers), peers of another swarm, outcome
        # counts: dht/kademlia/book.py
        self.book = RpcBook()
        self._view = _CoreView(self)
        # routing-table insertions running in the background (``_learn``), and their nursery
        self._inserting: set = set()
        self._upkeep: trio.Nursery | None = None
        version = installed_version()
        self.inbound_handlers_off = widen_inbound_handlers(self.kad, version)   # None: widened
        self.maintenance_off = replace_maintenance(self.kad, version, self._maintain)   # None: ours runs
        # both shown by ``meshd status`` (dht/compat/registry.py)
        decide("dht_inbound_handlers", self.inbound_handlers_off, version, f" ({DHT_INBOUND_HANDLERS} streams)")
        decide("dht_maintenance", self.maintenance_off, version,
               f" (meshd's refresh, every {REFRESH_INTERVAL_S:g} s at a random phase)")
        self.refreshes = 0

    # the book's parts under their earlier names (tests and ``rpc_stats`` read and set them)
    @property
    def rpc_timer(self) -> RpcTimer:
        return self.book.connected

    @rpc_timer.setter
    def rpc_timer(self, timer: RpcTimer) -> None:
        self.book.connected = timer

    @property
    def dial_timer(self) -> RpcTimer:
        return self.book.dialed

    @property
    def health(self) -> PeerHealth:
        return self.book.health

    @property
    def rpc_counts(self) -> dict:
        return self.book.counts

    @property
    def foreign_seen(self) -> int:
        """How many peers were found not to speak our DHT protocol (each once while remembered)."""
        return self.book.foreign.seen

    async def _maintain(self) -> None:
        """The routing-table refresh (in place of the library's; see LIBRARY_MAINTENANCE): our
        own id's neighbourhood and one random far bucket, then the expiry sweep; at a random
        phase so that nodes started together do not refresh together."""
        rng = random.Random()
        while True:
            await trio.sleep(ops.refresh_delay(rng, REFRESH_INTERVAL_S))
            try:
                await self.refresh(rng.randbytes(32))
            except Exception as exc:  # noqa: BLE001 - the next refresh tries again
                log.info("DHT refresh failed: %s", exc)

    async def refresh(self, far_key: bytes) -> None:
        """One refresh: lookups of our own id and of ``far_key``, then drop expired values."""
        await self._drive(ops.refresh(self._view, far_key))
        self.store.cleanup_expired()
        self.refreshes += 1

    @asynccontextmanager
    async def running(self) -> AsyncIterator[DhtNode]:
        async with background_trio_service(self.kad), trio.open_nursery() as upkeep:
            self._upkeep = upkeep
            try:
                yield self
            finally:
                self._upkeep = None
                upkeep.cancel_scope.cancel()

    def _learn(self, peer) -> None:
        """Put a peer that answered into the routing table, off the lookup's path: inserting
        into a full bucket pings its oldest peer, which after churn is often dead and would
        hold the lookup's round for a dial deadline. At most MAX_PENDING_INSERTS at once."""
        if (self._upkeep is None or peer in self._inserting or len(self._inserting) >= MAX_PENDING_INSERTS
                or self.kad.routing_table.peer_in_table(peer)):
            return
        self._inserting.add(peer)

        async def insert() -> None:
            try:
                with trio.move_on_after(DIAL_TIMEOUT_S):
                    await self.kad.add_peer(peer, skip_server_mode_check=True)
            except Exception as exc:  # noqa: BLE001 - a full bucket pings its oldest peer
                log.debug("could not add %s to the routing table: %s", peer, exc)
            finally:
                self._inserting.discard(peer)

        self._upkeep.start_soon(insert)

    def _is_foreign(self, peer) -> bool:
        return self.book.foreign.excluded(peer, trio.current_time())

    def foreign_peers(self) -> list[str]:
        """Connected peers known not to speak our DHT protocol (``meshd status``)."""
        return sorted(p.to_base58() for p in self.host.get_connected_peers() if self._is_foreign(p))

    async def speaks_dht(self, peer) -> bool:
        """Does the connected ``peer`` serve our swarm's DHT protocol? Yes when identify listed it;
        else a probe stream decides (negotiated: yes, then reset; refused or silent: no, remembered
        for FOREIGN_RECHECK_S in the RpcBook's ``foreign``)."""
        if self._is_foreign(peer):
            return False
        try:
            protocols = self.host.get_peerstore().get_protocols(peer)
        except Exception:  # noqa: BLE001 - the library raises PeerStoreError for a peer it has no data on
            protocols = []
        if protocols and self.protocol in protocols:
            return True
        ok = False
        with trio.move_on_after(DIAL_TIMEOUT_S):
            try:
                stream = await self.host.new_stream(peer, [self.protocol])
            except Exception as exc:  # noqa: BLE001 - protocol refused (negotiation), connection gone
                log.debug("%s does not speak %s: %s", peer, self.protocol, exc)
            else:
                ok = True
                await rpc.reset_stream(stream, peer)
        if ok:
            self.book.foreign.speaks(peer)
            return True
        if self.book.foreign.found(peer, trio.current_time()):
            log.info("peer %s does not speak our swarm's DHT protocol %s (another swarm, or not meshd): "
                     "kept out of the routing table", peer, self.protocol)
        return False

    async def sync_peers(self) -> int:
        """Add every connected peer that speaks our DHT protocol to the routing table."""
        added = 0
        for peer in self.host.get_connected_peers():
            if not self.kad.routing_table.peer_in_table(peer) and not await self.speaks_dht(peer):
                continue
            try:
                if await self.kad.add_peer(peer, skip_server_mode_check=True):
                    added += 1
            except Exception as exc:  # noqa: BLE001 - routing-table insertion pings the peer
                log.debug("could not add %s to the routing table: %s", peer, exc)
        return added

    async def join(self) -> int:
        """Kademlia's join: the connected peers (bootstrap) into the table, then a lookup of our own
        id, which fills our neighbourhood and makes the peers it asks add us to theirs, and one
        lookup per bucket beyond it (dht/kademlia/ops.py ``join``). Returns the routing table's size."""
        await self.sync_peers()
        if self.host.get_connected_peers():
            await self._drive(ops.join(self._view))
        return self.routing_table_size()

    def routing_table_size(self) -> int:
        return self.kad.get_routing_table_size()

    # ------------------------------------------------------------------ writes

    def store_locally(self, key: str, value: bytes) -> None:
        """Validate like a remote PUT would, then store or merge."""
        check_value(key, value, self.clock(), self.records)
        kb = key.encode()
        existing = self.store.get(kb)
        if existing is not None and self.validator.select(key, [existing.value, value]) == 0:
            raise RecordRejected("replayed", "the stored value is newer")
        self.store.put_record(kb, Record(key=kb, value=value))

    async def publish(self, record: CapabilityRecord) -> int:
        """Store ``record`` under all its keys, locally and at the closest peers.

        All local stores happen first (one validation instant), then every
        remote PUT of every key runs concurrently, so a publish takes at most
        about one RPC timeout however many peers are dead (dht/kademlia/ops.py).
        Returns how many remote stores were acknowledged (0 in a swarm of one).
        """
        async with rpc.Session(self.host, self.protocol) as session:   # the keys' lookups and PUTs share streams
            return await self._drive(ops.publish(self._view, record), session)

    async def put_remote(self, key: str, value: bytes, session: rpc.Session | None = None) -> int:
        """PUT ``value`` at the k closest peers of ``key`` that a network lookup finds.

        The PUTs go over the streams the lookup's GET_VALUEs opened (``session``,
        one of its own when not given): the k closest were just asked."""
        if session is None:
            async with rpc.Session(self.host, self.protocol) as own:
                return await self.put_remote(key, value, own)
        return await self._drive(ops.put_remote(self._view, key, value), session)

    def rpc_stats(self) -> dict:
        """Counts of this node's RPC outcomes and its two deadline estimators (JSON-able)."""
        return {**self.rpc_counts, "connected": self.rpc_timer.snapshot(), "dialed": self.dial_timer.snapshot()}

    # ------------------------------------------------------------------ the core's effects

    async def _drive(self, step: ops.Step, session: rpc.Session | None = None,
                     limiter: trio.CapacityLimiter | None = None):
        """Carry out a core step's effects (dht/kademlia/ops.py) until it returns; its result.

        GET and PUT run under ``_rpc``'s deadline over ``session``'s streams, at most
        ``limiter``'s count at once; ``Together`` runs its sub-steps in a nursery."""
        result: Any = None
        while True:
            try:
                effect = step.send(result)
            except StopIteration as done:
                return done.value
            if isinstance(effect, (ops.Get, ops.Put)):
                async with limiter if limiter is not None else nullcontext():
                    result = await self._perform(effect, session)
            elif isinstance(effect, ops.Pause):
                await trio.sleep(effect.seconds)
                result = None
            elif isinstance(effect, ops.Together):
                result = await self._together(effect, session, limiter)
            else:
                raise TypeError(f"unknown DHT effect {effect!r}")

    async def _together(self, effect: ops.Together, session: rpc.Session | None,
                        limiter: trio.CapacityLimiter | None) -> list:
        """``effect``'s sub-steps at once in a nursery, at most its ``limit`` of their RPCs in flight
        (else the caller's limiter's); their results in order."""
        inner = trio.CapacityLimiter(effect.limit) if effect.limit else limiter
        results: list = [None] * len(effect.steps)

        async def one(i: int, sub: ops.Step) -> None:
            results[i] = await self._drive(sub, session, inner)

        async with trio.open_nursery() as nursery:
            for i, sub in enumerate(effect.steps):
                nursery.start_soon(one, i, sub)
        return results

    async def _perform(self, effect, session: rpc.Session | None) -> ops.Outcome:
        """One GET or PUT as the core's Outcome; whether the peer is still connected is read after it."""
        peer = effect.peer
        if isinstance(effect, ops.Get):
            answer = await self._rpc(peer, rpc.get_value, effect.key, session=session)
        else:
            answer = await self._rpc(peer, rpc.put_value, effect.key, effect.value, session=session)
        connected = peer in self.host.get_network().connections
        if answer is self._TIMED_OUT:
            return ops.Outcome(ops.TIMED_OUT, connected)
        if answer is None:
            return ops.Outcome(ops.FAILED, connected)
        if isinstance(effect, ops.Put):
            return ops.Outcome(ops.ANSWERED, connected, stored=answer is True)
        got, closer = answer
        value = got.value if isinstance(got, Record) and got.value else None
        return ops.Outcome(ops.ANSWERED, connected, value=value, closer=tuple(closer))

    _TIMED_OUT = object()

    async def _rpc(self, peer, call, *args, session: rpc.Session | None = None):
        """``call(host, peer, *args, session)`` under the measured deadline; its result, ``_TIMED_OUT``,
        or None when it failed (dial refused, stream reset). The outcome goes to the RpcBook
        (dht/kademlia/book.py), which says when a connected peer that keeps missing deadlines
        is to be closed (``_close_stuck``)."""
        connected = peer in self.host.get_network().connections
        misses = self.book.misses(peer, connected)
        start = trio.current_time()
        try:
            with trio.move_on_after(self.book.timer(connected).timeout(misses)):
                result = await call(self.host, peer, *args, session=session, protocol=self.protocol)
                self.book.answered(peer, connected, trio.current_time() - start)
                return result
        except Exception as exc:  # noqa: BLE001 - dial and stream errors of every kind (groups too)
            log.debug("DHT RPC to %s failed: %s", peer, exc)
            self.book.failed(peer)
            return None
        now = trio.current_time()
        if self.book.timed_out(peer, connected, now - start, now, misses) == CLOSE:
            await self._close_stuck(peer)
        return self._TIMED_OUT

    async def _close_stuck(self, peer) -> None:
        """Drop a connected peer that left STUCK_AFTER RPCs in a row unanswered: out of the
        routing table, its connection closed (shielded, bounded); a live peer reconnects."""
        log.info("DHT peer %s left %d RPCs in a row unanswered: closing its connection", peer, STUCK_AFTER)
        try:
            self.kad.routing_table.remove_peer(peer)
        except Exception as exc:  # noqa: BLE001 - it may not be in the table
            log.debug("removing %s from the routing table: %s", peer, exc)
        with trio.CancelScope(shield=True), trio.move_on_after(rpc.CLEANUP_S):
            try:
                await self.host.get_network().close_peer(peer)
            except Exception as exc:  # noqa: BLE001 - already gone
                log.debug("closing the connection to %s: %s", peer, exc)

    def _seeds(self, kb: bytes) -> list:
        """A lookup's first candidates: the routing table's closest, then every connected peer
        not known to be of another swarm."""
        found = list(self.kad.routing_table.find_local_closest_peers(kb, SEED_PEERS))
        for peer in self.host.get_connected_peers():
            if peer not in found and not self._is_foreign(peer):
                found.append(peer)
        return found

    def _forget(self, peer) -> None:
        """A peer we could not reach: out of the routing table, left out of lookups for a while."""
        self.kad.routing_table.remove_peer(peer)
        self.health.mark_unreachable(peer, trio.current_time())

    async def lookup(self, kb: bytes, *, values: list[bytes] | None = None,
                     session: rpc.Session | None = None) -> LookupResult:
        """Iterative Kademlia lookup of ``kb`` (dht/lookup.py, run by dht/kademlia/ops.py) over GET_VALUE.

        Every answering peer's value is appended to ``values`` when given.
        A peer that fails leaves our routing table; one that answers joins it (in the
        background: ``_learn``, so a full bucket's ping of its oldest peer never holds a round).
        With ``session`` the streams stay open for the caller's next RPCs.
        """
        return await self._drive(ops.lookup(self._view, kb, values), session)

    # ------------------------------------------------------------------ reads

    async def fetch(self, key: str) -> list[CapabilityRecord]:
        """Every valid, unexpired record under ``key`` that we and the peers a lookup asks hold."""
        fetched = await self._drive(ops.fetch(self._view, key))
        return fetched.records

    async def publish_relay(self, record: RelayRecord) -> int:
        """Store a relay's record under /meshd/relays/v1, locally and at the closest peers."""
        key, value = K.relays_key(), encode_record_set([record])
        self.store_locally(key, value)
        return await self.put_remote(key, value)

    async def fetch_relays(self) -> list[RelayRecord]:
        """Every live relay record the closest peers and we hold."""
        return await self.fetch(K.relays_key())  # type: ignore[return-value]  # values.decode: relay records here

    async def publish_experts(self, record) -> int:
        """Store an expert peer's placement record under /meshd/experts/<digest>, here and at the closest peers."""
        key, value = K.experts_key(record.model_artifact_digest), encode_record_set([record])
        self.store_locally(key, value)
        return await self.put_remote(key, value)

    async def fetch_experts(self, digest: str) -> list:
        """Every valid, unexpired expert placement record of one model the closest peers and we hold."""
        return await self.fetch(K.experts_key(digest))

    def local_models(self) -> list[str]:
        """Artifact digests of the model indexes this node holds."""
        return sorted(K.parse_key(k).subject for k in self.store.index_keys())


class _CoreView:
    """The node as the core's operations see it (dht/kademlia/ops.py ``Node``)."""

    def __init__(self, node: DhtNode) -> None:
        self._node = node
        self.me = node.host.get_id()
        self.cache = node.records
        self.rng = random.Random()

    def to_bytes(self, peer) -> bytes:
        return peer.to_bytes()

    def position(self, peer) -> int:
        return peer_hash(peer.to_bytes())

    def seeds(self, key: bytes) -> list:
        return self._node._seeds(key)

    def skip(self):
        return self._node.health.skip(trio.current_time(), self._node.host.get_network().connections)

    def learn(self, peer) -> None:
        self._node._learn(peer)

    def forget(self, peer) -> None:
        self._node._forget(peer)

    def looked_up(self, result: LookupResult) -> None:
        self._node.last_lookup = result

    def store_locally(self, key: str, value: bytes) -> None:
        self._node.store_locally(key, value)

    def local_value(self, key: bytes) -> bytes | None:
        stored = self._node.store.get(key)
        return stored.value if stored is not None else None

    def wall_ms(self) -> int:
        return self._node.clock()
