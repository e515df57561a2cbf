"""proto.flow, proto.chunking, proto.records."""
from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from proto import shard_runtime_pb2 as pb
from proto.chunking import plan_prefill_chunks
from proto.errors import (
    FlowControlViolation,
    LimitExceeded,
    LocalError,
    PayloadCorrupt,
    ProtocolViolation,
    VersionUnsupported,
)
from proto.flow import CreditLedger, CreditWindow, negotiate
from proto.limits import DEFAULT_MAX_INFLIGHT_CHUNKS, MAX_INFLIGHT_CHUNKS
from proto.records import (
    RECORD_DOMAIN,
    parse_capability,
    parse_directive,
    parse_signed_record,
    sign_record,
    signed_message,
    verify_record_signature,
)

FC = pb.FlowControl


def test_negotiate_takes_the_strictest_nonzero_bound():
    got = negotiate(FC(credits_granted=6, max_inflight_chunks=8, max_chunk_bytes=1 << 20,
                       max_prefill_chunk_tokens=256),
                    FC(credits_granted=0, max_inflight_chunks=4, max_chunk_bytes=0,
                       max_prefill_chunk_tokens=128))
    assert got == FC(credits_granted=4, max_inflight_chunks=4, max_chunk_bytes=1 << 20,
                     max_prefill_chunk_tokens=128)


def test_negotiate_defaults_caps_and_symmetry():
    both_unset = negotiate(FC(), FC())
    assert both_unset.max_inflight_chunks == DEFAULT_MAX_INFLIGHT_CHUNKS
    assert both_unset.credits_granted == DEFAULT_MAX_INFLIGHT_CHUNKS
    assert both_unset.max_prefill_chunk_tokens == 128
    greedy = negotiate(FC(credits_granted=10**6, max_inflight_chunks=10**6), FC())
    assert greedy.max_inflight_chunks == MAX_INFLIGHT_CHUNKS
    assert greedy.credits_granted == MAX_INFLIGHT_CHUNKS
    a, b = FC(credits_granted=3, max_inflight_chunks=2), FC(max_chunk_bytes=99)
    assert negotiate(a, b) == negotiate(b, a)
    assert negotiate(a, b).credits_granted == 2              # never above the in-flight bound


def test_credit_window_and_ledger_stay_in_step():
    flow = negotiate(FC(max_inflight_chunks=2), FC())
    window, ledger = CreditWindow(flow), CreditLedger(flow)
    for _ in range(2):
        window.consume()
        ledger.on_chunk()
    with pytest.raises(LocalError):
        window.consume()
    with pytest.raises(FlowControlViolation):
        ledger.on_chunk()                                    # a chunk without credit
    assert ledger.grant(queued=1) == 1                       # one still being processed
    window.on_ack()
    window.on_grant(1)
    assert window.available == 1
    assert ledger.grant() == 1 and ledger.grant() == 0
    window.on_ack()
    window.on_grant(1)
    with pytest.raises(FlowControlViolation):
        window.on_grant(1)                                   # would exceed max_inflight
    with pytest.raises(ProtocolViolation):
        window.on_ack()                                      # nothing in flight


def test_chunk_byte_bound_and_unnegotiated_flow():
    flow = negotiate(FC(max_chunk_bytes=100), FC())
    with pytest.raises(LimitExceeded):
        CreditLedger(flow).on_chunk(nbytes=101)
    with pytest.raises(LocalError):
        CreditWindow(flow).consume(nbytes=101)
    with pytest.raises(LocalError):
        CreditWindow(FC())
    with pytest.raises(LocalError):
        CreditLedger(FC(max_inflight_chunks=2, credits_granted=3))


@pytest.mark.parametrize("n, size", [(0, 128), (1, 128), (128, 128), (129, 128), (1000, 128),
                                     (5, 1), (300, 100)])
def test_prefill_chunks_tile_the_prompt(n, size):
    plan = plan_prefill_chunks(n, size)
    assert sum(c for _, c in plan) == n
    assert all(0 < c <= size for _, c in plan)
    assert [p for p, _ in plan] == list(range(0, n, size))


def test_prefill_chunk_defaults_and_errors():
    assert plan_prefill_chunks(300) == [(0, 128), (128, 128), (256, 44)]
    assert plan_prefill_chunks(3, 2, first_position=10) == [(10, 2), (12, 1)]
    for bad in [dict(n_tokens=-1), dict(n_tokens=5, chunk_tokens=0), dict(n_tokens=1.5)]:
        with pytest.raises(LocalError):
            plan_prefill_chunks(**bad)


KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))


def capability_record():
    payload = pb.CapabilityPayload(schema_version=pb.SCHEMA_VERSION_1, peer_id="12D3KooW",
                                   shard_range=pb.ShardRange(start_layer=0, end_layer=4))
    return sign_record(pb.RECORD_KIND_CAPABILITY, payload.SerializeToString(), KEY)


def test_records_sign_verify_and_parse():
    rec = parse_signed_record(capability_record().SerializeToString())
    verify_record_signature(rec)
    assert parse_capability(rec).peer_id == "12D3KooW"
    with pytest.raises(ProtocolViolation):
        parse_directive(rec)
    assert signed_message(1, b"x") == RECORD_DOMAIN + b"\x01x"
    directive = pb.RebalanceDirective(schema_version=1, action=pb.DIRECTIVE_ACTION_LOAD_SHARD)
    drec = sign_record(pb.RECORD_KIND_DIRECTIVE, directive.SerializeToString(), KEY)
    verify_record_signature(drec)
    assert parse_directive(drec).action == pb.DIRECTIVE_ACTION_LOAD_SHARD


@pytest.mark.parametrize("field, value", [("payload", b"tampered"), ("signature", b"\0" * 64),
                                          ("public_key", bytes(32)), ("public_key", b"short"),
                                          ("signature", b"short"), ("kind", 2)])
def test_tampered_records_are_corrupt(field, value):
    rec = capability_record()
    setattr(rec, field, value)
    with pytest.raises(PayloadCorrupt):
        verify_record_signature(rec)


def test_record_limits_and_versions():
    with pytest.raises(LimitExceeded):
        parse_signed_record(b"\0" * 20000)
    with pytest.raises(ProtocolViolation):
        parse_signed_record(pb.SignedRecord(kind=0).SerializeToString())
    old = sign_record(pb.RECORD_KIND_CAPABILITY, pb.CapabilityPayload().SerializeToString(), KEY)
    with pytest.raises(VersionUnsupported):
        parse_capability(old)
    with pytest.raises(LocalError):
        sign_record(0, b"", KEY)
    with pytest.raises(LocalError):
        sign_record(pb.RECORD_KIND_CAPABILITY, b"x" * 20000, KEY)
