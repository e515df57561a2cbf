"""Fast checks of the swarm's pure parts: tracker duty, directive records, params, tokenizer, demo sizing."""
from __future__ import annotations

import random

import pytest

from dht.identity import Identity
from meshd.generate.service import GenerateParams
from meshd.plan.adverts import ShardAd, Span
from meshd.plan.assignment import DirectiveIntent, ModelFootprint
from meshd.plan.directives import DirectiveLedger, NodeView, accept_directive, build_directive
from meshd.plan.errors import DirectiveRefused
from meshd.plan.tracker import epoch_at
from meshd.swarm.tracker_duty import GAP_CONFIRMATIONS, PENDING_LOAD_MS, TrackerDuty
from meshd.swarm.view import SwarmSnapshot
from meshd.swarm.wire import open_directive, sign_directive
from proto import shard_runtime_pb2 as pb
from proto.errors import LocalError, ProtocolError

DIGEST = "sha256:" + "cd" * 32
NOW = 1_800_000_000_000
LAYER = 1_000_000
FOOT = ModelFootprint.uniform(DIGEST, 8, LAYER)


def ident(n: int) -> Identity:
    return Identity.from_seed(bytes([n]) * 32)


def ad(peer: str, start: int, end: int, memory: int = 0) -> ShardAd:
    return ShardAd(peer_id=peer, model_digest=DIGEST, start=start, end=end, num_layers=8, decode_ms_per_layer=1.0,
                   prefill_tokens_per_s=1.0, free_kv_tokens=100, memory_budget_bytes=memory, relayed=False,
                   expires_at_ms=NOW + 60_000)


def duty(me: Identity) -> TrackerDuty:
    return TrackerDuty(me.peer_id, FOOT, me.signing_key, kv_budget_tokens=0, rng=random.Random(0))


def ask(memory: int) -> pb.JoinAsk:
    return pb.JoinAsk(schema_version=pb.SCHEMA_VERSION_1, model_artifact_digest=DIGEST, memory_budget_bytes=memory)


def test_tracker_answers_joins_into_gaps_and_counts_pending_loads():
    tracker = ident(1)
    snap = SwarmSnapshot(DIGEST, (ad(tracker.peer_id, 0, 2),))
    d = duty(tracker)
    spans = []
    for joiner in (ident(2), ident(3), ident(4)):
        reply = d.answer_join(joiner.peer_id, ask(3 * LAYER), snap, NOW)
        directive, signer = open_directive(reply.directive.SerializeToString())
        assert signer == tracker.peer_id and directive.target_peer_id == joiner.peer_id
        assert directive.action == pb.DIRECTIVE_ACTION_LOAD_SHARD
        spans.append((directive.shard_range.start_layer, directive.shard_range.end_layer))
    # still loading, yet counted: the three joiners fill [2, 8) without overlap, then add redundancy
    assert spans == [(2, 5), (5, 8), (0, 3)]
    assert len(d.pending) == 3
    # an assignment that never shows up stops counting once it is stale
    d.coverage(snap, NOW + PENDING_LOAD_MS + 1)
    assert not d.pending


def test_the_accepting_node_takes_a_tracker_directive_and_refuses_a_replay():
    tracker, joiner = ident(1), ident(2)
    snap = SwarmSnapshot(DIGEST, (ad(tracker.peer_id, 0, 4),))
    reply = duty(tracker).answer_join(joiner.peer_id, ask(4 * LAYER), snap, NOW)
    directive, signer = open_directive(reply.directive.SerializeToString())
    view = NodeView(joiner.peer_id, DIGEST, 8, snap.ads)
    accepted, ledger = accept_directive(directive, signer_peer_id=signer, view=view, ledger=DirectiveLedger(),
                                        now_ms=NOW)
    assert accepted.intent.span == Span(4, 8)
    with pytest.raises(DirectiveRefused) as err:
        accept_directive(directive, signer_peer_id=signer, view=view, ledger=ledger, now_ms=NOW)
    assert err.value.reason.value == "replayed"


def test_a_node_off_duty_refuses_join_asks():
    tracker, other = ident(1), ident(5)
    snap = SwarmSnapshot(DIGEST, (ad(tracker.peer_id, 0, 4), ad(other.peer_id, 4, 8)))
    on = duty(tracker).tracker(snap, NOW)
    off = other if on == tracker.peer_id else tracker
    reply = duty(off).answer_join(ident(9).peer_id, ask(4 * LAYER), snap, NOW)
    assert not reply.HasField("directive") and "not the tracker" in reply.refusal


def test_rebalance_moves_a_redundant_auto_node_into_a_gap():
    a, b, c = ident(1), ident(2), ident(3)
    d = duty(a)
    snap = SwarmSnapshot(DIGEST, (ad(a.peer_id, 0, 4), ad(b.peer_id, 0, 4, memory=4 * LAYER),
                                  ad(c.peer_id, 4, 6)))
    if d.tracker(snap, NOW) != a.peer_id:
        a, b = b, a  # keep the tracker first: it is never moved; b is the redundant auto node
        snap = SwarmSnapshot(DIGEST, (ad(a.peer_id, 0, 4), ad(b.peer_id, 0, 4, memory=4 * LAYER),
                                      ad(c.peer_id, 4, 6)))
        d = duty(a)
    for _ in range(GAP_CONFIRMATIONS - 1):  # a gap seen once may be a late republish: no move yet
        assert d.rebalance(snap, NOW) == []
    pushes = d.rebalance(snap, NOW)
    (target, records), = pushes
    kinds = [open_directive(r)[0].action for r in records]
    assert kinds == [pb.DIRECTIVE_ACTION_DROP_SHARD, pb.DIRECTIVE_ACTION_LOAD_SHARD]
    load = open_directive(records[1])[0].shard_range
    assert (load.start_layer, load.end_layer) == (6, 8) and target == b.peer_id   # the gap, no more
    assert d.rebalance(snap, NOW) == []  # one move at a time: b is still loading


def test_a_tampered_directive_record_is_refused():
    me = ident(1)
    d = build_directive(DirectiveIntent(pb.DIRECTIVE_ACTION_LOAD_SHARD, ident(2).peer_id, Span(0, 2)),
                        tracker_peer_id=me.peer_id, model_digest=DIGEST, epoch=epoch_at(NOW), now_ms=NOW,
                        rng=random.Random(0))
    rec = pb.SignedRecord.FromString(sign_directive(d, me.signing_key))
    rec.payload = rec.payload[:-1] + bytes([rec.payload[-1] ^ 1])
    with pytest.raises(ProtocolError):
        open_directive(rec.SerializeToString())
    with pytest.raises(ProtocolError):
        open_directive(b"\x00garbage")


@pytest.mark.parametrize("bad", [{"prompt": ""}, {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "max_tokens": True},
                                 {"prompt": "x", "temperature": float("nan")}, {"prompt": 3},
                                 {"prompt": "x", "seed": "1"}, {"prompt": "x" * 40_000},
                                 {"prompt": "x", "top_logprobs": 21}, {"prompt": "x", "top_logprobs": -1},
                                 {"prompt": "x", "logprobs": 1}, {"prompt": "x", "top_logprobs": True}])
def test_generate_params_are_validated(bad):
    with pytest.raises(LocalError):
        GenerateParams.from_request(bad)


def test_entry_tokenizer_matches_transformers_on_the_test_model():
    from transformers import AutoTokenizer

    from meshd.generate.tokenizer import EntryTokenizer
    from meshd.testing.models import build_random_llama

    path = build_random_llama(seed=3)
    ours, theirs = EntryTokenizer(path), AutoTokenizer.from_pretrained(str(path))
    text = "the swarm answers quickly"
    assert ours.encode_prompt(text, raw=True) == theirs.encode(text)
    ids = ours.encode_prompt(text, raw=True)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert theirs.eos_token_id in ours.stop_ids


def test_demo_memory_makes_three_joiners_cover_the_model():
    from dataclasses import replace

    from meshd.plan.assignment import EVEN_BASE_HEADROOM_BYTES, simulate_joins
    from meshd.plan.assignment import even_memory_for as demo_memory
    from meshd.plan.footprint import artifact_footprint
    from meshd.testing.models import build_random_llama

    fp = artifact_footprint(build_random_llama(seed=3), DIGEST)
    memory = demo_memory(fp, 3, 1024)
    assert simulate_joins(fp, 3, memory, 1024).fully_covered
    # nodes that measure a base as high as the headroom allows still cover, and it really takes three
    hungry = replace(fp, base_bytes=fp.base_bytes + EVEN_BASE_HEADROOM_BYTES)
    assert simulate_joins(hungry, 3, memory, 1024).fully_covered
    assert not simulate_joins(hungry, 2, memory, 1024).fully_covered


def test_a_refused_move_pins_that_node_for_a_while_and_the_tracker_plans_around_it():
    from dataclasses import replace

    from meshd.swarm.tracker_duty import REFUSED_BACKOFF_MS

    a, b, c = ident(1), ident(2), ident(3)

    def pool(tracker, mover):
        return SwarmSnapshot(DIGEST, (ad(tracker.peer_id, 0, 4), ad(mover.peer_id, 0, 4, memory=4 * LAYER),
                                      ad(c.peer_id, 4, 6)))
    if duty(a).tracker(pool(a, b), NOW) != a.peer_id:
        a, b = b, a   # the tracker is never moved: b is the redundant auto node
    d, snap = duty(a), pool(a, b)
    for _ in range(GAP_CONFIRMATIONS - 1):
        assert d.rebalance(snap, NOW) == []
    (target, _), = d.rebalance(snap, NOW)
    assert target == b.peer_id and b.peer_id in d.pending
    d.push_failed(b.peer_id, NOW)                      # e.g. it still had sessions
    assert b.peer_id not in d.pending and d.plan is None
    for _ in range(GAP_CONFIRMATIONS):                 # b is pinned: nobody else can move, nothing to push
        assert d.rebalance(snap, NOW + 1) == []
    later = NOW + REFUSED_BACKOFF_MS + 1
    snap = SwarmSnapshot(DIGEST, tuple(replace(x, expires_at_ms=later + 60_000) for x in snap.ads))
    pushes = []
    for _ in range(GAP_CONFIRMATIONS + 1):
        pushes += d.rebalance(snap, later)
    assert [t for t, _ in pushes] == [b.peer_id]       # asked again once the backoff is over
