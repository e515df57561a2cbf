"""Per-hop measurements at the entry, taken where every hop's frames pass: its channel.

``MeteredConnector`` wraps the driver's ``HopConnector``: each channel it
returns counts the bytes of every Session frame each way and times each
decode step (a ``DecodeStep`` request -> its ``DecodeResult``), whatever the
transport underneath (our worker's frame socket, pinned TLS gRPC, a relay
circuit) -- the route driver and ``HopLink`` are unchanged. Readings go to a
``HopObserver`` (the API's Prometheus metrics, meshd/api/metrics.py).

Frames are told apart by their first protobuf field (proto.wirescan), one
varint read per frame; nothing is parsed twice. Requests may be consumed by
gRPC's own thread or pushed by a relayed channel (``RequestQueue.attach``):
the send times wait in a deque (thread-safe appends and pops).
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Protocol

from meshd.plan.routing import Hop
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


class _Requests:
    """The request iterator handed to the transport: counts what it takes (or is pushed)."""

    def __init__(self, inner, reading: _Reading) -> None:
        self._inner, self._reading = inner, reading
        if hasattr(inner, "depth"):
            self.depth = inner.depth

    def __getattr__(self, name):
        if name == "attach" and hasattr(self._inner, "attach"):
            return self._attach
        raise AttributeError(name)

    def _attach(self, push, finish) -> None:
        def metered(body: bytes) -> None:
            self._reading.sent(body)
            push(body)
        self._inner.attach(metered, finish)

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        body = next(self._inner)
        self._reading.sent(body)
        return body


class _Call:
    def __init__(self, inner, reading: _Reading) -> None:
        self._inner, self._reading = inner, reading

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        try:
            body = next(self._inner)
        except BaseException:       # the call ended (or broke): what it counted is told now
            self._reading.flush()
            raise
        self._reading.received(body)
        return body

    def cancel(self):
        self._reading.flush()
        return self._inner.cancel()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Channel:
    def __init__(self, inner, reading: _Reading) -> None:
        self._inner, self._reading = inner, reading

    def stream_stream(self, method: str, request_serializer=None, response_deserializer=None):
        call = self._inner.stream_stream(method, request_serializer=request_serializer,
                                         response_deserializer=response_deserializer)

        def start(requests, **kwargs):
            return _Call(call(_Requests(requests, self._reading), **kwargs), self._reading)
        return start

    def close(self):
        self._reading.flush()
        return self._inner.close()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class MeteredConnector:
    """A HopConnector whose channels report to ``observer`` (see the module doc)."""

    def __init__(self, inner, observer: HopObserver, self_peer_id: str = "") -> None:
        self._inner, self._observer, self._self = inner, observer, self_peer_id

    def channel(self, hop: Hop):
        reading = _Reading(hop.peer_id, transport_of(hop, self._self), self._observer)
        channel = _Channel(self._inner.channel(hop), reading)
        self._observer.hop_opened(hop.peer_id, reading.transport)
        return channel

    def __getattr__(self, name):  # retry_same_peer and whatever else the driver may ask for
        return getattr(self._inner, name)
