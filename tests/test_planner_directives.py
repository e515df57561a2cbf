"""Rebalance directives: build -> accept, and the refusal table row by row."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.plan.adverts import Span
from meshd.plan.assignment import DirectiveIntent
from meshd.plan.directives import (
    CLOCK_SKEW_MS,
    MAX_DIRECTIVE_TTL_MS,
    MAX_SEEN_DIRECTIVES,
    DirectiveLedger,
    NodeView,
    accept_directive,
    build_directive,
)
from meshd.plan.errors import DirectiveRefused, PlanInputError, RefusalReason
from meshd.plan.tracker import TRACKER_EPOCH_MS, rank_trackers
from proto import shard_runtime_pb2 as pb
from proto.errors import ProtocolError
from tests._planner_helpers import MODEL, make_ad

LOAD, DROP = pb.DIRECTIVE_ACTION_LOAD_SHARD, pb.DIRECTIVE_ACTION_DROP_SHARD
EPOCH = 10
NOW = EPOCH * TRACKER_EPOCH_MS + TRACKER_EPOCH_MS // 2
HEADS = tuple(make_ad(f"12D3KooWhead{i}", 0, 4) for i in range(4))
ME = make_ad("12D3KooWme", 4, 8)
TWIN = make_ad("12D3KooWtwin", 4, 8)
TRACKER, RUNNER_UP = rank_trackers(HEADS, model_digest=MODEL, epoch=EPOCH, now_ms=NOW)[:2]


def view(*, ads=HEADS + (ME,), sessions=0) -> NodeView:
    return NodeView(ME.peer_id, MODEL, 8, tuple(ads), active_sessions=sessions)


def directive(action=LOAD, span=(4, 8), *, tracker=TRACKER, epoch=EPOCH, now=NOW, seed=1, **fields):
    d = build_directive(DirectiveIntent(action, ME.peer_id, Span(*span)), tracker_peer_id=tracker,
                        model_digest=MODEL, epoch=epoch, now_ms=now, rng=random.Random(seed))
    for key, value in fields.items():
        if key == "range":
            d.shard_range.start_layer, d.shard_range.end_layer = value
            d.shard_range.effective_start_layer = value[0]
        elif key == "raw_effective":
            d.shard_range.effective_start_layer = value
        elif key == "raw_action":
            d.action = value
        else:
            setattr(d, key, value)
    return d


def test_a_directive_from_the_tracker_is_accepted_and_remembered():
    d = directive()
    assert d.schema_version == pb.SCHEMA_VERSION_1 and len(d.directive_id) == 32
    assert d.expires_at_unix_ms - d.issued_at_unix_ms == 30_000
    accepted, ledger = accept_directive(d, signer_peer_id=TRACKER, view=view(),
                                        ledger=DirectiveLedger(), now_ms=NOW + 100)
    assert accepted.intent == DirectiveIntent(LOAD, ME.peer_id, Span(4, 8))
    assert (accepted.directive_id, accepted.epoch, accepted.tracker_peer_id) == (d.directive_id, EPOCH, TRACKER)
    assert ledger.has(d.directive_id) and ledger.highest_epoch == EPOCH
    with pytest.raises(DirectiveRefused) as info:
        accept_directive(d, signer_peer_id=TRACKER, view=view(), ledger=ledger, now_ms=NOW + 200)
    assert info.value.reason is RefusalReason.REPLAYED


def test_directive_ids_come_from_the_injected_rng():
    assert directive(seed=5).directive_id == directive(seed=5).directive_id
    assert directive(seed=5).directive_id != directive(seed=6).directive_id


FULL = DirectiveLedger(frozenset((f"id{i}", NOW + 60_000) for i in range(MAX_SEEN_DIRECTIVES)))

# (name, directive kwargs, signer, view kwargs, ledger, now offset, expected reason)
REFUSALS = [
    ("old schema", dict(schema_version=0), TRACKER, {}, None, 0, "malformed"),
    ("no action", dict(raw_action=pb.DIRECTIVE_ACTION_UNSPECIFIED), TRACKER, {}, None, 0, "malformed"),
    ("empty id", dict(directive_id=""), TRACKER, {}, None, 0, "malformed"),
    ("huge id", dict(directive_id="x" * 65), TRACKER, {}, None, 0, "malformed"),
    ("range past the model", dict(range=(4, 9)), TRACKER, {}, None, 0, "malformed"),
    ("empty range", dict(range=(4, 4)), TRACKER, {}, None, 0, "malformed"),
    ("odd effective start", dict(range=(4, 8), raw_effective=6), TRACKER, {}, None, 0, "malformed"),
    ("no lifetime", dict(expires_at_unix_ms=NOW), TRACKER, {}, None, 0, "malformed"),
    ("lives too long", dict(expires_at_unix_ms=NOW + MAX_DIRECTIVE_TTL_MS + 1), TRACKER, {}, None, 0,
     "malformed"),
    ("for someone else", dict(target_peer_id="12D3KooWother"), TRACKER, {}, None, 0, "wrong_target"),
    ("other model", dict(model_artifact_digest="sha256:zz"), TRACKER, {}, None, 0, "wrong_model"),
    ("forged tracker field", dict(), RUNNER_UP, {}, None, 0, "signer_mismatch"),
    ("non-tracker", dict(tracker=RUNNER_UP), RUNNER_UP, {}, None, 0, "not_tracker"),
    ("non-tracker tail node", dict(tracker=TWIN.peer_id), TWIN.peer_id,
     dict(ads=HEADS + (ME, TWIN)), None, 0, "not_tracker"),
    ("expired", dict(), TRACKER, {}, None, 30_000 + CLOCK_SKEW_MS, "expired"),
    ("last epoch", dict(epoch=EPOCH - 1), TRACKER, {}, None, 0, "expired"),
    ("future-dated", dict(issued_at_unix_ms=NOW + CLOCK_SKEW_MS + 1,
                          expires_at_unix_ms=NOW + 40_000), TRACKER, {}, None, 0, "future_dated"),
    ("future epoch", dict(epoch=EPOCH + 1), TRACKER, {}, None, 0, "future_dated"),
    ("epoch older than seen", dict(), TRACKER, {}, DirectiveLedger(highest_epoch=EPOCH + 1), 0,
     "replayed"),
    ("drop of a range not served", dict(action=DROP, range=(0, 4)), TRACKER, {}, None, 0,
     "not_serving"),
    ("gap-making drop", dict(action=DROP), TRACKER, dict(sessions=2), None, 0, "would_leave_gap"),
    ("flood", dict(), TRACKER, {}, FULL, 0, "too_many"),
]


@pytest.mark.parametrize("name, fields, signer, view_kwargs, ledger, offset, reason", REFUSALS,
                         ids=[row[0] for row in REFUSALS])
def test_refusal_table(name, fields, signer, view_kwargs, ledger, offset, reason):
    d = directive(**fields)
    before = ledger or DirectiveLedger()
    with pytest.raises(DirectiveRefused) as info:
        accept_directive(d, signer_peer_id=signer, view=view(**view_kwargs), ledger=before,
                         now_ms=NOW + offset)
    assert info.value.reason is RefusalReason(reason), str(info.value)
    assert isinstance(info.value, ProtocolError)  # the sender's fault
    assert reason in str(info.value)


@pytest.mark.parametrize("ads, sessions", [
    (HEADS + (ME,), 0),         # a gap, but nobody is using it
    (HEADS + (ME, TWIN), 3),    # sessions, but the twin still covers 4..7
])
def test_drops_that_are_safe_are_accepted(ads, sessions):
    accepted, _ = accept_directive(directive(action=DROP), signer_peer_id=TRACKER,
                                   view=view(ads=ads, sessions=sessions), ledger=DirectiveLedger(),
                                   now_ms=NOW)
    assert accepted.intent.action == DROP


def test_clock_skew_is_tolerated_at_an_epoch_boundary():
    boundary = (EPOCH + 1) * TRACKER_EPOCH_MS
    old_tracker = rank_trackers(HEADS, model_digest=MODEL, epoch=EPOCH, now_ms=boundary)[0]
    d = directive(tracker=old_tracker, now=boundary - 1_000)
    accept_directive(d, signer_peer_id=old_tracker, view=view(), ledger=DirectiveLedger(),
                     now_ms=boundary + CLOCK_SKEW_MS - 1_001)
    new_tracker = rank_trackers(HEADS, model_digest=MODEL, epoch=EPOCH + 1, now_ms=boundary)[0]
    early = directive(tracker=new_tracker, epoch=EPOCH + 1, now=boundary + 1_000)
    accept_directive(early, signer_peer_id=new_tracker, view=view(), ledger=DirectiveLedger(),
                     now_ms=boundary - CLOCK_SKEW_MS + 1_001)


def test_a_newer_tracker_takes_over_when_the_old_one_disappears():
    d = directive(tracker=RUNNER_UP)
    ads = tuple(a for a in HEADS if a.peer_id != TRACKER) + (ME,)
    accepted, _ = accept_directive(d, signer_peer_id=RUNNER_UP, view=view(ads=ads),
                                   ledger=DirectiveLedger(), now_ms=NOW)
    assert accepted.tracker_peer_id == RUNNER_UP


def test_the_ledger_forgets_expired_ids_and_keeps_the_epoch():
    d = directive()
    _, ledger = accept_directive(d, signer_peer_id=TRACKER, view=view(), ledger=DirectiveLedger(),
                                 now_ms=NOW)
    pruned = ledger.pruned(NOW + 30_000 + CLOCK_SKEW_MS, CLOCK_SKEW_MS)
    assert not pruned.has(d.directive_id) and pruned.highest_epoch == EPOCH


@pytest.mark.parametrize("call", [
    lambda: directive(now=-1), lambda: build_directive(
        DirectiveIntent(LOAD, "x", Span(0, 1)), tracker_peer_id="t", model_digest=MODEL, epoch=0,
        now_ms=0, rng=random.Random(0), ttl_ms=0),
    lambda: NodeView("", MODEL, 8, ()), lambda: NodeView("a", MODEL, 8, [], active_sessions=0),
    lambda: NodeView("a", MODEL, 8, (), epoch_ms=0), lambda: NodeView("a", MODEL, 8, (), skew_ms=-1),
    lambda: NodeView("a", MODEL, 8, (), epoch_ms=1000, skew_ms=1000),
])
def test_misuse_is_a_local_error(call):
    with pytest.raises(PlanInputError):
        call()


FIELDS = st.sampled_from(["schema_version", "action", "epoch", "issued_at_unix_ms",
                          "expires_at_unix_ms", "directive_id", "tracker_peer_id",
                          "target_peer_id", "range"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(FIELDS, st.integers(-(2**40), 2**40)), max_size=4),
       st.integers(-(2**31), 2**31), st.sampled_from([TRACKER, RUNNER_UP, "x"]),
       st.integers(0, 3))
def test_any_directive_is_accepted_or_refused_with_a_reason(mutations, offset, signer, sessions):
    d = directive(action=DROP)
    for field, value in mutations:
        if field == "range":
            d.shard_range.start_layer, d.shard_range.end_layer = value % 10, (value // 7) % 10
        elif field in ("directive_id", "tracker_peer_id", "target_peer_id"):
            setattr(d, field, [TRACKER, ME.peer_id, "", "?" * (value % 80)][value % 4])
        elif field in ("issued_at_unix_ms", "expires_at_unix_ms"):
            setattr(d, field, NOW + value % 400_000 - 200_000)
        elif field == "epoch":
            setattr(d, field, EPOCH + value % 3 - 1)
        else:
            setattr(d, field, value % 4)
    try:
        accepted, ledger = accept_directive(d, signer_peer_id=signer, view=view(sessions=sessions),
                                            ledger=DirectiveLedger(), now_ms=max(0, NOW + offset))
    except DirectiveRefused as exc:
        assert isinstance(exc.reason, RefusalReason)
    else:
        assert signer == TRACKER == d.tracker_peer_id and ledger.has(d.directive_id)
        assert accepted.intent.span.end <= 8
