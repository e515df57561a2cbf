"""The in-memory edge: Session streams straight into a ShardService's stream core, no socket (tests).

The twin of the real edges (httpx's ``MockTransport``): a ``MemoryTransport``
is a proto.hop_transport.HopTransport whose streams hand request bodies to a
real ``SessionStream`` over a real ``ShardService`` (real model, real KV, real
push machinery), and whose response bodies come back exactly as an edge would
send them. Only the socket is missing.

    client thread ── send(body) ──▶ requests ─┐
    client thread ◀── receive() ◀─ responses ◀┴─ the core runs here, in the receiving thread:
                                                push.actions.receive(stream, body)

No thread of its own: the core runs in whichever thread receives from the
stream -- the route driver's, a pushed route's reader, a hop's successor-stream
reader -- one request at a time per stream, as one connection thread of a real
edge would. A pushed control stream's answers from other threads (its
ControlSink) are appended to the responses like a framed edge's writes.

Faults are the transport's, caused on a ``MemoryHop`` (one worker's end):

    kill()       the worker is gone: every stream breaks (receive raises UNAVAILABLE),
                 new streams and unary calls are refused, its pushed sessions end
    freeze()     the worker stops answering: requests wait unprocessed, unary calls
                 time out; ``thaw()`` lets it go on where it stopped
    refuse()     new streams and unary calls are refused (UNAVAILABLE), open ones go on
    corrupt(n)   the next ``n`` response bodies arrive as bytes no parser accepts
    kill_on(p)   killed the moment a request body for which ``p(body)`` holds reaches it (before
                 running it): a death at an exact point of a pipelined route, not a race

``MemoryNetwork`` names hops by endpoint: a route's transports and every
worker's push dialer look peers up there.

Bounds: at most MAX_QUEUED_FRAMES bodies wait per direction of a stream (credits
keep real traffic far below it; past it the stream breaks with
RESOURCE_EXHAUSTED: a test that queues without reading is the bug).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from proto import shard_runtime_pb2 as pb
from proto.errors import ProtocolError
from proto.frames import parse_unary
from proto.hop_transport import TransportError, TransportStatus, Unary
from shard.push.actions import receive, sink_of, stream_ended
from shard.session.service import ShardService
from shard.session.sessions import LOCAL_OWNER
from shard.session.stream import SessionStream

__all__ = ["MemoryHop", "MemoryNetwork", "MemoryTransport", "MemoryStream", "MAX_QUEUED_FRAMES"]

# Bodies waiting per direction of one stream: credit windows keep a real stream to a few.
MAX_QUEUED_FRAMES = 1024
# What a corrupted response body becomes: a length-delimited field that runs past the end.
GARBAGE = b"\x0a\xff\xff\xff\x0f"

_UNARY = {
    Unary.CAPABILITY: (pb.CapabilityRequest, lambda service, request, peer: service.capability(request)),
    Unary.HEALTH: (pb.HealthRequest, lambda service, request, peer: service.health(request)),
    Unary.RELEASE: (pb.ReleaseRequest, lambda service, request, peer: service.release(request, peer)),
}


class MemoryHop:
    """One worker's end of the in-memory network: its service, its live streams, its faults."""

    def __init__(self, service: ShardService, *, peer: str = LOCAL_OWNER.peer, private: bool = True) -> None:
        self.service = service
        self.peer, self.private = peer, private   # who the core sees calling (as a real edge tells it)
        self.dead = self.frozen = self.refusing = False
        self._corrupt = 0
        self._kill_on: Callable[[bytes], bool] | None = None
        self._lock = threading.Lock()
        self._thawed = threading.Condition(self._lock)
        self._streams: set[MemoryStream] = set()

    # -- faults ----------------------------------------------------------------------------
    def kill(self) -> None:
        with self._lock:
            self.dead = True
            streams = list(self._streams)
            self._thawed.notify_all()
        for stream in streams:
            stream.break_off(TransportError("the worker is gone", TransportStatus.UNAVAILABLE))

    def freeze(self) -> None:
        with self._lock:
            self.frozen = True

    def thaw(self) -> None:
        with self._lock:
            self.frozen = False
            self._thawed.notify_all()
            streams = list(self._streams)
        for stream in streams:
            stream.wake()

    def refuse(self, refusing: bool = True) -> None:
        with self._lock:
            self.refusing = refusing

    def corrupt(self, count: int = 1) -> None:
        with self._lock:
            self._corrupt += count

    def kill_on(self, predicate: Callable[[bytes], bool]) -> None:
        with self._lock:
            self._kill_on = predicate

    def dies_at(self, body: bytes) -> bool:
        """Kill this worker if ``body`` is the request it was told to die at (kill_on)."""
        predicate = self._kill_on
        if predicate is None or not predicate(body):
            return False
        self.kill()
        return True

    # -- what streams and transports ask -----------------------------------------------------
    def _check_reachable(self) -> None:
        if self.dead:
            raise TransportError("the worker is gone", TransportStatus.UNAVAILABLE)
        if self.refusing:
            raise TransportError("connection refused", TransportStatus.UNAVAILABLE)

    def connect(self, stream: MemoryStream) -> None:
        with self._lock:
            self._check_reachable()
            self._streams.add(stream)

    def disconnect(self, stream: MemoryStream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def deliverable(self, body: bytes) -> bytes:
        with self._lock:
            if not self._corrupt:
                return body
            self._corrupt -= 1
        return GARBAGE

    def unary(self, method: Unary, body: bytes, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._check_reachable()
            while self.frozen:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(f"{method.value}: no answer within {timeout_s:g} s",
                                         TransportStatus.DEADLINE_EXCEEDED)
                self._thawed.wait(left)
                self._check_reachable()
        request_cls, call = _UNARY[method]
        try:
            request = parse_unary(request_cls, body)
        except ProtocolError as exc:   # the gRPC edge's INVALID_ARGUMENT
            raise TransportError(f"{method.value}: {exc}", TransportStatus.INTERNAL) from exc
        return call(self.service, request, self.peer).SerializeToString()


class MemoryStream:
    """One Session stream into a MemoryHop's core (a proto.hop_transport.HopStream)."""

    def __init__(self, hop: MemoryHop) -> None:
        self.hop = hop
        self._core = SessionStream(hop.service, peer=hop.peer, private=hop.private)
        self._cond = threading.Condition()
        self._requests: deque[bytes] = deque()
        self._responses: deque[bytes] = deque()
        self._send_closed = False      # the client half-closed
        self._broken: TransportError | None = None
        self._busy = False             # a thread is running the core for this stream
        self._ended = False            # stream_ended ran (the edge is done with the core)
        hop.connect(self)

    # -- the client's side (HopStream) ---------------------------------------------------------
    def send(self, body: bytes, timeout_s: float | None = None) -> None:
        with self._cond:
            if self._broken is not None or self._send_closed:
                return                              # over: the next receive says why
            if not self._cond.wait_for(lambda: len(self._requests) < MAX_QUEUED_FRAMES or self._broken,
                                       timeout_s):
                raise TransportError("no room for the request", TransportStatus.DEADLINE_EXCEEDED)
            self._requests.append(bytes(body))
            self._cond.notify_all()

    def close_send(self) -> None:
        with self._cond:
            self._send_closed = True
            self._cond.notify_all()

    def cancel(self) -> None:
        self.break_off(TransportError("the call was cancelled", TransportStatus.CANCELLED))

    def receive(self) -> bytes | None:
        while True:
            with self._cond:
                body = self._next_or_work()
            if isinstance(body, bytes):
                return self.hop.deliverable(body)
            if body is None:
                self._end()
                return None
            self._serve(body[0])

    # -- the edge's side -------------------------------------------------------------------------
    def _next_or_work(self) -> bytes | None | tuple[bytes]:
        """Under the lock: a response to return, None at the stream's end, or (request,) to run."""
        while True:
            if self._broken is not None:
                raise self._broken
            if self._responses:
                return self._responses.popleft()
            if not self._busy and self._requests and not self.hop.frozen and not self._core.closed:
                self._busy = True
                return (self._requests.popleft(),)
            if not self._busy and (self._core.closed or (self._send_closed and not self._requests)):
                return None                 # the core ended it, or the client's requests did
            self._cond.wait()

    def _serve(self, body: bytes) -> None:
        """Run one request through the core (in this thread, outside the lock), as an edge would."""
        try:
            if self.hop.dies_at(body):
                return
            out = receive(self._core, body)
            sink = sink_of(self._core)
            if sink is not None:          # pushed: other threads answer on this stream too
                if not sink.attached:
                    sink.attach(self._write)
                for r in out:
                    sink.emit(r)
            else:
                for r in out:
                    self._write(r)
        finally:
            with self._cond:
                self._busy = False
                broken = self._broken is not None
                self._cond.notify_all()
            if broken:
                self._end()

    def _write(self, body: bytes) -> None:
        with self._cond:
            if self._broken is not None:
                return
            if len(self._responses) >= MAX_QUEUED_FRAMES:
                self._broken = TransportError("nobody reads the stream", TransportStatus.RESOURCE_EXHAUSTED)
            else:
                self._responses.append(bytes(body))
            self._cond.notify_all()

    def break_off(self, error: TransportError) -> None:
        """End the stream with ``error`` (a cancel, the worker's death), from any thread."""
        with self._cond:
            if self._broken is None:
                self._broken = error
                self._responses.clear()
                self._requests.clear()
            busy = self._busy
            self._cond.notify_all()
        if not busy:
            self._end()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _end(self) -> None:
        """The edge is done with the core (once): a control stream's pushed session goes too."""
        with self._cond:
            if self._ended or self._busy:
                return
            self._ended = True
        self.hop.disconnect(self)
        stream_ended(self._core)


class MemoryTransport:
    """A proto.hop_transport.HopTransport to one MemoryHop."""

    kind = "memory"

    def __init__(self, hop: MemoryHop) -> None:
        self.hop = hop

    def open_session(self) -> MemoryStream:
        return MemoryStream(self.hop)

    def unary(self, method: Unary, body: bytes, timeout_s: float) -> bytes:
        return self.hop.unary(method, body, timeout_s)

    def close(self) -> None:
        pass


class MemoryNetwork:
    """Hops by endpoint: the transports of a route, and every worker's push dialer."""

    def __init__(self) -> None:
        self.hops: dict[str, MemoryHop] = {}

    def add(self, endpoint: str, service: ShardService, **kwargs) -> MemoryHop:
        hop = self.hops[endpoint] = MemoryHop(service, **kwargs)
        service.push_dialer = self.dial
        return hop

    def transport(self, endpoint: str) -> MemoryTransport:
        hop = self.hops.get(endpoint)
        if hop is None:
            raise TransportError(f"nothing listens at {endpoint}", TransportStatus.UNAVAILABLE)
        return MemoryTransport(hop)

    def dial(self, target: pb.PushTarget) -> MemoryTransport:
        """A worker's push dialer: the successor the entry named, by its endpoint."""
        return self.transport(target.endpoint)
