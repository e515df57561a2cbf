"""numpy arrays <-> NamedTensor / TensorBundle messages, validated both ways.

Encode (our arrays, LocalError on bad arguments):
    array --(little-endian raw | q8 blocks)--> encoded bytes --CRC32C-->
    --(optional zstd)--> wire body --split--> fragments (index, count, offset)
``prepare_tensor`` stops before building the protobuf fragments and keeps the
wire body as a buffer (a memoryview of the array for raw, no copy), so
``proto.wire`` can serialize a frame around it by hand; ``encode_tensor`` turns
the same preparation into a ``pb.NamedTensor``.

Decode (a peer's message, only ProtocolError subclasses): every declaration is
checked against ``Limits`` BEFORE any allocation -- name, rank, dims, dtype,
byte order, encoding, compression, checksum algorithm, total_bytes against
shape x dtype (or the q8 size), fragment count/index/offset tiling -- then the
body is reassembled, zstd-decompressed into a buffer of exactly total_bytes
(a frame that would expand further is refused), CRC-checked, and viewed as an
array. Decoded raw arrays are READ-ONLY views over the received bytes (no
copy); ``.copy()`` them if you must write. bf16 is ``ml_dtypes.bfloat16``.
No state; no I/O.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import zstandard

from proto import shard_runtime_pb2 as pb
from proto.checksum import crc32c, crc32c_bytes
from proto.errors import LimitExceeded, LocalError, PayloadCorrupt, ProtocolViolation, VersionUnsupported
from proto.limits import DEFAULT_FRAGMENT_BYTES, DEFAULT_LIMITS, ZSTD_LEVEL, Limits
from proto.q8 import decode_q8, encode_q8, q8_encoded_size

__all__ = [
    "BUNDLE_VERSION", "PB_TO_NUMPY", "PreparedTensor", "prepare_tensor", "encode_tensor", "varint",
    "prepare_bundle", "bundle_pieces",
    "decode_tensor", "encode_bundle", "decode_bundle", "pb_dtype_of",
]

# TensorBundle layout generation, versioned apart from the schema.
BUNDLE_VERSION = 1

PB_TO_NUMPY: dict[int, np.dtype] = {
    pb.DTYPE_BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_UINT8: np.dtype("u1"),
    pb.DTYPE_INT8: np.dtype("i1"),
    pb.DTYPE_BOOL: np.dtype("?"),
}
_NUMPY_TO_PB = {dt: code for code, dt in PB_TO_NUMPY.items()}
_FLOAT_DTYPES = frozenset({pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT16, pb.DTYPE_FLOAT32})
_COMPRESSIONS = frozenset({pb.COMPRESSION_NONE, pb.COMPRESSION_ZSTD})
_ENCODINGS = frozenset({pb.TENSOR_ENCODING_RAW, pb.TENSOR_ENCODING_Q8_BLOCK32})


def pb_dtype_of(dtype) -> int:
    """The wire DType of a numpy dtype (LocalError if unsupported)."""
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    try:
        return _NUMPY_TO_PB[dt]
    except KeyError:
        raise LocalError(f"unsupported dtype {dt}; use one of "
                         + ", ".join(str(d) for d in PB_TO_NUMPY.values())) from None


def varint(n: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int."""
    if n < 0x80:
        return _ONE_BYTE[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_ONE_BYTE = [bytes([i]) for i in range(0x80)]


@dataclass(frozen=True, slots=True)
class PreparedTensor:
    """A NamedTensor before its fragments exist: serialized header + wire body.

    ``header`` is the canonical serialization of fields 1-7 (name .. checksum);
    ``body`` is the wire body (compressed when compression is ZSTD) as bytes or a
    read-only memoryview; ``fragment_bytes`` is the split size.
    """

    name: str
    header: bytes
    encoding: int
    body: bytes | memoryview
    fragment_bytes: int

    def pieces(self) -> tuple[list, int]:
        """The canonical serialization of the NamedTensor as pieces to join, and its size.

        Fields in number order, proto3 defaults omitted: header (1-7), one
        TensorFragment per slice (8), encoding (9). Payloads are views, not copies.
        """
        view = memoryview(self.body)
        step = self.fragment_bytes
        count = max(1, -(-len(view) // step))
        out = [self.header]
        total = len(self.header)
        count_field = b"\x10" + varint(count)
        for i in range(count):
            payload = view[i * step:(i + 1) * step]
            n = len(payload)
            head = b"\x08" + varint(i) + count_field + b"\x18" + varint(i * step) if i else count_field
            if n:
                head += b"\x22" + varint(n)
            frag = b"\x42" + varint(len(head) + n) + head
            out.append(frag)
            total += len(frag)
            if n:
                out.append(payload)
                total += n
        if self.encoding:
            out.append(b"\x48" + varint(self.encoding))
            total += len(out[-1])
        return out, total

    def to_message(self) -> pb.NamedTensor:
        return pb.NamedTensor.FromString(b"".join(self.pieces()[0]))


def _header_bytes(name_utf8: bytes, shape: tuple[int, ...], dtype: int, total: int,
                  compression: int, crc: bytes) -> bytes:
    """Canonical serialization of NamedTensor fields 1-7 as prepare_tensor fills them."""
    out = b"\x0a" + varint(len(name_utf8)) + name_utf8
    if shape:
        packed = b"".join([varint(d) for d in shape])
        out += b"\x12" + varint(len(packed)) + packed
    out += b"\x18" + varint(dtype) + b"\x20\x01"          # byte_order: little-endian
    if total:
        out += b"\x28" + varint(total)
    return out + b"\x30" + varint(compression) + b"\x3a\x08\x08\x02\x12\x04" + crc  # CRC32C


def prepare_tensor(name: str, array: np.ndarray, *, compression: int = pb.COMPRESSION_NONE,
                   encoding: int = pb.TENSOR_ENCODING_RAW,
                   max_fragment_bytes: int = DEFAULT_FRAGMENT_BYTES) -> PreparedTensor:
    """Validate our arguments and compute the header and wire body of one tensor."""
    limits = DEFAULT_LIMITS
    if not isinstance(name, str) or not name:
        raise LocalError("tensor name must be a non-empty str")
    name_utf8 = name.encode("utf-8")
    if len(name_utf8) > limits.max_name_len:
        raise LocalError(f"tensor name {name[:16]!r}... longer than {limits.max_name_len} bytes")
    if not isinstance(array, np.ndarray):
        raise LocalError(f"tensor {name!r}: expected a numpy array, got {type(array).__name__}")
    if compression not in _COMPRESSIONS:
        raise LocalError(f"tensor {name!r}: compression must be COMPRESSION_NONE or _ZSTD")
    if encoding not in _ENCODINGS:
        raise LocalError(f"tensor {name!r}: encoding must be TENSOR_ENCODING_RAW or _Q8_BLOCK32")
    if (not isinstance(max_fragment_bytes, int) or isinstance(max_fragment_bytes, bool)
            or not 1 <= max_fragment_bytes <= limits.max_fragment_bytes):
        raise LocalError(f"max_fragment_bytes must be in 1..{limits.max_fragment_bytes}")
    dtype = pb_dtype_of(array.dtype)
    if array.ndim > limits.max_rank or (array.ndim and max(array.shape) > limits.max_dim):
        raise LocalError(f"tensor {name!r}: shape {array.shape} exceeds rank {limits.max_rank}"
                         f" / dim {limits.max_dim}")
    if encoding == pb.TENSOR_ENCODING_Q8_BLOCK32:
        if dtype not in _FLOAT_DTYPES:
            raise LocalError(f"tensor {name!r}: q8 needs a floating dtype, not {array.dtype}")
        encoded: bytes | memoryview = encode_q8(array)
    else:
        le = np.ascontiguousarray(array, dtype=PB_TO_NUMPY[dtype])
        encoded = memoryview(le.reshape(-1).view(np.uint8)).toreadonly()
    total = len(encoded)
    if total > limits.max_tensor_bytes:
        raise LocalError(f"tensor {name!r} is {total} bytes; the limit is {limits.max_tensor_bytes}")
    body = encoded
    if compression == pb.COMPRESSION_ZSTD:
        body = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(encoded)
    if max(1, -(-len(body) // max_fragment_bytes)) > limits.max_fragments_per_tensor:
        raise LocalError(f"tensor {name!r} needs more than {limits.max_fragments_per_tensor} "
                         f"fragments of {max_fragment_bytes} bytes; use larger fragments")
    header = _header_bytes(name_utf8, array.shape, dtype, total, compression, crc32c_bytes(encoded))
    return PreparedTensor(name=name, header=header, encoding=encoding, body=body,
                          fragment_bytes=max_fragment_bytes)


def encode_tensor(name: str, array: np.ndarray, *, compression: int = pb.COMPRESSION_NONE,
                  encoding: int = pb.TENSOR_ENCODING_RAW,
                  max_fragment_bytes: int = DEFAULT_FRAGMENT_BYTES) -> pb.NamedTensor:
    """Encode one array as a NamedTensor (CRC32C over the uncompressed encoded bytes)."""
    return prepare_tensor(name, array, compression=compression, encoding=encoding,
                          max_fragment_bytes=max_fragment_bytes).to_message()


def prepare_bundle(tensors: Mapping, **kwargs) -> list[PreparedTensor]:
    """PreparedTensors for a mapping of name -> array (or ready PreparedTensor)."""
    if not isinstance(tensors, Mapping):
        raise LocalError("a bundle is a mapping of name -> array")
    if len(tensors) > DEFAULT_LIMITS.max_tensors_per_bundle:
        raise LocalError(f"a bundle holds at most {DEFAULT_LIMITS.max_tensors_per_bundle} tensors")
    out = []
    for name, value in tensors.items():
        if isinstance(value, PreparedTensor):
            if value.name != name:
                raise LocalError(f"PreparedTensor named {value.name!r} under key {name!r}")
            out.append(value)
        else:
            out.append(prepare_tensor(name, value, **kwargs))
    return out


def bundle_pieces(prepared: list[PreparedTensor]) -> tuple[list, int]:
    """Canonical serialization of a TensorBundle as pieces to join, and its size."""
    out = [b"\x08" + varint(BUNDLE_VERSION)]
    total = len(out[0])
    for prep in prepared:
        pieces, size = prep.pieces()
        head = b"\x12" + varint(size)
        out.append(head)
        out.extend(pieces)
        total += len(head) + size
    return out, total


def encode_bundle(tensors: Mapping[str, np.ndarray], **kwargs) -> pb.TensorBundle:
    """Encode named arrays as a TensorBundle; kwargs as for encode_tensor."""
    pieces, _ = bundle_pieces(prepare_bundle(tensors, **kwargs))
    return pb.TensorBundle.FromString(b"".join(pieces))


# --------------------------------------------------------------------------- decode


def _declared_size(t: pb.NamedTensor, limits: Limits) -> tuple[np.dtype, tuple[int, ...], int]:
    """Check a tensor's declarations; return (numpy dtype, shape, element count)."""
    name = t.name
    if not name:
        raise ProtocolViolation("tensor without a name")
    if len(name.encode("utf-8")) > limits.max_name_len:
        raise LimitExceeded(f"tensor name longer than {limits.max_name_len} bytes")
    if len(t.shape) > limits.max_rank:
        raise LimitExceeded(f"tensor {name!r} has rank {len(t.shape)} > {limits.max_rank}")
    shape = tuple(t.shape)
    count = 1
    for d in shape:
        if d < 0:
            raise PayloadCorrupt(f"tensor {name!r} has a negative dimension in {shape}")
        if d > limits.max_dim:
            raise LimitExceeded(f"tensor {name!r} dimension {d} > {limits.max_dim}")
        count *= d
    if t.dtype not in PB_TO_NUMPY:
        raise ProtocolViolation(f"tensor {name!r} has unspecified or unknown dtype {t.dtype}")
    if t.byte_order != pb.BYTE_ORDER_LITTLE_ENDIAN:
        raise ProtocolViolation(f"tensor {name!r}: byte order must be little-endian")
    if t.encoding not in _ENCODINGS:
        raise ProtocolViolation(f"tensor {name!r} has unspecified or unknown encoding")
    if t.compression not in _COMPRESSIONS:
        raise ProtocolViolation(f"tensor {name!r} has unspecified or unknown compression")
    if t.checksum.algorithm != pb.CHECKSUM_ALGORITHM_CRC32C or len(t.checksum.value) != 4:
        raise ProtocolViolation(f"tensor {name!r}: a 4-byte CRC32C checksum is required")
    dtype = PB_TO_NUMPY[t.dtype]
    if t.encoding == pb.TENSOR_ENCODING_Q8_BLOCK32:
        if t.dtype not in _FLOAT_DTYPES:
            raise ProtocolViolation(f"tensor {name!r}: q8 encoding of a non-float dtype")
        expected = q8_encoded_size(count)
    else:
        expected = count * dtype.itemsize
    if t.total_bytes > limits.max_tensor_bytes or expected > limits.max_tensor_bytes:
        raise LimitExceeded(f"tensor {name!r} declares {max(expected, t.total_bytes)} bytes"
                            f" > {limits.max_tensor_bytes}")
    if expected != t.total_bytes:
        raise PayloadCorrupt(f"tensor {name!r}: shape {list(shape)} needs {expected} bytes, "
                             f"total_bytes says {t.total_bytes}")
    return dtype, shape, count


def _zstd_bound(n: int) -> int:
    # libzstd's ZSTD_COMPRESSBOUND plus frame-header slack: a legitimate frame
    # of n bytes is never longer than this.
    return n + (n >> 8) + (128 * 1024 - n >> 11 if n < 128 * 1024 else 0) + 64


def _wire_body(t: pb.NamedTensor, limits: Limits, views: list | None) -> bytes | memoryview:
    """Check the fragments tile the body exactly and return the joined body.

    ``views``: the fragment payloads when the caller holds them outside the message
    (proto.zerocopy strips them from the message to avoid copies), else None.
    """
    frags = t.fragments
    count = len(frags)
    if count == 0:
        raise PayloadCorrupt(f"tensor {t.name!r} carries no fragment")
    if count > limits.max_fragments_per_tensor:
        raise LimitExceeded(f"tensor {t.name!r} has {count} fragments "
                            f"> {limits.max_fragments_per_tensor}")
    bound = (t.total_bytes if t.compression == pb.COMPRESSION_NONE
             else _zstd_bound(t.total_bytes))
    payloads = []
    offset = 0
    for i, f in enumerate(frags):
        if f.fragment_index != i or f.fragment_count != count or f.byte_offset != offset:
            raise PayloadCorrupt(f"tensor {t.name!r}: fragment {i} has index/count/offset "
                                 f"{f.fragment_index}/{f.fragment_count}/{f.byte_offset}, "
                                 f"expected {i}/{count}/{offset}")
        payload = f.payload if views is None else views[i]
        size = len(payload)
        if size > limits.max_fragment_bytes:
            raise LimitExceeded(f"tensor {t.name!r}: fragment of {size} bytes "
                                f"> {limits.max_fragment_bytes}")
        offset += size
        if offset > bound:
            raise PayloadCorrupt(f"tensor {t.name!r}: fragments exceed the declared size")
        payloads.append(payload)
    if t.compression == pb.COMPRESSION_NONE and offset != t.total_bytes:
        raise PayloadCorrupt(f"tensor {t.name!r}: fragments carry {offset} bytes, "
                             f"total_bytes says {t.total_bytes}")
    return payloads[0] if count == 1 else b"".join(payloads)


def _decompress(name: str, body: bytes, total: int, limits: Limits) -> bytes:
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


def decode_tensor(t: pb.NamedTensor, limits: Limits = DEFAULT_LIMITS, *,
                  views: list | None = None) -> np.ndarray:
    """Validate and decode a peer's NamedTensor (raises only ProtocolError types).

    ``views`` (internal, proto.zerocopy): fragment payloads held outside ``t``.
    """
    dtype, shape, count = _declared_size(t, limits)
    if views is not None and len(views) != len(t.fragments):
        raise PayloadCorrupt(f"tensor {t.name!r}: non-canonical fragment layout")
    data = _wire_body(t, limits, views)
    if t.compression == pb.COMPRESSION_ZSTD:
        data = _decompress(t.name, data, t.total_bytes, limits)
    if crc32c(data).to_bytes(4, "big") != t.checksum.value:
        raise PayloadCorrupt(f"tensor {t.name!r} failed its CRC32C check")
    if t.encoding == pb.TENSOR_ENCODING_Q8_BLOCK32:
        return decode_q8(data, count, dtype).reshape(shape)
    if t.dtype == pb.DTYPE_BOOL and count and np.frombuffer(data, np.uint8).max() > 1:
        raise PayloadCorrupt(f"tensor {t.name!r}: bool bytes must be 0 or 1")
    return np.frombuffer(data, dtype=dtype, count=count).reshape(shape)


def decode_bundle(b: pb.TensorBundle, limits: Limits = DEFAULT_LIMITS, *,
                  views: list | None = None) -> dict[str, np.ndarray]:
    """Validate and decode every tensor of a peer's bundle; names must be unique.

    ``views`` (internal, proto.zerocopy): per tensor, its fragment payloads.
    """
    if b.bundle_version != BUNDLE_VERSION:
        raise VersionUnsupported(f"bundle version {b.bundle_version} is not supported "
                                 f"(this build speaks {BUNDLE_VERSION})")
    if len(b.tensors) > limits.max_tensors_per_bundle:
        raise LimitExceeded(f"bundle has {len(b.tensors)} tensors > {limits.max_tensors_per_bundle}")
    declared = sum(t.total_bytes for t in b.tensors)
    if declared > limits.max_bundle_bytes:
        raise LimitExceeded(f"bundle declares {declared} bytes > {limits.max_bundle_bytes}")
    if views is not None and len(views) != len(b.tensors):
        raise PayloadCorrupt("non-canonical bundle layout")
    out: dict[str, np.ndarray] = {}
    for i, t in enumerate(b.tensors):
        if t.name in out:
            raise ProtocolViolation(f"bundle names tensor {t.name!r} twice")
        out[t.name] = decode_tensor(t, limits, views=None if views is None else views[i])
    return out
