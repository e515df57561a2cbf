"""proto.tensors / proto.q8 / proto.checksum: round trips, validation, q8 error bound."""
from __future__ import annotations

import google_crc32c
import ml_dtypes
import numpy as np
import pytest

from proto import shard_runtime_pb2 as pb
from proto.checksum import crc32c
from proto.errors import LimitExceeded, LocalError, PayloadCorrupt, ProtocolError, ProtocolViolation, VersionUnsupported
from proto.limits import DEFAULT_LIMITS, Limits
from proto.q8 import BLOCK, decode_q8, encode_q8, q8_encoded_size
from proto.tensors import decode_bundle, decode_tensor, encode_bundle, encode_tensor

DTYPES = [ml_dtypes.bfloat16, np.float16, np.float32, np.int32, np.int64, np.int8, np.uint8,
          np.bool_]


def reparse(t: pb.NamedTensor) -> pb.NamedTensor:
    return pb.NamedTensor.FromString(t.SerializeToString())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("compression", [pb.COMPRESSION_NONE, pb.COMPRESSION_ZSTD])
def test_round_trip_every_dtype(dtype, compression):
    a = (np.random.default_rng(1).standard_normal((3, 7)) * 50).astype(dtype)
    t = reparse(encode_tensor("h", a, compression=compression, max_fragment_bytes=5))
    assert len(t.fragments) > 1
    b = decode_tensor(t)
    assert b.dtype == np.dtype(dtype) and b.shape == a.shape
    assert np.array_equal(b.view(np.uint8), a.view(np.uint8))


def test_big_endian_input_is_sent_little_endian():
    a = np.arange(6, dtype=">f4").reshape(2, 3)
    t = encode_tensor("h", a)
    assert t.fragments[0].payload == a.astype("<f4").tobytes()
    assert np.array_equal(decode_tensor(t), a)


def test_zero_size_and_scalar_tensors():
    out = decode_bundle(reparse_bundle(encode_bundle({"e": np.zeros((0, 4), np.float32),
                                                      "s": np.array(7, np.int64)})))
    assert out["e"].shape == (0, 4) and out["s"].shape == () and out["s"] == 7


def reparse_bundle(b):
    return pb.TensorBundle.FromString(b.SerializeToString())


def test_crc_is_google_crc32c_over_uncompressed_bytes():
    a = np.arange(1000, dtype=np.float32)
    t = encode_tensor("h", a, compression=pb.COMPRESSION_ZSTD)
    assert t.checksum.value == google_crc32c.value(a.tobytes()).to_bytes(4, "big")
    assert crc32c(memoryview(a.tobytes())[1:9]) == google_crc32c.value(a.tobytes()[1:9])


def test_bad_crc_shape_lie_and_tiling_are_refused():
    t = encode_tensor("h", np.arange(64, dtype=np.float32), max_fragment_bytes=64)
    bad = reparse(t)
    bad.checksum.value = b"\0\0\0\0"
    with pytest.raises(PayloadCorrupt):
        decode_tensor(bad)
    lie = reparse(t)
    lie.shape[:] = [65]
    with pytest.raises(PayloadCorrupt):
        decode_tensor(lie)
    for field, value in [("fragment_index", 2), ("fragment_count", 3), ("byte_offset", 60)]:
        holed = reparse(t)
        setattr(holed.fragments[1], field, value)
        with pytest.raises(PayloadCorrupt):
            decode_tensor(holed)
    short = reparse(t)
    del short.fragments[-1]
    with pytest.raises(PayloadCorrupt):
        decode_tensor(short)


@pytest.mark.parametrize("mutate, error", [
    (lambda t: setattr(t, "dtype", pb.DTYPE_UNSPECIFIED), ProtocolViolation),
    (lambda t: setattr(t, "byte_order", pb.BYTE_ORDER_BIG_ENDIAN), ProtocolViolation),
    (lambda t: setattr(t, "encoding", 0), ProtocolViolation),
    (lambda t: setattr(t, "compression", 0), ProtocolViolation),
    (lambda t: setattr(t.checksum, "algorithm", pb.CHECKSUM_ALGORITHM_NONE), ProtocolViolation),
    (lambda t: setattr(t, "name", ""), ProtocolViolation),
    (lambda t: setattr(t, "name", "x" * 65), LimitExceeded),
    (lambda t: t.shape.extend([1] * 8), LimitExceeded),
    (lambda t: t.shape.__setitem__(0, 1 << 40), LimitExceeded),
    (lambda t: setattr(t, "total_bytes", 1 << 40), LimitExceeded),
])
def test_declarations_are_checked(mutate, error):
    t = reparse(encode_tensor("h", np.ones((2, 2), np.float32)))
    mutate(t)
    with pytest.raises(error):
        decode_tensor(t)


def test_limits_are_validated_and_applied():
    with pytest.raises(LocalError):
        Limits(max_rank=0)
    t = encode_tensor("h", np.ones(100, np.float32), max_fragment_bytes=40)
    with pytest.raises(LimitExceeded):
        decode_tensor(t, Limits(max_fragments_per_tensor=5))
    with pytest.raises(LimitExceeded):
        decode_tensor(t, Limits(max_fragment_bytes=39))
    with pytest.raises(LimitExceeded):
        decode_tensor(t, Limits(max_tensor_bytes=399))


def test_bundle_checks():
    b = encode_bundle({"a": np.ones(3, np.int8)})
    b.bundle_version = 2
    with pytest.raises(VersionUnsupported):
        decode_bundle(b)
    b.bundle_version = 1
    b.tensors.append(b.tensors[0])
    with pytest.raises(ProtocolViolation):
        decode_bundle(b)


def test_bool_bytes_other_than_0_1_are_corrupt():
    t = encode_tensor("m", np.array([True, False]))
    t.fragments[0].payload = b"\x02\x00"
    t.checksum.value = google_crc32c.value(b"\x02\x00").to_bytes(4, "big")
    with pytest.raises(PayloadCorrupt):
        decode_tensor(t)


@pytest.mark.parametrize("bad", [
    dict(name=""), dict(name="x" * 65), dict(array=[1, 2]), dict(array=np.zeros(2, np.uint16)),
    dict(compression=0), dict(encoding=0), dict(max_fragment_bytes=0),
    dict(array=np.zeros(4, np.int32), encoding=pb.TENSOR_ENCODING_Q8_BLOCK32),
    dict(array=np.array([np.nan], np.float32), encoding=pb.TENSOR_ENCODING_Q8_BLOCK32),
    dict(array=np.array([np.inf], np.float32), encoding=pb.TENSOR_ENCODING_Q8_BLOCK32),
    dict(array=np.array([1e7], np.float32), encoding=pb.TENSOR_ENCODING_Q8_BLOCK32),
    dict(array=np.zeros(65 * 4, np.float32), max_fragment_bytes=4),
])
def test_local_misuse_is_local_error(bad):
    kwargs = dict(name="h", array=np.zeros(2, np.float32)) | bad
    with pytest.raises(LocalError):
        encode_tensor(kwargs.pop("name"), kwargs.pop("array"), **kwargs)


# ----------------------------------------------------------------------------- q8


def _half_scale_errors(x: np.ndarray, encoded: bytes) -> np.ndarray:
    n = x.size
    scales = np.frombuffer(encoded, "<f2", count=-(-n // BLOCK)).astype(np.float64)
    y = decode_q8(encoded, n, np.dtype(np.float32)).astype(np.float64)
    half = np.repeat(scales, BLOCK)[:n] / 2
    err = np.abs(y - x.astype(np.float64).reshape(-1))
    return np.where(half > 0, err / np.where(half > 0, half, 1), err)


@pytest.mark.parametrize("n", [1, 31, 32, 33, 64, 1000])
@pytest.mark.parametrize("magnitude", [1e-9, 1e-6, 1.0, 3e4, 1e6])
def test_q8_error_within_half_scale(n, magnitude):
    x = (np.random.default_rng(n).standard_normal(n) * magnitude).astype(np.float32)
    enc = encode_q8(x)
    assert len(enc) == q8_encoded_size(n)
    assert _half_scale_errors(x, enc).max() <= 1.0


def test_q8_zero_block_subnormal_scale_and_size():
    x = np.zeros(70, np.float32)
    x[40] = 1e-12                      # block 1: scale rounds up to the smallest subnormal
    enc = encode_q8(x)
    scales = np.frombuffer(enc, "<f2", count=3)
    assert scales[0] == 0 and scales[1] == np.nextafter(np.float16(0), np.float16(1))
    assert np.all(decode_q8(enc, 70, np.dtype(np.float32)) == 0)
    assert q8_encoded_size(32) / 32 == 1.0625


def test_q8_scale_is_rounded_up_so_nothing_clamps():
    # amax/127 just above a float16 value: a nearest-rounded scale would clamp.
    s = np.float16(0.1)
    x = np.full(32, float(s) * 127 * (1 + 1e-4), np.float32)
    enc = encode_q8(x)
    assert np.frombuffer(enc, "<f2", count=1)[0] > s
    assert _half_scale_errors(x, enc).max() <= 1.0


def test_q8_bad_scale_from_peer_is_corrupt():
    t = encode_tensor("h", np.ones(40, np.float32), encoding=pb.TENSOR_ENCODING_Q8_BLOCK32)
    body = bytearray(t.fragments[0].payload)
    body[0:2] = np.float16(np.nan).tobytes()
    t.fragments[0].payload = bytes(body)
    t.checksum.value = google_crc32c.value(bytes(body)).to_bytes(4, "big")
    with pytest.raises(PayloadCorrupt):
        decode_tensor(t)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
def test_q8_tensor_decodes_to_declared_dtype(dtype):
    a = np.random.default_rng(0).standard_normal((5, 40)).astype(dtype)
    out = decode_tensor(reparse(encode_tensor("h", a, encoding=pb.TENSOR_ENCODING_Q8_BLOCK32,
                                              compression=pb.COMPRESSION_ZSTD)))
    assert out.dtype == np.dtype(dtype) and out.shape == a.shape
    assert np.abs(out.astype(np.float32) - a.astype(np.float32)).max() < 0.05


def test_every_protocol_error_carries_a_code():
    for cls in ProtocolError.__subclasses__():
        assert cls.code != pb.ERROR_CODE_UNSPECIFIED
    assert DEFAULT_LIMITS.max_frame_bytes >= DEFAULT_LIMITS.max_fragment_bytes


def test_varint_fast_paths_match_protobuf_and_header_cache_is_bounded():
    from google.protobuf.internal.encoder import _VarintBytes

    from proto import tensors as T

    for n in (0, 1, 0x7F, 0x80, 0x81, 576, 2304, 0x3FFF, 0x4000, 0x4001, 2**21, 2**35, 2**63):
        assert T.varint(n) == _VarintBytes(n), n
    T._HEADER_CACHE.clear()
    for i in range(T.MAX_HEADER_CACHE + 5):   # distinct shapes: the cache never grows past its bound
        arr = np.zeros((1, i + 1), np.float32)
        prepared = T.prepare_tensor("h", arr).to_message()
        assert T.encode_tensor("h", arr).SerializeToString() == prepared.SerializeToString()
        assert len(T._HEADER_CACHE) <= T.MAX_HEADER_CACHE
    a, b = np.ones((1, 4), np.float32), np.full((1, 4), 2.0, np.float32)   # same header prefix, other CRC
    assert T.prepare_tensor("h", a).header != T.prepare_tensor("h", b).header
