"""Sans-I/O framing of one relayed session stream (both directions, no sockets).

A relayed hop carries exactly the serialized SessionRequest / SessionResponse
bytes a gRPC hop carries, each behind proto.frames' 4-byte big-endian length.
``FramedStream`` is the state of one such byte stream:

    bytes from the wire ──▶ read_size() tells the edge how much to pull next
                            (never past the end of the frame at the head, so the
                            stream buffers at most ONE frame, never a backlog)
                        ──▶ receive_data(b) ──▶ next_frame() -> body | None
                        ──▶ receive_eof()   (a partial frame at EOF is a protocol error)
    body to send        ──▶ frame(body) -> bytes for the wire

It counts frames and bytes both ways (for status and benchmarks). Bodies are
opaque here: the worker parses them (proto.frames.parse_request); a relay
never does. ``ByteBudget`` bounds the bytes all streams of one node hold at
once (frames read but not yet consumed by the worker or the wire), so many
hostile peers together cannot exhaust memory either.

The trio edge (relay/transport.py) is a loop of ``read(read_size())`` /
``receive_data`` / ``next_frame``; the in-memory tests feed whole streams,
single bytes and trailing garbage.
"""
from __future__ import annotations

from dataclasses import dataclass

from proto.errors import LimitExceeded, LocalError, PayloadCorrupt
from proto.frames import PREFIX_BYTES, FrameReader, encode_frame
from proto.limits import MAX_FRAME_BYTES

__all__ = ["FramedStream", "FrameCounters", "ByteBudget", "RELAYED_MAX_FRAME_BYTES",
           "NODE_RELAYED_BUFFER_BYTES"]

# A relayed hop must carry every frame a gRPC hop carries, so the bound is the
# codec's: a frame bigger than this is refused before its body is read.
RELAYED_MAX_FRAME_BYTES = MAX_FRAME_BYTES

# Bytes of relayed frames one node holds at once across all its relayed
# sessions: four maximal frames (two sessions each with one frame on the way
# in and one on the way out). Past it a new frame is refused (LimitExceeded)
# and that session ends; the other sessions carry on.
NODE_RELAYED_BUFFER_BYTES = 4 * MAX_FRAME_BYTES


@dataclass(slots=True)
class FrameCounters:
    """Frames and payload bytes (prefix included) seen on one stream."""

    frames_in: int = 0
    bytes_in: int = 0
    frames_out: int = 0
    bytes_out: int = 0


class FramedStream:
    """Frame reassembly and framing for one stream; holds at most one partial frame."""

    __slots__ = ("_reader", "_max", "_eof", "_prefix", "_frame_total", "counters")

    def __init__(self, max_frame_bytes: int = RELAYED_MAX_FRAME_BYTES) -> None:
        self._max = max_frame_bytes
        self._reader = FrameReader(max_frame_bytes)
        self._eof = False
        self._prefix = bytearray()         # the head frame's length prefix, as it arrives
        self._frame_total: int | None = None   # prefix + body bytes of the head frame, once known
        self.counters = FrameCounters()

    @property
    def head_frame_bytes(self) -> int | None:
        """Prefix + body bytes of the frame being read, once its prefix arrived."""
        return self._frame_total

    def read_size(self) -> int:
        """How many bytes the edge may read now without buffering past the head frame."""
        if self._frame_total is None:
            return PREFIX_BYTES - len(self._prefix)
        return self._frame_total - self._reader.buffered

    def receive_data(self, data: bytes) -> None:
        """Bytes from the wire. LimitExceeded on an oversized/zero length (peer's fault)."""
        if self._eof:
            raise LocalError("receive_data after receive_eof")
        if len(data) > self.read_size():
            raise LocalError(f"got {len(data)} bytes but only {self.read_size()} were asked for")
        if not data:
            return
        self._reader.feed(data)            # validates the length as soon as 4 bytes exist
        self.counters.bytes_in += len(data)
        if self._frame_total is None:
            self._prefix += data
            if len(self._prefix) == PREFIX_BYTES:
                self._frame_total = PREFIX_BYTES + int.from_bytes(self._prefix, "big")

    def next_frame(self) -> bytes | None:
        """The next complete frame body, or None until more bytes arrive."""
        body = self._reader.next_frame()
        if body is not None:
            self.counters.frames_in += 1
            self._prefix.clear()
            self._frame_total = None
        return body

    def receive_eof(self) -> None:
        """The peer closed its side. PayloadCorrupt if it stopped inside a frame."""
        self._eof = True
        if self._reader.buffered:
            raise PayloadCorrupt(f"stream ended inside a frame ({self._reader.buffered} bytes of it)")

    def frame(self, body: bytes) -> bytes:
        """Wire bytes for one outgoing body (LocalError if empty or oversized: our bug)."""
        data = encode_frame(body, self._max)
        self.counters.frames_out += 1
        self.counters.bytes_out += len(data)
        return data


class ByteBudget:
    """A node-wide bound on relayed bytes held in memory at once (sans-I/O)."""

    __slots__ = ("capacity", "in_use", "refused")

    def __init__(self, capacity: int = NODE_RELAYED_BUFFER_BYTES) -> None:
        if capacity <= 0:
            raise LocalError("a byte budget needs a positive capacity")
        self.capacity = capacity
        self.in_use = 0
        self.refused = 0

    def take(self, n: int) -> None:
        """Reserve ``n`` bytes; LimitExceeded (the sending peer's fault) when over capacity."""
        if n < 0:
            raise LocalError("cannot take a negative number of bytes")
        if self.in_use + n > self.capacity:
            self.refused += 1
            raise LimitExceeded(f"relayed frames would hold {self.in_use + n} bytes "
                                f"> node budget {self.capacity}; the session is closed")
        self.in_use += n

    def give_back(self, n: int) -> None:
        if not 0 <= n <= self.in_use:
            raise LocalError(f"giving back {n} bytes but only {self.in_use} are in use")
        self.in_use -= n
