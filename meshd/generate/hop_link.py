"""One hop's Session stream as seen from the entry node (blocking gRPC; used in a thread).

A ``HopLink`` owns one bidi ``Session`` call to one worker: it opens the
session (route session id + *this hop's* epoch, and for the tail what to
send back), sends prefill chunks and decode steps, and returns the hop's
output: hidden rows, or the tail's ``TailOut`` (the token it drew, with
logprobs and the logits row only when the route driver asked). Every way a
hop can fail -- the peer refused (ShardStatus), the stream ended, the
transport broke, the watchdog cut a call past its step deadline -- surfaces
as ``HopFailure`` naming the hop, so the route driver has exactly one thing
to catch. A cut call fails with code DEADLINE_EXCEEDED.

Transport: the link is given a ready ``grpc.Channel`` (TLS pinned to the
peer's advertised certificate, loopback plaintext or a frame socket to the
daemon's own worker, or a relayed circuit -- see ``routes.PeerConnector``).

State: the call, its bounded send queue, the credit window, ``past_len``
(positions this hop's KV holds for the session), the step deadlines derived
from what this link measured (deadlines.py), the deadline of the call in
flight (read by the driver's watchdog) and ``received_bytes`` (every
response body, for the driver's bytes-per-step figures).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, cast

import grpc
import numpy as np

from meshd.errors import HopFailure
from meshd.generate.deadlines import StepDeadlines
from proto import shard_runtime_pb2 as pb
from proto import wire
from proto.chunking import plan_prefill_chunks
from proto.errors import MeshdError
from proto.fastpath import read_decode_response
from proto.flow import CreditWindow
from proto.frames import SCHEMA_VERSION, parse_response
from proto.tensors import decode_bundle
from proto.threads import ThreadGroup
from proto.zerocopy import read_response
from shard.edges.grpc_server import SERVICE_NAME
from shard.session.request_queue import RequestQueue
from shard.session.stream import HIDDEN, LOGITS, SMALL_FRAME_BYTES, TOKEN_IDS

SESSION_METHOD = f"/{SERVICE_NAME}/Session"
RELEASE_METHOD = f"/{SERVICE_NAME}/Release"
# Requests queued per hop before send() blocks; the credit window is smaller anyway.
SEND_QUEUE_DEPTH = 16
# No stream outlives this, whatever happens (a wedged peer is also cut by the step deadline).
STREAM_TIMEOUT_S = 6 * 3600.0
# A release is a courtesy to the peer; never wait long for it.
RELEASE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """What to open: the hop's peer and ranges, the session and its epoch, what the tail returns."""

    peer_id: str
    start: int
    end: int
    effective_start: int
    num_layers: int
    session_id: str
    epoch: int
    fingerprint: pb.Fingerprint
    chunk_tokens: int
    max_tokens: int
    tail: pb.TailOptions | None = None   # the tail's options (sampling, logprobs, logits)
    owner_token: bytes = b""             # this hop's secret for the session (driver.owner_token)

    @property
    def is_tail(self) -> bool:
        return self.end == self.num_layers

    @property
    def returns_rows(self) -> bool:
        """Hidden rows come back for every position: a non-tail hop, or a tail asked for embeddings."""
        return not self.is_tail or (self.tail is not None and self.tail.return_hidden)


@dataclass(frozen=True, slots=True)
class TailOut:
    """The tail's answer for the position after a step."""

    sample: pb.TailSample
    logits: np.ndarray | None


class HopLink:
    def __init__(self, index: int, spec: LinkSpec, channel: grpc.Channel, *, patience: float = 1.0) -> None:
        self.index, self.spec, self.channel = index, spec, channel
        self._queue = RequestQueue(SEND_QUEUE_DEPTH)
        self._call: Any = None      # the open Session stream call (gRPC's, or a framed channel's)
        self._cut = False
        self.window: CreditWindow | None = None
        self.past_len = 0
        self.deadline = 0.0         # monotonic time after which the watchdog cuts the call (0: idle)
        self.step_timeout = 0.0     # the deadline in flight, in seconds (for the failure's message)
        self.deadlines = StepDeadlines(patience)
        self.received_bytes = 0
        self.execution_ns = 0       # the hop's own compute of its last step (DecodeResult/Ack)

    # ------------------------------------------------------------------ helpers
    def _fail(self, detail: str, code: int = pb.ERROR_CODE_INTERNAL, retry_after_ms: int = 0) -> HopFailure:
        return HopFailure(self.index, self.spec.peer_id, detail, code, retry_after_ms)

    def _send(self, body: bytes, *, work: bool = True) -> None:
        if work and self.window is not None:
            self.window.consume(len(body))
        self._queue.put(body)

    def _recv(self, timeout_s: float) -> tuple[pb.SessionResponse, dict[str, np.ndarray]]:
        self.step_timeout = timeout_s
        self.deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    body = next(self._call)
                except StopIteration:
                    raise self._fail("the stream ended", pb.ERROR_CODE_PROTOCOL_VIOLATION) from None
                except grpc.RpcError as exc:
                    if self._cut:
                        raise self._fail(f"silent past its step deadline ({self.step_timeout:.1f} s)",
                                         pb.ERROR_CODE_DEADLINE_EXCEEDED) from exc
                    raise self._fail(f"transport: {exc.code().name}") from exc
                self.received_bytes += len(body)
                try:
                    resp, tensors = _read(body)
                except MeshdError as exc:
                    raise self._fail(f"bad response: {exc}", pb.ERROR_CODE_PROTOCOL_VIOLATION) from exc
                kind = resp.WhichOneof("kind")
                if kind == "flow_control":
                    if self.window is not None:
                        self.window.on_grant(resp.flow_control.credits_granted)
                    continue
                if kind == "status":
                    err = resp.status.error
                    name = pb.ErrorCode.Name(err.code) if err.code in pb.ErrorCode.values() else str(err.code)
                    raise self._fail(f"{name}: {err.detail}", err.code, err.retry_after_ms)
                if kind in ("chunk", "decode", "ack") and self.window is not None and self.window.inflight:
                    self.window.on_ack()
                return resp, tensors
        finally:
            self.deadline = 0.0

    # ------------------------------------------------------------------ protocol
    def open(self) -> None:
        resp = self._open_session()
        self.window = CreditWindow(resp.accepted.flow_control)

    def _open_session(self, **extra) -> pb.SessionResponse:
        """Start the Session call and open this hop's session (``extra``: more SessionOpen fields);
        the SessionAccepted, or a HopFailure."""
        s = self.spec
        call = self.channel.stream_stream(SESSION_METHOD, request_serializer=None, response_deserializer=None)
        try:   # a frame channel connects here (gRPC connects lazily): the same one failure type
            self._call = call(self._queue, timeout=STREAM_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._fail(f"transport: {exc.code().name}: {exc.details()}") from exc
        except MeshdError as exc:   # CertificateMismatch: unreachable, or not the peer its record names
            raise self._fail(f"cannot connect: {exc}", pb.ERROR_CODE_PROTOCOL_VIOLATION) from exc
        self._send(pb.SessionRequest(open=pb.SessionOpen(
            schema_version=SCHEMA_VERSION, route_session_id=s.session_id, route_epoch=s.epoch,
            fingerprint=s.fingerprint,
            shard_range=pb.ShardRange(start_layer=s.start, end_layer=s.end, effective_start_layer=s.effective_start),
            proposed_flow_control=pb.FlowControl(max_prefill_chunk_tokens=s.chunk_tokens),
            accepted_compression=[pb.COMPRESSION_NONE], tail=s.tail if s.is_tail else None,
            max_tokens=s.max_tokens, owner_token=s.owner_token, **extra,
        )).SerializeToString(), work=False)
        resp, _ = self._recv(self.deadlines.open_s())
        if resp.WhichOneof("kind") != "accepted":
            raise self._fail("expected SessionAccepted", pb.ERROR_CODE_PROTOCOL_VIOLATION)
        if resp.accepted.past_len != 0:
            raise self._fail(f"a new session starts with {resp.accepted.past_len} cached positions",
                             pb.ERROR_CODE_PROTOCOL_VIOLATION)
        return resp

    @property
    def is_open(self) -> bool:
        return self.window is not None

    def run(self, inputs: np.ndarray, step: StepCounter) -> np.ndarray | TailOut:
        """Feed positions ``[past_len, past_len + len(inputs))``; returns hidden rows or the tail's answer."""
        first, n = self.past_len, int(inputs.shape[0])
        name = TOKEN_IDS if self.spec.effective_start == 0 else HIDDEN
        if n == 1 and first > 0:  # decode fast path
            head = pb.DecodeStep(idempotency_step=step.next(), position=first, expected_past_len=first)
            self._send(wire.request_decode(head, name, inputs))
            t0 = time.monotonic()
            resp, tensors = self._recv(self.deadlines.decode_s())
            self.deadlines.decode_done(time.monotonic() - t0)
            self.execution_ns = resp.decode.execution_nanos
            self.past_len = first + 1
            return self._output(resp.decode, tensors, 1)
        plan = plan_prefill_chunks(n, self.spec.chunk_tokens)
        outs = []
        self.execution_ns = 0
        for index, (offset, count) in enumerate(plan):
            s = self.spec
            idem = step.next()
            env = pb.Envelope(
                schema_version=SCHEMA_VERSION, work_id=f"{s.session_id}:{s.epoch}:{idem}",
                route_session_id=s.session_id, route_epoch=s.epoch, fingerprint=s.fingerprint,
                shard_range=pb.ShardRange(start_layer=s.start, end_layer=s.end,
                                          effective_start_layer=s.effective_start),
                phase=pb.PHASE_PREFILL,
                position=pb.PositionSpan(first_position=first + offset, token_count=count),
                idempotency_step=idem,
                cache_expectation=pb.CacheExpectation(mode=pb.CACHE_MODE_PREFILL, expected_past_len=first + offset),
                chunk=pb.ChunkInfo(chunk_index=index, chunk_count=len(plan), final_chunk=index == len(plan) - 1))
            self._send(wire.request_chunk(env, {name: inputs[offset:offset + count]}))
            t0 = time.monotonic()
            resp, tensors = self._recv(self.deadlines.chunk_s(count))
            self.deadlines.chunk_done(count, time.monotonic() - t0)
            self.past_len = first + offset + count
            final = index == len(plan) - 1
            if self.spec.returns_rows or final:
                outs.append(self._output(resp.chunk, tensors, count))
        # returns_rows: every output is an array of rows (_output)
        return np.concatenate(cast(list[np.ndarray], outs), axis=0) if self.spec.returns_rows else outs[-1]

    def _output(self, holder, tensors: dict[str, np.ndarray], rows: int) -> np.ndarray | TailOut:
        if self.spec.returns_rows:
            out = tensors.get(HIDDEN)
            if out is None or out.ndim != 2 or out.shape[0] != rows:
                got = "none" if out is None else str(out.shape)
                raise self._fail(f"hidden output of shape {got}, expected {rows} rows",
                                 pb.ERROR_CODE_PROTOCOL_VIOLATION)
            return out
        tail = self.spec.tail
        if not holder.HasField("sample"):
            raise self._fail("the tail sent no sampled token", pb.ERROR_CODE_PROTOCOL_VIOLATION)
        logits = tensors.get(LOGITS)
        if tail is not None and tail.return_logits and logits is None:
            raise self._fail("the tail sent no logits although asked", pb.ERROR_CODE_PROTOCOL_VIOLATION)
        return TailOut(holder.sample, logits)

    def cut(self) -> None:
        """The watchdog's cut: the blocked ``run`` raises HopFailure(DEADLINE_EXCEEDED)."""
        self._cut = True
        self.cancel_call()

    def cancel_call(self) -> None:
        """Cut the call (cancellation); a blocked ``run`` raises HopFailure."""
        if self._call is not None:
            self._call.cancel()

    def _cut_after(self, closed: threading.Event) -> None:
        """The close's guard: cut the call unless the close is done within RELEASE_TIMEOUT_S."""
        if not closed.wait(RELEASE_TIMEOUT_S):
            self.cancel_call()

    def close(self, *, release: bool) -> None:
        """Release the session (in-stream if alive, else by unary RPC) and close the channel."""
        s = self.spec
        guard = ThreadGroup(f"hop-{self.index}-close")    # a frozen peer never blocks a close
        guard.start(self._cut_after, guard.stopping, name="release-guard")
        try:
            if release and self.is_open:
                released = False
                try:
                    self._send(pb.SessionRequest(release=pb.ReleaseSignal(
                        route_session_id=s.session_id, route_epoch=s.epoch)).SerializeToString(), work=False)
                    self._recv(RELEASE_TIMEOUT_S)
                    released = True
                except Exception:  # noqa: BLE001 - the stream is gone; try the unary release
                    pass
                if not released:
                    try:
                        self.channel.unary_unary(
                            RELEASE_METHOD, request_serializer=pb.ReleaseRequest.SerializeToString,
                            response_deserializer=pb.ReleaseResponse.FromString)(
                            pb.ReleaseRequest(schema_version=SCHEMA_VERSION, route_session_id=s.session_id,
                                              route_epoch=s.epoch, owner_token=s.owner_token),
                            timeout=RELEASE_TIMEOUT_S)
                    except (grpc.RpcError, MeshdError):
                        # A dead hop holds nothing worth releasing (its TTL cleans up); a frozen or
                        # gone one cannot even show its certificate (CertificateMismatch) to the
                        # gRPC fallback of a frames channel.
                        pass
        finally:
            guard.close()
            self._queue.finish()
            if self._call is not None:
                self._call.cancel()
            self.channel.close()
            self.window = None


def _read(body: bytes) -> tuple[pb.SessionResponse, dict[str, np.ndarray]]:
    """A response and its tensors: protobuf parses small frames (a decode step: fewer Python
    steps), the zero-copy reader large ones (shard.session.stream.SMALL_FRAME_BYTES); same checks."""
    if len(body) > SMALL_FRAME_BYTES:
        return read_response(body)
    if body[:1] == b"\x32":      # a decode step's answer: read by hand when it is a plain one
        fast = read_decode_response(body)
        if fast is not None:
            # the view reads like a SessionResponse{decode}: the fields this module uses (proto/fastpath.py)
            return fast  # type: ignore[return-value]
    resp = parse_response(body)
    kind = resp.WhichOneof("kind")
    holder = resp.decode if kind == "decode" else resp.chunk if kind == "chunk" else None
    if holder is None or not holder.HasField("bundle"):
        return resp, {}
    return resp, decode_bundle(holder.bundle)


class StepCounter:
    """Idempotency steps: strictly increasing across every hop and epoch of one generation."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def next(self) -> int:
        self.value += 1
        return self.value
