"""Push topology, worker side: a hop sends its output rows straight to the next hop.

In a pushed session the entry sends only the head its input; each
hop pushes its boundary rows to the successor the entry named; the tail sends
the sampled token back to the entry. Legs per decode token: hops + 1. A looped
session's tail (``SessionOpen.push_loop``) also sends each token it draws to the
head (its ``push_next``) as the head's next decode input, first, unless it is a
stop token (``TailOptions.stop_token_ids``), the session's last position, or
before ``push_loop_from`` (positions the entry feeds the head itself); its
successor stream carries tokens only and keeps nothing (a replacement head
gets its history from the entry).

Streams of one pushed session (route session id + epoch) on this worker:

    control   the entry's Session stream, opened with ``SessionOpen.push``. It
              opened the session's KV and is where this hop speaks to the
              entry: the head's inputs arrive on it, the tail's answers leave on
              it, and so does a failure report when this hop cannot reach or is
              refused by its successor (``ShardStatus.failed_peer_id``). It also
              carries ``PushRepoint`` (recovery) and the release.
    feeder    the upstream hop's Session stream, opened with
              ``SessionOpen.push_feed`` naming the same id and epoch: it attaches
              to the session the control stream opened (none: CACHE_MISS) and
              carries this hop's inputs; it is answered with credits and
              refusals only.
    successor this hop's own stream to its successor (``push_next``): dialed
              lazily on the first output, only to the PushTarget the entry
              named, through the worker's ``push_dialer`` (the worker CLI pins
              the target's TLS certificate hash; a target without one is
              refused). It mirrors the batch shapes it was fed (a decode step
              stays a decode step, a prefill chunk keeps its ChunkInfo), and it
              keeps every row it sent, with those shapes, for the session
              (bounded by the session's max tokens): on ``PushRepoint`` it dials
              the replacement and re-sends them all in the same batches -- the
              replacement's prefill -- then continues.

Answers leaving a control stream come from other threads (a feeder's, a
successor stream's reader), so a pushed control stream sends through a
``ControlSink``: over gRPC the handler, once the open is accepted, yields from
the sink's bounded queue while a pump thread feeds the stream's own requests
through the core (shard/push/actions.py ``serve_control``); on the framed
edges the sink writes frames under a lock.

This module holds the state (PushHub: the sessions by key; PushSession: one
session's sink and successor stream); shard/push/actions.py carries out the
stream core's push actions against it.

Legs: a decode step carries ``legs`` (the entry sends 1); every hop's push adds
one, the tail's answer one more, so the entry *counts* the legs a token took.

Bounds: PUSH_MAX_SESSIONS registered sessions per worker, a sink queue of
SINK_DEPTH answers; the successor stream's own bounds are in
shard/push/successor.py.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import numpy as np

from proto import shard_runtime_pb2 as pb
from proto.errors import LimitExceeded, ProtocolViolation
from proto.limits import MAX_STOP_TOKENS
from shard.errors import CacheMiss, to_shard_error
from shard.push.successor import Dialer, PushError, SuccessorStream
from shard.session.sessions import SessionKey

log = logging.getLogger(__name__)

# Pushed sessions one worker tracks at once (the session manager bounds KV anyway).
PUSH_MAX_SESSIONS = 256
# Answers queued on one control stream before a producer waits (the entry reads them at once).
SINK_DEPTH = 64
SINK_PUT_TIMEOUT_S = 30.0
_END = object()


def _status(detail: str, *, code: int, session_id: str, failed_peer: str = "", terminal: bool = False) -> bytes:
    return pb.SessionResponse(status=pb.ShardStatus(
        route_session_id=session_id, terminal=terminal, failed_peer_id=failed_peer,
        error=pb.ShardError(code=code, detail=detail[:300]))).SerializeToString()


class ControlSink:
    """Where a pushed control stream's answers go: a bounded queue (gRPC) or a locked writer (Unix)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue(SINK_DEPTH)
        self._writer: Callable[[bytes], None] | None = None
        self._lock = threading.Lock()

    @property
    def attached(self) -> bool:
        return self._writer is not None

    def attach(self, writer: Callable[[bytes], None]) -> None:
        with self._lock:
            self._writer = writer
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _END:
                    writer(item)

    def emit(self, body: bytes) -> None:
        with self._lock:
            writer = self._writer
            if writer is not None:
                writer(body)
                return
        self._queue.put(body, timeout=SINK_PUT_TIMEOUT_S)

    def end(self) -> None:
        try:
            self._queue.put_nowait(_END)
        except queue.Full:
            pass

    def drain(self):
        """The queued answers, blocking for each, until ``end()`` (the gRPC handler yields them)."""
        while True:
            item = self._queue.get()
            if item is _END:
                return
            yield item


class PushSession:
    """One pushed session on this worker: its control sink, its successor stream (non-tail hops)."""

    def __init__(self, hub: PushHub, key: SessionKey, open_msg: pb.SessionOpen, fingerprint: pb.Fingerprint,
                 is_tail: bool) -> None:
        self.hub, self.key = hub, key
        self.sink = ControlSink()
        self.fingerprint = fingerprint
        self.max_tokens = int(open_msg.max_tokens)
        self.chunk_tokens = int(open_msg.proposed_flow_control.max_prefill_chunk_tokens)
        self.effective_start = int(open_msg.shard_range.effective_start_layer)
        self.tail, self.sampling = open_msg.tail, None
        self.is_tail = is_tail
        # A looped tail sends its tokens on to the head (push_next), from position loop_from on.
        self.loop = is_tail and open_msg.push_loop
        self.loop_from = int(open_msg.push_loop_from)
        self.stop_ids = frozenset(open_msg.tail.stop_token_ids)
        self.owner_digest = b""   # the control stream's owner: what a feeder must prove (actions.py)
        self.successor = (SuccessorStream(self, open_msg.push_next, loop=self.loop)
                          if (not is_tail or self.loop) else None)

    # -- what the successor stream needs of its session (successor.Upstream) ------------
    @property
    def dialer(self) -> Dialer | None:
        return self.hub.dialer

    def note_stream(self, transport: str) -> None:
        self.hub.note_stream(transport)

    def report(self, detail: str, failed_peer: str, code: int = pb.ERROR_CODE_INTERNAL) -> None:
        try:
            self.sink.emit(_status(detail, code=code, session_id=self.key.session_id, failed_peer=failed_peer))
        except queue.Full:
            log.warning("push session %s: failure report dropped (control stream not reading)", self.key)

    def answer(self, body: bytes) -> None:
        """The tail's answer for the entry."""
        self.sink.emit(body)

    def push(self, first: int, rows: np.ndarray, **kw) -> None:
        try:
            self.successor.push(first, rows, **kw)
        except PushError as exc:
            self.report(str(exc), self.successor.target.peer_id, pb.ERROR_CODE_INTERNAL)
        except Exception as exc:  # noqa: BLE001 - a dial failure (certificate mismatch, unreachable)
            self.report(f"cannot push to the successor: {to_shard_error(exc).detail or type(exc).__name__}",
                        self.successor.target.peer_id, pb.ERROR_CODE_INTERNAL)

    def loop_token(self, position: int, token: int | None) -> None:
        """A looped tail drew ``token`` for ``position``: the head's next input, unless the
        generation ends there (a stop token, the session's last position) or the entry feeds it."""
        if (not self.loop or token is None or position < self.loop_from or token in self.stop_ids
                or (self.max_tokens and position + 1 >= self.max_tokens)):
            return
        try:
            self.successor.push_token(position, token)
        except PushError as exc:
            self.report(str(exc), self.successor.target.peer_id, pb.ERROR_CODE_INTERNAL)
        except Exception as exc:  # noqa: BLE001 - a dial failure (certificate mismatch, unreachable)
            self.report(f"cannot send the token to the head: {to_shard_error(exc).detail or type(exc).__name__}",
                        self.successor.target.peer_id, pb.ERROR_CODE_INTERNAL)

    def repoint(self, target: pb.PushTarget) -> None:
        if self.successor is None:
            raise ProtocolViolation("the tail has no successor to repoint")
        check_target(target)
        try:
            self.successor.repoint(target)
        except Exception as exc:  # noqa: BLE001
            self.report(f"cannot push to the replacement: {exc}", target.peer_id)

    def release(self) -> None:
        """The entry released the session: forget it and close the successor stream (the sink still answers)."""
        self.hub.drop(self.key, self)
        if self.successor is not None:
            self.successor.close()

    def close(self) -> None:
        self.release()
        self.sink.end()


class PushHub:
    """The worker's pushed sessions, by (session id, epoch), and how it dials successors."""

    @property
    def dialer(self) -> Dialer | None:
        return self.service.push_dialer

    def __init__(self, service) -> None:
        self.service = service
        self._sessions: dict[SessionKey, PushSession] = {}
        self._lock = threading.Lock()
        self.streams = {"frames": 0, "grpc": 0}   # successor streams opened, by transport (Health)

    def note_stream(self, transport: str) -> None:
        with self._lock:
            self.streams[transport] = self.streams.get(transport, 0) + 1

    def register(self, key: SessionKey, open_msg: pb.SessionOpen, fingerprint: pb.Fingerprint,
                 is_tail: bool) -> PushSession:
        if open_msg.push_loop and not is_tail:
            raise ProtocolViolation("only the tail of a pushed route loops its tokens (push_loop)")
        if len(open_msg.tail.stop_token_ids) > MAX_STOP_TOKENS:
            raise LimitExceeded(f"more than {MAX_STOP_TOKENS} stop tokens")
        if not is_tail or open_msg.push_loop:
            if not open_msg.HasField("push_next"):
                raise ProtocolViolation("a pushed non-tail hop (and a looped tail) needs push_next")
            check_target(open_msg.push_next)
            if self.dialer is None:
                raise ProtocolViolation("this worker cannot push (no dialer configured)")
        session = PushSession(self, key, open_msg, fingerprint, is_tail)
        with self._lock:
            if len(self._sessions) >= PUSH_MAX_SESSIONS and key not in self._sessions:
                raise LimitExceeded(f"more than {PUSH_MAX_SESSIONS} pushed sessions")
            old = self._sessions.get(key)
            self._sessions[key] = session
        if old is not None:
            old.close()
        return session

    def get(self, key: SessionKey) -> PushSession:
        with self._lock:
            session = self._sessions.get(key)
        if session is None:
            raise CacheMiss("no pushed session with this id and epoch here", actual_past_len=0)
        return session

    def drop(self, key: SessionKey, session: PushSession) -> None:
        with self._lock:
            if self._sessions.get(key) is session:
                del self._sessions[key]


def check_target(target: pb.PushTarget) -> None:
    if not target.peer_id or not target.endpoint or len(target.endpoint) > 300:
        raise ProtocolViolation("a push target needs a peer id and an endpoint (at most 300 bytes)")
    if len(target.frames_endpoint) > 300:
        raise ProtocolViolation("a push target's frames endpoint is at most 300 bytes")
    if target.frames_endpoint and len(target.tls_cert_sha256) != 32:
        raise ProtocolViolation("a push target's frames endpoint needs its certificate pin")
    if target.tls_cert_sha256 and len(target.tls_cert_sha256) != 32:
        raise ProtocolViolation("a push target's certificate pin is a 32-byte SHA-256")


def hub_of(service) -> PushHub:
    hub = service.push_hub
    if hub is None:
        hub = service.push_hub = PushHub(service)
    return hub
