"""Rebalance directives: building them (tracker side) and accepting them (node side).

Data flow::

    tracker: assignment intents -> build_directive(intent, epoch, now_ms, rng)
             -> pb.RebalanceDirective -> (daemon signs: proto/records.py) -> peer
    node:    SignedRecord -> (daemon verifies signature, maps key -> signer peer id)
             -> accept_directive(payload, signer, view, ledger, now_ms)
             -> (AcceptedDirective, new ledger)  |  DirectiveRefused(reason)

Acceptance rules, checked in this order (the first failing row refuses):

    row  rule                                                       reason
    1    schema v1, LOAD/DROP, id 1..64 printable, range inside
         the model, issued < expires, lifetime <= MAX_DIRECTIVE_TTL  MALFORMED
    2    target_peer_id is this node                                 WRONG_TARGET
    3    model_artifact_digest is the model this node plans for      WRONG_MODEL
    4    the verified signer is the named tracker_peer_id            SIGNER_MISMATCH
    5    issued_at <= now + skew; epoch <= epoch_at(now + skew)     FUTURE_DATED
    6    now < expires_at + skew; epoch >= epoch_at(now - skew)     EXPIRED
    7    directive_id unseen; epoch >= highest accepted epoch        REPLAYED
    8    signer is the current tracker of (model, epoch) in our view NOT_TRACKER
    9    DROP names exactly the range this node serves               NOT_SERVING
    10   DROP opens no gap in our view while sessions are active     WOULD_LEAVE_GAP
    11   fewer than MAX_SEEN_DIRECTIVES unexpired ids remembered     TOO_MANY

State: the ``DirectiveLedger`` (ids seen until they expire, highest epoch
accepted) is an immutable value the daemon keeps and replaces with the one
returned on acceptance; a refusal leaves it unchanged. Clock and RNG are
arguments. Signature checks are the daemon's (proto/records.py): this module
takes an already verified payload plus the signer's peer id.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from meshd.plan.adverts import ShardAd, Span, live_adverts
from meshd.plan.assignment import DirectiveIntent
from meshd.plan.errors import DirectiveRefused, PlanInputError, RefusalReason
from meshd.plan.tracker import TRACKER_EPOCH_MS, current_tracker, epoch_at
from proto import shard_runtime_pb2 as pb

# A directive is acted on within one DHT refresh period; a short life limits
# the window in which a captured directive could be replayed.
DEFAULT_DIRECTIVE_TTL_MS = 30_000
# Longest lifetime a node accepts: anything longer is a replay risk.
MAX_DIRECTIVE_TTL_MS = 5 * 60_000
# Clock disagreement tolerated between tracker and node (NTP-synced hosts
# agree within a second; home machines drift, so allow a few).
CLOCK_SKEW_MS = 5_000
# directive_id is 32 hex chars from build_directive; room for other formats.
MAX_DIRECTIVE_ID_LEN = 64
R = RefusalReason  # short alias for the table below

# Ids remembered until they expire. A correct tracker sends a node a few
# directives per refresh period; over MAX_DIRECTIVE_TTL_MS this is a flood.
MAX_SEEN_DIRECTIVES = 1024


def build_directive(intent: DirectiveIntent, *, tracker_peer_id: str, model_digest: str,
                    epoch: int, now_ms: int, rng: random.Random,
                    ttl_ms: int = DEFAULT_DIRECTIVE_TTL_MS) -> pb.RebalanceDirective:
    """The unsigned payload for one intent (the daemon signs and sends it).

    ``epoch`` is the one whose ranking made the sender tracker (by default
    ``tracker.epoch_at(now_ms)``); nodes check it against their own view.
    """
    if not 0 < ttl_ms <= MAX_DIRECTIVE_TTL_MS:
        raise PlanInputError(f"ttl_ms={ttl_ms} outside (0, {MAX_DIRECTIVE_TTL_MS}]")
    if not tracker_peer_id or not model_digest or now_ms < 0 or epoch < 0:
        raise PlanInputError("build_directive needs a tracker id, a model digest, now_ms >= 0, epoch >= 0")
    return pb.RebalanceDirective(
        schema_version=pb.SCHEMA_VERSION_1,
        directive_id=f"{rng.getrandbits(128):032x}",
        action=intent.action,
        tracker_peer_id=tracker_peer_id,
        target_peer_id=intent.target_peer_id,
        model_artifact_digest=model_digest,
        shard_range=pb.ShardRange(start_layer=intent.span.start, end_layer=intent.span.end,
                                  effective_start_layer=intent.span.start),
        epoch=epoch,
        issued_at_unix_ms=now_ms,
        expires_at_unix_ms=now_ms + ttl_ms,
    )


@dataclass(frozen=True, slots=True)
class NodeView:
    """What the accepting node knows: itself, its model, the live ads it sees."""

    self_peer_id: str
    model_digest: str
    num_layers: int
    ads: tuple[ShardAd, ...]
    active_sessions: int = 0
    epoch_ms: int = TRACKER_EPOCH_MS
    skew_ms: int = CLOCK_SKEW_MS

    def __post_init__(self) -> None:
        if not self.self_peer_id or not self.model_digest or self.num_layers < 1:
            raise PlanInputError("NodeView needs a peer id, a model digest and num_layers >= 1")
        if not isinstance(self.ads, tuple) or self.active_sessions < 0 or self.skew_ms < 0:
            raise PlanInputError("NodeView.ads must be a tuple; sessions and skew >= 0")
        if self.epoch_ms <= 0 or self.skew_ms >= self.epoch_ms:
            raise PlanInputError(f"NodeView needs 0 <= skew_ms < epoch_ms, got {self.skew_ms}, "
                                 f"{self.epoch_ms}")


@dataclass(frozen=True, slots=True)
class DirectiveLedger:
    """Replay memory: (directive_id, expires_at_ms) seen, and the highest epoch."""

    seen: frozenset[tuple[str, int]] = frozenset()
    highest_epoch: int = 0

    def pruned(self, now_ms: int, skew_ms: int) -> DirectiveLedger:
        """Forget ids that have expired: rule 6 refuses them anyway."""
        keep = frozenset(e for e in self.seen if now_ms < e[1] + skew_ms)
        return DirectiveLedger(keep, self.highest_epoch)

    def has(self, directive_id: str) -> bool:
        return any(i == directive_id for i, _ in self.seen)


@dataclass(frozen=True, slots=True)
class AcceptedDirective:
    directive_id: str
    tracker_peer_id: str
    epoch: int
    intent: DirectiveIntent


def _refuse(reason: RefusalReason, message: str) -> DirectiveRefused:
    return DirectiveRefused(reason, message)


def _check_shape(d: pb.RebalanceDirective, num_layers: int) -> Span:
    if d.schema_version != pb.SCHEMA_VERSION_1:
        raise _refuse(R.MALFORMED, f"schema_version {d.schema_version} is not SCHEMA_VERSION_1")
    if d.action not in (pb.DIRECTIVE_ACTION_LOAD_SHARD, pb.DIRECTIVE_ACTION_DROP_SHARD):
        raise _refuse(R.MALFORMED, f"action {d.action} is neither LOAD_SHARD nor DROP_SHARD")
    if not 0 < len(d.directive_id) <= MAX_DIRECTIVE_ID_LEN or not d.directive_id.isprintable():
        raise _refuse(R.MALFORMED, "directive_id must be 1..64 printable characters")
    r = d.shard_range
    if not r.start_layer < r.end_layer <= num_layers or r.effective_start_layer not in (0, r.start_layer):
        raise _refuse(R.MALFORMED, f"range [{r.start_layer}, {r.end_layer}) is not inside a "
                                   f"{num_layers}-layer model")
    life = d.expires_at_unix_ms - d.issued_at_unix_ms
    if d.issued_at_unix_ms < 0 or not 0 < life <= MAX_DIRECTIVE_TTL_MS:
        raise _refuse(R.MALFORMED, f"lifetime {life} ms outside (0, {MAX_DIRECTIVE_TTL_MS}]")
    return Span(r.start_layer, r.end_layer)


def accept_directive(d: pb.RebalanceDirective, *, signer_peer_id: str, view: NodeView,
                     ledger: DirectiveLedger, now_ms: int) -> tuple[AcceptedDirective, DirectiveLedger]:
    """Apply the acceptance table; return what to do and the ledger to keep."""
    span = _check_shape(d, view.num_layers)
    if d.target_peer_id != view.self_peer_id:
        raise _refuse(R.WRONG_TARGET, f"addressed to {d.target_peer_id!r}, this node is "
                                      f"{view.self_peer_id!r}")
    if d.model_artifact_digest != view.model_digest:
        raise _refuse(R.WRONG_MODEL, f"model {d.model_artifact_digest!r} is not {view.model_digest!r}")
    if signer_peer_id != d.tracker_peer_id:
        raise _refuse(R.SIGNER_MISMATCH, f"signed by {signer_peer_id!r} but names tracker "
                                         f"{d.tracker_peer_id!r}")
    skew = view.skew_ms
    newest_epoch = epoch_at(now_ms + skew, view.epoch_ms)
    oldest_epoch = epoch_at(max(0, now_ms - skew), view.epoch_ms)
    if d.issued_at_unix_ms > now_ms + skew or d.epoch > newest_epoch:
        raise _refuse(R.FUTURE_DATED, f"issued at {d.issued_at_unix_ms} (epoch {d.epoch}); our clock "
                                      f"reads {now_ms} (epoch <= {newest_epoch}) with {skew} ms skew")
    if now_ms >= d.expires_at_unix_ms + skew or d.epoch < oldest_epoch:
        raise _refuse(R.EXPIRED, f"expired at {d.expires_at_unix_ms} (epoch {d.epoch}); our clock "
                                 f"reads {now_ms} (epoch >= {oldest_epoch})")
    ledger = ledger.pruned(now_ms, skew)
    if ledger.has(d.directive_id) or d.epoch < ledger.highest_epoch:
        raise _refuse(R.REPLAYED, f"directive {d.directive_id} (epoch {d.epoch}) already seen or "
                                  f"older than epoch {ledger.highest_epoch}")
    tracker = current_tracker(view.ads, model_digest=view.model_digest, epoch=d.epoch, now_ms=now_ms)
    if tracker != signer_peer_id:
        raise _refuse(R.NOT_TRACKER, f"{signer_peer_id!r} is not the tracker of epoch {d.epoch} "
                                     f"in our view (that is {tracker!r})")
    if d.action == pb.DIRECTIVE_ACTION_DROP_SHARD:
        _check_drop(span, view, now_ms)
    if len(ledger.seen) >= MAX_SEEN_DIRECTIVES:
        raise _refuse(R.TOO_MANY, f"{len(ledger.seen)} unexpired directives already accepted")
    accepted = AcceptedDirective(d.directive_id, d.tracker_peer_id, d.epoch,
                                 DirectiveIntent(d.action, view.self_peer_id, span))
    new_ledger = DirectiveLedger(ledger.seen | {(d.directive_id, d.expires_at_unix_ms)},
                                 max(ledger.highest_epoch, d.epoch))
    return accepted, new_ledger


def _check_drop(span: Span, view: NodeView, now_ms: int) -> None:
    live = live_adverts(view.ads, model_digest=view.model_digest, now_ms=now_ms)
    mine = [ad for ad in live if ad.peer_id == view.self_peer_id]
    if not mine or mine[0].span != span:
        served = mine[0].span if mine else None
        raise _refuse(R.NOT_SERVING, f"DROP of layers {span} but this node serves {served}")
    if view.active_sessions == 0:
        return
    others = [ad for ad in live if ad.peer_id != view.self_peer_id and ad.num_layers == view.num_layers]
    uncovered = [layer for layer in range(span.start, span.end)
                 if not any(ad.serves(layer) for ad in others)]
    if uncovered:
        raise _refuse(R.WOULD_LEAVE_GAP, f"dropping layers {span} would leave layers "
                                         f"{uncovered[0]}..{uncovered[-1]} without a server while "
                                         f"{view.active_sessions} session(s) use them")
