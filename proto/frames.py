"""Bounded parsing of session messages and the length-prefixed frame codec.

    parse_request / parse_response   bytes -> pb message. Before protobuf parses: the
                                     size, exactly one top-level field, and either a
                                     bounded wire scan (tensor frames over
                                     MAX_UNSCANNED_FRAME_BYTES, proto.wirescan) or the
                                     small-frame bound. Protobuf errors
                                     map to PayloadCorrupt; then structural checks
                                     (a kind is set, schema versions, counts)
    parse_unary                      bytes -> a unary request message (GetCapability, Health,
                                     Release, Cancel), at most MAX_UNARY_REQUEST_BYTES; protobuf
                                     errors map to PayloadCorrupt
    encode_frame                     body -> 4-byte big-endian length || body
    FrameReader                      sans-I/O reassembly of frames from arbitrary pieces

FrameReader state: one bytearray of received-but-unreturned bytes. The length
prefix at its head is validated as soon as its 4 bytes exist, so a zero or
oversized length is refused (LimitExceeded) before any body byte is kept.
The caller drains with ``next_frame()`` after each ``feed()``; buffering more
than two maximal frames without draining is the caller's bug (LocalError).
Tensor payloads are not decoded here: ``proto.tensors.decode_bundle`` does it.
"""
from __future__ import annotations

from google.protobuf.message import DecodeError

from proto import shard_runtime_pb2 as pb
from proto.errors import LimitExceeded, LocalError, PayloadCorrupt, ProtocolViolation, VersionUnsupported
from proto.limits import (
    DEFAULT_LIMITS,
    MAX_CONTROL_FRAME_BYTES,
    MAX_FRAME_BYTES,
    MAX_UNARY_REQUEST_BYTES,
    MAX_UNSCANNED_FRAME_BYTES,
    Limits,
)
from proto.wirescan import REQUEST, RESPONSE, TENSOR_FIELDS, scan, top_level_field

__all__ = ["SCHEMA_VERSION", "PREFIX_BYTES", "parse_request", "parse_response", "parse_unary", "encode_frame",
           "FrameReader", "check_schema_version"]

SCHEMA_VERSION = pb.SCHEMA_VERSION_1
PREFIX_BYTES = 4
# A peer lists each Compression value at most once; a few spare for future ones.
MAX_ACCEPTED_COMPRESSIONS = 8


def check_schema_version(version: int) -> None:
    """VersionUnsupported unless ``version`` is the one this build speaks."""
    if version != SCHEMA_VERSION:
        raise VersionUnsupported(f"schema version {version} is not supported; this build speaks "
                                 f"{pb.SchemaVersion.Name(SCHEMA_VERSION)}")


def _parse(message, data, limits: Limits, what: str, top: int, scanned: bool = False):
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise LocalError(f"{what} must be parsed from bytes, not {type(data).__name__}")
    if len(data) > limits.max_frame_bytes:
        raise LimitExceeded(f"{what} of {len(data)} bytes > {limits.max_frame_bytes}")
    data = bytes(data) if not isinstance(data, bytes) else data
    first = top_level_field(data)
    if first is None:
        raise ProtocolViolation(f"{what} carries no message kind")
    if first[2] > len(data):
        raise PayloadCorrupt(f"{what} is truncated")
    if first[2] != len(data):
        raise ProtocolViolation(f"{what} must carry exactly one message kind")
    if first[0] in TENSOR_FIELDS[top]:
        if not scanned and len(data) > MAX_UNSCANNED_FRAME_BYTES:
            scan(data, top, limits)        # bounds element counts before protobuf allocates
    elif len(data) > MAX_CONTROL_FRAME_BYTES:
        raise LimitExceeded(f"{what} without tensors of {len(data)} bytes "
                            f"> {MAX_CONTROL_FRAME_BYTES}")
    try:
        message.ParseFromString(data)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise PayloadCorrupt(f"{what} does not parse: {exc}") from exc
    kind = message.WhichOneof("kind")
    if kind is None:
        raise ProtocolViolation(f"{what} carries no message kind")
    return message, kind


def _check_bundle(bundle: pb.TensorBundle, limits: Limits) -> None:
    if len(bundle.tensors) > limits.max_tensors_per_bundle:
        raise LimitExceeded(f"bundle has {len(bundle.tensors)} tensors "
                            f"> {limits.max_tensors_per_bundle}")


def _check_chunk(chunk: pb.ActivationChunk, limits: Limits) -> None:
    if not chunk.HasField("envelope"):
        raise ProtocolViolation("activation chunk without an envelope")
    check_schema_version(chunk.envelope.schema_version)
    _check_bundle(chunk.bundle, limits)


def _check_compressions(values) -> None:
    if len(values) > MAX_ACCEPTED_COMPRESSIONS:
        raise LimitExceeded(f"more than {MAX_ACCEPTED_COMPRESSIONS} accepted compressions")


def parse_request(data: bytes, limits: Limits = DEFAULT_LIMITS, *,
                  _scanned: bool = False) -> pb.SessionRequest:
    """Parse one SessionRequest from a peer (raises only ProtocolError types)."""
    req, kind = _parse(pb.SessionRequest(), data, limits, "SessionRequest", REQUEST, _scanned)
    if kind == "open":
        check_schema_version(req.open.schema_version)
        _check_compressions(req.open.accepted_compression)
    elif kind == "chunk":
        _check_chunk(req.chunk, limits)
    elif kind == "decode" and not req.decode.HasField("tensor"):
        raise ProtocolViolation("decode step without a tensor")
    return req


def parse_response(data: bytes, limits: Limits = DEFAULT_LIMITS, *,
                   _scanned: bool = False) -> pb.SessionResponse:
    """Parse one SessionResponse from a peer (raises only ProtocolError types)."""
    resp, kind = _parse(pb.SessionResponse(), data, limits, "SessionResponse", RESPONSE, _scanned)
    if kind == "accepted":
        check_schema_version(resp.accepted.schema_version)
        _check_compressions(resp.accepted.accepted_compression)
    elif kind == "chunk":
        _check_chunk(resp.chunk, limits)
    elif kind == "decode":
        _check_bundle(resp.decode.bundle, limits)
    return resp


def parse_unary(message_cls, data: bytes, max_bytes: int = MAX_UNARY_REQUEST_BYTES):
    """Parse one unary request body (raises only ProtocolError types).

    The size is checked before protobuf parses; a body that does not parse is
    PayloadCorrupt. Unknown fields are ignored, as protobuf does (newer peers).
    """
    what = message_cls.DESCRIPTOR.name
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise LocalError(f"{what} must be parsed from bytes, not {type(data).__name__}")
    if len(data) > max_bytes:
        raise LimitExceeded(f"{what} of {len(data)} bytes > {max_bytes}")
    message = message_cls()
    try:
        message.ParseFromString(bytes(data))
    except (DecodeError, RecursionError, ValueError) as exc:
        raise PayloadCorrupt(f"{what} does not parse: {exc}") from exc
    return message


def frame_prefix(length: int, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """The 4-byte big-endian prefix of a body of ``length`` bytes (LocalError if illegal)."""
    if not 0 < length <= max_frame_bytes:
        raise LocalError(f"frame body must be 1..{max_frame_bytes} bytes, got {length}")
    return length.to_bytes(PREFIX_BYTES, "big")


def encode_frame(body: bytes, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """``length:uint32 big-endian || body``; refuses empty or oversized bodies."""
    return frame_prefix(len(body), max_frame_bytes) + bytes(body)


class FrameReader:
    """Reassembles length-prefixed frames from pieces of any size (sans-I/O)."""

    __slots__ = ("_max", "_buf", "_need")

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if not isinstance(max_frame_bytes, int) or not 0 < max_frame_bytes < 1 << 32:
            raise LocalError("max_frame_bytes must be in 1..2**32-1")
        self._max = max_frame_bytes
        self._buf = bytearray()
        self._need: int | None = None   # body length of the frame at the head, once known

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned (a partial frame at EOF is truncation)."""
        return len(self._buf)

    def _check_head(self) -> None:
        if self._need is None and len(self._buf) >= PREFIX_BYTES:
            length = int.from_bytes(self._buf[:PREFIX_BYTES], "big")
            if length == 0:
                raise LimitExceeded("zero-length frame")
            if length > self._max:
                raise LimitExceeded(f"frame of {length} bytes > {self._max}")
            self._need = length

    def feed(self, data: bytes) -> None:
        """Append received bytes. Raises LimitExceeded on a zero/oversized length."""
        if len(self._buf) > 2 * (self._max + PREFIX_BYTES):
            raise LocalError("FrameReader: call next_frame() until None before feeding more")
        self._check_head()
        if self._need is None and len(self._buf) < PREFIX_BYTES:
            # Take only the prefix first, so a bad length is refused before the body is kept.
            view = memoryview(data)
            take = PREFIX_BYTES - len(self._buf)
            self._buf += view[:take]
            self._check_head()
            self._buf += view[take:]
        else:
            self._buf += data

    def take_one(self, data: bytes) -> bytes | None:
        """``data`` when it is exactly one whole frame and nothing is buffered: its body, without
        going through the buffer (a decode step's frame, arriving in one read); otherwise None and
        nothing consumed -- then ``feed`` it. The same checks as ``feed`` + ``next_frame``."""
        if self._buf or len(data) <= PREFIX_BYTES:
            return None
        length = int.from_bytes(data[:PREFIX_BYTES], "big")
        if length != len(data) - PREFIX_BYTES or length > self._max:
            return None
        return data[PREFIX_BYTES:]

    def next_frame(self) -> bytes | None:
        """The next complete frame body, or None until more bytes arrive."""
        self._check_head()
        need = self._need
        if need is None or len(self._buf) < PREFIX_BYTES + need:
            return None
        body = bytes(self._buf[PREFIX_BYTES:PREFIX_BYTES + need])
        del self._buf[:PREFIX_BYTES + need]
        self._need = None   # the next head is checked on the next call, so this body is never lost
        return body
