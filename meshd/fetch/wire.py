"""The chunk protocol on a provider's fetch port (pinned TLS): fixed-size requests, sized replies (sans-I/O).

After the TLS handshake (the dialer checks the certificate against the pin in
the provider's signed record before sending a byte), the dialer sends
requests and the provider answers each in order; a connection carries any
number of them, and a dialer may send the next request before the last
answer arrived (a pipeline of ``PIPELINE_DEPTH``) so a long link never idles::

    request  = "MF" | version u8 | op u8 | root 32 B | entry u32 | first u32 | count u32   (46 bytes)
    reply    = status u8 | length u64 | length bytes

``op`` MANIFEST asks for the manifest of ``root`` (entry/first/count 0): the
bytes of ``shard.model.manifest.Manifest.encode``, which the dialer decodes
against the root it asked for. ``op`` CHUNKS asks for chunks
``first .. first+count-1`` of entry ``entry``: their bytes back to back (each
chunk's length is the manifest's, so the dialer knows the expected
``length`` before it reads one byte of it, and refuses any other). A status
other than OK carries no bytes (``length`` 0).

Bounds: a request is exactly ``REQUEST_BYTES``; one CHUNKS reply at most
``MAX_RUN_BYTES`` (the dialer asks for runs up to ``RUN_BYTES``), a MANIFEST
reply at most ``MAX_MANIFEST_BYTES``. Both sides check before they allocate.
Decoding errors are ``proto.errors`` ProtocolErrors: the other side's fault.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from proto.errors import LimitExceeded, PayloadCorrupt, ProtocolViolation
from shard.model.manifest import MAX_MANIFEST_BYTES

__all__ = ["Op", "Status", "Request", "ReplyHead", "REQUEST_BYTES", "REPLY_HEAD_BYTES", "RUN_BYTES",
           "MAX_RUN_BYTES", "PIPELINE_DEPTH", "encode_request", "decode_request", "encode_reply_head",
           "decode_reply_head"]

VERSION = 1
_REQUEST = struct.Struct("<2sBB32sIII")
_REPLY = struct.Struct("<BQ")
REQUEST_BYTES = _REQUEST.size
REPLY_HEAD_BYTES = _REPLY.size
# The dialer asks for runs of consecutive chunks of one entry up to this many bytes: large
# enough that a request's round trip vanishes next to the transfer on a LAN, small enough
# that a slow or failing provider holds back little work, and that a run fits in memory.
RUN_BYTES = 8 << 20
# A provider never sends more in one reply (the dialer refuses longer).
MAX_RUN_BYTES = 64 << 20
# Requests a dialer keeps in flight on one connection (hides one round trip per run).
PIPELINE_DEPTH = 2


class Op(enum.IntEnum):
    MANIFEST = 1
    CHUNKS = 2


class Status(enum.IntEnum):
    OK = 0
    UNKNOWN_MODEL = 1     # the provider holds nothing of that root
    NOT_HELD = 2          # it holds the model, not those chunks (not yet, or not that range)
    BAD_REQUEST = 3       # out of range, or a malformed request (the connection is closed after)
    BUSY = 4              # too many connections; try another provider


@dataclass(frozen=True, slots=True)
class Request:
    op: Op
    root: bytes
    entry: int = 0
    first: int = 0
    count: int = 0

    def __post_init__(self) -> None:
        if len(self.root) != 32:
            raise ValueError("a root is 32 bytes")
        if self.op == Op.CHUNKS and self.count < 1:
            raise ValueError("a chunk request names at least one chunk")


def encode_request(req: Request) -> bytes:
    return _REQUEST.pack(b"MF", VERSION, int(req.op), req.root, req.entry, req.first, req.count)


def decode_request(data: bytes) -> Request:
    if len(data) != REQUEST_BYTES:
        raise PayloadCorrupt(f"a fetch request is {REQUEST_BYTES} bytes, not {len(data)}")
    magic, version, op, root, entry, first, count = _REQUEST.unpack(data)
    if magic != b"MF":
        raise PayloadCorrupt("not a fetch request (bad magic)")
    if version != VERSION:
        raise ProtocolViolation(f"fetch protocol version {version} is not {VERSION}")
    try:
        op = Op(op)
    except ValueError:
        raise ProtocolViolation(f"unknown fetch op {op}") from None
    if op == Op.MANIFEST and (entry or first or count):
        raise ProtocolViolation("a manifest request names no chunks")
    if op == Op.CHUNKS and count < 1:
        raise ProtocolViolation("a chunk request names no chunk")
    return Request(op, root, entry, first, count)


@dataclass(frozen=True, slots=True)
class ReplyHead:
    status: Status
    length: int


def encode_reply_head(status: Status, length: int = 0) -> bytes:
    return _REPLY.pack(int(status), length)


def decode_reply_head(data: bytes, *, op: Op, expect: int | None = None) -> ReplyHead:
    """The head of a reply to a request of ``op``; ``expect``: the exact length an OK chunk reply
    must have (the manifest's chunk lengths). Raises before the body is read."""
    if len(data) != REPLY_HEAD_BYTES:
        raise PayloadCorrupt(f"a reply head is {REPLY_HEAD_BYTES} bytes, not {len(data)}")
    status, length = _REPLY.unpack(data)
    try:
        status = Status(status)
    except ValueError:
        raise ProtocolViolation(f"unknown fetch status {status}") from None
    if status != Status.OK:
        if length:
            raise ProtocolViolation(f"a {status.name} reply carries {length} bytes")
        return ReplyHead(status, 0)
    limit = MAX_MANIFEST_BYTES if op == Op.MANIFEST else MAX_RUN_BYTES
    if length > limit:
        raise LimitExceeded(f"a reply of {length} bytes exceeds {limit}")
    if expect is not None and length != expect:
        raise PayloadCorrupt(f"the reply carries {length} bytes, the chunks asked for are {expect}")
    return ReplyHead(status, length)
