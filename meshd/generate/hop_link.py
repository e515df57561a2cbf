"""One hop's Session stream as seen from the entry node (blocking; used in the driver's thread).

A ``HopLink`` owns one bidi ``Session`` call to one worker: it opens the
session (route session id + *this hop's* epoch, and for the tail what to
send back), sends prefill chunks and decode steps, and returns the hop's
output: hidden rows, or the tail's ``TailOut`` (the token it drew, with
logprobs and the logits row only when the route driver asked). Every way a
hop can fail -- the peer refused (ShardStatus), the stream ended, the
transport broke, the watchdog cut a call past its step deadline -- surfaces
as ``HopFailure`` naming the hop, so the route driver has exactly one thing
to catch. A cut call fails with code DEADLINE_EXCEEDED.

Transport: the link is given how to connect (``connect()``: a
proto.hop_transport.HopTransport -- gRPC pinned to the peer's advertised
certificate, its framed TLS port, loopback plaintext or the frame socket of
the daemon's own worker, a relayed circuit, see ``routes.PeerConnector``; in
tests, a worker in memory) and connects when it is first opened, so that a
dead peer fails inside the driver's step loop like any other hop failure.

State: the call, its bounded send queue, the credit window, ``past_len``
(positions this hop's KV holds for the session), the step deadlines derived
from what this link measured (deadlines.py), the deadline of the call in
flight (read by the driver's watchdog) and ``received_bytes`` (every
response body, for the driver's bytes-per-step figures).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np

from meshd.errors import HopFailure
from meshd.generate.deadlines import StepDeadlines
from meshd.generate.receipt_check import ReceiptCheck
from proto import shard_runtime_pb2 as pb
from proto import wire
from proto.chunking import plan_prefill_chunks
from proto.errors import LocalError, MeshdError
from proto.fastpath import read_decode_response
from proto.flow import CreditWindow
from proto.frames import SCHEMA_VERSION, parse_response
from proto.hop_transport import HopStream, HopTransport, TransportError, Unary
from proto.receipts import HISTORY_START, Delegation, SignedReceipt
from proto.tensors import decode_bundle
from proto.threads import ThreadGroup
from proto.zerocopy import read_response
from shard.session.stream import HIDDEN, LOGITS, SMALL_FRAME_BYTES, TOKEN_IDS

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
    accepted: int | None = None   # a verify step's verdict: drafted tokens accepted before ``sample``


class HopLink:
    """One hop's Session stream (see the module doc); ``connect()`` gives its transport when opened."""

    def __init__(self, index: int, spec: LinkSpec, connect: Callable[[], HopTransport], *,
                 patience: float = 1.0) -> None:
        self.index, self.spec, self._connect = index, spec, connect
        self.transport: HopTransport | None = None
        self._stream: HopStream | None = None
        self._cut = False
        self.window: CreditWindow | None = None
        self.past_len = 0
        self.deadline = 0.0         # monotonic time after which the watchdog cuts the call (0: idle)
        self.step_timeout = 0.0     # the deadline in flight, in seconds (for the failure's message)
        self.deadlines = StepDeadlines(patience)
        self.received_bytes = 0
        self.execution_ns = 0       # the hop's own compute of its last step (DecodeResult/Ack)
        # Step receipts (receipt_check.py): how to check them (set by the driver before open; None:
        # not checked), the hop's certified key, and the verified receipts of the last ``run``.
        self.receipt_check: ReceiptCheck | None = None
        self.delegation: Delegation | None = None
        self.receipts: list[SignedReceipt] = []
        self.history = HISTORY_START        # the chain of this session's input digests, as receipted
        self._receipting = False

    # ------------------------------------------------------------------ helpers
    def fail(self, detail: str, code: int = pb.ERROR_CODE_INTERNAL, retry_after_ms: int = 0) -> HopFailure:
        """A HopFailure naming this hop."""
        return HopFailure(self.index, self.spec.peer_id, detail, code, retry_after_ms)

    @property
    def stream(self) -> HopStream:
        """The open Session stream (a LocalError before ``open``: a bug of the caller)."""
        if self._stream is None:
            raise LocalError(f"hop {self.index}: no stream is open")
        return self._stream

    def _send(self, body: bytes, *, work: bool = True) -> None:
        if work and self.window is not None:
            self.window.consume(len(body))
        self.stream.send(body)

    def _recv(self, timeout_s: float) -> tuple[pb.SessionResponse, dict[str, np.ndarray]]:
        self.step_timeout = timeout_s
        self.deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    body = self.stream.receive()
                except TransportError as exc:
                    if self._cut:
                        raise self.fail(f"silent past its step deadline ({self.step_timeout:.1f} s)",
                                        pb.ERROR_CODE_DEADLINE_EXCEEDED) from exc
                    raise self.fail(f"transport: {exc.status.value}") from exc
                if body is None:
                    raise self.fail("the stream ended", pb.ERROR_CODE_PROTOCOL_VIOLATION)
                self.received_bytes += len(body)
                try:
                    resp, tensors = read_answer(body)
                except MeshdError as exc:
                    raise self.fail(f"bad response: {exc}", pb.ERROR_CODE_PROTOCOL_VIOLATION) from exc
                kind = resp.WhichOneof("kind")
                if kind == "flow_control":
                    if self.window is not None:
                        self.window.on_grant(resp.flow_control.credits_granted)
                    continue
                if kind == "status":
                    err = resp.status.error
                    name = pb.ErrorCode.Name(err.code) if err.code in pb.ErrorCode.values() else str(err.code)
                    raise self.fail(f"{name}: {err.detail}", err.code, err.retry_after_ms)
                if kind in ("chunk", "decode", "ack") and self.window is not None and self.window.inflight:
                    self.window.on_ack()
                return resp, tensors
        finally:
            self.deadline = 0.0

    def connect(self) -> HopTransport:
        """This hop's transport, made on first use; a peer that cannot be reached is a HopFailure."""
        if self.transport is None:
            try:
                self.transport = self._connect()
            except MeshdError as exc:  # e.g. CertificateMismatch, unreachable endpoint, relayed hop
                detail = exc.detail if isinstance(exc, HopFailure) else f"cannot connect: {exc}"
                raise self.fail(detail) from exc
        return self.transport

    # ------------------------------------------------------------------ protocol
    def open(self) -> None:
        resp = self._open_session()
        if self.receipt_check is not None:
            try:
                self.delegation = self.receipt_check.delegation(self.spec.peer_id, resp.accepted)
            except MeshdError as exc:
                raise self.fail(f"receipt key: {exc}", pb.ERROR_CODE_PAYLOAD_CORRUPT) from exc
            self._receipting = True
        self.window = CreditWindow(resp.accepted.flow_control)

    def _receipt(self, holder, first: int, inputs: np.ndarray, output: np.ndarray | None) -> None:
        """Check the receipt that came with one answer (receipt_check.py); a lie is a HopFailure."""
        if not self._receipting or self.receipt_check is None:
            return
        s = self.spec
        try:
            signed = self.receipt_check.receipt(
                self.delegation, bytes(getattr(holder, "receipt", b"")), peer_id=s.peer_id, session_id=s.session_id,
                epoch=s.epoch, start=s.effective_start, end=s.end, first=first, inputs=inputs,
                output=output, history=self.history)
        except MeshdError as exc:
            raise self.fail(f"step receipt: {exc}", pb.ERROR_CODE_PAYLOAD_CORRUPT) from exc
        if signed is not None:
            self.receipts.append(signed)
            self.history = signed.receipt.history_sha256

    def _open_session(self, **extra) -> pb.SessionResponse:
        """Connect, start the Session stream and open this hop's session (``extra``: more SessionOpen
        fields); the SessionAccepted, or a HopFailure."""
        s = self.spec
        transport = self.connect()
        try:   # a frame transport connects here (gRPC connects lazily): the same one failure type
            self._stream = transport.open_session()
        except TransportError as exc:
            raise self.fail(f"transport: {exc}") from exc
        except MeshdError as exc:   # CertificateMismatch: unreachable, or not the peer its record names
            raise self.fail(f"cannot connect: {exc}", pb.ERROR_CODE_PROTOCOL_VIOLATION) from exc
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
            raise self.fail("expected SessionAccepted", pb.ERROR_CODE_PROTOCOL_VIOLATION)
        if resp.accepted.past_len != 0:
            raise self.fail(f"a new session starts with {resp.accepted.past_len} cached positions",
                            pb.ERROR_CODE_PROTOCOL_VIOLATION)
        return resp

    @property
    def is_open(self) -> bool:
        return self.window is not None

    def run(self, inputs: np.ndarray, step: StepCounter) -> np.ndarray | TailOut:
        """Feed positions ``[past_len, past_len + len(inputs))``; returns hidden rows or the tail's answer."""
        first, n = self.past_len, int(inputs.shape[0])
        name = TOKEN_IDS if self.spec.effective_start == 0 else HIDDEN
        self.receipts = []
        if n == 1 and first > 0:  # decode fast path
            head = pb.DecodeStep(idempotency_step=step.next(), position=first, expected_past_len=first)
            self._send(wire.request_decode(head, name, inputs))
            t0 = time.monotonic()
            resp, tensors = self._recv(self.deadlines.decode_s())
            self.deadlines.decode_done(time.monotonic() - t0)
            self.execution_ns = resp.decode.execution_nanos
            self.past_len = first + 1
            answer = self._output(resp.decode, tensors, 1)
            self._receipt(resp.decode, first, inputs, answer if isinstance(answer, np.ndarray) else None)
            return answer
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
            if resp.WhichOneof("kind") == "chunk":   # (an Ack answers an old duplicate: no receipt)
                rows = outs[-1] if self.spec.returns_rows else None
                self._receipt(resp.chunk, first + offset, inputs[offset:offset + count],
                              rows if isinstance(rows, np.ndarray) else None)
        # returns_rows: every output is an array of rows (_output)
        return np.concatenate(cast(list[np.ndarray], outs), axis=0) if self.spec.returns_rows else outs[-1]

    def verify(self, inputs: np.ndarray, drafts: tuple[int, ...], step: StepCounter) -> np.ndarray | TailOut:
        """Feed the last token and ``drafts`` (``inputs``: their 1 + len(drafts) rows) as one verify
        chunk (speculative decoding); returns hidden rows, or the tail's verdict and next token.
        The hop keeps every position until ``roll_back`` names how many the tail accepted."""
        first, n = self.past_len, int(inputs.shape[0])
        if n != len(drafts) + 1 or first == 0:
            raise LocalError(f"a verify step carries 1 + {len(drafts)} positions after the prompt, got {n} at {first}")
        s, idem = self.spec, step.next()
        env = pb.Envelope(
            schema_version=SCHEMA_VERSION, work_id=f"{s.session_id}:{s.epoch}:{idem}",
            route_session_id=s.session_id, route_epoch=s.epoch, fingerprint=s.fingerprint,
            shard_range=pb.ShardRange(start_layer=s.start, end_layer=s.end, effective_start_layer=s.effective_start),
            phase=pb.PHASE_DECODE, position=pb.PositionSpan(first_position=first, token_count=n),
            idempotency_step=idem,
            cache_expectation=pb.CacheExpectation(mode=pb.CACHE_MODE_DECODE, expected_past_len=first),
            verify=pb.VerifyDrafts(draft_token_ids=drafts))
        name = TOKEN_IDS if s.effective_start == 0 else HIDDEN
        self._send(wire.request_chunk(env, {name: inputs}))
        t0 = time.monotonic()
        resp, tensors = self._recv(self.deadlines.chunk_s(n))
        self.deadlines.chunk_done(n, time.monotonic() - t0)
        self.execution_ns = 0
        self.past_len = first + n
        out = self._output(resp.chunk, tensors, n)
        if isinstance(out, TailOut):
            if not resp.chunk.HasField("verify") or resp.chunk.verify.accepted > len(drafts):
                raise self.fail("the tail sent no valid verdict on a verify step", pb.ERROR_CODE_PROTOCOL_VIOLATION)
            out = TailOut(out.sample, out.logits, int(resp.chunk.verify.accepted))
        return out

    def roll_back(self, length: int) -> None:
        """The route kept ``length`` positions of the last verify step: the next step says so (its
        expected past length), and the hop drops the rest before it runs (no round trip here)."""
        if not 0 < length <= self.past_len:
            raise LocalError(f"hop {self.index}: cannot roll {self.past_len} positions back to {length}")
        self.past_len = length

    def _output(self, holder, tensors: dict[str, np.ndarray], rows: int) -> np.ndarray | TailOut:
        if self.spec.returns_rows:
            out = tensors.get(HIDDEN)
            if out is None or out.ndim != 2 or out.shape[0] != rows:
                got = "none" if out is None else str(out.shape)
                raise self.fail(f"hidden output of shape {got}, expected {rows} rows",
                                pb.ERROR_CODE_PROTOCOL_VIOLATION)
            return out
        tail = self.spec.tail
        if not holder.HasField("sample"):
            raise self.fail("the tail sent no sampled token", pb.ERROR_CODE_PROTOCOL_VIOLATION)
        logits = tensors.get(LOGITS)
        if tail is not None and tail.return_logits and logits is None:
            raise self.fail("the tail sent no logits although asked", pb.ERROR_CODE_PROTOCOL_VIOLATION)
        return TailOut(holder.sample, logits)

    def cut(self) -> None:
        """The watchdog's cut: the blocked ``run`` raises HopFailure(DEADLINE_EXCEEDED)."""
        self._cut = True
        self.cancel_call()

    def cancel_call(self) -> None:
        """Cut the stream (cancellation); a blocked ``run`` raises HopFailure."""
        if self._stream is not None:
            self._stream.cancel()

    def _cut_after(self, closed: threading.Event) -> None:
        """The close's guard: cut the call unless the close is done within RELEASE_TIMEOUT_S."""
        if not closed.wait(RELEASE_TIMEOUT_S):
            self.cancel_call()

    def close(self, *, release: bool) -> None:
        """Release the session (in-stream if alive, else by the unary call) and close the transport."""
        if self.transport is None:
            return                      # never connected: nothing to release or close
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
                        self.transport.unary(Unary.RELEASE, pb.ReleaseRequest(
                            schema_version=SCHEMA_VERSION, route_session_id=s.session_id, route_epoch=s.epoch,
                            owner_token=s.owner_token).SerializeToString(), RELEASE_TIMEOUT_S)
                    except MeshdError:
                        # A dead hop holds nothing worth releasing (its TTL cleans up); a frozen or
                        # gone one cannot even show its certificate (CertificateMismatch) to the
                        # gRPC fallback of a frames transport; the Unix socket carries no unary call.
                        pass
        finally:
            guard.close()
            if self._stream is not None:
                self._stream.close_send()
                self._stream.cancel()
            self.transport.close()
            self.window = None


def read_answer(body: bytes) -> tuple[pb.SessionResponse, dict[str, np.ndarray]]:
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
