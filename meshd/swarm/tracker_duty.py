"""Tracker duty: plan ranges for ``--layers auto`` nodes, close gaps, issue signed directives.

Runs in every daemon that knows a model (a child of the daemon's nursery,
through meshd/daemon/swarm_part.py). Each refresh (``DUTY_REFRESH_S``) it reads the
model's live ads from the DHT and computes the current tracker with the
planner's pure ranking (tracker.py: rank by hash distance to (model, epoch)
among the layer-0 servers). Only the node that finds itself on duty acts:

* answers ``/meshd/join/1`` asks: ``plan_join`` over the coverage map plus
  the assignments it issued that are still loading (``pending``), inside the
  layers the asker holds (``JoinAsk.held_start/held_end``: a GGUF slice),
  preferring what it holds unbound (``prefer_*``: fetched before) and then
  the layers most peers serve on a fetch port (``holder_counts``).
  When that greedy window would leave a gap that a new layout of the pool
  closes (meshd/plan/layout.py: the joiner plus moves of other auto nodes),
  the joiner gets its range in that layout instead, and the layout becomes
  the plan the refreshes carry out. It signs a LOAD_SHARD directive for the
  asker and returns it (meshd/swarm/wire.py);
* while the model has a gap confirmed by ``GAP_CONFIRMATIONS`` refreshes in
  a row, it plans a layout (``plan_layout``: the fewest moves of auto nodes
  that cover every layer, ranges in proportion to their budgets) and keeps
  it while the pool it was made for stays the same (``basis``); each refresh
  it pushes DROP_SHARD + LOAD_SHARD over ``/meshd/directive/1`` for every
  move that is safe now (``ready_moves``: the layers a node gives up are
  served by another that is not moving), so moves chain as their
  replacements come up. A swap that no safe order allows moves one node at
  a time once nothing is loading (``forced_move``). The node checks every
  directive (directives.py) and answers; a refusal pins that node for
  ``REFUSED_BACKOFF_MS`` and the next refresh plans around it.

When no layout covers, nothing moves: the pool is short, and every node's
status, the dashboard and the API's 503 say by how much (view.py
``pool_status``, the same pure function over the same records).

A node that is not on duty refuses join asks ("not the tracker"), so a
joiner that raced a change of duty simply asks again at its next refresh.

State (owned here): ``pending`` -- peer id -> (span, until_ms) for LOADs
issued but not yet advertised (they count as covered, and are never moved
again while loading); the plan being carried out and the basis it was made
for; ``refused`` -- peer id -> until_ms. Signing uses the node's identity key.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field, replace

from meshd.plan.adverts import CoverageMap, ShardAd, Span, holder_counts
from meshd.plan.assignment import DirectiveIntent, JoinRequest, ModelFootprint, plan_join
from meshd.plan.directives import build_directive
from meshd.plan.errors import NoFitError, PlanInputError
from meshd.plan.layout import Layout, Member, forced_move, gaps_of, members_from_ads, plan_layout, ready_moves
from meshd.plan.tracker import current_tracker, epoch_at
from meshd.swarm.view import SwarmSnapshot
from meshd.swarm.wire import sign_directive
from proto import shard_runtime_pb2 as pb

log = logging.getLogger(__name__)

# How often duty is re-evaluated and gaps looked at; a dead tracker's
# successor acts within one period after its record is gone.
DUTY_REFRESH_S = 3.0
# A LOAD counts as coverage for this long before the target advertises: the
# worker must read its weights and pass a validation forward (a minute or so
# for a mid-size model on a slow CPU).
PENDING_LOAD_MS = 180_000
# Bound on remembered pending assignments (one per joiner) and refusing nodes.
MAX_PENDING = 256
# A gap must be seen in this many consecutive refreshes before a node is
# moved into it: DHT views are eventually consistent, and a record that is
# republished late looks like a gap for a moment. Moving a node on such a
# phantom opens a real gap elsewhere (its withdrawal), which the next
# refresh would "fix" by moving another: a cascade. A dead node's record
# lingers for its TTL anyway, so waiting a few refreshes costs little.
GAP_CONFIRMATIONS = 3
# A node that refused a move (sessions still running, a directive it could not
# check) or could not be reached is left where it is this long: ten refreshes,
# time for its sessions to end, without asking again every refresh.
REFUSED_BACKOFF_MS = 30_000

Basis = frozenset[tuple[str, int, Span | None, bool]]


def _coverage(members: tuple[Member, ...], model_digest: str, num_layers: int) -> CoverageMap:
    per_layer: list[list[str]] = [[] for _ in range(num_layers)]
    for m in members:
        if m.span is not None:
            for layer in range(m.span.start, m.span.end):
                per_layer[layer].append(m.peer_id)
    return CoverageMap(model_digest, num_layers, tuple(tuple(sorted(p)) for p in per_layer))


@dataclass(slots=True)
class TrackerDuty:
    self_peer_id: str
    footprint: ModelFootprint
    signing_key: object
    kv_budget_tokens: int
    rng: random.Random = field(default_factory=random.Random)
    pending: dict[str, tuple[Span, int]] = field(default_factory=dict)
    gap_streak: int = 0
    plan: Layout | None = None        # the layout being carried out (or None: nothing to do, or short)
    planned: bool = False             # a plan was computed for ``basis`` (also when it is None: short)
    basis: Basis | None = None        # the pool the plan was made for
    refused: dict[str, int] = field(default_factory=dict)

    @property
    def model_digest(self) -> str:
        return self.footprint.model_digest

    def tracker(self, snap: SwarmSnapshot, now_ms: int) -> str | None:
        return current_tracker(snap.ads, model_digest=self.model_digest, epoch=epoch_at(now_ms), now_ms=now_ms)

    def on_duty(self, snap: SwarmSnapshot, now_ms: int) -> bool:
        return self.tracker(snap, now_ms) == self.self_peer_id

    # ------------------------------------------------------------------ the pool
    def members(self, snap: SwarmSnapshot, now_ms: int) -> tuple[Member, ...]:
        """The pool as the layout sees it: live ads, our pending loads (pinned, loading), the nodes
        that refused a move lately pinned where they are. Drops pending loads once advertised or stale."""
        n = self.footprint.num_layers
        live = {a.peer_id: a for a in snap.ads if a.num_layers == n and a.is_live(now_ms)}
        for peer, (span, until) in list(self.pending.items()):
            ad = live.get(peer)
            if until <= now_ms or (ad is not None and ad.span == span):
                del self.pending[peer]
        for peer, until in list(self.refused.items()):
            if until <= now_ms:
                del self.refused[peer]
        members = members_from_ads(snap.ads, model_digest=self.model_digest, num_layers=n, now_ms=now_ms,
                                   tracker=self.tracker(snap, now_ms),
                                   pending={p: s for p, (s, _) in self.pending.items()})
        return tuple(replace(m, movable=False) if m.movable and m.peer_id in self.refused else m for m in members)

    def coverage(self, snap: SwarmSnapshot, now_ms: int) -> tuple[CoverageMap, tuple[ShardAd, ...]]:
        """Coverage of live ads plus still-loading assignments, and the live ads."""
        members = self.members(snap, now_ms)
        n = self.footprint.num_layers
        live = tuple(a for a in snap.ads if a.num_layers == n and a.is_live(now_ms))
        return _coverage(members, self.model_digest, n), live

    def _basis(self, members: tuple[Member, ...]) -> Basis:
        """What the plan depends on: every member, the plan's movers by id only (their spans change as
        they move). Another node joining, leaving, loading or refusing makes a new plan."""
        movers = set(self.plan.targets) if self.plan is not None else set()
        return frozenset((m.peer_id, 0, None, False) if m.peer_id in movers else
                         (m.peer_id, m.memory_bytes, m.span, m.movable) for m in members)

    def _signed(self, intent: DirectiveIntent, now_ms: int) -> bytes:
        d = build_directive(intent, tracker_peer_id=self.self_peer_id, model_digest=self.model_digest,
                            epoch=epoch_at(now_ms), now_ms=now_ms, rng=self.rng)
        return sign_directive(d, self.signing_key)

    # ------------------------------------------------------------------ joins
    def answer_join(self, peer_id: str, ask: pb.JoinAsk, snap: SwarmSnapshot, now_ms: int) -> pb.JoinReply:
        if ask.model_artifact_digest != self.model_digest:
            return pb.JoinReply(refusal=f"this tracker plans {self.model_digest[:23]}..., not that model")
        if not self.on_duty(snap, now_ms):
            return pb.JoinReply(refusal=f"not the tracker (that is {self.tracker(snap, now_ms)})")
        if len(self.pending) >= MAX_PENDING and peer_id not in self.pending:
            return pb.JoinReply(refusal="too many assignments still loading; ask again later")
        self.pending.pop(peer_id, None)   # it asks again: what it was told to load is not coming
        members = tuple(m for m in self.members(snap, now_ms) if m.peer_id != peer_id)
        n = self.footprint.num_layers
        coverage = _coverage(members, self.model_digest, n)
        try:
            held = Span(int(ask.held_start), int(ask.held_end)) if ask.held_end else None
            prefer = Span(int(ask.prefer_start), int(ask.prefer_end)) if ask.prefer_end else None
            request = JoinRequest(peer_id, int(ask.memory_budget_bytes),
                                  int(ask.kv_budget_tokens or self.kv_budget_tokens), held, prefer)
        except PlanInputError as exc:
            return pb.JoinReply(refusal=str(exc))
        try:
            greedy: Span | None = plan_join(coverage, self.footprint, request, holders=holder_counts(
                (a for a in snap.ads if a.is_live(now_ms)), n)).span
            refusal = ""
        except (NoFitError, PlanInputError) as exc:
            greedy, refusal = None, str(exc)
        span, reason = greedy, "coverage first"
        if held is None and (greedy is None or gaps_of(n, (*members, Member(peer_id, 0, greedy, movable=False)))):
            joiner = Member(peer_id, request.memory_bytes)
            layout = plan_layout(self.footprint, (*members, joiner), self.kv_budget_tokens)
            if layout is not None and peer_id in layout.targets:   # the joiner and some moves close every gap
                span, reason = layout.targets[peer_id], f"in a layout with {len(layout.moves) - 1} move(s)"
                self.plan, self.planned, self.basis = layout, True, None   # basis: taken at the next refresh
        if span is None:
            return pb.JoinReply(refusal=refusal)
        if held is not None and not held.start <= span.start < span.end <= held.end:
            return pb.JoinReply(refusal=f"no range inside the held layers {held.start}:{held.end}")
        intent = DirectiveIntent(pb.DIRECTIVE_ACTION_LOAD_SHARD, peer_id, span)
        self.pending[peer_id] = (span, now_ms + PENDING_LOAD_MS)
        log.info("tracker: %s joins with layers %s (%s)", peer_id[:16], span, reason)
        return pb.JoinReply(directive=pb.SignedRecord.FromString(self._signed(intent, now_ms)))

    # ------------------------------------------------------------------ gaps
    def rebalance(self, snap: SwarmSnapshot, now_ms: int) -> list[tuple[str, list[bytes]]]:
        """Signed directives to push now: [(target peer, [DROP, LOAD])], one entry per move."""
        if not self.on_duty(snap, now_ms):
            self.gap_streak, self.plan, self.planned, self.basis = 0, None, False, None
            return []
        members = self.members(snap, now_ms)
        n = self.footprint.num_layers
        if not gaps_of(n, members):
            self.gap_streak, self.plan, self.planned, self.basis = 0, None, False, None
            return []
        self.gap_streak += 1
        if self.planned and self.basis is None:
            self.basis = self._basis(members)   # a plan made while answering a join
        if not self.planned or self._basis(members) != self.basis:
            if self.gap_streak < GAP_CONFIRMATIONS:
                return []   # not a confirmed gap yet
            self.plan = plan_layout(self.footprint, members, self.kv_budget_tokens)
            self.planned, self.basis = True, self._basis(members)
            if self.plan is not None and self.plan.moves:
                log.info("tracker: a layout closes the gap with %d move(s)%s", len(self.plan.moves),
                         "" if self.plan.safe else " (a swap)")
        if self.plan is None:
            return []   # short of memory: pool_status says by how much
        served = {m.peer_id: m.span for m in members if m.span is not None and not m.loading}
        todo = [mv for mv in self.plan.moves if served.get(mv.peer_id) != mv.new and mv.peer_id not in self.pending]
        batch = ready_moves(todo, served, n)
        if not batch and todo and not self.plan.safe and not any(m.loading for m in members):
            forced = forced_move(todo, served, n)
            batch = (forced,) if forced is not None else ()
        pushes = []
        for move in batch:
            old = served.get(move.peer_id)
            intents = ([DirectiveIntent(pb.DIRECTIVE_ACTION_DROP_SHARD, move.peer_id, old)] if old else []) + [
                DirectiveIntent(pb.DIRECTIVE_ACTION_LOAD_SHARD, move.peer_id, move.new)]
            self.pending[move.peer_id] = (move.new, now_ms + PENDING_LOAD_MS)
            pushes.append((move.peer_id, [self._signed(i, now_ms) for i in intents]))
        return pushes

    def push_failed(self, peer_id: str, now_ms: int) -> None:
        """A move's directive was refused or not delivered: leave that node be for a while, replan."""
        self.pending.pop(peer_id, None)
        if len(self.refused) < MAX_PENDING:
            self.refused[peer_id] = now_ms + REFUSED_BACKOFF_MS
        self.plan, self.planned, self.basis = None, False, None
