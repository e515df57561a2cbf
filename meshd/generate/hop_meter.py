"""Per-hop measurements at the entry, taken where every hop's frames pass: its transport.

``MeteredConnector`` wraps the driver's ``HopConnector``: each transport it
returns counts the bytes of every Session frame each way and times each
decode step (a ``DecodeStep`` request -> its ``DecodeResult``), whatever
carries it underneath (our worker's frame socket, pinned TLS gRPC, a relay
circuit) -- the route driver and ``HopLink`` are unchanged. Readings go to a
``HopObserver`` (the API's Prometheus metrics, meshd/api/metrics.py).

Frames are told apart by their first protobuf field (proto.wirescan), one
varint read per frame; nothing is parsed twice. A pushed route sends from
one thread and receives on another: the send times wait in a deque
(thread-safe appends and pops).
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Protocol

from meshd.generate.driver import HopConnector, PushDial
from meshd.plan.routing import Hop
from proto.hop_transport import HopStream, HopTransport, Unary
from proto.wirescan import top_level_field

# SessionRequest / SessionResponse oneof field numbers (proto/shard_runtime.proto).
_REQ_DECODE = 3
_RESP_DECODE = 6
# Send times kept per call: decode steps are one in flight at a time; the
# bound only guards against a peer that never answers.
MAX_PENDING_STEPS = 64
# How often a channel's counts reach the observer at the latest (see _Reading).
FLUSH_S = 0.5
FLUSH_STEPS = 64


class HopObserver(Protocol):
    def hop_opened(self, peer_id: str, transport: str) -> None: ...

    def hop_step(self, peer_id: str, transport: str, seconds: float) -> None: ...

    def hop_bytes(self, peer_id: str, transport: str, sent: int, received: int) -> None: ...


def transport_of(hop: Hop, self_peer_id: str) -> str:
    return "own" if hop.peer_id == self_peer_id else "relayed" if hop.relayed else "direct"


def _field(body: bytes) -> int:
    try:
        first = top_level_field(body)
    except Exception:  # noqa: BLE001 - a malformed frame is HopLink's to report; we only count it
        return 0
    return first[0] if first else 0


class _Reading:
    """One channel's counts. Frames are counted where they pass (a few integer adds), and the
    observer hears the sums at most every FLUSH_S (or FLUSH_STEPS decode steps), when the call
    ends, and when the channel closes: the metrics calls stay off the per-token path (each
    costs tens of microseconds there, its caches cold after a forward)."""

    __slots__ = ("peer_id", "transport", "observer", "sent_at", "_sent", "_received", "_steps", "_flushed_at",
                 "_lock")

    def __init__(self, peer_id: str, transport: str, observer: HopObserver) -> None:
        self.peer_id, self.transport, self.observer = peer_id, transport, observer
        self.sent_at: collections.deque[float] = collections.deque(maxlen=MAX_PENDING_STEPS)
        self._sent = self._received = 0
        self._steps: list[float] = []
        self._flushed_at = time.monotonic()
        self._lock = threading.Lock()   # a pushed route sends from one thread and reads from another

    def sent(self, body: bytes) -> None:
        if _field(body) == _REQ_DECODE:
            self.sent_at.append(time.perf_counter())
        with self._lock:
            self._sent += len(body)
        self._maybe_flush()

    def received(self, body: bytes) -> None:
        if _field(body) == _RESP_DECODE and self.sent_at:
            step = time.perf_counter() - self.sent_at.popleft()
            with self._lock:
                self._steps.append(step)
        with self._lock:
            self._received += len(body)
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if len(self._steps) >= FLUSH_STEPS or time.monotonic() - self._flushed_at >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            sent, received, steps = self._sent, self._received, self._steps
            self._sent = self._received = 0
            self._steps = []
            self._flushed_at = time.monotonic()
        for seconds in steps:
            self.observer.hop_step(self.peer_id, self.transport, seconds)
        if sent or received:
            self.observer.hop_bytes(self.peer_id, self.transport, sent, received)


class _MeteredStream:
    """A HopStream that counts what passes (proto.hop_transport)."""

    def __init__(self, inner: HopStream, reading: _Reading) -> None:
        self._inner, self._reading = inner, reading

    def send(self, body: bytes, timeout_s: float | None = None) -> None:
        self._reading.sent(body)
        self._inner.send(body, timeout_s)

    def receive(self) -> bytes | None:
        try:
            body = self._inner.receive()
        except BaseException:       # the stream broke: what it counted is told now
            self._reading.flush()
            raise
        if body is None:            # the stream ended
            self._reading.flush()
        else:
            self._reading.received(body)
        return body

    def close_send(self) -> None:
        self._inner.close_send()

    def cancel(self) -> None:
        self._reading.flush()
        self._inner.cancel()


class MeteredTransport:
    """A HopTransport whose streams report to one reading (proto.hop_transport)."""

    def __init__(self, inner: HopTransport, reading: _Reading) -> None:
        self._inner, self._reading = inner, reading

    @property
    def kind(self) -> str:
        return self._inner.kind

    def open_session(self) -> HopStream:
        return _MeteredStream(self._inner.open_session(), self._reading)

    def unary(self, method: Unary, body: bytes, timeout_s: float) -> bytes:
        return self._inner.unary(method, body, timeout_s)

    def close(self) -> None:
        self._reading.flush()
        self._inner.close()


class MeteredConnector:
    """A driver.HopConnector whose transports report to ``observer`` (see the module doc)."""

    def __init__(self, inner: HopConnector, observer: HopObserver, self_peer_id: str = "") -> None:
        self._inner, self._observer, self._self = inner, observer, self_peer_id

    @property
    def self_peer_id(self) -> str:
        return self._inner.self_peer_id

    def transport(self, hop: Hop) -> HopTransport:
        reading = _Reading(hop.peer_id, transport_of(hop, self._self), self._observer)
        transport = MeteredTransport(self._inner.transport(hop), reading)
        self._observer.hop_opened(hop.peer_id, reading.transport)
        return transport

    def retry_same_peer(self, peer_id: str) -> bool:
        return self._inner.retry_same_peer(peer_id)

    def push_dial(self, hop: Hop, *, head: bool = False) -> PushDial | None:
        return self._inner.push_dial(hop, head=head)
