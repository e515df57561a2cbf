"""RouteDriver: run a generation through a list of shard hops (tests, benchmarks).

Topology is a **star**: the driver opens one Session stream per hop and
carries each hop's output to the next hop itself (hop i's boundary tensor
comes back to the driver, which sends it to hop i+1; the tail's logits come
back to the driver, which picks the next token). Hops never talk to each
other, so a hop needs no route knowledge and the driver sees every boundary
(simple failure handling; the price is one extra loopback leg per hop).

Per generation: chunked prefill (ActivationChunk, ``chunk_tokens`` per chunk,
default 128) through every hop in order, then decode through the DecodeStep
fast path, one position at a time, greedy by default (ties to the lowest id)
or ``Sampler`` when ``sampling`` is given. Each hop's stream keeps its own
CreditWindow; flow-control grants are applied as they arrive.

State: one ``_HopStream`` per hop (channel, bidi call fed from a bounded
queue, credit window, past length), the route session id/epoch and the
idempotency step counter. Errors: ``HopError`` names the hop and carries the
hop's typed ``pb.ShardError``; transport failures are mapped to it too.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

import grpc
import numpy as np

from proto import shard_runtime_pb2 as pb
from proto import wire
from proto.chunking import plan_prefill_chunks
from proto.errors import MeshdError
from proto.flow import CreditWindow
from proto.frames import SCHEMA_VERSION
from proto.limits import DEFAULT_PREFILL_CHUNK_TOKENS
from proto.frames import parse_response
from proto.tensors import decode_bundle
from proto.zerocopy import read_response
from shard.artifact import fingerprints_match
from shard.backend import LayerRange
from shard.sampling import Sampler, SamplingSpec, greedy_token
from meshd.generate.request_queue import RequestQueue
from shard.server import GRPC_OPTIONS, SERVICE_NAME
from shard.stream import HIDDEN, LOGITS, SMALL_FRAME_BYTES, TOKEN_IDS

SESSION_METHOD = f"/{SERVICE_NAME}/Session"
# Requests buffered per hop before send() blocks (the window is smaller anyway).
SEND_QUEUE_DEPTH = 16
# A whole stream may not outlive this (bounds a wedged peer); generous for CPUs.
DEFAULT_STREAM_TIMEOUT_S = 3600.0
# Unary calls (capability, release) must answer within this.
UNARY_TIMEOUT_S = 30.0


class HopError(MeshdError):
    """Hop ``hop`` refused or failed; ``error`` is its typed ShardError."""

    def __init__(self, hop: int, error: pb.ShardError) -> None:
        name = pb.ErrorCode.Name(error.code) if error.code in pb.ErrorCode.values() else str(error.code)
        super().__init__(f"hop {hop}: {name}: {error.detail}")
        self.hop = hop
        self.error = error


@dataclass(frozen=True, slots=True)
class Hop:
    endpoint: str
    layer_range: LayerRange
    effective_start: int

    def __post_init__(self) -> None:
        if not self.layer_range.start <= self.effective_start < self.layer_range.end:
            raise ValueError(f"effective_start {self.effective_start} outside {self.layer_range}")


@dataclass(slots=True)
class GenerationResult:
    tokens: list[int]
    logits: list[np.ndarray]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    hop_execution_ns: list[int] = field(default_factory=list)
    # Per decode step: wall time of the round through every hop, and the hops' own
    # execution time within it (the difference is transport + protocol work).
    step_wall_ns: list[int] = field(default_factory=list)
    step_execution_ns: list[int] = field(default_factory=list)


class _HopStream:
    """One hop's bidi Session stream: send request bodies, read typed responses."""

    def __init__(self, index: int, hop: Hop, channel: grpc.Channel, timeout_s: float) -> None:
        self.index, self.hop, self.channel = index, hop, channel
        self._queue = RequestQueue(SEND_QUEUE_DEPTH)
        call = channel.stream_stream(SESSION_METHOD, request_serializer=None, response_deserializer=None)
        self._responses = call(self._queue, timeout=timeout_s)
        self.window: CreditWindow | None = None
        self.past_len = 0
        self.execution_ns = 0

    def send(self, body: bytes, *, work: bool = True) -> None:
        """Queue one request; ``work`` requests (chunk, decode) spend a credit."""
        if work and self.window is not None:
            self.window.consume(len(body))
        self._queue.put(body)

    def recv(self) -> tuple[pb.SessionResponse, dict[str, np.ndarray]]:
        """The next non-flow-control response; a ShardStatus becomes HopError."""
        while True:
            try:
                body = next(self._responses)
            except StopIteration:
                raise HopError(self.index, pb.ShardError(code=pb.ERROR_CODE_PROTOCOL_VIOLATION,
                                                         detail="stream ended")) from None
            except grpc.RpcError as exc:
                raise HopError(self.index, pb.ShardError(
                    code=pb.ERROR_CODE_INTERNAL, retryable=True,
                    detail=f"transport: {exc.code().name}")) from exc
            if len(body) > SMALL_FRAME_BYTES:
                resp, tensors = read_response(body)
            else:
                resp = parse_response(body)
                kind = resp.WhichOneof("kind")
                bundle = resp.decode.bundle if kind == "decode" else resp.chunk.bundle if kind == "chunk" else None
                tensors = decode_bundle(bundle) if bundle is not None else {}
            kind = resp.WhichOneof("kind")
            if kind == "flow_control":
                if self.window is not None:
                    self.window.on_grant(resp.flow_control.credits_granted)
                continue
            if kind == "status":
                raise HopError(self.index, resp.status.error)
            if kind in ("chunk", "decode", "ack") and self.window is not None and self.window.inflight:
                self.window.on_ack()
            return resp, tensors

    def close(self) -> None:
        self._queue.finish()
        self._responses.cancel()
        self.channel.close()


def _default_channel(endpoint: str) -> grpc.Channel:
    return grpc.insecure_channel(endpoint, options=GRPC_OPTIONS)


class RouteDriver:
    def __init__(self, hops: Sequence[Hop], *, fingerprint: pb.Fingerprint | None = None,
                 channel_factory: Callable[[str], grpc.Channel] = _default_channel,
                 chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS, session_id: str | None = None,
                 epoch: int = 0, max_tokens: int = 0, stream_timeout_s: float = DEFAULT_STREAM_TIMEOUT_S,
                 tail_logits: bool = True) -> None:
        if not hops:
            raise ValueError("a route needs at least one hop")
        if hops[0].effective_start != 0 or not hops[-1].layer_range.is_tail:
            raise ValueError("a route must start at layer 0 and end at the tail")
        for a, b in zip(hops, hops[1:]):
            if b.effective_start != a.layer_range.end:
                raise ValueError(f"hop at {b.endpoint} starts at {b.effective_start}, previous ends at {a.layer_range.end}")
        self.hops = list(hops)
        self.chunk_tokens = chunk_tokens
        self.session_id = session_id or uuid.uuid4().hex
        self.epoch = epoch
        self.max_tokens = max_tokens
        # True: the tail returns its logits row and the driver picks the token (and
        # GenerationResult.logits is filled). False: the tail samples and returns only
        # the token id (4 bytes instead of vocab x 4 per step).
        self.tail_logits = tail_logits
        self._channel_factory = channel_factory
        self._timeout = stream_timeout_s
        self._streams: list[_HopStream] = []
        self._step = 0
        self.fingerprint = fingerprint if fingerprint is not None else self._discover_fingerprint()

    # -- setup --------------------------------------------------------------------------
    def _discover_fingerprint(self) -> pb.Fingerprint:
        """Every hop's validated capability must name the same artifact and recipe."""
        found: pb.Fingerprint | None = None
        for i, hop in enumerate(self.hops):
            channel = self._channel_factory(hop.endpoint)
            try:
                report = channel.unary_unary(f"/{SERVICE_NAME}/GetCapability",
                                             request_serializer=pb.CapabilityRequest.SerializeToString,
                                             response_deserializer=pb.CapabilityReport.FromString)(
                    pb.CapabilityRequest(schema_version=SCHEMA_VERSION), timeout=UNARY_TIMEOUT_S)
            finally:
                channel.close()
            if not report.validated:
                raise HopError(i, pb.ShardError(code=pb.ERROR_CODE_INTERNAL, detail="capability not validated"))
            if found is not None and not fingerprints_match(found, report.fingerprint):
                raise HopError(i, pb.ShardError(code=pb.ERROR_CODE_FINGERPRINT_MISMATCH,
                                                detail="hops serve different artifacts or recipes"))
            found = report.fingerprint
        return found

    def _tail_options(self, sampling: SamplingSpec | None) -> pb.TailOptions:
        if self.tail_logits:
            return pb.TailOptions(return_logits=True)
        spec = sampling or SamplingSpec()
        return pb.TailOptions(sample=True, sampling=pb.SamplingParams(
            temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p, seed=spec.seed))

    def _open(self, max_tokens: int, sampling: SamplingSpec | None = None) -> None:
        for i, hop in enumerate(self.hops):
            stream = _HopStream(i, hop, self._channel_factory(hop.endpoint), self._timeout)
            self._streams.append(stream)
            lr = hop.layer_range
            tail = self._tail_options(sampling) if lr.is_tail else None
            stream.send(pb.SessionRequest(open=pb.SessionOpen(
                schema_version=SCHEMA_VERSION, route_session_id=self.session_id, route_epoch=self.epoch,
                fingerprint=self.fingerprint,
                shard_range=pb.ShardRange(start_layer=lr.start, end_layer=lr.end,
                                          effective_start_layer=hop.effective_start),
                proposed_flow_control=pb.FlowControl(max_prefill_chunk_tokens=self.chunk_tokens),
                accepted_compression=[pb.COMPRESSION_NONE], tail=tail, max_tokens=max_tokens,
            )).SerializeToString())
        for stream in self._streams:
            resp, _ = stream.recv()
            if resp.WhichOneof("kind") != "accepted":
                raise HopError(stream.index, pb.ShardError(code=pb.ERROR_CODE_PROTOCOL_VIOLATION,
                                                           detail="expected SessionAccepted"))
            stream.window = CreditWindow(resp.accepted.flow_control)
            stream.past_len = resp.accepted.past_len

    # -- work ------------------------------------------------------------------------------
    def _next_step(self) -> int:
        self._step += 1
        return self._step

    def _prefill_chunk(self, ids: np.ndarray, first: int, index: int, count: int) -> dict[str, np.ndarray]:
        x, step = ids, self._next_step()
        for stream in self._streams:
            hop = stream.hop
            env = pb.Envelope(
                schema_version=SCHEMA_VERSION, work_id=f"{self.session_id}:{step}",
                route_session_id=self.session_id, route_epoch=self.epoch, fingerprint=self.fingerprint,
                shard_range=pb.ShardRange(start_layer=hop.layer_range.start, end_layer=hop.layer_range.end,
                                          effective_start_layer=hop.effective_start),
                phase=pb.PHASE_PREFILL, position=pb.PositionSpan(first_position=first, token_count=len(ids)),
                idempotency_step=step,
                cache_expectation=pb.CacheExpectation(mode=pb.CACHE_MODE_PREFILL, expected_past_len=first),
                chunk=pb.ChunkInfo(chunk_index=index, chunk_count=count, final_chunk=index == count - 1))
            stream.send(wire.request_chunk(env, {TOKEN_IDS if hop.effective_start == 0 else HIDDEN: x}))
            _, tensors = stream.recv()
            x = tensors if hop.layer_range.is_tail else tensors[HIDDEN]
            stream.past_len = first + len(ids)
        return x

    def _decode_one(self, token: int, position: int, result: GenerationResult) -> dict[str, np.ndarray]:
        t0, executed = time.perf_counter_ns(), 0
        x, step = np.array([token], dtype=np.int64), self._next_step()
        head = pb.DecodeStep(idempotency_step=step, position=position, expected_past_len=position)
        for stream in self._streams:
            name = TOKEN_IDS if stream.hop.effective_start == 0 else HIDDEN
            stream.send(wire.request_decode(head, name, x))
            resp, tensors = stream.recv()
            stream.execution_ns += resp.decode.execution_nanos
            executed += resp.decode.execution_nanos
            x = tensors if stream.hop.layer_range.is_tail else tensors[HIDDEN]
            stream.past_len = position + 1
        result.step_wall_ns.append(time.perf_counter_ns() - t0)
        result.step_execution_ns.append(executed)
        return x

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
                 sampling: SamplingSpec | None = None, stop_ids: Sequence[int] = ()) -> GenerationResult:
        """Prefill the prompt, then decode up to ``max_new_tokens`` tokens."""
        if self._streams:
            raise ValueError("this driver already ran a generation; use a new RouteDriver")
        if not prompt_ids or max_new_tokens < 1:
            raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
        pick = Sampler(sampling) if sampling is not None else greedy_token
        self._open(self.max_tokens or len(prompt_ids) + max_new_tokens, sampling)
        ids = np.asarray(prompt_ids, dtype=np.int64)
        plan = plan_prefill_chunks(len(ids), self.chunk_tokens)
        result = GenerationResult(tokens=[], logits=[])
        t0 = time.perf_counter()
        for index, (first, count) in enumerate(plan):
            out = self._prefill_chunk(ids[first:first + count], first, index, len(plan))
        result.prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        position = len(ids)
        while True:
            token = self._token_of(out, pick, result)
            result.tokens.append(token)
            if len(result.tokens) >= max_new_tokens or token in stop_ids:
                break
            out = self._decode_one(token, position, result)
            position += 1
        result.decode_s = time.perf_counter() - t0
        result.hop_execution_ns = [s.execution_ns for s in self._streams]
        return result

    def _token_of(self, out: dict[str, np.ndarray], pick, result: GenerationResult) -> int:
        """The next token from the tail's answer (its logits, or the token it sampled)."""
        if not self.tail_logits:
            ids = out.get(TOKEN_IDS)
            if ids is None or ids.shape != (1,):
                raise HopError(len(self.hops) - 1, pb.ShardError(code=pb.ERROR_CODE_PROTOCOL_VIOLATION,
                                                                 detail="the tail sent no sampled token"))
            return int(ids[0])
        logits = out.get(LOGITS)
        if logits is None:
            raise HopError(len(self.hops) - 1, pb.ShardError(code=pb.ERROR_CODE_PROTOCOL_VIOLATION,
                                                             detail="the tail sent no logits"))
        result.logits.append(np.array(logits, dtype=np.float32))
        return pick(logits)

    def close(self) -> None:
        """Release every hop's session (best effort) and close the streams."""
        for stream in self._streams:
            try:
                stream.send(pb.SessionRequest(release=pb.ReleaseSignal(
                    route_session_id=self.session_id, route_epoch=self.epoch)).SerializeToString(), work=False)
            except Exception:
                pass
        for stream in self._streams:
            try:
                stream.recv()
            except Exception:  # closing anyway: a failed hop has nothing to release
                pass
            stream.close()
        self._streams = []

    def __enter__(self) -> "RouteDriver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
