"""Tracker duty: plan ranges for ``--layers auto`` nodes and issue signed directives.

Runs in every daemon that knows a model (a child of the daemon's nursery,
through meshd/daemon/swarm_part.py). Each refresh (``DUTY_REFRESH_S``) it reads the
model's live ads from the DHT and computes the current tracker with the
planner's pure ranking (tracker.py: rank by hash distance to (model, epoch)
among the layer-0 servers). Only the node that finds itself on duty acts:

* answers ``/meshd/join/1`` asks: ``plan_join`` over the coverage map plus
  the assignments it issued that are still loading (``pending``), inside the
  layers the asker holds (``JoinAsk.held_start/held_end``: a GGUF slice),
  preferring what it holds unbound (``prefer_*``: fetched before) and then
  the layers most peers serve on a fetch port,
  signs a LOAD_SHARD directive for the asker and returns it (meshd/swarm/wire.py);
* while the model has a gap confirmed by ``GAP_CONFIRMATIONS`` refreshes in
  a row and nothing is still loading, ``plan_rebalance`` moves at most one
  fully redundant auto node (never the tracker itself) into it: DROP_SHARD
  then LOAD_SHARD, pushed over ``/meshd/directive/1``; the node checks them
  (directives.py) and answers.

A node that is not on duty refuses join asks ("not the tracker"), so a
joiner that raced a change of duty simply asks again at its next refresh.

State (owned here): ``pending`` -- peer id -> (span, until_ms) for LOADs
issued but not yet advertised, so two joiners asking within one load time
are not sent to the same gap. Signing uses the node's identity key.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from meshd.plan.adverts import CoverageMap, ShardAd, Span, holder_counts
from meshd.plan.assignment import DirectiveIntent, JoinRequest, ModelFootprint, plan_join, plan_rebalance
from meshd.plan.directives import build_directive
from meshd.plan.errors import NoFitError, PlanInputError
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
# Bound on remembered pending assignments (one per joiner).
MAX_PENDING = 256
# A gap must be seen in this many consecutive refreshes before a node is
# moved into it: DHT views are eventually consistent, and a record that is
# republished late looks like a gap for a moment. Moving a node on such a
# phantom opens a real gap elsewhere (its withdrawal), which the next
# refresh would "fix" by moving another: a cascade. A dead node's record
# lingers for its TTL anyway, so waiting a few refreshes costs little.
GAP_CONFIRMATIONS = 3


def _virtual_ad(peer_id: str, span: Span, model_digest: str, num_layers: int, until_ms: int) -> ShardAd:
    return ShardAd(peer_id=peer_id, model_digest=model_digest, start=span.start, end=span.end,
                   num_layers=num_layers, decode_ms_per_layer=0.0, prefill_tokens_per_s=0.0, free_kv_tokens=0,
                   memory_budget_bytes=0, relayed=False, expires_at_ms=until_ms)


@dataclass(slots=True)
class TrackerDuty:
    self_peer_id: str
    footprint: ModelFootprint
    signing_key: object
    kv_budget_tokens: int
    rng: random.Random = field(default_factory=random.Random)
    pending: dict[str, tuple[Span, int]] = field(default_factory=dict)
    gap_streak: int = 0

    @property
    def model_digest(self) -> str:
        return self.footprint.model_digest

    def tracker(self, snap: SwarmSnapshot, now_ms: int) -> str | None:
        return current_tracker(snap.ads, model_digest=self.model_digest, epoch=epoch_at(now_ms), now_ms=now_ms)

    def on_duty(self, snap: SwarmSnapshot, now_ms: int) -> bool:
        return self.tracker(snap, now_ms) == self.self_peer_id

    def coverage(self, snap: SwarmSnapshot, now_ms: int) -> tuple[CoverageMap, tuple[ShardAd, ...]]:
        """Coverage of live ads plus still-loading assignments (dropped once advertised or stale)."""
        n = self.footprint.num_layers
        live = {a.peer_id: a for a in snap.ads if a.num_layers == n and a.is_live(now_ms)}
        for peer, (span, until) in list(self.pending.items()):
            ad = live.get(peer)
            if until <= now_ms or (ad is not None and ad.span == span):
                del self.pending[peer]
        virtual = [_virtual_ad(p, s, self.model_digest, n, u) for p, (s, u) in self.pending.items()
                   if p not in live]
        ads = tuple(live.values()) + tuple(virtual)
        return CoverageMap.build(ads, model_digest=self.model_digest, num_layers=n), tuple(live.values())

    def _signed(self, intent, now_ms: int) -> bytes:
        d = build_directive(intent, tracker_peer_id=self.self_peer_id, model_digest=self.model_digest,
                            epoch=epoch_at(now_ms), now_ms=now_ms, rng=self.rng)
        return sign_directive(d, self.signing_key)

    def answer_join(self, peer_id: str, ask: pb.JoinAsk, snap: SwarmSnapshot, now_ms: int) -> pb.JoinReply:
        if ask.model_artifact_digest != self.model_digest:
            return pb.JoinReply(refusal=f"this tracker plans {self.model_digest[:23]}..., not that model")
        if not self.on_duty(snap, now_ms):
            return pb.JoinReply(refusal=f"not the tracker (that is {self.tracker(snap, now_ms)})")
        if len(self.pending) >= MAX_PENDING and peer_id not in self.pending:
            return pb.JoinReply(refusal="too many assignments still loading; ask again later")
        coverage, live = self.coverage(snap, now_ms)
        current = next((a.span for a in live if a.peer_id == peer_id), None)
        try:
            held = Span(int(ask.held_start), int(ask.held_end)) if ask.held_end else None
            prefer = Span(int(ask.prefer_start), int(ask.prefer_end)) if ask.prefer_end else None
            plan = plan_join(coverage, self.footprint, JoinRequest(
                peer_id, int(ask.memory_budget_bytes), int(ask.kv_budget_tokens or self.kv_budget_tokens), held,
                prefer), holders=holder_counts(live, self.footprint.num_layers))
        except (NoFitError, PlanInputError) as exc:
            return pb.JoinReply(refusal=str(exc))
        load = next(i for i in plan.intents if i.action == pb.DIRECTIVE_ACTION_LOAD_SHARD) if plan.intents else None
        if load is None:  # it already serves the planned range
            load_span = current or plan.span
        else:
            load_span = load.span
        if held is not None and not held.start <= load_span.start < load_span.end <= held.end:
            load_span = plan.span  # never outside what the asker holds (its current ad may predate the slice)
        intent = DirectiveIntent(pb.DIRECTIVE_ACTION_LOAD_SHARD, peer_id, load_span)
        self.pending[peer_id] = (load_span, now_ms + PENDING_LOAD_MS)
        log.info("tracker: %s joins with layers %s (%s)", peer_id[:16], load_span, plan.reason.value)
        return pb.JoinReply(directive=pb.SignedRecord.FromString(self._signed(intent, now_ms)))

    def rebalance(self, snap: SwarmSnapshot, now_ms: int) -> list[tuple[str, list[bytes]]]:
        """Signed directives to push now: [(target peer, [DROP, LOAD])], at most one move."""
        if not self.on_duty(snap, now_ms):
            self.gap_streak = 0
            return []
        coverage, live = self.coverage(snap, now_ms)
        self.gap_streak = 0 if coverage.fully_covered else self.gap_streak + 1
        if self.gap_streak < GAP_CONFIRMATIONS or self.pending:
            return []  # not a confirmed gap, or a move / join still loading: one change at a time
        # Never the tracker itself: it is an entry node, and moving it would shift duty mid-plan.
        movable = [a for a in live if a.memory_budget_bytes > 0 and a.peer_id != self.self_peer_id]
        intents = plan_rebalance(coverage, self.footprint, movable, kv_budget_tokens=self.kv_budget_tokens)
        if not intents:
            return []
        target = intents[0].target_peer_id
        load = [i for i in intents if i.action == pb.DIRECTIVE_ACTION_LOAD_SHARD]
        if load:
            self.pending[target] = (load[0].span, now_ms + PENDING_LOAD_MS)
        self.gap_streak = 0
        return [(target, [self._signed(i, now_ms) for i in intents])]
