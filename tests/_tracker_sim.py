"""A simulated swarm for the tracker: the product's cores over in-memory records on trio's MockClock.

Each ``SimNode`` runs what meshd/daemon/swarm_part.py runs every refresh, with
the same sans-I/O functions: ``join_step`` (wait, plan alone, or ask the
tracker), the tracker's ``TrackerDuty.answer_join`` / ``rebalance`` /
``push_failed``, and ``open_for`` + ``take_directive`` for every directive it is
handed (real Ed25519 signatures, the real acceptance table). What is simulated:

* the DHT: every node's signed record is a ``ShardAd`` put at a virtual time;
  another node sees it ``propagation_ms`` later, its owner at once; it expires
  ``record_ttl_ms`` after its last put (a serving node re-puts every half TTL);
  a withdrawal (the worker stopped) hides it the same way;
* the worker slot: ``load(span)`` stops serving the old range at once and
  serves the new one ``load_s`` later; ``loads`` counts worker starts;
* the wire: a join ask or a directive reaches a live node at once.

``SimSwarm.served`` is the truth (who serves what now), and every change of it
is checked: a layer that loses its last server is recorded in ``lost``, with
whether the model already had a gap then.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import trio

from dht.identity import Identity
from meshd.daemon.swarm_part import NO_TRACKER_GRACE_S
from meshd.plan.adverts import CoverageMap, ShardAd, Span
from meshd.plan.assignment import JoinRequest, ModelFootprint
from meshd.plan.directives import DirectiveLedger, NodeView
from meshd.swarm.member import AskTracker, PlanOwn, Wait, join_step, open_for, take_directive
from meshd.swarm.tracker_duty import DUTY_REFRESH_S, TrackerDuty
from meshd.swarm.view import SwarmSnapshot, pool_status
from proto import shard_runtime_pb2 as pb

# Virtual wall clock at trio time 0: the start of a tracker epoch, so duty does not rotate mid-test.
T0_MS = 1_800_000_000_000
POLL_S = 0.5


@dataclass
class SimConfig:
    record_ttl_ms: int = 8_000
    propagation_ms: int = 1_000
    load_s: float = 20.0
    kv_budget_tokens: int = 1024


@dataclass
class Lost:
    at_ms: int
    peer_id: str
    layers: tuple[int, ...]
    had_gap: bool


class SimNode:
    def __init__(self, sim: SimSwarm, name: str, *, memory: int, held: Span | None, layers: Span | None) -> None:
        self.sim, self.name, self.memory, self.held, self.fixed = sim, name, memory, held, layers
        self.identity = Identity.from_seed(name.encode().ljust(32, b"\0")[:32])
        self.peer_id = self.identity.peer_id
        self.role = "fixed" if layers is not None else "auto"
        self.duty = TrackerDuty(self.peer_id, sim.footprint, self.identity.signing_key, sim.config.kv_budget_tokens,
                                rng=random.Random(name))
        self.ledger = DirectiveLedger()
        self.layers: Span | None = None   # the slot's range (loading or serving)
        self.serving = False
        self.loads = 0
        self.alive = True
        self.started_ms = sim.now_ms()
        self.notes: list[str] = []
        self._scope = trio.CancelScope()
        self._load: trio.CancelScope | None = None
        self._sequence = 0

    # ------------------------------------------------------------------ the refresh loop
    async def run(self) -> None:
        with self._scope:
            if self.fixed is not None:
                self.load(self.fixed)
            while True:
                self.refresh()
                await trio.sleep(DUTY_REFRESH_S)

    def refresh(self) -> None:
        now, snap = self.sim.now_ms(), self.sim.snapshot(self.peer_id)
        if self.role == "auto" and self.layers is None:
            self.join(snap, now)
        for target, records in self.duty.rebalance(snap, now):
            self.push(target, records)

    def join(self, snap: SwarmSnapshot, now: int) -> None:
        request = JoinRequest(self.peer_id, self.memory, self.sim.config.kv_budget_tokens, self.held)
        waiting = self.sim.bootstrapped(self) and now - self.started_ms < NO_TRACKER_GRACE_S * 1000
        step = join_step(self.duty, snap, now, request, waiting=waiting)
        if isinstance(step, Wait):
            self.notes.append(step.note)
        elif isinstance(step, PlanOwn):
            self.load(step.assignment.span)
        elif isinstance(step, AskTracker):
            tracker = self.sim.by_peer.get(step.tracker)
            if tracker is None or not tracker.alive:
                return
            reply = tracker.duty.answer_join(self.peer_id, step.ask, self.sim.snapshot(tracker.peer_id), now)
            if reply.HasField("directive"):
                self.apply(reply.directive.SerializeToString())
            else:
                self.notes.append(reply.refusal)

    def apply(self, record: bytes) -> pb.DirectiveAck:
        opened = open_for(record, self.role)
        if isinstance(opened, pb.DirectiveAck):
            return opened
        directive, signer = opened
        snap = self.sim.snapshot(self.peer_id)
        view = NodeView(self.peer_id, self.sim.footprint.model_digest, self.sim.footprint.num_layers, snap.ads)
        verdict = take_directive(directive, signer, view=view, ledger=self.ledger, now_ms=self.sim.now_ms(),
                                 held=self.held)
        if verdict.ledger is not None:
            self.ledger = verdict.ledger
        if verdict.note:
            self.notes.append(verdict.note)
        if verdict.action == pb.DIRECTIVE_ACTION_DROP_SHARD:
            self.drop()
        elif verdict.action == pb.DIRECTIVE_ACTION_LOAD_SHARD and verdict.span is not None:
            self.load(verdict.span)
        return verdict.ack

    def push(self, target: str, records: list[bytes]) -> None:
        node = self.sim.by_peer.get(target)
        for record in records:
            if node is None or not node.alive:
                self.duty.push_failed(target, self.sim.now_ms())
                return
            if not node.apply(record).accepted:
                self.duty.push_failed(target, self.sim.now_ms())
                return

    # ------------------------------------------------------------------ the worker slot
    def drop(self) -> None:
        if self._load is not None:
            self._load.cancel()
            self._load = None
        was = self.layers if self.serving else None
        self.layers, self.serving = None, False
        if was is not None:
            self.sim.put(self, None)
            self.sim.changed(self)

    def load(self, span: Span) -> None:
        if span == self.layers:
            return
        self.drop()
        self.layers, self.loads = span, self.loads + 1
        self._load = trio.CancelScope()
        self.sim.nursery.start_soon(self._serve, span, self._load)

    async def _serve(self, span: Span, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep(self.sim.config.load_s)
            self.serving = True
            self.sim.changed(self)
            while True:
                self.sim.put(self, span)
                await trio.sleep(self.sim.config.record_ttl_ms / 2000)

    def ad(self, span: Span) -> ShardAd:
        now = self.sim.now_ms()
        self._sequence += 1
        budget = self.memory if self.role == "auto" and self.held is None else 0
        return ShardAd(peer_id=self.peer_id, model_digest=self.sim.footprint.model_digest, start=span.start,
                       end=span.end, num_layers=self.sim.footprint.num_layers, decode_ms_per_layer=1.0,
                       prefill_tokens_per_s=100.0, free_kv_tokens=self.sim.config.kv_budget_tokens,
                       memory_budget_bytes=budget, relayed=False, expires_at_ms=now + self.sim.config.record_ttl_ms,
                       issued_at_ms=now, sequence=self._sequence)

    def kill(self) -> None:
        """The machine is gone: no withdrawal, its record expires."""
        self.alive = False
        self._scope.cancel()
        if self._load is not None:
            self._load.cancel()
        was_serving = self.serving
        self.layers, self.serving = None, False
        if was_serving:
            self.sim.changed(self)

    def pool(self) -> dict | None:
        """What this node's ``meshd status`` says about gaps (Swarm.pool_status over its own view)."""
        snap, now = self.sim.snapshot(self.peer_id), self.sim.now_ms()
        tracker = self.duty.tracker(snap, now)
        pending = ({p: s for p, (s, u) in self.duty.pending.items() if u > now} if tracker == self.peer_id
                   else None)
        return pool_status(snap, self.sim.footprint, self.sim.config.kv_budget_tokens, now,
                           num_layers=self.sim.footprint.num_layers, tracker=tracker, pending=pending)


@dataclass
class SimSwarm:
    footprint: ModelFootprint
    nursery: trio.Nursery
    config: SimConfig = field(default_factory=SimConfig)
    nodes: list[SimNode] = field(default_factory=list)
    by_peer: dict[str, SimNode] = field(default_factory=dict)
    puts: dict[str, list[tuple[int, ShardAd | None]]] = field(default_factory=dict)
    lost: list[Lost] = field(default_factory=list)
    _served: dict[str, Span] = field(default_factory=dict)

    def now_ms(self) -> int:
        return T0_MS + round(trio.current_time() * 1000)

    def start(self, name: str, *, memory: int = 0, held: Span | None = None, layers: Span | None = None) -> SimNode:
        node = SimNode(self, name, memory=memory, held=held, layers=layers)
        self.nodes.append(node)
        self.by_peer[node.peer_id] = node
        self.nursery.start_soon(node.run)
        return node

    def bootstrapped(self, node: SimNode) -> bool:
        return self.nodes[0] is not node   # the first node has nobody to bootstrap from

    # ------------------------------------------------------------------ records
    def put(self, node: SimNode, span: Span | None) -> None:
        self.puts.setdefault(node.peer_id, []).append((self.now_ms(), node.ad(span) if span else None))

    def snapshot(self, viewer: str) -> SwarmSnapshot:
        now, ads = self.now_ms(), []
        for peer, puts in self.puts.items():
            delay = 0 if peer == viewer else self.config.propagation_ms
            seen = [ad for at, ad in puts if at + delay <= now]
            if seen and seen[-1] is not None and seen[-1].is_live(now):
                ads.append(seen[-1])
        return SwarmSnapshot(self.footprint.model_digest, tuple(ads),
                             addrs={ad.peer_id: ("/ip4/127.0.0.1/tcp/1",) for ad in ads})

    # ------------------------------------------------------------------ the truth
    def served(self) -> dict[str, Span]:
        return {n.name: n.layers for n in self.nodes if n.alive and n.serving and n.layers is not None}

    def coverage(self) -> CoverageMap:
        n = self.footprint.num_layers
        servers = [tuple(sorted(name for name, s in self.served().items() if s.start <= layer < s.end))
                   for layer in range(n)]
        return CoverageMap(self.footprint.model_digest, n, tuple(servers))

    def changed(self, node: SimNode) -> None:
        """Record layers that just lost their last server, and whether the model had a gap already."""
        before = self._served
        after = {n.peer_id: n.layers for n in self.nodes if n.alive and n.serving and n.layers is not None}
        n = self.footprint.num_layers
        count = [sum(1 for s in before.values() if s.start <= layer < s.end) for layer in range(n)]
        now_count = [sum(1 for s in after.values() if s.start <= layer < s.end) for layer in range(n)]
        lost = tuple(layer for layer in range(n) if count[layer] == 1 and now_count[layer] == 0)
        if lost and node.alive:
            self.lost.append(Lost(self.now_ms(), node.peer_id, lost, had_gap=0 in count))
        self._served = after

    async def until(self, predicate, timeout_s: float, what: str):
        with trio.move_on_after(timeout_s):
            while True:
                got = predicate()
                if got:
                    return got
                await trio.sleep(POLL_S)
        raise AssertionError(f"{what}: not within {timeout_s:g} virtual s; served {self.served()}, notes "
                             + "; ".join(f"{n.name}: {n.notes[-3:]}" for n in self.nodes))
