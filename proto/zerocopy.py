"""Parse a session message and decode its tensors without copying the payloads.

``parse_request`` + ``decode_bundle`` copy each payload twice (protobuf parses
it into its arena; reading ``fragment.payload`` copies it out again). Here the
wire format is walked by hand along the few fields that lead to payloads:

    SessionRequest.chunk(2) / .decode(3)      SessionResponse.chunk(2) / .decode(6)
    ActivationChunk.bundle(2)   DecodeStep.tensor(4)   DecodeResult.bundle(5)
    TensorBundle.tensors(2) -> NamedTensor.fragments(8) -> TensorFragment.payload(4)

Every other field is copied verbatim into a small *skeleton* (the message with
the payload fields removed and enclosing lengths recomputed), which protobuf
parses and ``frames`` checks as usual. The payloads stay memoryviews of the
input: CRC32C runs on them in place and raw arrays are read-only views of the
input bytes. The returned message's fragments have EMPTY payloads.

Stricter than protobuf on purpose: a top level that is not exactly one tensor-
carrying field falls back to the ordinary path; a repeated DecodeStep.tensor,
groups and bad wire types are PayloadCorrupt. Raises only ProtocolError types.
"""
from __future__ import annotations

import numpy as np

from proto import shard_runtime_pb2 as pb
from proto.errors import LimitExceeded, LocalError, PayloadCorrupt, ProtocolViolation
from proto.frames import parse_request, parse_response
from proto.limits import DEFAULT_LIMITS, Limits
from proto.tensors import decode_bundle, decode_tensor

__all__ = ["read_request", "read_response"]

# message kinds along the payload paths, and the fields that lead deeper
_REQ, _RESP, _CHUNK, _STEP, _RESULT, _BUNDLE, _TENSOR, _FRAG = range(8)
_DESCEND = {
    _REQ: {2: _CHUNK, 3: _STEP},
    _RESP: {2: _CHUNK, 6: _RESULT},
    _CHUNK: {2: _BUNDLE},
    _STEP: {4: _TENSOR},
    _RESULT: {5: _BUNDLE},
    _BUNDLE: {2: _TENSOR},
    _TENSOR: {8: _FRAG},
    _FRAG: {},
}
_MAX_VARINT_BYTES = 10
_ONE_BYTE = [bytes([i]) for i in range(0x80)]


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(pos, min(end, pos + _MAX_VARINT_BYTES)):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    raise PayloadCorrupt("truncated or overlong varint")


def _encode_varint(n: int) -> bytes:
    if n < 0x80:
        return _ONE_BYTE[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class _Walker:
    """Builds the skeleton pieces and collects payload views per tensor/fragment."""

    __slots__ = ("data", "view", "tensors", "fragments")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.view = memoryview(data)
        self.tensors: list[list[memoryview]] = []   # per tensor, per fragment payload

    def walk(self, kind: int, start: int, end: int) -> tuple[list, int]:
        """Skeleton pieces of the message in data[start:end] and their total size."""
        data, view, pieces, size = self.data, self.view, [], 0
        descend = _DESCEND[kind]
        if kind == _TENSOR:
            self.tensors.append([])
        elif kind == _FRAG:
            self.tensors[-1].append(view[0:0])
        seen_tensor = False
        pos = start
        while pos < end:
            field_start = pos
            key = data[pos]             # one-byte varints inline: the common case
            pos += 1
            if key >= 0x80:
                key, pos = _varint(data, field_start, end)
            wire_type = key & 7
            if key < 8:
                raise PayloadCorrupt("field number 0")
            if wire_type == 2:
                if pos >= end:
                    raise PayloadCorrupt("truncated length")
                length = data[pos]
                pos += 1
                if length >= 0x80:
                    length, pos = _varint(data, pos - 1, end)
                body = pos
                pos += length
            elif wire_type == 0:
                stop = min(end, pos + _MAX_VARINT_BYTES)
                while pos < stop and data[pos] >= 0x80:
                    pos += 1
                if pos >= stop:
                    raise PayloadCorrupt("truncated or overlong varint")
                pos += 1
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            else:
                raise PayloadCorrupt(f"unsupported wire type {wire_type}")
            if pos > end:
                raise PayloadCorrupt("field runs past the end of its message")
            field = key >> 3
            if wire_type == 2 and field in descend:
                if kind == _STEP:
                    if seen_tensor:
                        raise PayloadCorrupt("decode step carries its tensor twice")
                    seen_tensor = True
                inner, inner_size = self.walk(descend[field], body, pos)
                head = _encode_varint(key) + _encode_varint(inner_size)
                pieces.append(head)
                pieces.extend(inner)
                size += len(head) + inner_size
            elif kind == _FRAG and field == 4 and wire_type == 2:
                self.tensors[-1][-1] = view[body:pos]   # protobuf: the last one wins
            else:
                pieces.append(view[field_start:pos])
                size += pos - field_start
        return pieces, size


def _read(data, limits: Limits, top: int, parse):
    if not isinstance(data, bytes):
        raise LocalError("zero-copy reads need an immutable bytes object")
    if len(data) > limits.max_frame_bytes:
        raise LimitExceeded(f"message of {len(data)} bytes > {limits.max_frame_bytes}")
    # exactly one top-level field that carries tensors, else the ordinary path
    pos = 0
    if data:
        key, pos = _varint(data, 0, len(data))
        if key & 7 == 2 and key >> 3 in _DESCEND[top]:
            length, body = _varint(data, pos, len(data))
            pos = body + length
    if pos != len(data) or not data:
        return parse(data, limits), None
    walker = _Walker(data)
    pieces, _ = walker.walk(top, 0, len(data))
    return parse(b"".join(pieces), limits), walker.tensors


def _check(views: list, n: int) -> None:
    if len(views) != n:
        raise PayloadCorrupt("non-canonical tensor layout")


def read_request(data: bytes, limits: Limits = DEFAULT_LIMITS
                 ) -> tuple[pb.SessionRequest, dict[str, np.ndarray]]:
    """Parse a SessionRequest and decode the tensors it carries (chunk bundle or decode
    step tensor; {} for other kinds). Arrays are read-only views of ``data``."""
    req, views = _read(data, limits, _REQ, parse_request)
    kind = req.WhichOneof("kind")
    if kind == "chunk":
        bundle = req.chunk.bundle
        return req, decode_bundle(bundle, limits, views=views)
    if kind == "decode":
        t = req.decode.tensor
        if views is not None:
            _check(views, 1)
        return req, {t.name: decode_tensor(t, limits, views=None if views is None else views[0])}
    if views:
        raise ProtocolViolation("tensors outside a chunk or decode step")
    return req, {}


def read_response(data: bytes, limits: Limits = DEFAULT_LIMITS
                  ) -> tuple[pb.SessionResponse, dict[str, np.ndarray]]:
    """Parse a SessionResponse and decode the tensors of its chunk or decode result."""
    resp, views = _read(data, limits, _RESP, parse_response)
    kind = resp.WhichOneof("kind")
    if kind == "chunk":
        return resp, decode_bundle(resp.chunk.bundle, limits, views=views)
    if kind == "decode":
        return resp, decode_bundle(resp.decode.bundle, limits, views=views)
    if views:
        raise ProtocolViolation("tensors outside a chunk or decode result")
    return resp, {}
