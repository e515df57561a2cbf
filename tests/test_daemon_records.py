"""Pure record rules (dht/records.py, dht/validator.py): no network, injected clock."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht import keys as K
from dht.records import (
    MAX_CLOCK_SKEW_MS,
    MAX_INDEX_RECORDS,
    decode_record_set,
    encode_record_set,
    merge_records,
    news,
    sign_withdrawal,
    validate_capability,
    validate_record_set,
)
from dht.validator import MeshdValidator, check_value
from meshd.errors import RecordRejected
from tests._daemon_helpers import DIGEST, NOW_MS, TTL_MS, forged_records, good, identity

A, B, EVE = identity(1), identity(2), identity(3)
REASONS = {"forged_signature": "signature", "key_peer_id_mismatch": "peer_id", "expired": "expired",
           "future_dated": "future", "unknown_schema": "schema"}


def test_valid_record_round_trips():
    rec = validate_capability(good(A), NOW_MS)
    assert (rec.peer_id, rec.sequence, rec.span, rec.withdrawn) == (A.peer_id, 10, (0, 4), False)
    assert rec.payload.reachability.tls_cert_sha256 == b"\x01" * 32


@pytest.mark.parametrize("name", sorted(REASONS))
def test_forged_records_refused_with_reason(name):
    with pytest.raises(RecordRejected) as info:
        validate_capability(forged_records(A, EVE)[name], NOW_MS)
    assert info.value.reason == REASONS[name]


def test_skew_boundary_and_expiry_boundary():
    validate_capability(good(A, now=NOW_MS + MAX_CLOCK_SKEW_MS), NOW_MS)
    with pytest.raises(RecordRejected, match="future"):
        validate_capability(good(A, now=NOW_MS + MAX_CLOCK_SKEW_MS + 1), NOW_MS)
    rec = good(A)
    validate_capability(rec, NOW_MS + TTL_MS - 1)
    with pytest.raises(RecordRejected, match="expired"):
        validate_capability(rec, NOW_MS + TTL_MS)


def test_peer_key_select_refuses_replay_and_takes_newer():
    v = MeshdValidator(lambda: NOW_MS)
    key = K.peer_key(A.peer_id)
    old, new = good(A, seq=10), good(A, seq=11)
    assert v.select(key, [old, new]) == 1       # newer replaces
    assert v.select(key, [new, old]) == 0       # replayed older does not
    assert v.select(key, [old, old]) == 0       # an identical replay does not either
    with pytest.raises(RecordRejected, match="key_mismatch"):
        check_value(K.peer_key(B.peer_id), old, NOW_MS)


def test_index_select_and_merge():
    v = MeshdValidator(lambda: NOW_MS)
    key = K.model_key(DIGEST)
    a10 = validate_capability(good(A, seq=10), NOW_MS)
    a11 = validate_capability(good(A, seq=11), NOW_MS)
    b5 = validate_capability(good(B, seq=5, start=4, end=8), NOW_MS)
    stored = encode_record_set([a11, b5])
    assert v.select(key, [stored, encode_record_set([a10])]) == 0   # replay: no news
    assert v.select(key, [encode_record_set([a10]), encode_record_set([b5])]) == 1  # news -> merge
    merged = merge_records([a10, b5], [a11], NOW_MS)
    assert [(r.peer_id, r.sequence) for r in merged] == sorted([(A.peer_id, 11), (B.peer_id, 5)])
    assert news([a10], [a11, b5]) == 0
    # expired records fall out of a merge
    assert merge_records([a10, b5], [], NOW_MS + TTL_MS) == []


def test_withdrawal_hides_and_outranks():
    live = validate_capability(good(A, seq=10), NOW_MS)
    gone = validate_capability(sign_withdrawal(DIGEST, A.signing_key, peer_id=A.peer_id, sequence=11,
                                               now_ms=NOW_MS, ttl_ms=TTL_MS), NOW_MS)
    assert gone.withdrawn and gone.span == (0, 0)
    assert merge_records([live], [gone], NOW_MS) == [gone]
    assert merge_records([gone], [live], NOW_MS) == [gone]  # the old live record cannot come back
    # a withdrawal is allowed under the span key of the range it retracts
    check_value(K.span_key(DIGEST, 0, 4), encode_record_set([gone]), NOW_MS)


def test_index_key_binding():
    rec = validate_capability(good(A), NOW_MS)
    with pytest.raises(RecordRejected, match="key_mismatch"):
        check_value(K.model_key("sha256:" + "cd" * 32), encode_record_set([rec]), NOW_MS)
    with pytest.raises(RecordRejected, match="key_mismatch"):
        check_value(K.span_key(DIGEST, 4, 8), encode_record_set([rec]), NOW_MS)
    check_value(K.span_key(DIGEST, 0, 4), encode_record_set([rec]), NOW_MS)


def test_record_set_bounds():
    recs = [validate_capability(good(identity(i + 10)), NOW_MS) for i in range(3)]
    data = encode_record_set(recs)
    assert [validate_capability(r, NOW_MS).peer_id for r in decode_record_set(data)] == \
        sorted(r.peer_id for r in recs)
    with pytest.raises(RecordRejected):
        decode_record_set(data + b"\x00")
    with pytest.raises(RecordRejected):
        decode_record_set(data[:-1])
    with pytest.raises(RecordRejected, match="too_large"):
        decode_record_set(b"MSR1" + (MAX_INDEX_RECORDS + 1).to_bytes(2, "big"))
    one = recs[0].raw
    dup = b"MSR1" + (2).to_bytes(2, "big") + 2 * (len(one).to_bytes(4, "big") + one)
    with pytest.raises(RecordRejected):
        validate_record_set(dup, NOW_MS)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_record_parsers_only_raise_typed_errors(data):
    for fn in (lambda: validate_capability(data, NOW_MS), lambda: decode_record_set(data),
               lambda: validate_record_set(b"MSR1" + data, NOW_MS)):
        try:
            fn()
        except RecordRejected:
            pass


@settings(max_examples=100, deadline=None)
@given(st.integers(0, len(good(A)) - 1), st.integers(1, 255))
def test_fuzz_bit_flips_never_validate_as_another_record(pos, flip):
    data = bytearray(good(A))
    data[pos] ^= flip
    try:
        rec = validate_capability(bytes(data), NOW_MS)
    except RecordRejected:
        return
    # a flip that still validates can only touch unsigned wrapper framing, never the content
    assert rec.payload == validate_capability(good(A), NOW_MS).payload


def test_store_refuses_new_keys_beyond_its_bound(monkeypatch):
    from libp2p.kad_dht.pb.kademlia_pb2 import Record

    import dht.validator as V

    class FakeHost:  # ValueStore only keeps a reference; nothing is dialed here
        def get_private_key(self):
            raise AssertionError("not used")

    store = V.MergingValueStore(FakeHost(), None, lambda: NOW_MS)
    monkeypatch.setattr(V, "MAX_STORED_KEYS", 2)
    for seed in (70, 71):
        ident = identity(seed)
        key = K.peer_key(ident.peer_id).encode()
        store.put_record(key, Record(key=key, value=good(ident)))
    key = K.peer_key(identity(72).peer_id).encode()
    with pytest.raises(RecordRejected, match="too_large"):
        store.put_record(key, Record(key=key, value=good(identity(72))))
    # an index key merges into a bounded set and prunes what expired
    mk = K.model_key(DIGEST).encode()
    store.store.clear()
    store.put_record(mk, Record(key=mk, value=encode_record_set([validate_capability(good(A, seq=1), NOW_MS)])))
    store.put_record(mk, Record(key=mk, value=encode_record_set([validate_capability(good(B, seq=1), NOW_MS)])))
    assert len(decode_record_set(store.get(mk).value)) == 2
    store.clock = lambda: NOW_MS + TTL_MS
    assert store.get(mk) is None


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([K.peer_key(A.peer_id), K.model_key(DIGEST), K.span_key(DIGEST, 0, 4)]),
       st.lists(st.binary(max_size=300), min_size=1, max_size=4))
def test_fuzz_validator_typed_errors_and_total_select(key, values):
    v = MeshdValidator(lambda: NOW_MS)
    for value in values:
        try:
            v.validate(key, value)
        except RecordRejected:
            pass
    assert 0 <= v.select(key, values) < len(values)
    # a valid value among garbage always wins
    valid = good(A) if "/peer/" in key else encode_record_set([validate_capability(good(A), NOW_MS)])
    assert v.select(key, values + [valid]) == len(values)


def test_frames_endpoint_travels_signed_beside_its_grpc_fallback():
    from dataclasses import replace

    from dht.records import sign_capability
    from meshd.swarm.view import snapshot_from_records
    from tests._daemon_helpers import claim

    with_frames = replace(claim(), frames_endpoint="127.0.0.1:5001")
    raw = sign_capability(with_frames, A.signing_key, peer_id=A.peer_id, sequence=11, now_ms=NOW_MS, ttl_ms=TTL_MS)
    rec = validate_capability(raw, NOW_MS)
    assert rec.payload.reachability.frames_endpoint == "127.0.0.1:5001"
    plain = validate_capability(good(B), NOW_MS)
    snap = snapshot_from_records(DIGEST, [rec, plain], NOW_MS)
    assert snap.frames == {A.peer_id: "127.0.0.1:5001"}          # B offers none: gRPC only
    assert snap.pins[A.peer_id] == b"\x01" * 32                  # the same record's pin covers it
    with pytest.raises(ValueError, match="frames_endpoint"):
        replace(claim(), grpc_endpoint="", tls_cert_sha256=b"", frames_endpoint="127.0.0.1:5001")


@pytest.mark.parametrize("frames, grpc_ep, reason", [("1" * 300, "127.0.0.1:5000", "too long"),
                                                     ("127.0.0.1:5001", "", "never alone")])
def test_frames_endpoint_bounds_are_refused(frames, grpc_ep, reason):
    from tests._daemon_helpers import raw_payload, signed

    p = raw_payload(A)
    p.reachability.grpc_endpoint = grpc_ep
    p.reachability.tls_cert_sha256 = b"\x01" * 32
    p.reachability.frames_endpoint = frames
    with pytest.raises(RecordRejected, match=reason):
        validate_capability(signed(p, A.signing_key), NOW_MS)


def test_a_node_listening_on_all_interfaces_lists_its_advertise_host_as_direct_address():
    from meshd.daemon.node import direct_addrs_of

    any4, any6 = "/ip4/0.0.0.0/tcp/4001/p2p/P", "/ip6/::/tcp/4001/p2p/P"
    assert direct_addrs_of([any4, any6], "203.0.113.7") == ("/ip4/203.0.113.7/tcp/4001/p2p/P",)
    assert direct_addrs_of([any4, any6], "2001:db8::7") == ("/ip6/2001:db8::7/tcp/4001/p2p/P",)
    assert direct_addrs_of([any4], None) == () and direct_addrs_of([any4], "relay.example.org") == ()
    lan = "/ip4/192.168.1.5/tcp/4001/p2p/P"
    assert direct_addrs_of([lan, lan, any4], None) == (lan,)
