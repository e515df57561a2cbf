"""The sans-I/O framing core of relayed hops: whole, byte-by-byte, trailing bytes, bad input."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.errors import LimitExceeded, LocalError, PayloadCorrupt, ProtocolError
from relay.framing import ByteBudget, FramedStream


def drain(fs: FramedStream, wire: bytes, piece: int | None = None) -> list[bytes]:
    """Feed ``wire`` the way the trio edge does: never more than read_size() at once."""
    out, pos = [], 0
    while pos < len(wire):
        n = fs.read_size() if piece is None else min(piece, fs.read_size())
        fs.receive_data(wire[pos:pos + n])
        pos += n
        while (body := fs.next_frame()) is not None:
            out.append(body)
    return out


BODIES = [b"a", b"hello world", bytes(range(256)) * 40]


def wire_of(bodies):
    sender = FramedStream()
    return b"".join(sender.frame(b) for b in bodies), sender


def test_whole_and_byte_by_byte_give_the_same_frames():
    wire, sender = wire_of(BODIES)
    assert sender.counters.frames_out == 3 and sender.counters.bytes_out == len(wire)
    for piece in (None, 1, 3, 7):
        fs = FramedStream()
        assert drain(fs, wire, piece) == BODIES
        fs.receive_eof()
        assert fs.counters.frames_in == 3 and fs.counters.bytes_in == len(wire)


def test_golden_bytes():
    # 4-byte big-endian length (5) followed by the body
    assert FramedStream().frame(b"hello") == b"\x00\x00\x00\x05hello"


def test_read_size_never_reaches_past_the_head_frame():
    wire, _ = wire_of([b"x" * 10, b"y" * 3])
    fs = FramedStream()
    assert fs.read_size() == 4
    fs.receive_data(wire[:4])
    assert fs.read_size() == 10
    with pytest.raises(LocalError):
        fs.receive_data(wire[4:4 + 11])  # more than asked for is the edge's bug


def test_trailing_partial_frame_at_eof_is_the_peers_fault():
    wire, _ = wire_of([b"abc"])
    fs = FramedStream()
    assert drain(fs, wire + b"\x00\x00") == [b"abc"]
    with pytest.raises(PayloadCorrupt):
        fs.receive_eof()


def test_zero_and_oversized_lengths_are_refused_before_the_body():
    fs = FramedStream(max_frame_bytes=16)
    with pytest.raises(LimitExceeded):
        fs.receive_data(b"\x00\x00\x00\x11")
    with pytest.raises(LimitExceeded):
        FramedStream().receive_data(b"\x00\x00\x00\x00")
    with pytest.raises(LocalError):
        FramedStream(max_frame_bytes=16).frame(b"z" * 17)
    with pytest.raises(LocalError):
        FramedStream().frame(b"")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.integers(min_value=1, max_value=9))
def test_any_bytes_give_frames_or_a_protocol_error(data, piece):
    fs = FramedStream(max_frame_bytes=32)
    try:
        bodies = drain(fs, data, piece)
        fs.receive_eof()
    except ProtocolError:
        return
    assert all(0 < len(b) <= 32 for b in bodies)


def test_byte_budget_bounds_and_refuses():
    budget = ByteBudget(100)
    budget.take(60)
    with pytest.raises(LimitExceeded):
        budget.take(41)
    assert budget.refused == 1 and budget.in_use == 60
    budget.give_back(60)
    budget.take(100)
    with pytest.raises(LocalError):
        budget.give_back(101)
