"""Validated decoding of a peer's tensors (raises only ProtocolError subclasses).

Both decoders go through one function, ``decode_header``, over plain values
(``TensorHeader``) and the fragment payloads:
    decode_tensor(pb.NamedTensor)      values read from the protobuf message;
    proto.zerocopy                     values read straight off the wire by its
                                       walker (no protobuf wrapper objects), for
                                       canonically encoded tensors.
Order of checks -- all before any allocation: name, rank, dims, dtype, byte
order, encoding, compression, checksum algorithm, total_bytes against shape x
dtype (or the q8 size) and the limits, fragment count / index / offset tiling
and sizes. Then: join (only if several fragments), bounded zstd into a buffer
of exactly total_bytes, CRC32C, and a read-only array view (q8: decoded copy).
"""
from __future__ import annotations

import numpy as np
import zstandard

from proto import shard_runtime_pb2 as pb
from proto.checksum import crc32c
from proto.dtypes import BUNDLE_VERSION, COMPRESSIONS, ENCODINGS, FLOAT_DTYPES, PB_TO_NUMPY
from proto.errors import LimitExceeded, PayloadCorrupt, ProtocolViolation, VersionUnsupported
from proto.limits import DEFAULT_LIMITS, Limits
from proto.q8 import decode_q8, q8_encoded_size

__all__ = ["TensorHeader", "header_of", "decode_header", "decode_headers", "decode_tensor",
           "decode_bundle"]

_LE = pb.BYTE_ORDER_LITTLE_ENDIAN
_CRC32C = pb.CHECKSUM_ALGORITHM_CRC32C
_Q8 = pb.TENSOR_ENCODING_Q8_BLOCK32
_NONE = pb.COMPRESSION_NONE
_ZSTD = pb.COMPRESSION_ZSTD
_BOOL = PB_TO_NUMPY[pb.DTYPE_BOOL]


class TensorHeader:
    """The declared values of one NamedTensor; ``fragments`` is [(index, count, offset)]."""

    __slots__ = ("name", "shape", "dtype", "byte_order", "total_bytes", "compression",
                 "algorithm", "checksum", "encoding", "fragments")

    def __init__(self, name: str = "", shape: tuple = (), dtype: int = 0, byte_order: int = 0,
                 total_bytes: int = 0, compression: int = 0, algorithm: int = 0,
                 checksum: bytes = b"", encoding: int = 0, fragments: list | None = None) -> None:
        self.name, self.shape, self.dtype, self.byte_order = name, shape, dtype, byte_order
        self.total_bytes, self.compression, self.algorithm = total_bytes, compression, algorithm
        self.checksum, self.encoding = checksum, encoding
        self.fragments = [] if fragments is None else fragments


def header_of(t: pb.NamedTensor, limits: Limits = DEFAULT_LIMITS) -> TensorHeader:
    """The declared values of a protobuf NamedTensor (at most one fragment over the
    limit is read, so the count check still fires without touching the rest)."""
    checksum = t.checksum
    frags = t.fragments[:limits.max_fragments_per_tensor + 1]
    return TensorHeader(t.name, tuple(t.shape[:limits.max_rank + 1]), t.dtype, t.byte_order,
                        t.total_bytes, t.compression, checksum.algorithm, checksum.value,
                        t.encoding, [(f.fragment_index, f.fragment_count, f.byte_offset)
                                     for f in frags])


def _declared_size(h: TensorHeader, limits: Limits) -> tuple[np.dtype, int]:
    """Check the declarations; return (numpy dtype, element count)."""
    name = h.name
    if not name:
        raise ProtocolViolation("tensor without a name")
    if len(name) > limits.max_name_len or len(name.encode("utf-8")) > limits.max_name_len:
        raise LimitExceeded(f"tensor name longer than {limits.max_name_len} bytes")
    shape = h.shape
    if len(shape) > limits.max_rank:
        raise LimitExceeded(f"tensor {name!r} has rank {len(shape)} > {limits.max_rank}")
    count = 1
    max_dim = limits.max_dim
    for d in shape:
        if d < 0:
            raise PayloadCorrupt(f"tensor {name!r} has a negative dimension in {shape}")
        if d > max_dim:
            raise LimitExceeded(f"tensor {name!r} dimension {d} > {max_dim}")
        count *= d
    code, encoding, total = h.dtype, h.encoding, h.total_bytes
    dtype = PB_TO_NUMPY.get(code)
    if dtype is None:
        raise ProtocolViolation(f"tensor {name!r} has unspecified or unknown dtype {code}")
    if h.byte_order != _LE:
        raise ProtocolViolation(f"tensor {name!r}: byte order must be little-endian")
    if encoding not in ENCODINGS:
        raise ProtocolViolation(f"tensor {name!r} has unspecified or unknown encoding")
    if h.compression not in COMPRESSIONS:
        raise ProtocolViolation(f"tensor {name!r} has unspecified or unknown compression")
    if h.algorithm != _CRC32C or len(h.checksum) != 4:
        raise ProtocolViolation(f"tensor {name!r}: a 4-byte CRC32C checksum is required")
    if encoding == _Q8:
        if code not in FLOAT_DTYPES:
            raise ProtocolViolation(f"tensor {name!r}: q8 encoding of a non-float dtype")
        expected = q8_encoded_size(count)
    else:
        expected = count * dtype.itemsize
    if total > limits.max_tensor_bytes or expected > limits.max_tensor_bytes:
        raise LimitExceeded(f"tensor {name!r} declares {max(expected, total)} bytes"
                            f" > {limits.max_tensor_bytes}")
    if expected != total:
        raise PayloadCorrupt(f"tensor {name!r}: shape {list(shape)} needs {expected} bytes, "
                             f"total_bytes says {total}")
    return dtype, count


def _zstd_bound(n: int) -> int:
    # libzstd's ZSTD_COMPRESSBOUND plus frame-header slack: a legitimate frame
    # of n bytes is never longer than this.
    return n + (n >> 8) + (128 * 1024 - n >> 11 if n < 128 * 1024 else 0) + 64


def _wire_body(h: TensorHeader, payloads: list, limits: Limits):
    """Check the fragments tile the body exactly; return the (joined) body."""
    frags = h.fragments
    count = len(frags)
    if count == 0:
        raise PayloadCorrupt(f"tensor {h.name!r} carries no fragment")
    if count > limits.max_fragments_per_tensor:
        raise LimitExceeded(f"tensor {h.name!r} has {count} fragments "
                            f"> {limits.max_fragments_per_tensor}")
    if len(payloads) != count:
        raise PayloadCorrupt(f"tensor {h.name!r}: non-canonical fragment layout")
    bound = h.total_bytes if h.compression == _NONE else _zstd_bound(h.total_bytes)
    offset = 0
    for i, (index, declared_count, byte_offset) in enumerate(frags):
        if index != i or declared_count != count or byte_offset != offset:
            raise PayloadCorrupt(f"tensor {h.name!r}: fragment {i} has index/count/offset "
                                 f"{index}/{declared_count}/{byte_offset}, "
                                 f"expected {i}/{count}/{offset}")
        size = len(payloads[i])
        if size > limits.max_fragment_bytes:
            raise LimitExceeded(f"tensor {h.name!r}: fragment of {size} bytes "
                                f"> {limits.max_fragment_bytes}")
        offset += size
        if offset > bound:
            raise PayloadCorrupt(f"tensor {h.name!r}: fragments exceed the declared size")
    if h.compression == _NONE and offset != h.total_bytes:
        raise PayloadCorrupt(f"tensor {h.name!r}: fragments carry {offset} bytes, "
                             f"total_bytes says {h.total_bytes}")
    return payloads[0] if count == 1 else b"".join(payloads)


def _decompress(name: str, body, total: int, limits: Limits) -> bytes:
    """Bounded zstd: the output buffer is exactly ``total`` bytes, never more."""
    try:
        params = zstandard.get_frame_parameters(body)
    except zstandard.ZstdError as exc:
        raise PayloadCorrupt(f"tensor {name!r}: not a zstd frame") from exc
    size = params.content_size
    if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        raise PayloadCorrupt(f"tensor {name!r}: zstd frame must declare its content size")
    if size > total:
        raise LimitExceeded(f"tensor {name!r}: zstd frame expands to {size} bytes "
                            f"> declared {total}")
    if size != total:
        raise PayloadCorrupt(f"tensor {name!r}: zstd frame holds {size} bytes, declared {total}")
    if params.window_size > limits.max_zstd_window_bytes:
        raise LimitExceeded(f"tensor {name!r}: zstd window {params.window_size} "
                            f"> {limits.max_zstd_window_bytes}")
    try:
        dctx = zstandard.ZstdDecompressor(max_window_size=limits.max_zstd_window_bytes)
        out = dctx.decompress(body, max_output_size=total, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise PayloadCorrupt(f"tensor {name!r}: corrupt zstd body ({exc})") from exc
    if len(out) != total:
        raise PayloadCorrupt(f"tensor {name!r}: zstd body holds {len(out)} bytes, declared {total}")
    return out


def decode_header(h: TensorHeader, payloads: list, limits: Limits = DEFAULT_LIMITS) -> np.ndarray:
    """Validate declarations and payloads, then decode (see the module docstring)."""
    dtype, count = _declared_size(h, limits)
    data = _wire_body(h, payloads, limits)
    if h.compression == _ZSTD:
        data = _decompress(h.name, data, h.total_bytes, limits)
    if crc32c(data).to_bytes(4, "big") != h.checksum:
        raise PayloadCorrupt(f"tensor {h.name!r} failed its CRC32C check")
    if h.encoding == _Q8:
        return decode_q8(data, count, dtype).reshape(h.shape)
    if dtype is _BOOL and count and np.frombuffer(data, np.uint8).max() > 1:
        raise PayloadCorrupt(f"tensor {h.name!r}: bool bytes must be 0 or 1")
    return np.frombuffer(data, dtype=dtype, count=count).reshape(h.shape)


def decode_tensor(t: pb.NamedTensor, limits: Limits = DEFAULT_LIMITS) -> np.ndarray:
    """Validate and decode a peer's NamedTensor (raises only ProtocolError types).

    Raw arrays are read-only views over the message's payload bytes.
    """
    cap = limits.max_fragments_per_tensor + 1
    return decode_header(header_of(t, limits), [f.payload for f in t.fragments[:cap]], limits)


def decode_headers(bundle_version: int, tensors: list, limits: Limits = DEFAULT_LIMITS
                   ) -> dict[str, np.ndarray]:
    """Bundle-level checks, then each (TensorHeader, payloads) decoded; names unique."""
    if bundle_version != BUNDLE_VERSION:
        raise VersionUnsupported(f"bundle version {bundle_version} is not supported "
                                 f"(this build speaks {BUNDLE_VERSION})")
    if len(tensors) > limits.max_tensors_per_bundle:
        raise LimitExceeded(f"bundle has {len(tensors)} tensors > {limits.max_tensors_per_bundle}")
    declared = sum(h.total_bytes for h, _ in tensors)
    if declared > limits.max_bundle_bytes:
        raise LimitExceeded(f"bundle declares {declared} bytes > {limits.max_bundle_bytes}")
    out: dict[str, np.ndarray] = {}
    for h, payloads in tensors:
        if h.name in out:
            raise ProtocolViolation(f"bundle names tensor {h.name!r} twice")
        out[h.name] = decode_header(h, payloads, limits)
    return out


def decode_bundle(b: pb.TensorBundle, limits: Limits = DEFAULT_LIMITS) -> dict[str, np.ndarray]:
    """Validate and decode every tensor of a peer's bundle; names must be unique."""
    tensors = b.tensors
    if len(tensors) > limits.max_tensors_per_bundle:
        raise LimitExceeded(f"bundle has {len(tensors)} tensors > {limits.max_tensors_per_bundle}")
    cap = limits.max_fragments_per_tensor + 1
    return decode_headers(b.bundle_version, [
        (header_of(t, limits), [f.payload for f in t.fragments[:cap]]) for t in tensors], limits)
