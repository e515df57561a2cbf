"""The in-memory twin of the DHT's network: many nodes running the core on a fake clock.

Every simulated node is the product's core -- the operations of
dht/kademlia/ops.py, the RpcBook's deadlines and peer health, a
``ValueStore`` with the validator's rules, a routing table that follows
py-libp2p's -- and nothing else; this module is only the network between
them and the clock.

Data flow::

    Network.run_until(t) -- one trio task, on trio's MockClock
      pops (time, sequence, action) off its own heap, moves the clock to it,
      runs the action, hashes it into the trace
    a node's operation (a step of ops.py), driven by ``_advance``:
      Get / Put  -> ``_send``: a dial first when not connected (refused by a
                    dead peer, unanswered by a NAT'd one), the request
                    reaches the peer after the link's latency (``_deliver``:
                    the peer serves it with the core's rules), the answer
                    comes back after the peer's service time and the
                    latency -- or the caller's deadline (RpcBook) cuts it
      Pause      -> a wake-up on the heap
      Together   -> one driver per sub-step; the parent resumes with their
                    results when the last returns (``limit``: a FIFO limiter)
    ``kill``: nodes die at once; their connections close, and RPCs to them
    in flight fail when the reset reaches the caller.

Why one task and its own heap: trio runs tasks that become ready together
in an order it randomises on purpose, so per-node tasks would make the
trace differ from run to run. Here the order is (time, sequence number),
the sequence given when the event was scheduled, and every choice draws
from RNGs seeded by the simulation's seed: the same seed gives the same
trace, whose SHA-256 is ``trace_digest``. Why the clock is jumped, not
slept on: an autojump sleep costs ~0.1 ms of trio's scheduling here, and a
1,000-node run has about a million events; ``MockClock.jump`` moves trio's
clock to each event's time, so ``trio.current_time()`` is the virtual time
throughout.

The network model (all seeded):

* one-way latency of a link = the two ends' access delays (ACCESS_MS) plus a
  backbone delay per pair (BACKBONE_MS);
* a dial costs DIAL_ROUND_TRIPS round trips (TCP, Noise, multistream) before
  the request; a dead peer refuses it after one round trip; a NAT'd peer
  never answers a dial (only connections it opened reach it), and announces
  no dialable address, so no table takes it in;
* a slow peer answers after an extra service time drawn from an exponential
  of mean SLOW_SERVICE_S, sometimes past the caller's deadline;
* connections stay up until an end dies or a stuck peer is closed; both
  ends put each other in their routing tables when a connection comes up
  (the daemon's peer sync, ``sync_peers`` every 2 s), a NAT'd peer excepted;
* serving, as py-libp2p's KadDHT does: the caller joins the server's table
  first (a full bucket pings its oldest peer, and the answer waits for that
  ping); a GET answers the stored value and the k closest of the server's
  table (the caller left out); a PUT is validated, selected and merged, and
  a refused one resets the stream (the caller sees a failure).

State: the nodes (each owns its table, store, book, connections), the event
heap, the in-flight RPCs per target, the counts and the trace hash: all
owned by the ``Network``; nothing else touches them.
"""
from __future__ import annotations

import hashlib
import heapq
import random
import struct
from collections import deque
from collections.abc import Callable

import trio
import trio.testing

from dht.errors import RecordRejected
from dht.kademlia import ops
from dht.kademlia.book import CLOSE, RpcBook
from dht.kademlia.ops import ANSWERED, FAILED, TIMED_OUT, Get, LookupResult, Outcome, Pause, Put, Together
from dht.kademlia.table import RoutingTable, key_position
from dht.kademlia.values import ValueStore
from dht.lookup import SEED_PEERS
from dht.records import RecordCache

# A home uplink adds a few ms each way; the backbone between two homes tens of ms.
ACCESS_MS = (1.0, 20.0)
BACKBONE_MS = (2.0, 60.0)
# TCP handshake, Noise XX and multistream negotiation before the first request.
DIAL_ROUND_TRIPS = 2
# A slow peer's extra time to answer: exponential, this mean; past a 3 s deadline ~14% of the time.
SLOW_SERVICE_S = 1.5
# Trace bytes hashed at once.
TRACE_CHUNK = 1 << 16
# Events between two trio checkpoints: the simulation's task yields now and then.
CHECKPOINT_EVERY = 4096
# The wall clock the simulation starts at (records carry wall-clock ms): 2026-01-01.
EPOCH_MS = 1_767_225_600_000

_TRACE = struct.Struct("<dBIII")
# trace event codes
T_SEND, T_DELIVER, T_ANSWER, T_FAIL, T_EXPIRE, T_CONNECT, T_KILL, T_MARK = range(8)


def _mix(*values: int) -> int:
    """A deterministic 64-bit hash of small ints (splitmix64 steps)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h


class Links:
    """Seeded one-way latencies (seconds) between simulated nodes: both ends' access delays
    plus a backbone delay per pair, drawn from the product of the ends' odd 64-bit salts."""

    def __init__(self, count: int, seed: int) -> None:
        rng = random.Random(_mix(seed, 1))
        self.access = [rng.uniform(*ACCESS_MS) / 1000 for _ in range(count)]
        self.salt = [rng.getrandbits(64) | 1 for _ in range(count)]
        self._base = BACKBONE_MS[0] / 1000
        self._span = (BACKBONE_MS[1] - BACKBONE_MS[0]) / 1000 / 2 ** 16

    def one_way(self, a: int, b: int) -> float:
        mixed = (self.salt[a] * self.salt[b]) >> 48 & 0xFFFF
        return self.access[a] + self.access[b] + self._base + mixed * self._span


class SimNode:
    """One simulated node: the core's state, and the ``ops.Node`` view its operations see."""

    def __init__(self, net: Network, index: int, peer_id: bytes, *, nat: bool, slow: bool) -> None:
        self.net = net
        self.me = index
        self.peer_id = peer_id
        self.nat, self.slow = nat, slow
        self.alive = True
        self.cache = net.cache
        self.rng = random.Random(_mix(net.seed, 2, index))
        self.table: RoutingTable[int] = RoutingTable(index, net.position.__getitem__)
        self.store = ValueStore(self.wall_ms, net.cache)
        self.book = RpcBook()
        self.conns: dict[int, None] = {}          # connected peers, in connection order
        self.inserting: set[int] = set()          # answering peers whose table insertion pings
        self.inflight: dict[int, _Rpc] = {}       # RPCs to this node not resolved yet
        self.last_lookup: LookupResult | None = None

    # ---- ops.Node
    def to_bytes(self, peer: int) -> bytes:
        return self.net.peer_ids[peer]

    def position(self, peer: int) -> int:
        return self.net.position[peer]

    def seeds(self, key: bytes) -> list:
        found = self.table.closest(key, SEED_PEERS)
        known = set(found)
        found += [p for p in self.conns if p not in known]
        return found

    def skip(self):
        return self.book.health.skip(self.net.now, self.conns)

    def learn(self, peer: int) -> None:
        """DhtNode._learn: an answering peer into the table, off the lookup's path (a full
        bucket's ping runs on its own), at most MAX_PENDING_INSERTS pinging at once."""
        if (self.net.nodes[peer].nat or peer in self.inserting or len(self.inserting) >= MAX_PENDING_INSERTS
                or peer in self.table):
            return
        self.net.insert(self, peer, self.inserting)

    def forget(self, peer: int) -> None:
        self.table.remove(peer)
        self.book.health.mark_unreachable(peer, self.net.now)

    def looked_up(self, result: LookupResult) -> None:
        self.last_lookup = result
        self.net.lookups += 1
        self.net.max_rounds = max(self.net.max_rounds, result.rounds)

    def store_locally(self, key: str, value: bytes) -> None:
        self.store.store_locally(key, value)

    def local_value(self, key: bytes) -> bytes | None:
        return self.store.get(key)

    def wall_ms(self) -> int:
        return EPOCH_MS + int(self.net.now * 1000)


# dht/node.py's MAX_PENDING_INSERTS (not imported: that module is the libp2p edge)
MAX_PENDING_INSERTS = 4


class _Limiter:
    __slots__ = ("limit", "busy", "waiting")

    def __init__(self, limit: int) -> None:
        self.limit, self.busy = limit, 0
        self.waiting: deque = deque()


class _Join:
    """A ``Together`` in progress: its parent resumes when the last sub-step returns."""

    __slots__ = ("parent", "results", "left")

    def __init__(self, parent: _Driver, count: int) -> None:
        self.parent, self.results, self.left = parent, [None] * count, count


class _Driver:
    """One running step of a node: resumed with each effect's result; when it returns, its
    result goes to ``done`` (a started operation) or into its ``join`` at ``index``."""

    __slots__ = ("node", "step", "limiter", "join", "index", "done")

    def __init__(self, node: SimNode, step: ops.Step, limiter: _Limiter | None,
                 join: _Join | None = None, index: int = 0, done: Callable | None = None) -> None:
        self.node, self.step, self.limiter = node, step, limiter
        self.join, self.index, self.done = join, index, done


class _Rpc:
    __slots__ = ("id", "driver", "effect", "start", "deadline_at", "connected", "misses", "resolved")

    def __init__(self, rid: int, driver: _Driver, effect, start: float, deadline_at: float,
                 connected: bool, misses: int) -> None:
        self.id, self.driver, self.effect = rid, driver, effect
        self.start, self.deadline_at = start, deadline_at
        self.connected, self.misses = connected, misses
        self.resolved = False


class Network:
    """The simulated network and its event loop (see the module docstring)."""

    def __init__(self, peer_ids: list[bytes], *, seed: int, nat: frozenset = frozenset(),
                 slow: frozenset = frozenset(), cache_entries: int | None = None) -> None:
        self.seed = seed
        self.peer_ids = peer_ids
        self.position = [key_position(p) for p in peer_ids]
        # Records that passed their signature check, shared by every node: rules 1-6 of
        # dht/records.py depend on the bytes alone, so one node's check holds for all
        # (each real node keeps its own cache; sharing saves the simulation re-checking).
        self.cache = RecordCache(cache_entries or 8 * len(peer_ids) + 1024)
        self.links = Links(len(peer_ids), seed)
        self.rng = random.Random(_mix(seed, 3))
        self.now = 0.0
        self.nodes = [SimNode(self, i, p, nat=i in nat, slow=i in slow) for i, p in enumerate(peer_ids)]
        self._heap: list = []
        self._seq = 0
        self._rpc_ids = 0
        self._dialing: dict[tuple[int, int], float] = {}   # (a, b) -> when a's dial to b is up
        self._trace = hashlib.sha256()
        self._pending_trace = bytearray()     # hashed in chunks: one update per event costs more
        self.events = 0
        self.messages = {"get": 0, "put": 0}
        self.lookups = 0
        self.max_rounds = 0
        self._clock: trio.testing.MockClock | None = None

    # ------------------------------------------------------------------ clock and events

    def at(self, when: float, action: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, action, args))

    def mark(self, code: int, a: int = 0, b: int = 0) -> None:
        """Hash one event into the trace."""
        buf = self._pending_trace
        buf += _TRACE.pack(self.now, code, a, b, self._seq)
        if len(buf) > TRACE_CHUNK:
            self._trace.update(buf)
            buf.clear()

    def trace_digest(self) -> str:
        self._trace.update(self._pending_trace)
        self._pending_trace.clear()
        return self._trace.hexdigest()

    async def run_until(self, when: float, stop: Callable[[], bool] | None = None) -> None:
        """Process every event up to ``when`` (virtual seconds), or until ``stop()``; the clock ends at ``when``
        (or at the event that made ``stop()`` true)."""
        clock = self._clock
        heap = self._heap
        pop = heapq.heappop
        while heap and heap[0][0] <= when:
            t, _, action, args = pop(heap)
            if t > self.now:
                if clock is not None:
                    clock.jump(t - self.now)
                self.now = t
            action(*args)
            self.events += 1
            if self.events % CHECKPOINT_EVERY == 0:
                await trio.lowlevel.checkpoint()
            if stop is not None and stop():
                return
        if when > self.now:
            if clock is not None:
                clock.jump(when - self.now)
            self.now = when

    def attach(self, clock: trio.testing.MockClock) -> None:
        """Drive trio's ``clock`` (rate 0) along with the virtual time."""
        self._clock = clock
        clock.jump(max(0.0, self.now - trio.current_time()))

    # ------------------------------------------------------------------ operations

    def start(self, node: SimNode, step: ops.Step, done: Callable | None = None) -> None:
        """Run ``step`` (an ops.py operation) on ``node``; ``done(result)`` when it returns."""
        self._advance(_Driver(node, step, None, done=done), None)

    def _advance(self, drv: _Driver, value) -> None:
        node = drv.node
        while True:
            if not node.alive:
                return
            try:
                effect = drv.step.send(value)
            except StopIteration as stop:
                join = drv.join
                if join is None:
                    if drv.done is not None:
                        drv.done(stop.value)
                    return
                join.results[drv.index] = stop.value
                join.left -= 1
                if join.left:
                    return
                drv, value = join.parent, join.results     # the last sub-step: its parent goes on
                continue
            kind = type(effect)
            if kind is Get or kind is Put:
                lim = drv.limiter
                if lim is not None:
                    if lim.busy >= lim.limit:
                        lim.waiting.append((drv, effect))
                        return
                    lim.busy += 1
                self._send(drv, effect)
                return
            if kind is Pause:
                self.at(self.now + effect.seconds, self._advance, drv, None)
                return
            if kind is Together:
                count = len(effect.steps)
                if not count:
                    value = []
                    continue
                lim = _Limiter(effect.limit) if effect.limit else drv.limiter
                join = _Join(drv, count)
                for i, sub in enumerate(effect.steps):
                    self._advance(_Driver(node, sub, lim, join, i), None)
                return
            raise TypeError(f"unknown DHT effect {effect!r}")

    # ------------------------------------------------------------------ RPCs

    def _send(self, drv: _Driver, effect) -> None:
        a, b = drv.node, self.nodes[effect.peer]
        connected = b.me in a.conns
        misses = a.book.misses(b.me, connected)
        deadline_at = self.now + a.book.timer(connected).timeout(misses)
        self._rpc_ids += 1
        rpc = _Rpc(self._rpc_ids, drv, effect, self.now, deadline_at, connected, misses)
        self.messages["get" if type(effect) is Get else "put"] += 1
        one_way = self.links.one_way(a.me, b.me)
        t = self.now
        if not connected:
            if not b.alive:                             # refused: a reset after one round trip
                when = t + 2 * one_way
                if when < deadline_at:
                    self.at(when, self._fail, rpc)
                else:
                    self.at(deadline_at, self._expire, rpc)
                return
            if b.nat:                                   # the dial is never answered
                self.at(deadline_at, self._expire, rpc)
                return
            up = self._dialing.get((a.me, b.me))
            if up is None or up < t:
                up = t + DIAL_ROUND_TRIPS * 2 * one_way
                self._dialing[(a.me, b.me)] = up
                self.at(up, self._connect, a.me, b.me)
            t = up
        b.inflight[rpc.id] = rpc
        if t + one_way >= deadline_at:              # cut before the request even arrives
            self.at(deadline_at, self._expire, rpc)
        self.at(t + one_way, self._deliver, rpc)

    def dial(self, a: int, b: int, then: Callable[[], None]) -> None:
        """``a`` dials ``b`` (a bootstrap connection); ``then()`` once the connection is up."""
        up = self.now + DIAL_ROUND_TRIPS * 2 * self.links.one_way(a, b)
        self._dialing[(a, b)] = up
        self.at(up, self._connect, a, b)
        self.at(up, then)

    def _connect(self, a: int, b: int) -> None:
        self._dialing.pop((a, b), None)
        na, nb = self.nodes[a], self.nodes[b]
        if not (na.alive and nb.alive) or b in na.conns:
            return
        self.mark(T_CONNECT, a, b)
        na.conns[b] = None
        nb.conns[a] = None
        for me, other in ((na, nb), (nb, na)):          # the daemon's peer sync
            if not other.nat:
                self.insert(me, other.me)

    def insert(self, node: SimNode, peer: int, pending: set | None = None) -> float:
        """``peer`` into ``node``'s table; a full bucket pings its oldest peer (one round trip, a
        dead one refuses), evicted when it does not answer. Returns the ping's duration (0: none);
        ``pending`` holds ``peer`` while its ping runs."""
        oldest = node.table.add(peer)
        if oldest is None:
            return 0.0
        took = 2 * self.links.one_way(node.me, oldest)
        if oldest not in node.conns:
            took *= 1 + DIAL_ROUND_TRIPS
        if pending is not None:
            pending.add(peer)
        self.at(self.now + took, self._pinged, node, oldest, peer, pending)
        return took

    def _pinged(self, node: SimNode, oldest: int, newcomer: int, pending: set | None) -> None:
        if pending is not None:
            pending.discard(newcomer)
        if node.alive and not self.nodes[oldest].alive:
            node.table.evict(oldest, newcomer)

    def _deliver(self, rpc: _Rpc) -> None:
        """The request reaches the peer, which serves it (py-libp2p's handler, with the core's rules)."""
        caller, server = rpc.driver.node, self.nodes[rpc.effect.peer]
        if not (server.alive and caller.alive):
            return
        took = 0.0 if caller.nat else self.insert(server, caller.me)
        effect = rpc.effect
        outcome: Outcome | None
        if type(effect) is Get:
            value = server.store.get(effect.key)
            closer = server.table.closest(effect.key)
            if caller.me in closer:
                closer.remove(caller.me)
            outcome = Outcome(ANSWERED, True, value=value, closer=tuple(closer))
        else:
            try:
                stored = server.store.put(effect.key, effect.value)
            except RecordRejected:
                stored = False
            outcome = Outcome(ANSWERED, True, stored=True) if stored else None
        if server.slow:
            took += self.rng.expovariate(1 / SLOW_SERVICE_S)
        back = self.now + took + self.links.one_way(caller.me, server.me)
        if rpc.resolved:
            return
        if back < rpc.deadline_at:
            self.at(back, self._answer, rpc, outcome)
        else:
            self.at(rpc.deadline_at, self._expire, rpc)

    def _settle(self, rpc: _Rpc) -> bool:
        """Mark ``rpc`` resolved; False when it already was, or its caller died meanwhile."""
        if rpc.resolved:
            return False
        rpc.resolved = True
        self.nodes[rpc.effect.peer].inflight.pop(rpc.id, None)
        drv = rpc.driver
        lim = drv.limiter
        if lim is not None:
            lim.busy -= 1
            if lim.waiting and drv.node.alive:      # the limiter's drivers are all this node's
                nxt, effect = lim.waiting.popleft()
                lim.busy += 1
                self._send(nxt, effect)
        return drv.node.alive

    def _answer(self, rpc: _Rpc, outcome: Outcome | None) -> None:
        if outcome is None:             # a refused PUT: the stream is reset
            self._fail(rpc)
            return
        if not self._settle(rpc):
            return
        caller, peer = rpc.driver.node, rpc.effect.peer
        self.mark(T_ANSWER, caller.me, peer)
        caller.book.answered(peer, rpc.connected, self.now - rpc.start)
        if peer not in caller.conns:
            outcome = Outcome(outcome.kind, False, outcome.value, outcome.closer, outcome.stored)
        self._advance(rpc.driver, outcome)

    def _fail(self, rpc: _Rpc) -> None:
        if not self._settle(rpc):
            return
        caller, peer = rpc.driver.node, rpc.effect.peer
        self.mark(T_FAIL, caller.me, peer)
        caller.book.failed(peer)
        self._advance(rpc.driver, Outcome(FAILED, peer in caller.conns))

    def _expire(self, rpc: _Rpc) -> None:
        if not self._settle(rpc):
            return
        caller, peer = rpc.driver.node, rpc.effect.peer
        self.mark(T_EXPIRE, caller.me, peer)
        verdict = caller.book.timed_out(peer, rpc.connected, self.now - rpc.start, self.now, rpc.misses)
        if verdict == CLOSE:            # DhtNode._close_stuck: out of the table, connection closed
            caller.table.remove(peer)
            self.disconnect(caller.me, peer)
        self._advance(rpc.driver, Outcome(TIMED_OUT, peer in caller.conns))

    def disconnect(self, a: int, b: int) -> None:
        self.nodes[a].conns.pop(b, None)
        self.nodes[b].conns.pop(a, None)

    # ------------------------------------------------------------------ churn

    def kill(self, victims: list[int]) -> None:
        """``victims`` die at once: their connections close; RPCs to them fail as the reset reaches
        each caller (or at its deadline, whichever is first)."""
        for v in victims:
            node = self.nodes[v]
            self.mark(T_KILL, v)
            node.alive = False
            for peer in list(node.conns):
                self.disconnect(v, peer)
            for rpc in list(node.inflight.values()):
                when = self.now + self.links.one_way(v, rpc.driver.node.me)
                self.at(min(when, rpc.deadline_at), self._fail if when < rpc.deadline_at else self._expire, rpc)
            node.inflight.clear()


def run_on_mock_clock(main: Callable, *args):
    """``trio.run(main, clock, *args)`` on a MockClock (rate 0) that the simulation moves."""
    clock = trio.testing.MockClock(rate=0)
    return trio.run(main, clock, *args, clock=clock)
