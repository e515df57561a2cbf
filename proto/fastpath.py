"""Decode-step frames written and read by hand: the canonical protobuf bytes, without protobuf.

Why: a decode step's frame is built and read on every hop of every token, and
on this machine those moments come right after a llama.cpp/torch forward has
streamed tens of MB of weights through the caches: every distinct piece of
code and data the codec touches is a cache miss then, and the general codec
touches far more of both than these few lines (cold, about three times the
time; hot, the same: docs/measurements/2026-12-04.md). Per token a pushed
route builds and reads about six such frames.

What: exactly the bytes protobuf's canonical serialization gives (fields in
number order, proto3 defaults left out -- tests compare byte for byte) for

    SessionRequest{decode: DecodeStep{1 idempotency_step, 2 position, 3 expected_past_len,
                                      4 tensor, 5 work_id, 6 deadline_unix_nanos, 7 legs,
                                      8 route_execution_nanos}}
    SessionResponse{decode: DecodeResult{1 idempotency_step, 2 past_len, 3 duplicate,
                                         4 execution_nanos, 5 bundle{1 version, 2 tensor},
                                         6 sample{1 token_id}, 7 legs, 8 receipt}}

where a tensor is RAW, uncompressed, little-endian, in one fragment (at most
DEFAULT_FRAGMENT_BYTES), with its CRC32C: what meshd's own peers send on
every decode step.

Reading is a strict subset of the general bounded path (proto.frames +
proto.decoding): ``read_decode_request`` / ``read_decode_response`` return None for
anything that is not exactly such a frame -- another field order, a repeated
or unknown field, a non-minimal or oversized varint, zstd, q8, several
fragments, a bool tensor, a sample with logprobs, a bad checksum -- and the
caller then takes the general path, which parses it (or refuses it with its
typed error). What the fast reader accepts it checks as the general
one does (the same ``Limits``), so it never accepts a frame the general path
would refuse, and it yields the same values (tests, hypothesis). The views it
returns answer the attribute reads the stream core and the hop links make
(``WhichOneof``, ``decode``, ``HasField``, the scalar fields, ``sample.token_id``).
No state but a bounded cache of tensor header bytes; no I/O.
"""
from __future__ import annotations

import numpy as np

from proto.checksum import crc32c
from proto.dtypes import BUNDLE_VERSION, NUMPY_TO_PB, PB_TO_NUMPY
from proto.limits import DEFAULT_FRAGMENT_BYTES, DEFAULT_LIMITS, MAX_FRAME_BYTES
from proto.tensors import varint

__all__ = ["decode_request_bytes", "decode_response_bytes", "read_decode_request", "read_decode_response",
           "DecodeStepView", "DecodeResultView", "SampleView"]

_LIMITS = DEFAULT_LIMITS
_MAX_NAME = _LIMITS.max_name_len
_MAX_RANK = _LIMITS.max_rank
_MAX_DIM = _LIMITS.max_dim
_MAX_TENSOR = min(_LIMITS.max_tensor_bytes, _LIMITS.max_fragment_bytes)
_BOOL_CODE = next(code for code, dt in PB_TO_NUMPY.items() if dt == np.dtype(np.bool_))
_LE, _NONE, _RAW = 1, 1, 1               # BYTE_ORDER_LITTLE_ENDIAN, COMPRESSION_NONE, TENSOR_ENCODING_RAW
_U32 = 1 << 32
_BIG = 1 << 63                            # larger varints (10 bytes, or negative int64s) go the general way
_MAX_RECEIPT = 1024                       # proto.receipts.MAX_RECEIPT_BYTES: a larger one goes the general way


class _Bail(Exception):
    """Not a frame this module reads: the caller takes the general path."""


# ------------------------------------------------------------------------------ writing
# (name, shape, pb dtype) -> (header bytes up to the CRC value, fragment head before the payload)
_HEADERS: dict[tuple, tuple[bytes, bytes]] = {}
_MAX_HEADERS = 256


def _tensor(name: str, array: np.ndarray) -> tuple[list[bytes], int] | None:
    """The NamedTensor's canonical pieces for a raw one-fragment tensor, or None (general path)."""
    dtype = NUMPY_TO_PB.get(array.dtype)
    if dtype is None or dtype == _BOOL_CODE or not array.flags.c_contiguous:
        return None
    shape = array.shape
    n = array.nbytes
    if not 0 < n <= DEFAULT_FRAGMENT_BYTES:
        return None
    key = (name, shape, dtype)
    known = _HEADERS.get(key)
    if known is None:
        name_utf8 = name.encode("utf-8")
        if not name or len(name_utf8) > _MAX_NAME or len(shape) > _MAX_RANK or (shape and max(shape) > _MAX_DIM):
            return None
        head = b"\x0a" + varint(len(name_utf8)) + name_utf8
        if shape:
            packed = b"".join(varint(d) for d in shape)
            head += b"\x12" + varint(len(packed)) + packed
        head += b"\x18" + varint(dtype) + b"\x20\x01\x28" + varint(n) + b"\x30\x01\x3a\x08\x08\x02\x12\x04"
        frag = b"\x10\x01\x22" + varint(n)
        known = (head, b"\x42" + varint(len(frag) + n) + frag)
        if len(_HEADERS) >= _MAX_HEADERS:
            _HEADERS.clear()
        _HEADERS[key] = known
    head, frag = known
    data = array.tobytes()
    return [head, crc32c(data).to_bytes(4, "big"), frag, data, b"\x48\x01"], len(head) + 4 + len(frag) + n + 2


def decode_request_bytes(step: int, position: int, expected_past_len: int, name: str, array: np.ndarray, *,
                         work_id: str = "", deadline_unix_nanos: int = 0, legs: int = 0,
                         route_execution_nanos: int = 0) -> bytes | None:
    """SessionRequest{decode: DecodeStep{...}} with ``array`` as its tensor, or None when the
    array needs the general encoder (proto.wire.request_decode)."""
    got = _tensor(name, array)
    if got is None or deadline_unix_nanos < 0:
        return None
    pieces, size = got
    head = ((b"\x08" + varint(step) if step else b"") + (b"\x10" + varint(position) if position else b"")
            + (b"\x18" + varint(expected_past_len) if expected_past_len else b"") + b"\x22" + varint(size))
    tail = b""
    if work_id:
        w = work_id.encode("utf-8")
        tail += b"\x2a" + varint(len(w)) + w
    if deadline_unix_nanos:
        tail += b"\x30" + varint(deadline_unix_nanos)
    if legs:
        tail += b"\x38" + varint(legs)
    if route_execution_nanos:
        tail += b"\x40" + varint(route_execution_nanos)
    total = len(head) + size + len(tail)
    if total + 8 > MAX_FRAME_BYTES:
        return None
    return b"".join([b"\x1a", varint(total), head, *pieces, tail])


def decode_response_bytes(step: int, past_len: int, duplicate: bool, execution_nanos: int, *,
                          tensors: dict | None = None, token_id: int | None = None, legs: int = 0,
                          receipt: bytes = b"") -> bytes | None:
    """SessionResponse{decode: DecodeResult{...}}: the bundle when ``tensors`` (one tensor at most
    here), the sample when ``token_id``, the step's signed receipt when ``receipt``; None when it
    needs the general encoder (proto.wire)."""
    body = ((b"\x08" + varint(step) if step else b"") + (b"\x10" + varint(past_len) if past_len else b"")
            + (b"\x18\x01" if duplicate else b"") + (b"\x20" + varint(execution_nanos) if execution_nanos else b""))
    parts = [body]
    size = len(body)
    if tensors or token_id is None:         # the general writer always writes a bundle without a sample
        if tensors and len(tensors) > 1:
            return None
        bundle = [b"\x08" + varint(BUNDLE_VERSION)]
        bsize = len(bundle[0])
        for name, array in (tensors or {}).items():
            if not isinstance(array, np.ndarray):
                return None
            got = _tensor(name, array)
            if got is None:
                return None
            pieces, tsize = got
            tag = b"\x12" + varint(tsize)
            bundle += [tag, *pieces]
            bsize += len(tag) + tsize
        tag = b"\x2a" + varint(bsize)
        parts += [tag, *bundle]
        size += len(tag) + bsize
    if token_id is not None:
        sample = b"\x08" + varint(token_id) if token_id else b""
        field = b"\x32" + varint(len(sample)) + sample
        parts.append(field)
        size += len(field)
    if legs:
        field = b"\x38" + varint(legs)
        parts.append(field)
        size += len(field)
    if receipt:
        field = b"\x42" + varint(len(receipt)) + receipt
        parts.append(field)
        size += len(field)
    if size + 8 > MAX_FRAME_BYTES:
        return None
    return b"".join([b"\x32", varint(size), *parts])


# ------------------------------------------------------------------------------ reading
def _uv(b: bytes, i: int) -> tuple[int, int]:
    """A minimal varint below 2**63 at ``b[i]``: (value, next index); anything else bails."""
    x = b[i]
    if x < 0x80:
        return x, i + 1
    value, shift = x & 0x7F, 7
    while True:
        i += 1
        x = b[i]
        value |= (x & 0x7F) << shift
        if x < 0x80:
            if x == 0 or value >= _BIG:      # a non-minimal encoding, or too large for here
                raise _Bail
            return value, i + 1
        shift += 7
        if shift > 63:
            raise _Bail


def _field(b: bytes, i: int, end: int, tag: int) -> tuple[int, int]:
    """If the next field at i (< end) has ``tag`` (a varint field): (value, next); else (0, i)."""
    if i < end and b[i] == tag:
        value, i = _uv(b, i + 1)
        if i > end:
            raise _Bail
        return value, i
    return 0, i


def _span(b: bytes, i: int, end: int) -> tuple[int, int]:
    """Length-delimited: (start, stop) of the value after the length at i."""
    n, i = _uv(b, i)
    stop = i + n
    if stop > end:
        raise _Bail
    return i, stop


def _read_tensor(b: bytes, i: int, end: int) -> tuple[str, np.ndarray]:
    """A NamedTensor occupying exactly b[i:end], as proto.decoding would check and decode it."""
    if i >= end or b[i] != 0x0A:
        raise _Bail
    s, e = _span(b, i + 1, end)
    if not 0 < e - s <= _MAX_NAME:
        raise _Bail
    name = b[s:e].decode("utf-8")           # UnicodeDecodeError is a ValueError: the caller bails
    i = e
    shape: list[int] = []
    count = 1
    if i < end and b[i] == 0x12:
        s, e = _span(b, i + 1, end)
        while s < e:
            d, s = _uv(b, s)
            if d > _MAX_DIM:
                raise _Bail
            shape.append(d)
            count *= d
        if s != e or len(shape) > _MAX_RANK:
            raise _Bail
        i = e
    dtype_code, i = _field(b, i, end, 0x18)
    order, i = _field(b, i, end, 0x20)
    total, i = _field(b, i, end, 0x28)
    compression, i = _field(b, i, end, 0x30)
    dtype = PB_TO_NUMPY.get(dtype_code)
    if dtype is None or dtype_code == _BOOL_CODE or order != _LE or compression != _NONE:
        raise _Bail
    if total != count * dtype.itemsize or not 0 < total <= _MAX_TENSOR:
        raise _Bail
    if i >= end or b[i] != 0x3A or b[i + 1] != 0x08 or b[i + 2:i + 5] != b"\x08\x02\x12" or b[i + 5] != 0x04:
        raise _Bail                          # Checksum{algorithm: CRC32C, value: 4 bytes}
    checksum = b[i + 6:i + 10]
    i += 10
    if i >= end or b[i] != 0x42:
        raise _Bail
    s, e = _span(b, i + 1, end)               # the one TensorFragment: {count: 1, payload}
    if b[s:s + 3] != b"\x10\x01\x22":
        raise _Bail
    ps, pe = _span(b, s + 3, e)
    if pe != e or pe - ps != total:
        raise _Bail
    i = e
    encoding, i = _field(b, i, end, 0x48)
    if encoding != _RAW or i != end:
        raise _Bail
    payload = b[ps:pe]
    if crc32c(payload).to_bytes(4, "big") != checksum:
        raise _Bail                          # the general path says PayloadCorrupt
    return name, np.frombuffer(payload, dtype=dtype, count=count).reshape(shape)


class DecodeStepView:
    """A fast-read SessionRequest{decode}: its DecodeStep's fields (``decode`` is itself)."""

    __slots__ = ("idempotency_step", "position", "expected_past_len", "work_id", "deadline_unix_nanos", "legs",
                 "route_execution_nanos")
    idempotency_step: int
    position: int
    expected_past_len: int
    work_id: str
    deadline_unix_nanos: int
    legs: int
    route_execution_nanos: int

    def WhichOneof(self, _group: str) -> str:   # protobuf's name
        return "decode"

    @property
    def decode(self) -> DecodeStepView:
        return self


def read_decode_request(data: bytes) -> tuple[DecodeStepView, dict[str, np.ndarray]] | None:
    """(the DecodeStep view, {name: array}) for a canonical decode-step frame; else None."""
    try:
        if data[0] != 0x1A:
            return None
        s, end = _span(data, 1, len(data))
        if end != len(data):
            return None
        v = DecodeStepView()
        v.idempotency_step, i = _field(data, s, end, 0x08)
        v.position, i = _field(data, i, end, 0x10)
        v.expected_past_len, i = _field(data, i, end, 0x18)
        if i >= end or data[i] != 0x22:
            return None
        ts, te = _span(data, i + 1, end)
        name, array = _read_tensor(data, ts, te)
        i = te
        work_id = ""
        if i < end and data[i] == 0x2A:
            ws, we = _span(data, i + 1, end)
            work_id = data[ws:we].decode("utf-8")
            i = we
        v.work_id = work_id
        v.deadline_unix_nanos, i = _field(data, i, end, 0x30)
        v.legs, i = _field(data, i, end, 0x38)
        v.route_execution_nanos, i = _field(data, i, end, 0x40)
        if i != end or v.legs >= _U32:
            return None
        return v, {name: array}
    except (_Bail, IndexError, ValueError):
        return None


class SampleView:
    """A TailSample with only its token id (a sample with logprobs is read by protobuf)."""

    __slots__ = ("token_id",)
    logprob = 0.0
    top = ()

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id


class DecodeResultView:
    """A fast-read SessionResponse{decode}: its DecodeResult's fields (``decode`` is itself)."""

    __slots__ = ("idempotency_step", "past_len", "duplicate", "execution_nanos", "legs", "sample", "receipt",
                 "_bundle")
    idempotency_step: int
    past_len: int
    duplicate: bool
    execution_nanos: int
    legs: int
    sample: SampleView | None
    receipt: bytes
    _bundle: bool

    def WhichOneof(self, _group: str) -> str:   # protobuf's name
        return "decode"

    @property
    def decode(self) -> DecodeResultView:
        return self

    def HasField(self, name: str) -> bool:     # protobuf's name
        if name == "sample":
            return self.sample is not None
        if name == "bundle":
            return self._bundle
        raise ValueError(f"DecodeResult has no singular message field {name!r}")


def read_decode_response(data: bytes) -> tuple[DecodeResultView, dict[str, np.ndarray]] | None:
    """(the DecodeResult view, its bundle's arrays) for a canonical decode answer; else None."""
    try:
        if data[0] != 0x32:
            return None
        s, end = _span(data, 1, len(data))
        if end != len(data):
            return None
        v = DecodeResultView()
        v.idempotency_step, i = _field(data, s, end, 0x08)
        v.past_len, i = _field(data, i, end, 0x10)
        duplicate, i = _field(data, i, end, 0x18)
        if duplicate > 1:
            return None
        v.duplicate = bool(duplicate)
        v.execution_nanos, i = _field(data, i, end, 0x20)
        tensors: dict[str, np.ndarray] = {}
        v._bundle = False
        if i < end and data[i] == 0x2A:
            bs, be = _span(data, i + 1, end)
            version, j = _field(data, bs, be, 0x08)
            if version != BUNDLE_VERSION:
                return None
            if j < be:
                if data[j] != 0x12:
                    return None
                ts, te = _span(data, j + 1, be)
                name, array = _read_tensor(data, ts, te)
                tensors[name] = array
                j = te
            if j != be:
                return None
            v._bundle = True
            i = be
        v.sample = None
        if i < end and data[i] == 0x32:
            ss, se = _span(data, i + 1, end)
            token, j = _field(data, ss, se, 0x08)
            if j != se or token >= _U32:
                return None                  # logprobs, alternatives: protobuf reads those
            v.sample = SampleView(token)
            i = se
        v.legs, i = _field(data, i, end, 0x38)
        v.receipt = b""
        if i < end and data[i] == 0x42:
            rs, re_ = _span(data, i + 1, end)
            if not 0 < re_ - rs <= _MAX_RECEIPT:
                return None                  # protobuf reads it (and the receipt parser bounds it)
            v.receipt, i = data[rs:re_], re_
        if i != end or v.legs >= _U32:
            return None
        return v, tensors
    except (_Bail, IndexError, ValueError):
        return None
