"""Hypothesis fuzzing of every codec decoder, round trips, and bounded-memory refusals.

Invariant (h11's fuzz rule): whatever bytes a peer sends, a decoder returns a valid
value or raises a proto.errors.ProtocolError -- never another exception.
"""
from __future__ import annotations

import random
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import zstandard
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto import shard_runtime_pb2 as pb
from proto import wire
from proto.errors import LimitExceeded, PayloadCorrupt, ProtocolError
from proto.frames import FrameReader, encode_frame, parse_request, parse_response
from proto.q8 import BLOCK
from proto.records import parse_capability, parse_directive, parse_signed_record, verify_record_signature
from proto.tensors import decode_bundle, decode_tensor, encode_bundle, encode_tensor
from proto.zerocopy import read_request, read_response
from tests._codec_fuzz_helpers import (
    BATCH,
    COMPRESSIONS,
    DTYPES,
    ENV,
    FLOATS,
    bundle_seeds,
    fuzz_inputs,
    mutate,
    only_protocol_errors,
    record_seeds,
    request_seeds,
    response_seeds,
    tensor_seeds,
)

# 300 examples x (1 arbitrary + BATCH mutated) inputs = 2700 inputs per decoder test.
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ROUND = settings(max_examples=150, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow])
REQUESTS, RESPONSES = request_seeds(), response_seeds()
TENSORS, BUNDLES, RECORDS = tensor_seeds(), bundle_seeds(), record_seeds()
SIGNED = {(r.kind, r.payload, r.public_key) for r in map(pb.SignedRecord.FromString, RECORDS)}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _decoded_request(data: bytes):
    req = parse_request(data)
    kind = req.WhichOneof("kind")
    if kind == "chunk":
        return decode_bundle(req.chunk.bundle)
    if kind == "decode":
        return {req.decode.tensor.name: decode_tensor(req.decode.tensor)}
    return {}


def _check_fast_agrees(fast_result, slow_fn, data):
    """When the zero-copy reader accepts bytes, the ordinary path gets the same arrays."""
    if isinstance(fast_result, ProtocolError):
        return
    slow = slow_fn(data)
    _, arrays = fast_result
    assert arrays.keys() == slow.keys()
    assert all(_same(arrays[k], slow[k]) for k in arrays)


# ------------------------------------------------------------------ arbitrary and mutated bytes

@FUZZ
@given(fuzz_inputs(REQUESTS))
def test_requests_raise_only_protocol_errors(inputs):
    for data in inputs:
        only_protocol_errors(_decoded_request, data)
        fast = only_protocol_errors(read_request, data)
        _check_fast_agrees(fast, _decoded_request, data)


def _decoded_response(data: bytes):
    resp = parse_response(data)
    kind = resp.WhichOneof("kind")
    holder = resp.chunk if kind == "chunk" else resp.decode if kind == "decode" else None
    if holder is None or not holder.HasField("bundle"):   # a token-only tail answer carries no bundle
        return {}
    return decode_bundle(holder.bundle)


@FUZZ
@given(fuzz_inputs(RESPONSES))
def test_responses_raise_only_protocol_errors(inputs):
    for data in inputs:
        only_protocol_errors(_decoded_response, data)
        fast = only_protocol_errors(read_response, data)
        _check_fast_agrees(fast, _decoded_response, data)


def _parsed(cls, data):
    try:
        return cls.FromString(data)
    except DecodeError:
        return None            # protobuf's own parse, not one of our decoders


@FUZZ
@given(fuzz_inputs(TENSORS))
def test_decode_tensor_raises_only_protocol_errors(inputs):
    for data in inputs:
        t = _parsed(pb.NamedTensor, data)
        if t is not None:
            only_protocol_errors(decode_tensor, t)


@FUZZ
@given(fuzz_inputs(BUNDLES))
def test_decode_bundle_raises_only_protocol_errors(inputs):
    for data in inputs:
        b = _parsed(pb.TensorBundle, data)
        if b is not None:
            only_protocol_errors(decode_bundle, b)


def _record(data):
    rec = parse_signed_record(data)
    verify_record_signature(rec)
    return parse_capability(rec) if rec.kind == pb.RECORD_KIND_CAPABILITY else parse_directive(rec)


@FUZZ
@given(fuzz_inputs(RECORDS))
def test_records_raise_only_protocol_errors(inputs):
    for data in inputs:
        result = only_protocol_errors(_record, data)
        if not isinstance(result, ProtocolError):      # a mutation that still verifies must
            rec = parse_signed_record(data)            # carry a genuinely signed record
            assert (rec.kind, rec.payload, rec.public_key) in SIGNED


# a tensor built field by field: shape/size lies, bad enums, broken tilings
_fragment = st.builds(pb.TensorFragment, fragment_index=st.integers(0, 4),
                      fragment_count=st.integers(0, 4), byte_offset=st.integers(0, 64),
                      payload=st.binary(max_size=40))
_tensor = st.builds(
    pb.NamedTensor, name=st.sampled_from(["h", "", "x" * 70]),
    shape=st.lists(st.one_of(st.integers(-2, 8), st.sampled_from([1 << 24, 1 << 40, 2**63 - 1])),
                   max_size=10),
    dtype=st.integers(0, 9), byte_order=st.integers(0, 3), total_bytes=st.one_of(
        st.integers(0, 80), st.sampled_from([1 << 40, 2**64 - 1])),
    compression=st.integers(0, 3), encoding=st.integers(0, 3),
    checksum=st.builds(pb.Checksum, algorithm=st.integers(0, 3), value=st.binary(max_size=5)),
    fragments=st.lists(_fragment, max_size=5))


@settings(FUZZ, max_examples=300)
@given(_tensor)
def test_structured_tensor_lies_raise_only_protocol_errors(t):
    only_protocol_errors(decode_tensor, t)
    only_protocol_errors(decode_bundle, pb.TensorBundle(bundle_version=1, tensors=[t]))


# ------------------------------------------------------------------ frames in arbitrary pieces

@settings(FUZZ, max_examples=200)
@given(st.lists(st.binary(min_size=1, max_size=60), max_size=6), st.data())
def test_frames_whole_byte_by_byte_and_split_anywhere(bodies, data):
    stream = b"".join(encode_frame(b) for b in bodies)
    trailing = data.draw(st.binary(max_size=3))            # a partial prefix after the frames
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream) + len(trailing)), max_size=8)))
    for pieces in ([stream + trailing],
                   [bytes([b]) for b in stream + trailing],
                   [(stream + trailing)[a:b] for a, b in zip([0, *cuts], [*cuts, None])]):
        reader, out = FrameReader(100), []
        for piece in pieces:
            reader.feed(piece)
            while (frame := reader.next_frame()) is not None:
                out.append(frame)
        assert out == bodies and reader.buffered == len(trailing)


@FUZZ
@given(st.binary(max_size=200), st.integers(0, 2**64 - 1))
def test_frame_reader_on_arbitrary_bytes_raises_only_protocol_errors(stream, rng_seed):
    rnd = random.Random(rng_seed)
    frames = b"".join(encode_frame(rnd.randbytes(rnd.randint(1, 70))) for _ in range(3))
    for data in [stream, *(mutate(frames, rnd) for _ in range(BATCH))]:
        reader = FrameReader(64)

        def run(data=data, reader=reader):
            pos = 0
            while pos < len(data):
                step = rnd.randint(1, 40)
                reader.feed(data[pos:pos + step])
                pos += step
                while (frame := reader.next_frame()) is not None:
                    assert 0 < len(frame) <= 64
        only_protocol_errors(run)


# ------------------------------------------------------------------ round trips

_shapes = st.lists(st.integers(0, 7), max_size=4).map(tuple)


@ROUND
@given(st.sampled_from(DTYPES), _shapes, st.sampled_from(COMPRESSIONS),
       st.integers(1, 80), st.integers(0, 2**32 - 1), st.booleans())
def test_raw_round_trip_every_dtype_shape_compression_fragment(dtype, shape, compression,
                                                              frag, seed, specials):
    rng = np.random.default_rng(seed)
    a = np.asarray((rng.standard_normal(shape) * 100).astype(dtype))
    frag = max(frag, -(-(2 * a.nbytes + 64) // 64))        # <= 64 fragments, even compressed
    if specials and a.size and np.dtype(dtype).kind == "f" or (
            specials and a.size and dtype is ml_dtypes.bfloat16):
        a.reshape(-1)[0] = np.nan
        a.reshape(-1)[-1] = -np.inf
    t = pb.NamedTensor.FromString(encode_tensor("h", a, compression=compression,
                                                max_fragment_bytes=frag).SerializeToString())
    assert _same(decode_tensor(t), a)
    fast = wire.request_chunk(ENV, {"h": a}, compression=compression, max_fragment_bytes=frag)
    ref = pb.SessionRequest(chunk=pb.ActivationChunk(
        envelope=ENV, bundle=encode_bundle({"h": a}, compression=compression,
                                           max_fragment_bytes=frag)))
    assert fast == ref.SerializeToString()                 # the one-copy path is canonical
    assert _same(read_request(fast)[1]["h"], a)


@ROUND
@given(st.sampled_from(FLOATS), _shapes, st.sampled_from(COMPRESSIONS), st.integers(1, 80),
       st.integers(0, 2**32 - 1), st.sampled_from([1e-30, 1e-6, 1.0, 1e3, 1e5]))
def test_q8_round_trip_within_half_a_scale(dtype, shape, compression, frag, seed, magnitude):
    rng = np.random.default_rng(seed)
    values = np.clip(rng.standard_normal(shape) * magnitude, -6e4, 6e4)   # finite in float16
    a = np.asarray(values.astype(dtype))
    frag = max(frag, -(-(2 * a.nbytes + 64) // 64))
    t = encode_tensor("q", a, encoding=pb.TENSOR_ENCODING_Q8_BLOCK32, compression=compression,
                      max_fragment_bytes=frag)
    out = decode_tensor(pb.NamedTensor.FromString(t.SerializeToString()))
    assert out.dtype == a.dtype and out.shape == a.shape
    # Error bound before the cast to the declared dtype: decode into float32.
    body = b"".join(f.payload for f in t.fragments)
    if compression == pb.COMPRESSION_ZSTD:
        body = zstandard.ZstdDecompressor().decompress(body)
    n = a.size
    scales = np.frombuffer(body, "<f2", count=-(-n // BLOCK)).astype(np.float64)
    q = np.frombuffer(body, np.int8, offset=2 * len(scales)).astype(np.float64)
    half = np.repeat(scales, BLOCK)[:n] / 2
    err = np.abs(q * np.repeat(scales, BLOCK)[:n] - a.astype(np.float64).reshape(-1))
    assert np.all(err <= half)
    assert len(body) / max(n, 1) <= 1.0625 + 2 / max(n, 1)


@ROUND
@given(st.dictionaries(st.sampled_from(["h", "token_ids", "logits", "mask"]),
                       st.tuples(st.sampled_from(DTYPES), _shapes), max_size=4),
       st.integers(0, 2**32 - 1))
def test_bundle_and_response_round_trips(spec, seed):
    arrays = {name: np.asarray((np.random.default_rng(seed).standard_normal(shape) * 9)
                               .astype(dtype))
              for name, (dtype, shape) in spec.items()}
    data = wire.response_decode(pb.DecodeResult(idempotency_step=seed), arrays)
    resp, out = read_response(data)
    assert resp.decode.idempotency_step == seed
    assert out.keys() == arrays.keys() and all(_same(out[k], arrays[k]) for k in arrays)
    assert decode_bundle(parse_response(data).decode.bundle).keys() == arrays.keys()


# ------------------------------------------------------------------ bounded memory

def _peak_during(fn) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _zeros_frame(size: int, *, declared: int | None = None, content_size: bool = True) -> bytes:
    """A zstd frame of ``size`` zero bytes, built in 1 MiB pieces (never all in memory)."""
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=content_size)
    obj = cctx.compressobj(size=size if content_size else -1)
    zero = bytes(1 << 20)
    frame = b"".join(obj.compress(zero) for _ in range(size >> 20)) + obj.flush()
    if declared is not None:                               # lie in the frame header
        fhd = frame[4]
        assert fhd >> 6 == 2 and not fhd & 0x20 and not fhd & 3   # 4-byte FCS after window byte
        frame = frame[:6] + declared.to_bytes(4, "little") + frame[10:]
    return frame


def _bomb_tensor(frame: bytes, total: int) -> pb.NamedTensor:
    return pb.NamedTensor(
        name="h", shape=[total], dtype=pb.DTYPE_UINT8, byte_order=1, total_bytes=total,
        compression=pb.COMPRESSION_ZSTD, encoding=pb.TENSOR_ENCODING_RAW,
        checksum=pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_CRC32C, value=b"\0\0\0\0"),
        fragments=[pb.TensorFragment(fragment_count=1, payload=frame)])


@pytest.mark.parametrize("variant", ["honest_header", "lying_header", "no_content_size"])
def test_zstd_bomb_is_refused_with_bounded_memory(variant):
    declared = 1 << 20                                     # the tensor says 1 MiB
    if variant == "honest_header":                         # header says 256 MiB
        frame, error = _zstd_cache("honest"), LimitExceeded
    elif variant == "lying_header":                        # header says 1 MiB, data is 256 MiB
        frame, error = _zstd_cache("lying"), PayloadCorrupt
    else:
        frame, error = _zstd_cache("unknown"), PayloadCorrupt
    assert len(frame) < 64 * 1024
    tensor = _bomb_tensor(frame, declared)

    def decode():
        with pytest.raises(error):
            decode_tensor(tensor)
    peak = _peak_during(decode)
    assert peak < 3 * declared, f"peak {peak} bytes while refusing a zstd bomb"


_ZSTD = {}


def _zstd_cache(kind: str) -> bytes:
    if kind not in _ZSTD:
        _ZSTD[kind] = {"honest": lambda: _zeros_frame(256 << 20),
                       "lying": lambda: _zeros_frame(256 << 20, declared=1 << 20),
                       "unknown": lambda: _zeros_frame(256 << 20, content_size=False)}[kind]()
    return _ZSTD[kind]


@pytest.mark.parametrize("shape, total", [([1 << 24, 1 << 24], 1 << 48),      # 256 TiB declared
                                          ([1 << 24, 1 << 24], 64),           # size lie
                                          ([4096, 4096], 64 << 20),            # over the limit
                                          ([1024], 1 << 62)])
def test_shape_and_size_lies_are_refused_before_allocation(shape, total):
    t = pb.NamedTensor(name="h", shape=shape, dtype=pb.DTYPE_FLOAT32, byte_order=1,
                       total_bytes=total, compression=pb.COMPRESSION_NONE, encoding=1,
                       checksum=pb.Checksum(algorithm=2, value=b"\0" * 4),
                       fragments=[pb.TensorFragment(fragment_count=1, payload=b"\0" * 64)])

    def decode():
        with pytest.raises(ProtocolError):
            decode_tensor(t)
    assert _peak_during(decode) < 64 * 1024


def test_oversized_frame_length_is_refused_before_buffering():
    reader = FrameReader()
    data = b"\xff\xff\xff\xff" + bytes(1 << 20)         # 4 GiB declared, 1 MiB sent

    def feed():
        with pytest.raises(LimitExceeded):
            reader.feed(data)
    assert _peak_during(feed) < 64 * 1024 and reader.buffered == 4


def _chunk_with_tensor_bytes(tensor_body: bytes) -> bytes:
    """SessionRequest{chunk{envelope, bundle{version 1, tensors: [raw tensor body]}}}."""
    from proto.tensors import varint
    env = ENV.SerializeToString()
    bundle = b"\x08\x01\x12" + varint(len(tensor_body)) + tensor_body
    chunk = b"\x0a" + varint(len(env)) + env + b"\x12" + varint(len(bundle)) + bundle
    return b"\x12" + varint(len(chunk)) + chunk


@pytest.mark.parametrize("reader", [parse_request, read_request])
def test_element_count_amplification_is_refused_before_protobuf_allocates(reader):
    # 8 MiB of empty fragments would be ~4 M protobuf objects (~200 MB); the scan
    # stops at MAX_WIRE_FIELDS, so the peak does not grow with the input.
    many_fragments = _chunk_with_tensor_bytes(b"\x0a\x01h" + b"\x42\x00" * (4 << 20))
    long_shape = _chunk_with_tensor_bytes(b"\x0a\x01h\x12\x80\x80\x80\x04" + b"\x01" * (8 << 20))
    for data in (many_fragments, long_shape):
        def parse(data=data):
            with pytest.raises(LimitExceeded):
                reader(data)
        assert _peak_during(parse) < 8 << 20


def test_control_frames_are_small():
    huge_open = pb.SessionRequest(open=pb.SessionOpen(
        schema_version=1, accepted_compression=[1] * 100_000)).SerializeToString()
    with pytest.raises(LimitExceeded):
        parse_request(huge_open)
    two_kinds = (pb.SessionRequest(flow_control=pb.FlowControl()).SerializeToString()
                 + pb.SessionRequest(release=pb.ReleaseSignal()).SerializeToString())
    with pytest.raises(ProtocolError):
        parse_request(two_kinds)

