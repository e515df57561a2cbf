"""numpy arrays <-> NamedTensor / TensorBundle messages, validated both ways.

Encode (our arrays, LocalError on bad arguments):
    array --(little-endian raw | q8 blocks)--> encoded bytes --CRC32C-->
    --(optional zstd)--> wire body --split--> fragments (index, count, offset)
``prepare_tensor`` stops before building the protobuf fragments and keeps the
wire body as a buffer (a memoryview of the array for raw, no copy), so
``proto.wire`` can serialize a frame around it by hand; ``encode_tensor`` turns
the same preparation into a ``pb.NamedTensor`` (by parsing the canonical bytes:
copying a payload into a protobuf message directly costs far more here).

Decode (a peer's message, only ProtocolError subclasses) lives in
proto.decoding and is re-exported here: ``decode_tensor`` / ``decode_bundle``
check every declaration against ``Limits`` before any allocation, then
reassemble, bounded-zstd, CRC-check and view the payload. Decoded raw arrays
are READ-ONLY views over the received bytes (no copy); ``.copy()`` them if you
must write. bf16 is ``ml_dtypes.bfloat16``. No state; no I/O.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import zstandard

from proto import shard_runtime_pb2 as pb
from proto.checksum import crc32c_bytes
from proto.decoding import decode_bundle, decode_tensor
from proto.dtypes import BUNDLE_VERSION, COMPRESSIONS, ENCODINGS, FLOAT_DTYPES, NUMPY_TO_PB, PB_TO_NUMPY, pb_dtype_of
from proto.errors import LocalError
from proto.limits import DEFAULT_FRAGMENT_BYTES, DEFAULT_LIMITS, ZSTD_LEVEL
from proto.q8 import encode_q8

__all__ = [
    "BUNDLE_VERSION", "PB_TO_NUMPY", "PreparedTensor", "prepare_tensor", "encode_tensor", "varint",
    "prepare_bundle", "bundle_pieces",
    "decode_tensor", "encode_bundle", "decode_bundle", "pb_dtype_of",
]

_BOOL = PB_TO_NUMPY[pb.DTYPE_BOOL]
_FLOAT_DTYPES, _COMPRESSIONS, _ENCODINGS, _NUMPY_TO_PB = FLOAT_DTYPES, COMPRESSIONS, ENCODINGS, NUMPY_TO_PB


def varint(n: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int."""
    if n < 0x80:
        return _ONE_BYTE[n]
    if n < 0x4000:       # two bytes: every size of a decode step's frame
        return bytes(((n & 0x7F) | 0x80, n >> 7))
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

    def pieces(self) -> tuple[list[bytes | memoryview], int]:
        """The canonical serialization of the NamedTensor as pieces to join, and its size.

        Fields in number order, proto3 defaults omitted: header (1-7), one
        TensorFragment per slice (8), encoding (9). Payloads are views, not copies.
        """
        view = memoryview(self.body)
        step = self.fragment_bytes
        count = max(1, -(-len(view) // step))
        out: list[bytes | memoryview] = [self.header]
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


# Header prefixes (everything before the CRC) already built: a decode step sends the
# same name, shape and dtype every time. Bounded: cleared when full.
_HEADER_CACHE: dict[tuple, bytes] = {}
MAX_HEADER_CACHE = 256


def _header_bytes(name_utf8: bytes, shape: tuple[int, ...], dtype: int, total: int,
                  compression: int, crc: bytes) -> bytes:
    """Canonical serialization of NamedTensor fields 1-7 as prepare_tensor fills them."""
    key = (name_utf8, shape, dtype, total, compression)
    prefix = _HEADER_CACHE.get(key)
    if prefix is None:
        out = b"\x0a" + varint(len(name_utf8)) + name_utf8
        if shape:
            packed = b"".join([varint(d) for d in shape])
            out += b"\x12" + varint(len(packed)) + packed
        out += b"\x18" + varint(dtype) + b"\x20\x01"          # byte_order: little-endian
        if total:
            out += b"\x28" + varint(total)
        prefix = out + b"\x30" + varint(compression) + b"\x3a\x08\x08\x02\x12\x04"  # CRC32C, 4 bytes
        if len(_HEADER_CACHE) >= MAX_HEADER_CACHE:
            _HEADER_CACHE.clear()
        _HEADER_CACHE[key] = prefix
    return prefix + crc


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
    if isinstance(array, np.generic):                     # a numpy scalar: rank 0
        array = np.asarray(array)
    if not isinstance(array, np.ndarray):
        raise LocalError(f"tensor {name!r}: expected a numpy array, got {type(array).__name__}")
    if compression not in _COMPRESSIONS:
        raise LocalError(f"tensor {name!r}: compression must be COMPRESSION_NONE or _ZSTD")
    if encoding not in _ENCODINGS:
        raise LocalError(f"tensor {name!r}: encoding must be TENSOR_ENCODING_RAW or _Q8_BLOCK32")
    if type(max_fragment_bytes) is not int or not 1 <= max_fragment_bytes <= limits.max_fragment_bytes:
        raise LocalError(f"max_fragment_bytes must be an int in 1..{limits.max_fragment_bytes}")
    dtype = _NUMPY_TO_PB.get(array.dtype)
    if dtype is None:
        dtype = pb_dtype_of(array.dtype)
    if array.ndim > limits.max_rank or (array.ndim and max(array.shape) > limits.max_dim):
        raise LocalError(f"tensor {name!r}: shape {array.shape} exceeds rank {limits.max_rank}"
                         f" / dim {limits.max_dim}")
    if encoding == pb.TENSOR_ENCODING_Q8_BLOCK32:
        if dtype not in _FLOAT_DTYPES:
            raise LocalError(f"tensor {name!r}: q8 needs a floating dtype, not {array.dtype}")
        encoded: bytes | memoryview = encode_q8(array)
    else:
        le = array
        if not (array.flags.c_contiguous and array.dtype is PB_TO_NUMPY[dtype]):
            le = np.ascontiguousarray(array, dtype=PB_TO_NUMPY[dtype])
        encoded = le.reshape(-1).view(np.uint8).data.toreadonly()
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


def bundle_pieces(prepared: list[PreparedTensor]) -> tuple[list[bytes | memoryview], int]:
    """Canonical serialization of a TensorBundle as pieces to join, and its size."""
    out: list[bytes | memoryview] = [b"\x08" + varint(BUNDLE_VERSION)]
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
