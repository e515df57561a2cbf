"""The expert exchange codec (proto/moe/wire.py): golden bytes, round trips, every bound, fuzz."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto import moe as W
from proto.errors import LimitExceeded, LocalError, PayloadCorrupt, ProtocolError, ProtocolViolation, VersionUnsupported
from proto.q8 import BLOCK


def _request(version=W.VERSION_ROWS_ONCE, act=W.ACT_F32, rows=None, items=None, layer=3, request_id=7):
    rows = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32) if rows is None else rows
    items = items or [W.Item(42, np.array([0, 1])), W.Item(43, np.array([0]))]
    return W.Request(version, act, request_id, layer, rows, tuple(items))


def test_golden_v2_request_rows_once_with_shared_item():
    """Row 0 routes to experts 42 and 43, row 1 to 42 only; the shared expert rides as one more item."""
    req = _request(items=[W.Item(42, np.array([0, 1])), W.Item(43, np.array([0])),
                          W.Item(W.SHARED, np.array([0, 1]))])
    expected = bytes.fromhex(
        "4d455850" "02" "04" "01" "00"          # magic MEXP, version 2, kind REQUEST, act f32, reserved
        "00000007" "00000003"                   # request id 7, layer 3
        "00000002" "00000002" "0003"            # hidden 2, rows 2, items 3
        "0000002a" "00000002" "00000000" "00000001"   # expert 42: rows 0, 1
        "0000002b" "00000001" "00000000"              # expert 43: row 0
        "ffffffff" "00000002" "00000000" "00000001"   # shared expert: rows 0, 1
        "0000803f" "00000040" "00004040" "00008040"   # the two rows once, f32 little-endian
    )
    body = W.encode_request(req)
    assert body == expected and len(body) == 86
    back = W.decode(body)
    assert isinstance(back, W.Request) and back.layer == 3 and back.request_id == 7
    assert [(i.expert, i.index.tolist()) for i in back.items] == [(42, [0, 1]), (43, [0]), (W.SHARED, [0, 1])]
    assert np.array_equal(back.rows, req.rows)


def test_v1_request_carries_a_copy_per_item():
    req = _request(version=W.VERSION_COPIES)
    body = W.encode_request(req)
    # header 8 + fixed 18 + 2 item heads (8) + 3 row copies of 8 bytes: row 0 travels twice
    assert len(body) == 8 + 18 + 16 + 3 * 8
    back = W.decode(body)
    assert [back.item_rows(i).tolist() for i in back.items] == [[[1, 2], [3, 4]], [[1, 2]]]


def test_v2_is_smaller_than_v1_when_rows_route_to_several_experts():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((4, 256)).astype(np.float32)
    items = [W.Item(e, np.arange(4)) for e in range(2)]   # top-2: every row in both experts
    v1 = len(W.encode_request(_request(version=W.VERSION_COPIES, rows=rows, items=items)))
    v2 = len(W.encode_request(_request(rows=rows, items=items)))
    assert v1 >= 0.9 * 2 * v2


@pytest.mark.parametrize("hidden", [2, 32, 70])
def test_q8_round_trip_within_half_a_scale(hidden):
    rng = np.random.default_rng(hidden)
    rows = rng.standard_normal((5, hidden)).astype(np.float32)
    req = _request(act=W.ACT_Q8, rows=rows, items=[W.Item(1, np.array([4, 0, 2]))])
    body = W.encode_request(req)
    assert len(body) == 8 + 18 + 8 + 12 + (2 * -(-5 * hidden // BLOCK) + 5 * hidden)
    back = W.decode(body)
    flat = rows.reshape(-1)
    scale = np.repeat(np.abs(np.pad(flat, (0, -flat.size % BLOCK))).reshape(-1, BLOCK).max(1) / 127, BLOCK)
    assert np.all(np.abs(back.rows.reshape(-1) - flat) <= scale[:flat.size] / 2 + 1e-3 * scale[:flat.size])
    out = [back.item_rows(i) * 2 for i in back.items]
    reply = W.decode(W.encode_reply(back, out))
    assert isinstance(reply, W.Reply) and reply.act == W.ACT_Q8 and reply.outputs[0][1].shape == (3, hidden)


def test_reply_round_trip_exact_in_f32():
    req = _request()
    outs = [np.arange(4, dtype=np.float32).reshape(2, 2), np.array([[9.5, -1.25]], np.float32)]
    reply = W.decode(W.encode_reply(req, outs))
    assert reply.request_id == 7 and reply.layer == 3 and reply.hidden == 2
    assert [(e, y.tolist()) for e, y in reply.outputs] == [(42, outs[0].tolist()), (43, outs[1].tolist())]


def test_hello_welcome_refuse_failure_round_trip():
    assert W.decode(W.encode_hello(2, W.ACT_Q8, "sha256:aa", "sha256:bb")) == W.Hello(2, W.ACT_Q8, "sha256:aa",
                                                                                     "sha256:bb")
    assert W.decode(W.encode_welcome(1, W.ACT_F32)) == W.Welcome(1, W.ACT_F32)
    refuse = W.decode(W.encode_refuse((1, 2), (1, 2), "no"))
    assert refuse == W.Refuse((1, 2), (1, 2), "no")
    fail = W.decode(W.encode_failure(2, 9, W.FAILURE_NOT_SERVED, "layer 1: expert 3"))
    assert fail == W.Failure(2, 9, W.FAILURE_NOT_SERVED, "layer 1: expert 3")


def _valid_bodies() -> list[bytes]:
    req = _request()
    return [W.encode_request(req), W.encode_request(_request(version=W.VERSION_COPIES)),
            W.encode_request(_request(act=W.ACT_Q8)),
            W.encode_reply(req, [np.zeros((2, 2), np.float32), np.ones((1, 2), np.float32)]),
            W.encode_hello(2, W.ACT_F32, "sha256:aa", "sha256:bb"), W.encode_welcome(2, W.ACT_F32),
            W.encode_refuse((1, 2), (1,), "why"), W.encode_failure(2, 1, 3, "x")]


@pytest.mark.parametrize("body", _valid_bodies())
def test_every_truncation_and_a_trailing_byte_are_refused(body):
    for cut in range(len(body)):
        with pytest.raises(ProtocolError):
            W.decode(body[:cut])
    with pytest.raises(PayloadCorrupt, match="trailing"):
        W.decode(body + b"\x00")


def _raw_request(version=2, act=1, hidden=2, rows=2, items=((0, [0]),), payload=None, header_items=None):
    parts = [struct.pack(">4sBBBB", b"MEXP", version, 4, act, 0),
             struct.pack(">IIIIH", 1, 0, hidden, rows, len(items) if header_items is None else header_items)]
    for expert, index in items:
        parts.append(struct.pack(">II", expert, len(index)))
        if version == 2:
            parts.append(np.array(index, ">u4").tobytes())
    parts.append(payload if payload is not None else b"\x00" * (4 * hidden * rows))
    return b"".join(parts)


@pytest.mark.parametrize("body,error,match", [
    (_raw_request(rows=W.MAX_ROWS + 1, payload=b""), LimitExceeded, "rows"),
    (_raw_request(rows=0, payload=b""), LimitExceeded, "rows"),
    (_raw_request(hidden=W.MAX_HIDDEN + 1, payload=b""), LimitExceeded, "hidden"),
    (_raw_request(items=(), header_items=0), LimitExceeded, "items"),
    (_raw_request(items=((0, [0, 1, 1]),)), LimitExceeded, "names 3 rows"),
    (_raw_request(items=((0, [2]),)), ProtocolViolation, "row 2 of 2"),
    (_raw_request(items=((5, [0]), (5, [1]))), ProtocolViolation, "twice"),
    (_raw_request(items=((W.MAX_EXPERTS_PER_LAYER, [0]),)), ProtocolViolation, "expert id"),
    (_raw_request(version=1, items=((W.SHARED, [0, 1]),)), ProtocolViolation, "expert id"),
    (_raw_request(version=1, items=((0, [0]),), rows=2, payload=b"\x00" * 8), ProtocolViolation, "declares 2"),
    (_raw_request(version=1, act=2), VersionUnsupported, "q8"),
    (_raw_request(version=3), VersionUnsupported, "version 3"),
    (_raw_request(act=7), VersionUnsupported, "act#7"),
    (b"MEXQ" + _raw_request()[4:], PayloadCorrupt, "magic"),
    (_raw_request()[:7] + b"\x01" + _raw_request()[8:], ProtocolViolation, "reserved"),
    (_raw_request(hidden=W.MAX_HIDDEN, rows=W.MAX_ROWS, items=((0, list(range(4096))),), payload=b""),
     LimitExceeded, "would not fit"),
])
def test_bounds_are_enforced_before_allocation(body, error, match):
    with pytest.raises(error, match=match):
        W.decode(body)


def test_oversized_body_is_refused_without_parsing():
    with pytest.raises(LimitExceeded):
        W.peek_header(memoryview(bytearray(W.MAX_EXCHANGE_FRAME_BYTES + 1)))


@pytest.mark.parametrize("make", [
    lambda: _request(version=1, act=W.ACT_Q8),
    lambda: _request(version=5),
    lambda: _request(rows=np.zeros((2, 2), np.float64)),
    lambda: _request(items=[W.Item(1, np.array([0])), W.Item(1, np.array([1]))]),
    lambda: _request(items=[W.Item(1, np.array([2]))]),
    lambda: _request(version=1, items=[W.Item(W.SHARED, np.array([0]))]),
])
def test_encoders_refuse_bad_local_arguments(make):
    with pytest.raises(LocalError):
        W.encode_request(make())


def test_item_refuses_bad_expert_ids():
    with pytest.raises(LocalError):
        W.Item(W.MAX_EXPERTS_PER_LAYER, np.array([0]))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_valid_bodies()), st.lists(st.tuples(st.integers(0, 4095), st.integers(0, 255)),
                                                   max_size=4), st.integers(0, 8))
def test_fuzz_mutations_decode_or_refuse(body, flips, chop):
    data = bytearray(body)
    for at, value in flips:
        data[at % len(data)] = value
    data = bytes(data[:len(data) - chop] if chop < len(data) else data)
    try:
        W.decode(data)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes_behind_a_header(tail):
    for kind in range(1, 7):
        try:
            W.decode(struct.pack(">4sBBBB", b"MEXP", 2, kind, 1, 0) + tail)
        except ProtocolError:
            pass
