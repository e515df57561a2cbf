"""Sans-I/O core of one Session stream: request bytes in, response bytes and push actions out.

One ``SessionStream`` per gRPC bidi call, frame connection or relay circuit.
It never touches a socket or a thread: ``receive(frame_body)`` returns, in
order, the response bodies to send and the push actions to carry out. The
edges (shard/edges/) only move bytes; they hand whatever ``receive`` returns
to shard/push/actions.py, which carries the actions out (h11 style: the core
says what happens, the edge does it) and gives back the bodies to send.

Push actions (a pushed session's work leaves through the push machinery, not
as this stream's answer):

    OpenPushed      the entry opened a pushed session (KV open): register it, then
                    send ``accepted``; if it cannot be registered, ``undo_open``
    AttachFeeder    the upstream hop asks to feed a pushed session: find it, check
                    the feeder, then ``feeder_attached`` answers (or the open is refused)
    PushChunk       a pushed prefill chunk ran: the tail answers the entry, others push on
    PushDecode      a pushed decode step ran: likewise, one leg more
    Repoint         the entry names a replacement successor
    ReleasePushed   the entry released the session (its KV is already freed)

The edge records what it registered with ``attach_push(handle, role)``; the
core keeps that handle without looking into it and remembers the role
(``control``: the entry's stream; ``feed``: the upstream hop's), which
decides what the stream may still receive. A failure while an action is
carried out ends the stream like a failure here (``fail``).

States and transitions (one table, the rules of the stream):

    AWAIT_OPEN --open ok--> OPEN --release/cancel--> CLOSED
    AWAIT_OPEN --anything else / refused open--> CLOSED (terminal ShardStatus)
    OPEN --chunk | decode | flow_control--> OPEN
    OPEN --frame-level error--> CLOSED (terminal ShardStatus)

Frame-level errors (unparseable or oversized bytes, tensors whose bytes fail
to decode -- checksum, declared sizes over a limit --, a chunk without credit,
a message the state does not allow, identity fields that contradict the
SessionOpen) end the stream with a terminal ShardStatus: the peer's framing
can no longer be trusted. Work-level refusals (CACHE_MISS, EPOCH_STALE,
DEADLINE_EXCEEDED, a tensor of the wrong name/shape/dtype/token range,
INTERNAL...) answer that one piece of
work with a non-terminal ShardStatus and the stream stays usable. Nothing a
peer sends here touches another stream's sessions.

Our own failures: an exception that is neither a protocol error nor one of
our refusals (a bug, a backend failure outside the session manager) ends
this stream with a typed terminal ShardStatus (``map_failure``: INTERNAL, or
RESOURCE_EXHAUSTED for a real lack of memory) and is logged with its
traceback in the worker's log; it never ends the worker.

Ownership: the edge tells the stream who is on the other end (``peer``: the
client address on the TLS port, "local" on the worker's private edges) and
whether it is a private edge (``private``: the Unix frame socket, loopback
gRPC), where the node's own daemon may name the relayed circuit's Noise peer
id in ``SessionOpen.relayed_peer_id``; elsewhere that field is ignored. The
open's ``owner_token`` (required on non-private edges) and that peer are the
session's Owner (shard/session/sessions.py); in-stream release and cancel act as the
stream's owner.

Tail: a tail opened with ``TailOptions.sample`` draws the next token itself
(shard/model/sampling.py: a pure function of the seed and the token's position, so
a replacement tail draws the same one) on decode steps and on a prompt's
final chunk, and answers with a ``TailSample`` (plus logprobs, top
alternatives or the logits row only when the open asked for them); a tail
that does not sample answers with the logits row.

Verify (speculative decoding): a chunk whose envelope carries ``verify`` holds
the last token plus drafted tokens. Every hop runs all of its positions as one
step and remembers that the positions after the first may be dropped: the next
step's expected_past_len says how many survived (shard/session/sessions.py
rolls the cache back), so no hop needs a round trip of its own. The tail draws
its token at every position exactly as a decode step would (the draw for
position p, from that position's logits row), accepts the drafted tokens while
they equal its draws, and answers with the count (``VerifyResult``) and the
token after them: the accepted tokens are the ones plain decoding would have
drawn. Tokens only: a verify chunk on a tail asked for logprobs or logits, or
on a pushed session, is refused (PROTOCOL_VIOLATION, the stream stays usable).

Flow control: each chunk/decode consumes one credit granted in
SessionAccepted; credits are returned in batches (a FlowControl response when
the peer's outstanding credit falls to half the window).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from proto import fastpath, wire
from proto import shard_runtime_pb2 as pb
from proto.errors import MeshdError, PayloadCorrupt, ProtocolError, ProtocolViolation
from proto.flow import CreditLedger, negotiate
from proto.frames import SCHEMA_VERSION, check_schema_version, parse_request
from proto.limits import MAX_DRAFT_TOKENS
from proto.receipts import HISTORY_START, chain_history, rows_digest, tail_digest
from proto.tensors import decode_bundle, decode_tensor
from proto.zerocopy import read_request
from shard.errors import (
    Cancelled,
    DeadlineExceeded,
    FingerprintMismatch,
    RangeMismatch,
    ShardRefusal,
    log_failure,
    map_failure,
    to_shard_error,
)
from shard.model.artifact import fingerprints_match
from shard.model.sampling import SamplingSpec, check_top_logprobs, sample_token, token_logprobs
from shard.session.service import ACCEPTED_COMPRESSION, ShardService
from shard.session.sessions import LOCAL_OWNER, Owner, SessionKey, StepResult

log = logging.getLogger(__name__)

# Boundary tensor names (contract with every driver).
TOKEN_IDS = "token_ids"
HIDDEN = "h"
LOGITS = "logits"

# Below this size a frame is parsed and built by protobuf directly (fewer Python
# steps: a decode step is ~2-5 KB); above it the zero-copy codec saves copying
# large activation payloads.
SMALL_FRAME_BYTES = 64 * 1024

AWAIT_OPEN, OPEN, CLOSED = "await_open", "open", "closed"
# Which request kinds each state accepts; anything else is a ProtocolViolation.
ALLOWED = {
    AWAIT_OPEN: {"open"},
    OPEN: {"chunk", "decode", "flow_control", "release", "cancel", "repoint"},
    CLOSED: set(),
}


# The handler method of each request kind.
_HANDLERS = {"open": "_on_open", "chunk": "_on_chunk", "decode": "_on_decode", "flow_control": "_on_flow_control",
             "release": "_on_release", "cancel": "_on_cancel", "repoint": "_on_repoint"}


def read_small_or_large(data: bytes) -> tuple[pb.SessionRequest | fastpath.DecodeStepView, dict[str, np.ndarray]]:
    """Parse a request and decode its tensors (same checks either way; see SMALL_FRAME_BYTES).
    A plain decode step is read by hand (proto.fastpath); anything else by protobuf."""
    if len(data) > SMALL_FRAME_BYTES:
        return read_request(data)
    if data[:1] == b"\x1a":
        fast = fastpath.read_decode_request(data)
        if fast is not None:
            return fast
    req = parse_request(data)
    kind = req.WhichOneof("kind")
    if kind == "decode":
        return req, {req.decode.tensor.name: decode_tensor(req.decode.tensor)}
    if kind == "chunk":
        return req, decode_bundle(req.chunk.bundle)
    return req, {}


def status_frame(exc: BaseException, *, terminal: bool, work_id: str = "", session_id: str = "",
            step: int = 0) -> bytes:
    return pb.SessionResponse(status=pb.ShardStatus(
        work_id=work_id, route_session_id=session_id, idempotency_step=step,
        error=to_shard_error(exc), terminal=terminal)).SerializeToString()


class TailAnswer:
    """A tail step's payload: tensors to send (the logits row, when asked) and the drawn token
    (``token``; ``sample`` is the full TailSample only when logprobs were asked for)."""

    __slots__ = ("tensors", "token", "_sample", "accepted")

    def __init__(self, tensors: dict[str, np.ndarray], token: int | None,
                 sample: pb.TailSample | None = None, accepted: int | None = None) -> None:
        self.tensors, self.token, self._sample = tensors, token, sample
        self.accepted = accepted   # a verify step's verdict: the drafted tokens accepted before ``token``

    @property
    def sample(self) -> pb.TailSample | None:
        if self._sample is None and self.token is not None:
            self._sample = pb.TailSample(token_id=self.token)
        return self._sample

    @property
    def plain_token(self) -> int | None:
        """The token when the sample is nothing else (no logprobs): the fast writer's case."""
        return self.token if self._sample is None else None


def _parts(payload) -> tuple[dict[str, np.ndarray], pb.TailSample | None]:
    if isinstance(payload, TailAnswer):
        return payload.tensors, payload.sample
    return payload or {}, None


def decode_answer(step: int, past_len: int, duplicate: bool, execution_nanos: int, payload, legs: int = 0,
                  receipt: bytes = b"") -> bytes:
    """The SessionResponse{decode} of one step: by hand when it is a plain one (proto.fastpath),
    else through protobuf and proto.wire (a sample with logprobs, q8, several tensors...)."""
    if isinstance(payload, TailAnswer):
        tensors, token = payload.tensors, payload.plain_token
        if token is not None or payload.token is None:
            body = fastpath.decode_response_bytes(step, past_len, duplicate, execution_nanos, tensors=tensors,
                                                  token_id=token, legs=legs, receipt=receipt)
            if body is not None:
                return body
        sample = payload.sample
    else:
        tensors, sample = payload or {}, None
        body = fastpath.decode_response_bytes(step, past_len, duplicate, execution_nanos, tensors=tensors,
                                              legs=legs, receipt=receipt)
        if body is not None:
            return body
    head = pb.DecodeResult(idempotency_step=step, past_len=past_len, duplicate=duplicate,
                           execution_nanos=execution_nanos, legs=legs, receipt=receipt)
    if sample is not None:
        head.sample.CopyFrom(sample)
    return wire.response_decode(head, tensors)


# How the owner's peer is spelled when the daemon names a relayed circuit's peer.
RELAYED_PEER_PREFIX = "noise:"

# Roles of a pushed session's streams (see the module doc).
CONTROL, FEED = "control", "feed"


# -- push actions: what the edge carries out (shard/push/actions.py) ----------------------
@dataclass(frozen=True, slots=True)
class OpenPushed:
    """The entry opened a pushed session on this stream (its KV is open)."""

    key: SessionKey
    open: pb.SessionOpen
    accepted: bytes           # the answer to send once the session is registered


@dataclass(frozen=True, slots=True)
class AttachFeeder:
    """The upstream hop asks to feed the pushed session ``key`` (ranges already checked)."""

    key: SessionKey
    open: pb.SessionOpen
    owner: Owner


@dataclass(frozen=True, slots=True)
class PushChunk:
    """A pushed prefill chunk ran; ``envelope`` is the answer's (token count set)."""

    envelope: pb.Envelope
    tensors: dict
    sample: pb.TailSample | None


@dataclass(frozen=True, slots=True)
class PushDecode:
    """A pushed decode step ran (``result``: the manager's StepResult)."""

    step: pb.DecodeStep
    result: StepResult


@dataclass(frozen=True, slots=True)
class Repoint:
    """The entry names a replacement successor for this hop."""

    target: pb.PushTarget


@dataclass(frozen=True, slots=True)
class ReleasePushed:
    """The entry released the pushed session (its KV is freed already)."""


PushAction = OpenPushed | AttachFeeder | PushChunk | PushDecode | Repoint | ReleasePushed
Output = bytes | PushAction


class SessionStream:
    def __init__(self, service: ShardService, *, wall_ns: Callable[[], int] = time.time_ns,
                 peer: str = LOCAL_OWNER.peer, private: bool = True) -> None:
        self.service = service
        self.wall_ns = wall_ns
        self.peer, self.private = peer, private
        self.owner: Owner = LOCAL_OWNER
        self.state = AWAIT_OPEN
        self.key: SessionKey | None = None
        self.effective_start = 0
        self.tail = pb.TailOptions()
        self.sampling: SamplingSpec | None = None   # the tail samples (a pure function of seed and position)
        self.ledger: CreditLedger | None = None
        self.push: object | None = None   # what the edge registered for a pushed session (opaque here)
        self.push_role = ""               # CONTROL (the entry's stream), FEED (the upstream hop's) or ""
        self._signed: bytes | None = None  # the last step's signed receipt (service.receipts set)
        self._history = HISTORY_START      # the chain of the session's input digests (receipts)

    @property
    def closed(self) -> bool:
        return self.state == CLOSED

    @property
    def open_key(self) -> SessionKey:
        """The session this stream opened (every state after AWAIT_OPEN has one)."""
        if self.key is None:
            raise ProtocolViolation("no session is open on this stream")
        return self.key

    @property
    def open_ledger(self) -> CreditLedger:
        """The open session's credits (set with the key)."""
        if self.ledger is None:
            raise ProtocolViolation("no session is open on this stream")
        return self.ledger

    # -- entry point -------------------------------------------------------------------
    def receive(self, data: bytes) -> Sequence[Output]:
        """Handle one request body; returns the response bodies to send and the push actions to
        carry out, in order."""
        if self.state == CLOSED:
            return []
        session_id = self.key.session_id if self.key else ""
        kind = None
        try:
            req, tensors = read_small_or_large(data)
            kind = req.WhichOneof("kind")
            if kind not in ALLOWED[self.state]:
                raise ProtocolViolation(f"a {kind} message is not allowed in state {self.state}")
            if kind == "decode" or kind == "chunk":
                self.open_ledger.on_chunk(len(data))
            return getattr(self, _HANDLERS[kind])(req, tensors)
        except Exception as exc:  # noqa: BLE001 - fail() maps every failure to a typed error answer
            return self.fail(exc, f"handling the {kind} message" if kind else "reading a request", session_id)

    def fail(self, exc: Exception, doing: str, session_id: str) -> list[bytes]:
        """End this stream with a terminal ShardStatus for ``exc`` (raised while ``doing``).

        A protocol error, a refused open or a cancel is answered as it is; anything else is our
        bug, logged with its traceback and answered as a typed failure: it ends this stream
        only, never the worker."""
        self.state = CLOSED
        if not isinstance(exc, (ProtocolError, ShardRefusal)):
            doing += f" of session {session_id[:32]}" if session_id else ""
            log_failure(log, exc, doing)
            exc = map_failure(exc, doing)
        return [status_frame(exc, terminal=True, session_id=session_id)]

    # -- what the edge reports back while carrying out push actions ------------------------
    def attach_push(self, handle: object, role: str) -> None:
        """The edge registered this stream's pushed session as ``handle``; ``role``: CONTROL or FEED."""
        self.push, self.push_role = handle, role

    def undo_open(self) -> None:
        """The pushed session this stream opened could not be registered: free its KV, close."""
        self.state = CLOSED
        with self.service.lock:
            self.service.manager.release(self.open_key, self.owner)

    def feeder_attached(self, handle: object, *, effective_start: int, tail: pb.TailOptions,
                        sampling: SamplingSpec | None, open_msg: pb.SessionOpen) -> list[bytes]:
        """The edge found the pushed session the upstream hop may feed: this stream carries its
        inputs from now on (answered with credits and refusals only)."""
        key = SessionKey(open_msg.route_session_id, int(open_msg.route_epoch))
        with self.service.lock:
            past_len = self.service.manager.past_len(key) or 0
        flow = negotiate(open_msg.proposed_flow_control, self.service.local_flow)
        self.ledger = CreditLedger(flow)
        self.key, self.effective_start, self.tail = key, effective_start, tail
        self.sampling, self.state = sampling, OPEN
        self.attach_push(handle, FEED)
        return [pb.SessionResponse(accepted=pb.SessionAccepted(
            schema_version=SCHEMA_VERSION, route_session_id=key.session_id, route_epoch=key.epoch,
            flow_control=flow, fingerprint=self.service.backend.fingerprint,
            past_len=past_len)).SerializeToString()]

    # -- open ---------------------------------------------------------------------------
    def _on_open(self, req: pb.SessionRequest, _tensors) -> Sequence[Output]:
        o = req.open
        check_schema_version(o.schema_version)
        backend = self.service.backend
        if not fingerprints_match(o.fingerprint, backend.fingerprint):
            raise FingerprintMismatch("artifact or recipe digest differs from this shard's")
        lr = backend.layer_range
        r = o.shard_range
        if (r.start_layer, r.end_layer) != (lr.start, lr.end) or not lr.start <= r.effective_start_layer < lr.end:
            raise RangeMismatch(f"this shard serves layers [{lr.start}, {lr.end}) of {lr.num_layers}")
        key = SessionKey(o.route_session_id, int(o.route_epoch))
        if not self.private and not o.owner_token:
            raise ProtocolViolation("SessionOpen needs an owner_token on this port")
        peer = RELAYED_PEER_PREFIX + o.relayed_peer_id if self.private and o.relayed_peer_id else self.peer
        owner = Owner.of(peer, o.owner_token)
        if o.push_feed:
            return [AttachFeeder(key, o, owner)]
        sampling = None
        hidden = lr.is_tail and o.tail.return_hidden    # embeddings: the normed rows, not a token
        if hidden and (o.tail.sample or o.push):
            raise ProtocolViolation("return_hidden goes with neither sample nor push")
        if lr.is_tail and o.tail.sample:
            sampling = SamplingSpec.from_pb(o.tail.sampling)
            check_top_logprobs(int(o.tail.top_logprobs))
        with self.service.lock:
            past_len = self.service.manager.open(key, int(o.max_tokens), owner, hidden_out=hidden)
        flow = negotiate(o.proposed_flow_control, self.service.local_flow)
        self.ledger = CreditLedger(flow)
        self.key, self.effective_start, self.tail, self.state = key, r.effective_start_layer, o.tail, OPEN
        self.sampling, self.owner = sampling, owner
        accepted = pb.SessionResponse(accepted=pb.SessionAccepted(
            schema_version=SCHEMA_VERSION, route_session_id=key.session_id, route_epoch=key.epoch,
            flow_control=flow, accepted_compression=ACCEPTED_COMPRESSION,
            fingerprint=backend.fingerprint, past_len=past_len,
            receipt_key=self._receipt_key())).SerializeToString()
        return [OpenPushed(key, o, accepted)] if o.push else [accepted]

    # -- work ----------------------------------------------------------------------------
    def _input(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        name = TOKEN_IDS if self.effective_start == 0 else HIDDEN
        if len(tensors) != 1 or name not in tensors:
            raise PayloadCorrupt(f"expected exactly one tensor named {name!r}, got {sorted(tensors)}")
        return tensors[name]

    def _poster(self, draw_at: int | None) -> Callable[[np.ndarray], TailAnswer | dict[str, np.ndarray]]:
        """What a step returns: hidden rows, or the tail's answer -- the token drawn for position
        ``draw_at`` (decode steps and a prompt's final chunk; None: no draw), and the logits row
        when asked (or when the tail does not sample)."""
        if not self.service.backend.layer_range.is_tail or self.tail.return_hidden:
            return lambda output: {HIDDEN: output}
        spec, tail = self.sampling, self.tail

        def post(output: np.ndarray) -> TailAnswer:
            token = sample = None
            if spec is not None and draw_at is not None:
                token = sample_token(output, spec, draw_at)
                if tail.logprobs or tail.top_logprobs:
                    logprob, top = token_logprobs(output, token, int(tail.top_logprobs))
                    sample = pb.TailSample(token_id=token, logprob=logprob)
                    sample.top.extend(pb.TokenLogprob(token_id=i, logprob=v) for i, v in top)
            return TailAnswer({LOGITS: output} if tail.return_logits or spec is None else {}, token, sample)
        return post

    def _verifier(self, first: int,
                  drafts: Sequence[int]) -> Callable[[np.ndarray], TailAnswer | dict[str, np.ndarray]]:
        """A verify step's answer (module doc): hidden rows before the tail; at the tail, the count of
        drafted tokens equal to the draws at their positions, and the draw after them."""
        if not self.service.backend.layer_range.is_tail:
            return lambda output: {HIDDEN: output}
        spec = self.sampling
        if spec is None or self.tail.return_logits or self.tail.logprobs or self.tail.top_logprobs:
            raise ProtocolViolation("a verify chunk needs a sampling tail that returns tokens only")

        def post(rows: np.ndarray) -> TailAnswer:
            if rows.ndim != 2 or rows.shape[0] != len(drafts) + 1:
                raise ProtocolViolation(f"the backend gave logits of shape {rows.shape} for a verify step")
            accepted = 0
            token = sample_token(rows[0], spec, first + 1)
            while accepted < len(drafts) and token == drafts[accepted]:
                accepted += 1
                token = sample_token(rows[accepted], spec, first + accepted + 1)
            return TailAnswer({}, token, accepted=accepted)
        return post

    def _run(self, *, step: int, position: int, expected: int, tensors, deadline: int, draw_at: int | None,
             drafts: Sequence[int] | None = None):
        if deadline and self.wall_ns() > deadline:
            raise DeadlineExceeded("the work's deadline passed before it ran")
        inputs = self._input(tensors)
        # A sampling tail that returns no logits only reads them to draw: the backend may lend them.
        lend = self.sampling is not None and not self.tail.return_logits
        post = self._poster(draw_at) if drafts is None else self._verifier(position, drafts)
        self._signed = None
        if self.service.receipts is not None and self.push is None:   # a pushed answer carries none (yet)
            post = self._digesting(post, inputs, position)
        with self.service.lock:
            return self.service.manager.step(
                self.open_key, step=step, position=position, expected_past_len=expected, inputs=inputs,
                effective_start=self.effective_start, post=post, lend=lend, verify=drafts is not None)

    # -- step receipts (proto/receipts.py) ---------------------------------------------------
    def _receipt_key(self) -> pb.KeyDelegation | None:
        signer = self.service.receipts
        return signer.delegation.to_pb() if signer is not None else None

    def _digesting(self, post: Callable, inputs: np.ndarray, position: int) -> Callable:
        """``post`` that also signs the step's receipt: the output is hashed inside the forward's
        post-processing, while a lent logits buffer is still this step's."""
        signer, key, start = self.service.receipts, self.open_key, self.effective_start
        assert signer is not None
        end, count = self.service.backend.layer_range.end, int(inputs.shape[0])

        def signed(output: np.ndarray):
            answer = post(output)
            digest = (tail_digest(answer.token, output) if isinstance(answer, TailAnswer) else rows_digest(output))
            into = rows_digest(inputs)
            self._history = chain_history(self._history, into)
            self._signed = signer.sign(key.session_id, key.epoch, start, end, position, count, into, digest,
                                       self._history)
            return answer
        return signed

    def _take_receipt(self) -> bytes:
        signed, self._signed = self._signed or b"", None
        return signed

    def _grant(self) -> list[bytes]:
        ledger = self.open_ledger
        if ledger.outstanding > ledger.max_inflight // 2:
            return []
        n = ledger.grant()
        return [pb.SessionResponse(flow_control=pb.FlowControl(credits_granted=n)).SerializeToString()] if n else []

    def _work_error(self, exc: MeshdError, work_id: str, step: int) -> list[bytes]:
        if isinstance(exc, Cancelled):
            self.state = CLOSED
        return [status_frame(exc, terminal=self.state == CLOSED, work_id=work_id,
                             session_id=self.open_key.session_id, step=step), *self._grant()]

    def _on_chunk(self, req: pb.SessionRequest, tensors) -> Sequence[Output]:
        env = req.chunk.envelope
        if env.route_session_id != self.open_key.session_id or env.route_epoch != self.open_key.epoch:
            raise ProtocolViolation("chunk names another session or epoch than this stream's")
        if env.HasField("shard_range") and env.shard_range.effective_start_layer != self.effective_start:
            raise ProtocolViolation("chunk names another effective start than this stream's")
        if env.HasField("fingerprint") and not fingerprints_match(env.fingerprint, self.service.backend.fingerprint):
            raise ProtocolViolation("chunk carries another fingerprint than this stream's")
        if env.phase not in (pb.PHASE_PREFILL, pb.PHASE_DECODE):
            raise ProtocolViolation("a chunk must be in phase PREFILL or DECODE")
        span = env.position
        try:
            if self._input(tensors).shape[0] != span.token_count:
                raise PayloadCorrupt("position.token_count disagrees with the tensor")
            final = env.chunk.final_chunk if env.HasField("chunk") else True
            drafts = self._drafts(env) if env.HasField("verify") else None
            result = self._run(step=env.idempotency_step, position=span.first_position,
                               expected=env.cache_expectation.expected_past_len, tensors=tensors,
                               deadline=env.deadline_unix_nanos,
                               draw_at=span.first_position + span.token_count if final else None, drafts=drafts)
        except (ProtocolError, ShardRefusal) as exc:
            return self._work_error(exc, env.work_id, env.idempotency_step)
        if result.payload is None:  # an older duplicate: acknowledged, nothing to replay
            return [pb.SessionResponse(ack=pb.Ack(
                work_id=env.work_id, idempotency_step=env.idempotency_step, duplicate=True,
                cache_result=pb.CacheResult(mode=env.cache_expectation.mode, past_len=result.past_len,
                                            cache_hit=True))).SerializeToString(), *self._grant()]
        out_env = pb.Envelope()
        out_env.CopyFrom(env)
        out_env.position.token_count = span.token_count
        tensors, sample = _parts(result.payload)
        if self.push is not None:
            return [PushChunk(out_env, tensors, sample), *self._grant()]
        accepted = getattr(result.payload, "accepted", None)
        verdict = pb.VerifyResult(accepted=accepted) if accepted is not None else None
        return [wire.response_chunk(out_env, tensors, sample=sample, receipt=self._take_receipt(), verify=verdict),
                *self._grant()]

    def _drafts(self, env: pb.Envelope) -> tuple[int, ...]:
        """A verify chunk's drafted tokens, checked against its span (module doc)."""
        drafts = tuple(int(t) for t in env.verify.draft_token_ids)
        if len(drafts) > MAX_DRAFT_TOKENS:
            raise ProtocolViolation(f"a verify chunk carries at most {MAX_DRAFT_TOKENS} drafted tokens")
        if env.position.token_count != len(drafts) + 1:
            raise ProtocolViolation("a verify chunk's token_count must be 1 + its drafted tokens")
        if self.push is not None:
            raise ProtocolViolation("verify chunks run on star routes only (not on a pushed session)")
        return drafts

    def _on_decode(self, req: pb.SessionRequest, tensors) -> Sequence[Output]:
        d = req.decode
        try:
            if self._input(tensors).shape[0] != 1:
                raise PayloadCorrupt("a decode step carries exactly one position")
            result = self._run(step=d.idempotency_step, position=d.position, expected=d.expected_past_len,
                               tensors=tensors, deadline=d.deadline_unix_nanos, draw_at=d.position + 1)
        except (ProtocolError, ShardRefusal) as exc:
            return self._work_error(exc, d.work_id, d.idempotency_step)
        if self.push is not None:
            return [PushDecode(d, result), *self._grant()]
        return [decode_answer(d.idempotency_step, result.past_len, result.duplicate, result.execution_nanos,
                              result.payload, receipt=self._take_receipt()), *self._grant()]

    def _on_flow_control(self, req: pb.SessionRequest, _tensors) -> list[bytes]:
        return []  # responses answer requests one to one; the peer's grants need no bookkeeping

    def _on_repoint(self, req: pb.SessionRequest, _tensors) -> Sequence[Output]:
        if self.push_role != CONTROL:
            raise ProtocolViolation("repoint is only for a pushed session's entry stream")
        return [Repoint(req.repoint.next)]

    def _on_release(self, req: pb.SessionRequest, _tensors) -> Sequence[Output]:
        if self.push_role == FEED:
            raise ProtocolViolation("a feeder stream cannot release the session")
        r = req.release
        if r.route_session_id != self.open_key.session_id or r.route_epoch != self.open_key.epoch:
            raise ProtocolViolation("release names another session or epoch than this stream's")
        with self.service.lock:
            self.service.manager.release(self.open_key, self.owner)
        self.state = CLOSED
        ack = pb.SessionResponse(ack=pb.Ack(work_id=r.work_id)).SerializeToString()
        return [ReleasePushed(), ack] if self.push is not None else [ack]

    def _on_cancel(self, req: pb.SessionRequest, _tensors) -> list[bytes]:
        c = req.cancel
        if c.route_session_id != self.open_key.session_id or c.route_epoch != self.open_key.epoch:
            raise ProtocolViolation("cancel names another session or epoch than this stream's")
        with self.service.lock:
            self.service.manager.cancel(self.open_key, self.owner)
        raise Cancelled(f"cancelled by the initiator: {c.reason[:80]}")
