"""proto.frames, proto.wire, proto.zerocopy: parsing, framing, hand-built serialization."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from proto import shard_runtime_pb2 as pb
from proto import wire
from proto.errors import LimitExceeded, LocalError, PayloadCorrupt, ProtocolViolation, VersionUnsupported
from proto.frames import FrameReader, encode_frame, parse_request, parse_response
from proto.limits import Limits
from proto.tensors import decode_bundle, encode_bundle, encode_tensor
from proto.zerocopy import read_request, read_response

ENV = pb.Envelope(schema_version=pb.SCHEMA_VERSION_1, work_id="w1", route_session_id="s",
                  route_epoch=2, phase=pb.PHASE_PREFILL,
                  position=pb.PositionSpan(first_position=0, token_count=4))


def arrays():
    rng = np.random.default_rng(3)
    return {"h": rng.standard_normal((4, 40)).astype(ml_dtypes.bfloat16),
            "token_ids": np.arange(4, dtype=np.int64)}


def test_parse_request_checks_structure():
    with pytest.raises(ProtocolViolation):
        parse_request(b"")                                   # no kind
    with pytest.raises(PayloadCorrupt):
        parse_request(b"\x12\x05ab")                         # truncated
    with pytest.raises(LimitExceeded):
        parse_request(b"\0" * 11, Limits(max_frame_bytes=10))
    with pytest.raises(VersionUnsupported):
        parse_request(pb.SessionRequest(open=pb.SessionOpen(schema_version=2)).SerializeToString())
    with pytest.raises(ProtocolViolation):
        parse_request(pb.SessionRequest(chunk=pb.ActivationChunk()).SerializeToString())
    with pytest.raises(ProtocolViolation):
        parse_request(pb.SessionRequest(decode=pb.DecodeStep(position=1)).SerializeToString())
    ok = pb.SessionRequest(flow_control=pb.FlowControl(credits_granted=2))
    assert parse_request(ok.SerializeToString()) == ok
    with pytest.raises(VersionUnsupported):
        parse_response(pb.SessionResponse(accepted=pb.SessionAccepted()).SerializeToString())


def test_frame_reader_whole_byte_by_byte_and_trailing():
    bodies = [b"a", b"bc" * 100, b"\x00" * 7]
    stream = b"".join(encode_frame(b) for b in bodies)
    for piece in (len(stream), 1, 3):
        reader, out = FrameReader(1000), []
        for i in range(0, len(stream), piece):
            reader.feed(stream[i:i + piece])
            while (frame := reader.next_frame()) is not None:
                out.append(frame)
        assert out == bodies and reader.buffered == 0
    reader = FrameReader(1000)
    reader.feed(stream + b"\x00\x00")                       # trailing partial prefix
    assert [reader.next_frame() for _ in range(3)] == bodies
    assert reader.next_frame() is None and reader.buffered == 2


@pytest.mark.parametrize("prefix", [b"\0\0\0\0", (1001).to_bytes(4, "big"), b"\xff\xff\xff\xff"])
def test_frame_reader_refuses_bad_lengths_before_the_body(prefix):
    reader = FrameReader(1000)
    with pytest.raises(LimitExceeded):
        reader.feed(prefix + b"x" * 5000)
    assert reader.buffered == 4                              # the body was never kept


def test_frame_reader_keeps_a_good_frame_before_a_bad_prefix():
    reader = FrameReader(1000)
    reader.feed(encode_frame(b"ok") + b"\0\0\0\0")
    assert reader.next_frame() == b"ok"
    with pytest.raises(LimitExceeded):
        reader.next_frame()


def test_encode_frame_refuses_empty_and_oversized():
    with pytest.raises(LocalError):
        encode_frame(b"")
    with pytest.raises(LocalError):
        encode_frame(b"x" * 11, max_frame_bytes=10)
    assert encode_frame(b"xyz") == b"\0\0\0\x03xyz"


@pytest.mark.parametrize("kwargs", [{}, {"compression": pb.COMPRESSION_ZSTD},
                                    {"max_fragment_bytes": 7},
                                    {"encoding": pb.TENSOR_ENCODING_Q8_BLOCK32}])
def test_wire_chunk_equals_protobuf_serialization(kwargs):
    data = arrays() if "encoding" not in kwargs else {"h": arrays()["h"]}
    fast = wire.request_chunk(ENV, data, **kwargs)
    ref = pb.SessionRequest(chunk=pb.ActivationChunk(envelope=ENV,
                                                     bundle=encode_bundle(data, **kwargs)))
    assert fast == ref.SerializeToString()
    assert wire.response_chunk(ENV, data, **kwargs) == pb.SessionResponse(
        chunk=ref.chunk).SerializeToString()
    req, out = read_request(fast)
    slow = decode_bundle(parse_request(fast).chunk.bundle)
    assert req.chunk.envelope == ENV and out.keys() == slow.keys()
    for name in out:
        assert np.array_equal(out[name].view(np.uint8), slow[name].view(np.uint8))
    assert wire.request_chunk(ENV, data, framed=True, **kwargs) == encode_frame(fast)


def test_wire_decode_step_and_result():
    h = np.ones((1, 64), ml_dtypes.bfloat16)
    step = pb.DecodeStep(idempotency_step=9, position=12, expected_past_len=12, work_id="w",
                         deadline_unix_nanos=1_700_000_000_000_000_000)
    ref = pb.DecodeStep()
    ref.CopyFrom(step)
    ref.tensor.CopyFrom(encode_tensor("h", h))
    fast = wire.request_decode(step, "h", h)
    assert fast == pb.SessionRequest(decode=ref).SerializeToString()
    req, out = read_request(fast)
    assert req.decode.position == 12 and np.array_equal(out["h"], h)
    result = pb.DecodeResult(idempotency_step=9, past_len=13, execution_nanos=5)
    logits = {"logits": np.arange(10, dtype=np.float32)}
    resp_bytes = wire.response_decode(result, logits)
    ref_result = pb.DecodeResult()
    ref_result.CopyFrom(result)
    ref_result.bundle.CopyFrom(encode_bundle(logits))
    assert resp_bytes == pb.SessionResponse(decode=ref_result).SerializeToString()
    resp, out = read_response(resp_bytes)
    assert resp.decode.past_len == 13 and np.array_equal(out["logits"], logits["logits"])


@pytest.mark.parametrize("sample", [pb.TailSample(token_id=0), pb.TailSample(token_id=49151),
                                    pb.TailSample(token_id=7, logprob=-1.25, top=[
                                        pb.TokenLogprob(token_id=7, logprob=-1.25),
                                        pb.TokenLogprob(token_id=3, logprob=-2.5)])])
@pytest.mark.parametrize("with_logits", [False, True])
def test_wire_tail_sample_equals_protobuf_serialization(sample, with_logits):
    tensors = {"logits": np.arange(10, dtype=np.float32)} if with_logits else {}
    result = pb.DecodeResult(idempotency_step=9, past_len=13, execution_nanos=12_345_678, sample=sample)
    ref = pb.DecodeResult()
    ref.CopyFrom(result)
    if with_logits:
        ref.bundle.CopyFrom(encode_bundle(tensors))
    fast = wire.response_decode(result, tensors)
    assert fast == pb.SessionResponse(decode=ref).SerializeToString()
    resp, out = read_response(fast)
    assert resp.decode.HasField("sample") and resp.decode.sample == sample and out.keys() == tensors.keys()
    if not with_logits and not sample.top:
        assert len(fast) <= 24          # a token-only decode step (MAX_TAIL_BYTES_PER_DECODE_STEP is 64)
    chunk = pb.ActivationChunk(envelope=ENV, sample=sample)
    if with_logits:
        chunk.bundle.CopyFrom(encode_bundle(tensors))
    body = wire.response_chunk(ENV, tensors, sample=sample)
    assert body == pb.SessionResponse(chunk=chunk).SerializeToString()
    resp, out = read_response(body)
    assert resp.chunk.sample == sample and out.keys() == tensors.keys()
    with pytest.raises(LocalError):
        wire.response_chunk(ENV, tensors, sample=pb.TokenLogprob())


def test_zero_copy_reader_paths():
    req, out = read_request(pb.SessionRequest(flow_control=pb.FlowControl()).SerializeToString())
    assert req.WhichOneof("kind") == "flow_control" and out == {}
    one = wire.request_decode(pb.DecodeStep(), "h", np.ones(4, np.float32))
    with pytest.raises(ProtocolViolation):   # two decode fields (protobuf would merge them)
        read_request(one + one)
    step = pb.SessionRequest.FromString(one).decode
    tensor_field = b"\x22" + bytes([step.tensor.ByteSize()]) + step.tensor.SerializeToString()
    inner = tensor_field + tensor_field
    with pytest.raises(PayloadCorrupt):      # one decode step, its tensor field twice
        read_request(b"\x1a" + bytes([len(inner)]) + inner)
    with pytest.raises(LocalError):
        read_request(bytearray(one))


def test_take_one_is_feed_and_next_frame_for_one_whole_frame():
    from proto.frames import FrameReader, encode_frame

    reader = FrameReader(64)
    body = b"x" * 10
    assert reader.take_one(encode_frame(body)) == body and reader.buffered == 0
    # anything else is left to feed(): a partial frame, two frames, an empty or oversized length
    for data in (encode_frame(body)[:-1], encode_frame(body) * 2, b"\0\0\0\0", (100).to_bytes(4, "big") + b"y" * 100):
        assert FrameReader(64).take_one(data) is None
    reader.feed(encode_frame(body)[:3])
    assert reader.take_one(encode_frame(body)) is None        # bytes are buffered: keep their order
