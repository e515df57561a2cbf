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
* ``sync_peers()``: add every connected peer that speaks our swarm's DHT
  protocol to the routing table (``speaks_dht``: identify's list, else a
  probe stream); ``join()``: that, then a lookup of our own id (after bootstrap).

Swarm scope (dht/host/swarm_scope.py): the KadDHT serves, and our RPCs ask,
on the swarm's protocol id ``/meshd/kad/<tag>/1.0.0`` -- the library's
``/ipfs/kad/1.0.0`` handler is removed (host's public stream-handler API;
``KadDHT.handle_stream`` does not look at the protocol id). A connected peer
of another swarm (or another libp2p program) cannot answer our lookups nor
store with us, and is kept out of our routing table and lookup seeds for
FOREIGN_RECHECK_S after a check found it does not speak our protocol.
* ``refresh()``: every REFRESH_INTERVAL_S at a random phase (``_maintain``, in
  place of the library's maintenance loop: see REFRESH_INTERVAL_S), lookups of
  our own id and of one random key, then the store's expiry sweep.

In a home swarm (fewer than k peers) the k closest peers of every key are
every node, so a read sees everything; beyond, lookups route. Measured by
``meshd bench dht`` (200 nodes in 5 processes on 2 shared cores): every
record found by every sampled node in at most ceil(log2 N) + 2 rounds; after
20% of the nodes die at once, the survivors' lookups keep meeting the dead
(named by other peers' answers) and RPC deadlines, and the view takes longer
than one republish interval to be complete again (figures: README, "Run a node").

RPCs: GET_VALUE and PUT_VALUE go through dht/rpc.py (the library's wire,
but a stream cut by our deadline is reset, not left open at the peer). Each
is bounded by a deadline derived from the latencies this node measured
(``RpcTimer``: one for peers we are connected to, between ``RPC_TIMEOUT_S``
and ``RPC_TIMEOUT_CEILING_S``, one for peers we must dial first, between
``DIAL_TIMEOUT_S`` and the same ceiling): a busy machine's slow answers
raise the deadline instead of turning into failures that widen every
lookup; fast answers never lower it below the first one (see the constants).
A connected peer that leaves an RPC unanswered gets its own deadline doubled
per consecutive miss (its first miss also counts as a latency sample of the
deadline, so an overloaded machine raises every deadline); after STUCK_AFTER misses its connection is closed and it
leaves the routing table (a peer whose host exited without closing its
connections must not cost every later lookup a deadline) -- unless other
connected peers missed deadlines too within CONGESTION_WINDOW_S: then this
machine or the network is congested and the peer is kept (``stuck_kept``),
since closing a busy peer's connection fails its RPCs in flight both ways and
makes the next one pay a handshake, load added where there is too much (in
a CI run of ``meshd bench dht``, congested by the library's maintenance burst
-- see REFRESH_INTERVAL_S -- 7,911 connections to live peers were closed as
stuck after the kill). For
the same reason a PUT is sent again only when the peer refused it (reset the
stream), never when our deadline cut it. Within one lookup,
connected peers cut by the deadline are asked once more when several were
(congestion; ``Lookup.late``); a lone late peer is given up at once. A peer
whose dial failed (no connection) is left out of every lookup for
UNREACHABLE_S unless it connects again (``Lookup``'s ``skip``).

State: the KadDHT (routing table, value store), the record cache and the two
RPC timers are owned here; records are owned by their signers. Concurrency
of network calls is bounded by ``MAX_PARALLEL_RPCS`` and the lookup's alpha.
"""
from __future__ import annotations

import logging
import random
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

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
from dht.expert_records import parse_expert_set_lenient
from dht.host.swarm_scope import DEFAULT_SCOPE, SwarmScope
from dht.lookup import K_CLOSEST, SEED_PEERS, Lookup
from dht.peer_health import CLOSE, KEEP, PeerHealth
from dht.records import (
    CapabilityRecord,
    RecordCache,
    encode_record_set,
    merge_records,
    parse_record_set_lenient,
    validate_capability,
)
from dht.relay_records import RelayRecord, parse_relay_set_lenient
from dht.rpc import RpcTimer
from dht.validator import MergingValueStore, check_value, namespaced_validator

log = logging.getLogger(__name__)

# Kademlia's k: how many closest peers hold each key.
REPLICATION = K_CLOSEST
# One slow peer must not stall a publish or a read for long; a live peer answers
# a DHT RPC in milliseconds on a LAN, well under a second across the internet.
# These are the first deadlines; measured latencies move them (RpcTimer).
RPC_TIMEOUT_S = 3.0
# Routing-table insertions of answering peers running at once in the background (``_learn``).
MAX_PENDING_INSERTS = 4
# Consecutive unanswered RPCs after which a connected peer's connection is closed (_rpc) --
# unless another connected peer also left an RPC unanswered within CONGESTION_WINDOW_S:
# then the machine or the network is congested, late means busy, and closing would turn
# the peer's in-flight RPCs (both ways) into failures and its next RPC into a new handshake.
STUCK_AFTER = 3
CONGESTION_WINDOW_S = 30.0
RECENT_MISSES = 64
# A peer we could not reach (dial refused, no connection) is left out of our lookups for
# UNREACHABLE_S, unless it is connected again (it came back and dialed us); at most
# MAX_UNREACHABLE remembered (the oldest forgotten first).
UNREACHABLE_S = 300.0
MAX_UNREACHABLE = 1024
# Dialing a peer we are not connected to: on loopback or a LAN a live peer
# answers in milliseconds; a gone one would otherwise hold a publish for long.
DIAL_TIMEOUT_S = 2.0
# A measured deadline never goes below the first one (RPC_TIMEOUT_S, DIAL_TIMEOUT_S)
# and never above RPC_TIMEOUT_CEILING_S (one dead peer would stall a lookup round).
# Not lower: a deadline cut loses the answer, and quiet-time latencies (tens of
# ms) say nothing about a burst -- measured in ``meshd bench dht`` at 200 nodes
# with a 1 s floor: a burst of lookups on a starved machine cut 12% of all RPCs
# and found a quarter of the records. A dead peer's connection is gone (a
# failed dial costs no deadline); a connected peer that is late is busy.
RPC_TIMEOUT_CEILING_S = 10.0
# Concurrent DHT RPCs per operation (Kademlia's alpha is 3; ours is a small swarm).
MAX_PARALLEL_RPCS = 8
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
PUT_ATTEMPTS = 3
PUT_RETRY_PAUSE_S = (0.05, 0.4)
# py-libp2p 0.8.1's KadDHT runs a maintenance loop (``KadDHT._run_main_loop``): at its start and
# every 600 s a routing-table refresh -- a lookup of its own id, then one per non-empty bucket,
# one after another, through the library's own RPCs (not cancel-safe, see dht/rpc.py) -- and
# republishes of values stored with ``put`` (meshd stores with ``put_record``: there are none).
# Nodes started together refresh together: in ``meshd bench dht`` 200 nodes' ~1,800 library
# lookups landed at once 600 s after the start, and whatever phase the bench was in collapsed
# (a CI run: 52,598 RPCs cut after the kill, the survivors' views never complete again).
# meshd replaces that loop with ``DhtNode._maintain``: a lookup of our own id and of one random
# key (a far bucket) through meshd's lookup, and the store's expiry sweep, every
# REFRESH_INTERVAL_S at a random phase (x uniform REFRESH_JITTER). Version-gated
# (``replace_maintenance``), shown in ``meshd status`` as ``dht_maintenance`` (dht/compat/;
# no upstream issue found).
REFRESH_INTERVAL_S = 600.0
REFRESH_JITTER = (0.5, 1.5)
# A connected peer found not to speak our swarm's DHT protocol (another swarm, another libp2p
# program) stays out of the routing table and lookups this long before it is checked again
# (a peer that restarted into our swarm is in again within that); at most MAX_FOREIGN remembered.
FOREIGN_RECHECK_S = 60.0
MAX_FOREIGN = 1024


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


@dataclass(frozen=True, slots=True)
class LookupResult:
    closest: tuple        # the k closest peers that answered, nearest first (PUT targets)
    rounds: int           # rounds of parallel asks the lookup took
    asked: int            # peers asked in all
    failed: int = 0       # of them, how many did not answer (unreachable, cut by the deadline)


class DhtNode:
    def __init__(self, host, clock: Callable[[], int], scope: SwarmScope = DEFAULT_SCOPE) -> None:
        self.host = host
        self.clock = clock
        self.scope = scope
        self.protocol = TProtocol(scope.dht_protocol)
        self.records = RecordCache()     # records whose signatures this node checked (dht/records.py)
        self.kad = KadDHT(host, DHTMode.SERVER, validator=namespaced_validator(clock, self.records),
                          validator_changed=True, strict_validation=True)
        # serve on our swarm's protocol, not the library's (see the module docstring)
        host.remove_stream_handler(LIBRARY_DHT_PROTOCOL)
        host.set_stream_handler(self.protocol, self.kad.handle_stream)
        # connected peers found not to speak our DHT protocol -> when to check again (trio time)
        self._foreign: OrderedDict = OrderedDict()
        self.foreign_seen = 0
        self.kad.value_store = MergingValueStore(host, host.get_id(), clock, self.records)
        self.store: MergingValueStore = self.kad.value_store
        self.last_lookup: LookupResult | None = None
        # deadlines of RPCs to connected peers, and to peers dialed first (measured, see the docstring)
        self.rpc_timer = RpcTimer(RPC_TIMEOUT_S, RPC_TIMEOUT_S, RPC_TIMEOUT_CEILING_S)
        self.dial_timer = RpcTimer(DIAL_TIMEOUT_S, DIAL_TIMEOUT_S, RPC_TIMEOUT_CEILING_S)
        # outcomes of this node's RPCs (``rpc_stats``): answered, cut by our deadline, failed
        self.rpc_counts = {"answered": 0, "timed_out": 0, "failed": 0, "stuck_closed": 0, "stuck_kept": 0}
        # per peer: consecutive misses (its deadline doubles per miss), congestion, unreachable peers
        self.health = PeerHealth(stuck_after=STUCK_AFTER, congestion_window_s=CONGESTION_WINDOW_S,
                                 recent=RECENT_MISSES, unreachable_s=UNREACHABLE_S, max_unreachable=MAX_UNREACHABLE)
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

    async def _maintain(self) -> None:
        """The routing-table refresh (in place of the library's; see REFRESH_INTERVAL_S): our
        own id's neighbourhood and one random far bucket, then the expiry sweep; at a random
        phase so that nodes started together do not refresh together."""
        rng = random.Random()
        while True:
            await trio.sleep(REFRESH_INTERVAL_S * rng.uniform(*REFRESH_JITTER))
            try:
                await self.refresh(rng.randbytes(32))
            except Exception as exc:  # noqa: BLE001 - the next refresh tries again
                log.info("DHT refresh failed: %s", exc)

    async def refresh(self, far_key: bytes) -> None:
        """One refresh: lookups of our own id and of ``far_key``, then drop expired values."""
        await self.lookup(self.host.get_id().to_bytes())
        await self.lookup(far_key)
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
        until = self._foreign.get(peer)
        return until is not None and until > trio.current_time()

    def foreign_peers(self) -> list[str]:
        """Connected peers known not to speak our DHT protocol (``meshd status``)."""
        return sorted(p.to_base58() for p in self.host.get_connected_peers() if self._is_foreign(p))

    async def speaks_dht(self, peer) -> bool:
        """Does the connected ``peer`` serve our swarm's DHT protocol? Yes when identify listed it;
        else a probe stream decides (negotiated: yes, then reset; refused or silent: no, remembered
        for FOREIGN_RECHECK_S)."""
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
            self._foreign.pop(peer, None)
            return True
        if peer not in self._foreign:
            self.foreign_seen += 1
            log.info("peer %s does not speak our swarm's DHT protocol %s (another swarm, or not meshd): "
                     "kept out of the routing table", peer, self.protocol)
        self._foreign.pop(peer, None)
        self._foreign[peer] = trio.current_time() + FOREIGN_RECHECK_S
        while len(self._foreign) > MAX_FOREIGN:
            self._foreign.popitem(last=False)
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
        check_value(key, value, self.clock(), self.records)
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

        async def one_key(key: str, value: bytes, session: rpc.Session) -> None:
            nonlocal acked
            stored = await self.put_remote(key, value, session)   # not ``acked += await``: that reads acked first
            acked += stored

        async with rpc.Session(self.host, self.protocol) as session:   # the keys' lookups and PUTs share streams
            async with trio.open_nursery() as nursery:
                for key, value in puts:
                    nursery.start_soon(one_key, key, value, session)
        return acked

    async def put_remote(self, key: str, value: bytes, session: rpc.Session | None = None) -> int:
        """PUT ``value`` at the k closest peers of ``key`` that a network lookup finds.

        The PUTs go over the streams the lookup's GET_VALUEs opened (``session``,
        one of its own when not given): the k closest were just asked."""
        if session is None:
            async with rpc.Session(self.host, self.protocol) as own:
                return await self.put_remote(key, value, own)
        kb = key.encode()
        targets = (await self.lookup(kb, session=session)).closest
        acked = 0
        limiter = trio.CapacityLimiter(MAX_PARALLEL_RPCS)

        network = self.host.get_network()

        async def one(peer) -> None:
            nonlocal acked
            for attempt in range(PUT_ATTEMPTS):
                if attempt:   # refused (a busy peer resets) but still connected: it is alive
                    await trio.sleep(random.uniform(*PUT_RETRY_PAUSE_S))
                async with limiter:
                    answer = await self._rpc(peer, rpc.put_value, kb, value, session=session)
                if answer is True:
                    acked += 1
                    return
                if answer is self._TIMED_OUT or peer not in network.connections:
                    return      # late: busy (asking again adds load where there is too much); gone

        async with trio.open_nursery() as nursery:
            for peer in targets:
                nursery.start_soon(one, peer)
        return acked

    def rpc_stats(self) -> dict:
        """Counts of this node's RPC outcomes and its two deadline estimators (JSON-able)."""
        return {**self.rpc_counts, "connected": self.rpc_timer.snapshot(), "dialed": self.dial_timer.snapshot()}

    def _timer_for(self, peer) -> RpcTimer:
        """The deadline estimator for an RPC to ``peer``: connected, or to be dialed first."""
        return self.rpc_timer if peer in self.host.get_network().connections else self.dial_timer

    _TIMED_OUT = object()

    async def _rpc(self, peer, call, *args, session: rpc.Session | None = None):
        """``call(host, peer, *args, session)`` under the measured deadline; its result, ``_TIMED_OUT``,
        or None when it failed (dial refused, stream reset). Feeds the latency into the timer.

        A connected peer that leaves RPCs unanswered gets a deadline doubled per consecutive
        miss (its own, not everyone's; only its first miss counts as a latency sample, so a
        machine-wide overload raises every deadline while one stuck peer cannot); after STUCK_AFTER
        misses in a row its connection is closed and it leaves the routing table: a connection
        whose far end stopped reading (a host that exited without closing it) must not cost
        every later RPC a deadline."""
        timer = self._timer_for(peer)
        connected = timer is self.rpc_timer
        misses = self.health.misses(peer) if connected else 0
        start = trio.current_time()
        try:
            with trio.move_on_after(timer.timeout(misses)):
                result = await call(self.host, peer, *args, session=session, protocol=self.protocol)
                timer.observe(trio.current_time() - start)
                self.rpc_counts["answered"] += 1
                self.health.answered(peer)
                return result
        except Exception as exc:  # noqa: BLE001 - dial and stream errors of every kind (groups too)
            log.debug("DHT RPC to %s failed: %s", peer, exc)
            self.rpc_counts["failed"] += 1
            self.health.failed(peer)
            return None
        self.rpc_counts["timed_out"] += 1
        if connected:    # a connected peer that did not answer in time: busy, or stuck
            if misses == 0:   # a peer's first miss is a latency sample of at least the deadline
                timer.observe(trio.current_time() - start)     # (its later misses are its own: backoff)
            verdict = self.health.missed(peer, trio.current_time())
            if verdict == KEEP:
                self.rpc_counts["stuck_kept"] += 1     # busy among busy peers: kept, at its backoff
            elif verdict == CLOSE:
                await self._close_stuck(peer)
        return self._TIMED_OUT

    async def _close_stuck(self, peer) -> None:
        """Drop a connected peer that left STUCK_AFTER RPCs in a row unanswered: out of the
        routing table, its connection closed (shielded, bounded); a live peer reconnects."""
        self.rpc_counts["stuck_closed"] += 1
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

    async def lookup(self, kb: bytes, *, values: list[bytes] | None = None,
                     session: rpc.Session | None = None) -> LookupResult:
        """Iterative Kademlia lookup of ``kb`` (dht/lookup.py) over GET_VALUE.

        Every answering peer's value is appended to ``values`` when given.
        A peer that fails leaves our routing table; one that answers joins it (in the
        background: ``_learn``, so a full bucket's ping of its oldest peer never holds a round).
        With ``session`` the streams stay open for the caller's next RPCs.
        """
        me = self.host.get_id()
        network = self.host.get_network()
        lk = Lookup(kb, self._seeds(kb), to_bytes=lambda p: p.to_bytes(), exclude=me,
                    skip=self.health.skip(trio.current_time(), network.connections))

        async def ask(peer) -> None:
            answer = await self._rpc(peer, rpc.get_value, kb, session=session)
            if answer is self._TIMED_OUT and peer in network.connections:
                lk.late(peer)        # past the quorum, asked once more, under its doubled deadline
                return
            if answer is None or answer is self._TIMED_OUT:
                lk.failed(peer)
                # a peer we cannot reach leaves the table; one cut by our deadline
                # or refused on a live connection (a busy peer) stays
                if answer is None and peer not in network.connections:
                    self.kad.routing_table.remove_peer(peer)
                    self.health.mark_unreachable(peer, trio.current_time())
                return
            got, closer = answer
            lk.answered(peer, closer)
            if isinstance(got, Record) and got.value and values is not None:
                values.append(got.value)
            self._learn(peer)

        while batch := lk.next_batch():
            async with trio.open_nursery() as nursery:
                for peer in batch:
                    nursery.start_soon(ask, peer)
            lk.round_done()
        result = LookupResult(closest=tuple(lk.answered_closest()), rounds=lk.rounds,
                              asked=sum(s != "new" for s in lk.state.values()),
                              failed=sum(s == "failed" for s in lk.state.values()))
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
                recs = self._decode(parsed, value, now, self.records)
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
    def _decode(parsed: K.ParsedKey, value: bytes, now: int,
                cache: RecordCache | None = None) -> list[CapabilityRecord]:
        if parsed.kind == "relays":
            return parse_relay_set_lenient(value, now)  # type: ignore[return-value]
        if parsed.kind == "experts":
            recs = parse_expert_set_lenient(value, now)
            if any(r.model_artifact_digest != parsed.subject for r in recs):
                raise RecordRejected("key_mismatch", "expert record of another model")
            return recs  # type: ignore[return-value]
        if parsed.kind == "peer":
            rec = validate_capability(value, now, cache)
            if rec.peer_id != parsed.subject:
                raise RecordRejected("key_mismatch", "record of another peer")
            return [rec]
        recs = parse_record_set_lenient(value, now, cache)
        for rec in recs:
            if rec.model_artifact_digest != parsed.subject:
                raise RecordRejected("key_mismatch", "record of another model")
            if parsed.kind == "span" and not rec.withdrawn and rec.span != parsed.span:
                raise RecordRejected("key_mismatch", "record of another span")
        return recs

    def local_models(self) -> list[str]:
        """Artifact digests of the model indexes this node holds."""
        return sorted(K.parse_key(k).subject for k in self.store.index_keys())
