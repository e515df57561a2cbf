"""One hop's Session stream as seen from the entry node (blocking gRPC; used in a thread).

A ``HopLink`` owns one bidi ``Session`` call to one worker: it opens the
session (route session id + *this hop's* epoch), sends prefill chunks and
decode steps, and returns the hop's output (hidden rows, or the tail's
logits). Every way a hop can fail -- the peer refused (ShardStatus), the
stream ended, the transport broke, the watchdog cancelled a call past its
deadline -- surfaces as ``HopFailure`` naming the hop, so the route driver
has exactly one thing to catch.

Transport: the link is given a ready ``grpc.Channel`` (TLS pinned to the
peer's advertised certificate, or loopback plaintext to the daemon's own
worker; a relayed hop will bring its own channel -- see ``route_driver``).

State: the call, its bounded send queue, the credit window, ``past_len``
(positions this hop's KV holds for the session) and whether it is open.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
import numpy as np

from proto import shard_runtime_pb2 as pb
from proto import wire
from proto.chunking import plan_prefill_chunks
from meshd.errors import HopFailure
from proto.errors import MeshdError
from proto.flow import CreditWindow
from proto.frames import SCHEMA_VERSION
from proto.zerocopy import read_response
from meshd.generate.request_queue import RequestQueue
from shard.server import SERVICE_NAME
from shard.stream import HIDDEN, LOGITS, TOKEN_IDS

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
    """What to open: the hop's peer and ranges, the session and its epoch."""

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

    @property
    def is_tail(self) -> bool:
        return self.end == self.num_layers


class HopLink:
    def __init__(self, index: int, spec: LinkSpec, channel: grpc.Channel) -> None:
        self.index, self.spec, self.channel = index, spec, channel
        self._queue = RequestQueue(SEND_QUEUE_DEPTH)
        self._call = None
        self.window: CreditWindow | None = None
        self.past_len = 0
        self.deadline = 0.0  # monotonic time after which the watchdog cancels the call (0: idle)

    # ------------------------------------------------------------------ helpers
    def _fail(self, detail: str, code: int = pb.ERROR_CODE_INTERNAL) -> HopFailure:
        return HopFailure(self.index, self.spec.peer_id, detail, code)

    def _send(self, body: bytes, *, work: bool = True) -> None:
        if work and self.window is not None:
            self.window.consume(len(body))
        self._queue.put(body)

    def _recv(self, step_deadline_s: float) -> tuple[pb.SessionResponse, dict[str, np.ndarray]]:
        self.deadline = time.monotonic() + step_deadline_s
        try:
            while True:
                try:
                    body = next(self._call)
                except StopIteration:
                    raise self._fail("the stream ended", pb.ERROR_CODE_PROTOCOL_VIOLATION) from None
                except grpc.RpcError as exc:
                    raise self._fail(f"transport: {exc.code().name}") from exc
                try:
                    resp, tensors = read_response(body)
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
                    raise self._fail(f"{name}: {err.detail}", err.code)
                if kind in ("chunk", "decode", "ack") and self.window is not None and self.window.inflight:
                    self.window.on_ack()
                return resp, tensors
        finally:
            self.deadline = 0.0

    # ------------------------------------------------------------------ protocol
    def open(self, step_deadline_s: float) -> None:
        s = self.spec
        call = self.channel.stream_stream(SESSION_METHOD, request_serializer=None, response_deserializer=None)
        self._call = call(self._queue, timeout=STREAM_TIMEOUT_S)
        tail = pb.TailOptions(return_logits=True) if s.is_tail else None
        self._send(pb.SessionRequest(open=pb.SessionOpen(
            schema_version=SCHEMA_VERSION, route_session_id=s.session_id, route_epoch=s.epoch,
            fingerprint=s.fingerprint,
            shard_range=pb.ShardRange(start_layer=s.start, end_layer=s.end, effective_start_layer=s.effective_start),
            proposed_flow_control=pb.FlowControl(max_prefill_chunk_tokens=s.chunk_tokens),
            accepted_compression=[pb.COMPRESSION_NONE], tail=tail, max_tokens=s.max_tokens,
        )).SerializeToString(), work=False)
        resp, _ = self._recv(step_deadline_s)
        if resp.WhichOneof("kind") != "accepted":
            raise self._fail("expected SessionAccepted", pb.ERROR_CODE_PROTOCOL_VIOLATION)
        if resp.accepted.past_len != 0:
            raise self._fail(f"a new session starts with {resp.accepted.past_len} cached positions",
                             pb.ERROR_CODE_PROTOCOL_VIOLATION)
        self.window = CreditWindow(resp.accepted.flow_control)

    @property
    def is_open(self) -> bool:
        return self.window is not None

    def run(self, inputs: np.ndarray, step: "StepCounter", step_deadline_s: float) -> np.ndarray:
        """Feed positions ``[past_len, past_len + len(inputs))``; returns hidden rows or tail logits."""
        first, n = self.past_len, int(inputs.shape[0])
        name = TOKEN_IDS if self.spec.effective_start == 0 else HIDDEN
        out_name = LOGITS if self.spec.is_tail else HIDDEN
        if n == 1 and first > 0:  # decode fast path
            head = pb.DecodeStep(idempotency_step=step.next(), position=first, expected_past_len=first)
            self._send(wire.request_decode(head, name, inputs))
            _, tensors = self._recv(step_deadline_s)
            self.past_len = first + 1
            return self._output(tensors, out_name, 1)
        plan = plan_prefill_chunks(n, self.spec.chunk_tokens)
        outs = []
        for index, (offset, count) in enumerate(plan):
            s = self.spec
            idem = step.next()
            env = pb.Envelope(
                schema_version=SCHEMA_VERSION, work_id=f"{s.session_id}:{s.epoch}:{idem}",
                route_session_id=s.session_id, route_epoch=s.epoch, fingerprint=s.fingerprint,
                shard_range=pb.ShardRange(start_layer=s.start, end_layer=s.end, effective_start_layer=s.effective_start),
                phase=pb.PHASE_PREFILL,
                position=pb.PositionSpan(first_position=first + offset, token_count=count),
                idempotency_step=idem,
                cache_expectation=pb.CacheExpectation(mode=pb.CACHE_MODE_PREFILL, expected_past_len=first + offset),
                chunk=pb.ChunkInfo(chunk_index=index, chunk_count=len(plan), final_chunk=index == len(plan) - 1))
            self._send(wire.request_chunk(env, {name: inputs[offset:offset + count]}))
            _, tensors = self._recv(step_deadline_s)
            self.past_len = first + offset + count
            outs.append(self._output(tensors, out_name, count))
        return outs[-1] if self.spec.is_tail else np.concatenate(outs, axis=0)

    def _output(self, tensors: dict[str, np.ndarray], name: str, rows: int) -> np.ndarray:
        out = tensors.get(name)
        if out is None:
            raise self._fail(f"the response carries no {name!r} tensor", pb.ERROR_CODE_PROTOCOL_VIOLATION)
        if name == HIDDEN and (out.ndim != 2 or out.shape[0] != rows):
            raise self._fail(f"hidden output of shape {out.shape}, expected {rows} rows",
                             pb.ERROR_CODE_PROTOCOL_VIOLATION)
        return out

    def cancel_call(self) -> None:
        """Cut the call (watchdog / cancellation); a blocked ``run`` raises HopFailure."""
        if self._call is not None:
            self._call.cancel()

    def close(self, *, release: bool) -> None:
        """Release the session (in-stream if alive, else by unary RPC) and close the channel."""
        s = self.spec
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
                                              route_epoch=s.epoch), timeout=RELEASE_TIMEOUT_S)
                    except grpc.RpcError:
                        pass  # a dead hop holds nothing worth releasing; its TTL cleans up
        finally:
            self._queue.finish()
            if self._call is not None:
                self._call.cancel()
            self.channel.close()
            self.window = None


class StepCounter:
    """Idempotency steps: strictly increasing across every hop and epoch of one generation."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def next(self) -> int:
        self.value += 1
        return self.value
