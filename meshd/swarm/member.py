"""What an auto node decides each refresh, and how any node takes a directive (sans-I/O).

meshd/daemon/swarm_part.py is the I/O around these two functions (DHT reads,
libp2p exchanges, the worker slot); the tracker simulation in the tests
drives the same functions over in-memory records on a fake clock.

    join_step(duty, snap, now_ms, request, waiting)   a node serving nothing yet
        -> Wait(note)                  the swarm's records may not be in our view yet
        -> PlanOwn(assignment)         no tracker: plan our own range with the same pure planner
                                       (preferring ``request.prefer``, then the most-held layers)
        -> AskTracker(tracker, ask)    send /meshd/join/1 (with ``request.held`` and ``.prefer``),
                                       then take the reply's directive

    open_for(record, role)                   -> (directive, signer) | a refusal ack
    take_directive(directive, signer, ...)   -> Verdict(ack, action, span, ledger, note)
        the acceptance table of meshd/plan/directives.py in this node's own view, plus
        the node's own rules: fixed ranges and client-only nodes refuse, a slice holder
        refuses a LOAD outside its slice.

State: none; the caller keeps the ledger it is handed back.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshd.plan.adverts import CoverageMap, Span, holder_counts
from meshd.plan.assignment import Assignment, JoinRequest, plan_join
from meshd.plan.directives import DirectiveLedger, NodeView, accept_directive
from meshd.plan.errors import DirectiveRefused, PlanningError
from meshd.swarm.tracker_duty import TrackerDuty
from meshd.swarm.view import SwarmSnapshot
from meshd.swarm.wire import open_directive
from proto import shard_runtime_pb2 as pb
from proto.errors import MeshdError

# Characters of an error's text carried in an ack's detail (the ack is one bounded control frame).
MAX_ACK_DETAIL = 500


@dataclass(frozen=True, slots=True)
class Wait:
    note: str


@dataclass(frozen=True, slots=True)
class PlanOwn:
    assignment: Assignment


@dataclass(frozen=True, slots=True)
class AskTracker:
    tracker: str
    ask: pb.JoinAsk


JoinStep = Wait | PlanOwn | AskTracker


def join_step(duty: TrackerDuty, snap: SwarmSnapshot, now_ms: int, request: JoinRequest, *,
              waiting: bool) -> JoinStep:
    """The next step of a node that serves nothing yet. ``waiting``: it has bootstrap peers and
    started less than the grace period ago (its view of the swarm may still be empty)."""
    tracker = duty.tracker(snap, now_ms)
    if tracker is None and waiting:
        return Wait("waiting for the swarm's records to name a tracker before planning our own range")
    if tracker is None or tracker == request.peer_id:
        coverage = CoverageMap.build(snap.ads, model_digest=duty.model_digest, num_layers=duty.footprint.num_layers)
        try:
            return PlanOwn(plan_join(coverage, duty.footprint, request,
                                     holders=holder_counts(snap.ads, duty.footprint.num_layers)))
        except PlanningError as exc:
            return Wait(f"cannot plan a range: {exc}")
    held, prefer = request.held, request.prefer
    return AskTracker(tracker, pb.JoinAsk(
        schema_version=pb.SCHEMA_VERSION_1, model_artifact_digest=duty.model_digest,
        memory_budget_bytes=request.memory_bytes, kv_budget_tokens=request.kv_budget_tokens,
        held_start=held.start if held else 0, held_end=held.end if held else 0,
        prefer_start=prefer.start if prefer else 0, prefer_end=prefer.end if prefer else 0))


@dataclass(frozen=True, slots=True)
class Verdict:
    ack: pb.DirectiveAck
    action: int | None = None   # pb.DIRECTIVE_ACTION_LOAD_SHARD / DROP_SHARD when accepted
    span: Span | None = None
    ledger: DirectiveLedger | None = None   # the ledger to keep (None: unchanged)
    note: str = ""                          # a line for the node's progress log


def _refusal(reason: str, detail: str) -> pb.DirectiveAck:
    return pb.DirectiveAck(accepted=False, reason=reason, detail=detail[:MAX_ACK_DETAIL])


def open_for(record: bytes, role: str) -> tuple[pb.RebalanceDirective, str] | pb.DirectiveAck:
    """Verify a directive record for a node of ``role`` ("auto", "client" or "fixed"): the payload
    and its signer, or the ack refusing it before any view of the swarm is read."""
    try:
        directive, signer = open_directive(record)
    except MeshdError as exc:
        return _refusal("malformed", str(exc))
    if role == "client":
        return _refusal("client_only", "this node holds no layers (--layers none)")
    if role != "auto":
        return _refusal("fixed_range", "this node serves the range its operator gave (--layers A:B)")
    return directive, signer


def take_directive(directive: pb.RebalanceDirective, signer: str, *, view: NodeView, ledger: DirectiveLedger,
                   now_ms: int, held: Span | None) -> Verdict:
    """Accept or refuse one verified directive in this node's own view."""
    try:
        accepted, ledger = accept_directive(directive, signer_peer_id=signer, view=view, ledger=ledger, now_ms=now_ms)
    except DirectiveRefused as exc:
        return Verdict(_refusal(exc.reason.value, str(exc)), note=f"refused a directive from {signer[:16]}: {exc}")
    span, action = accepted.intent.span, accepted.intent.action
    if action == pb.DIRECTIVE_ACTION_LOAD_SHARD and held is not None and not (
            held.start <= span.start < span.end <= held.end):
        return Verdict(_refusal("not_held", f"this node holds layers {held.start}:{held.end} only"), ledger=ledger,
                       note=f"refused a directive from {signer[:16]}: layers {span.start}:{span.end} are outside "
                            f"our slice {held.start}:{held.end}")
    verb = "drop" if action == pb.DIRECTIVE_ACTION_DROP_SHARD else "load"
    return Verdict(pb.DirectiveAck(accepted=True), action, span, ledger,
                   f"directive from tracker {signer[:16]}: {verb} layers {span.start}:{span.end}")
