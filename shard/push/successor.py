"""A pushed hop's own Session stream to its successor, and the rows it keeps for a replacement.

Part of the push topology (shard/push/hub.py has the whole picture). The
successor stream dials lazily, on the first output, only the PushTarget the entry
named, through the worker's ``push_dialer`` (a proto.hop_transport.HopTransport:
pinned frames or gRPC from meshd/cli/worker.py, in memory in tests); it opens a feeder stream
(``SessionOpen.push_feed``) and then mirrors the batch shapes it was fed: a
decode step stays a decode step (one more leg counted in ``legs``), a prefill
chunk keeps its ChunkInfo. A reader thread takes the successor's credits and
refusals; a refusal or a broken stream is reported once, to the entry, through
the session's control stream (``ShardStatus.failed_peer_id``). Rows sent are
kept with their batch shapes, bounded by the session's max tokens:
``repoint(target)`` dials the replacement and re-sends them all in the same
batches (its prefill), then pushing continues there. A generation counter
keeps an old stream's last words from being reported after a repoint.
The reader thread runs in the session's ThreadGroup (the hub's: the worker
joins it when it stops); ``close()`` ends the call and wakes a send or an
open waiting on the successor at once.

The session that drives a successor stream is seen through ``Upstream``, a
small protocol (shard/push/hub.py PushSession implements it): its key and
bounds, how to dial, where to count the stream, and where to report.

Bounds: credit waits of CREDIT_WAIT_S (the successor's credits bound what
waits in the transport), the open's answer within OPEN_TIMEOUT_S.
"""
from __future__ import annotations

import threading
from typing import Protocol

import numpy as np

from proto import fastpath, wire
from proto import shard_runtime_pb2 as pb
from proto.errors import LimitExceeded, ProtocolViolation
from proto.frames import SCHEMA_VERSION, parse_response
from proto.hop_transport import HopStream, HopTransport, PushDialer, TransportError
from proto.limits import DECODE_STEP_BASE
from proto.threads import GroupStopped, ThreadGroup
from shard.session.session_ids import SessionKey

# A successor that grants no credit for this long is reported as failed.
CREDIT_WAIT_S = 60.0
# Dialing and opening the successor's feeder stream.
OPEN_TIMEOUT_S = 30.0
HIDDEN = "h"
TOKEN_IDS = "token_ids"


Dialer = PushDialer   # the transport to the target the entry named


class PushError(Exception):
    """The successor could not be reached or refused the pushed work."""


class Upstream(Protocol):
    """The pushed session a successor stream works for (shard/push/hub.py PushSession)."""

    key: SessionKey
    fingerprint: pb.Fingerprint
    max_tokens: int          # bounds the rows kept (0: no bound)
    chunk_tokens: int        # the prefill chunk size proposed to the successor

    @property
    def dialer(self) -> Dialer | None:
        """How this worker dials a target (None: it cannot push)."""
        ...

    @property
    def threads(self) -> ThreadGroup:
        """Where the stream's reader thread runs (the worker's push threads, joined when it stops)."""
        ...

    def note_stream(self, transport: str) -> None:
        """A stream to a successor opened over ``transport`` ("frames" or "grpc")."""
        ...

    def report(self, detail: str, failed_peer: str, code: pb.ErrorCode = ...) -> None:
        """Tell the entry (once) that the successor failed."""
        ...


class SuccessorStream:
    """This hop's stream to its successor; keeps what it sent for a replacement (see module doc)."""

    def __init__(self, session: Upstream, target: pb.PushTarget, *, loop: bool = False) -> None:
        self.session, self.target = session, target
        self.loop = loop                        # a looped tail's stream to the head: tokens, nothing kept
        self._lock = threading.Lock()           # one send / repoint at a time
        self._rows: np.ndarray | None = None
        self._held = 0
        self._batches: list[tuple[int, int, int, int, bool, bool]] = []  # first, n, index, count, final, decode
        self._transport: HopTransport | None = None
        self._stream: HopStream | None = None
        self._credits = 0
        self._cond = threading.Condition()
        self._failed: str | None = None
        self._closed = False                    # close(): nothing is sent or dialed any more
        self._generation = 0
        self._step = 0
        self.sent_frames = 0
        self.transport = ""                     # "frames", "grpc", ...: what carries the stream now

    # -- rows kept for a replacement ---------------------------------------------------
    def _check_keep(self, first: int, rows: np.ndarray) -> None:
        end = first + rows.shape[0]
        cap = self.session.max_tokens
        if cap and end > cap:
            raise LimitExceeded(f"pushed rows up to {end} > the session's {cap} tokens")
        if first != self._held:
            raise ProtocolViolation(f"pushed rows start at {first}, {self._held} held")

    def _keep(self, first: int, rows: np.ndarray) -> None:
        """Hold rows [first, first + n) (checked by ``_check_keep``) for a replacement."""
        end = first + rows.shape[0]
        cap = self.session.max_tokens
        kept = self._rows
        size = 0 if kept is None else kept.shape[0]
        if kept is None or end > size:
            want = max(end, 2 * size, 16)
            grown = np.empty((min(want, cap) if cap else want, *rows.shape[1:]), dtype=rows.dtype)
            if kept is not None:
                grown[:self._held] = kept[:self._held]
            kept = self._rows = grown
        kept[first:end] = rows
        self._held = end

    # -- the successor's stream --------------------------------------------------------
    def _open(self) -> None:
        s, t = self.session, self.target
        dial = s.dialer
        if dial is None:
            raise PushError("this worker has no push dialer")
        if self._closed:
            raise PushError("the push session was closed")
        with self._cond:
            self._generation += 1
            generation = self._generation
        self._transport = dial(t)
        self._stream = stream = self._transport.open_session()
        self.transport = self._transport.kind
        s.note_stream(self.transport)
        stream.send(pb.SessionRequest(open=pb.SessionOpen(
            schema_version=SCHEMA_VERSION, route_session_id=s.key.session_id, route_epoch=t.route_epoch,
            fingerprint=s.fingerprint, shard_range=t.shard_range, push_feed=True, max_tokens=s.max_tokens,
            owner_token=t.owner_token,
            proposed_flow_control=pb.FlowControl(max_prefill_chunk_tokens=s.chunk_tokens),
            accepted_compression=[pb.COMPRESSION_NONE])).SerializeToString())
        opened = threading.Event()
        with self._cond:
            self._credits, self._failed = 0, None
            closed = self._closed
        if closed:                              # close() came while we dialed: it may not have seen the stream
            stream.cancel()
            raise PushError("the push session was closed")
        try:
            s.threads.start(self._read, stream, generation, opened, name="successor-read")
        except GroupStopped as exc:             # the worker is stopping
            stream.cancel()
            raise PushError("the worker is stopping") from exc
        if not opened.wait(OPEN_TIMEOUT_S):
            raise PushError(f"no answer to the feeder open within {OPEN_TIMEOUT_S:.0f} s")
        if self._failed:
            raise PushError(self._failed)

    def _read(self, stream: HopStream, generation: int, opened: threading.Event) -> None:
        try:
            while (body := stream.receive()) is not None:
                resp = parse_response(body)
                kind = resp.WhichOneof("kind")
                if kind == "status":
                    err = resp.status.error
                    name = pb.ErrorCode.Name(err.code) if err.code in pb.ErrorCode.values() else str(err.code)
                    self._fail(generation, f"{name}: {err.detail}", err.code)
                    return
                with self._cond:
                    if kind == "accepted":
                        self._credits = resp.accepted.flow_control.credits_granted
                        opened.set()
                    elif kind == "flow_control":
                        self._credits += resp.flow_control.credits_granted
                    self._cond.notify_all()
            self._fail(generation, "the successor ended the stream")
        except TransportError as exc:
            self._fail(generation, f"transport: {exc.status.value}")
        except Exception as exc:  # noqa: BLE001 - a bad frame from the successor
            self._fail(generation, f"transport: {type(exc).__name__}")
        finally:
            opened.set()

    def _fail(self, generation: int, detail: str, code: pb.ErrorCode = pb.ERROR_CODE_INTERNAL) -> None:
        with self._cond:
            if generation != self._generation or self._failed is not None:
                return                                   # an old stream after a repoint, or said already
            self._failed = detail
            self._cond.notify_all()
        self.session.report(f"successor {self.target.peer_id[-12:]}: {detail}", self.target.peer_id, code)

    def _send(self, body: bytes) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._credits > 0 or self._failed is not None or self._closed,
                                       CREDIT_WAIT_S):
                raise PushError(f"no credit from the successor for {CREDIT_WAIT_S:.0f} s")
            if self._closed:
                raise PushError("the push session was closed")
            if self._failed is not None:
                raise PushError(self._failed)
            self._credits -= 1
        if self._stream is None:
            raise PushError("the stream to the successor is closed")
        try:   # credits bound what waits first: gRPC's queue, or a framed socket's buffer
            self._stream.send(body, timeout_s=CREDIT_WAIT_S)
        except TransportError as exc:
            raise PushError(f"the stream to the successor took no frame: {exc}") from None
        self.sent_frames += 1

    def _body(self, first: int, rows: np.ndarray, index: int, count: int, final: bool, decode: bool,
              legs: int = 0, execution: int = 0) -> bytes:
        s = self.session
        self._step += 1
        if decode:
            body = fastpath.decode_request_bytes(self._step, first, first, HIDDEN, rows, legs=legs,
                                                 route_execution_nanos=execution)
            if body is not None:
                return body
            head = pb.DecodeStep(idempotency_step=self._step, position=first, expected_past_len=first, legs=legs,
                                 route_execution_nanos=execution)
            return wire.request_decode(head, HIDDEN, rows)
        t = self.target
        env = pb.Envelope(
            schema_version=SCHEMA_VERSION, work_id=f"{s.key.session_id}:{t.route_epoch}:push{self._step}",
            route_session_id=s.key.session_id, route_epoch=t.route_epoch, shard_range=t.shard_range,
            phase=pb.PHASE_PREFILL, position=pb.PositionSpan(first_position=first, token_count=rows.shape[0]),
            idempotency_step=self._step,
            cache_expectation=pb.CacheExpectation(mode=pb.CACHE_MODE_PREFILL, expected_past_len=first),
            chunk=pb.ChunkInfo(chunk_index=index, chunk_count=count, final_chunk=final))
        return wire.request_chunk(env, {HIDDEN: rows})

    def push(self, first: int, rows: np.ndarray, *, index: int = 0, count: int = 1, final: bool = True,
             decode: bool = False, legs: int = 0, execution: int = 0) -> None:
        """Send this hop's output rows for positions [first, first + n) on (PushError on failure).

        The send comes first (the successor waits for it; keeping a copy does not), but the rows
        are kept whatever the send does: a replacement successor gets them all on repoint."""
        with self._lock:
            self._check_keep(first, rows)
            try:
                if self._stream is None:
                    self._open()
                self._send(self._body(first, rows, index, count, final, decode, legs, execution))
            finally:
                self._keep(first, rows)
                self._batches.append((first, rows.shape[0], index, count, final, decode))

    def push_token(self, position: int, token: int) -> None:
        """A looped tail's drawn token, sent to the head as its decode input at ``position``
        (numbered DECODE_STEP_BASE + position, as the entry numbers its own; nothing is kept:
        a replacement head is fed its history by the entry)."""
        ids = np.array([token], dtype=np.int64)
        step = DECODE_STEP_BASE + position
        with self._lock:
            if self._stream is None:
                self._open()
            body = fastpath.decode_request_bytes(step, position, position, TOKEN_IDS, ids, legs=1)
            self._send(body or wire.request_decode(pb.DecodeStep(idempotency_step=step, position=position,
                                                                 expected_past_len=position, legs=1), TOKEN_IDS, ids))

    def repoint(self, target: pb.PushTarget) -> None:
        """Push to ``target`` from now on, after re-sending every held row in its first batches."""
        with self._lock:
            self._close_call()
            self.target = target
            self._step = 0
            self._open()
            kept = self._rows
            for first, n, index, count, final, decode in self._batches:
                assert kept is not None   # _keep held every batch's rows
                self._send(self._body(first, kept[first:first + n], index, count, final, decode))

    def _close_call(self) -> None:
        with self._cond:
            self._generation += 1       # whatever the old stream says now is not a failure to report
        if self._stream is not None:
            self._stream.close_send()
            self._stream.cancel()
        if self._transport is not None:
            self._transport.close()
        self._stream = self._transport = None

    def close(self) -> None:
        """End the stream for good. A send waiting for a credit, or an open waiting for its answer,
        gives up at once (PushError): the flag and the cancel need no ``_lock``, which they hold."""
        with self._cond:
            self._closed = True
            self._generation += 1               # what the cancelled stream says now is not a failure
            self._cond.notify_all()
            stream = self._stream
        if stream is not None:
            stream.cancel()                     # the reader ends; an open waiting for it wakes
        with self._lock:
            self._close_call()
