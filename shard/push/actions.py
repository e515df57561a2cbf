"""Carrying out the stream core's push actions: what every edge runs between its socket and the core.

The sans-I/O core (shard/session/stream.py) answers a request body with the
bodies to send and, for a pushed session, actions (``OpenPushed``,
``AttachFeeder``, ``PushChunk``, ``PushDecode``, ``Repoint``,
``ReleasePushed``). An edge calls ``receive(stream, body)``: the core runs,
each action is carried out here against the worker's PushHub (hub.py), in
order, and the bodies to send on this stream come back:

    edge ── body ──▶ receive ──▶ SessionStream.receive ──▶ [bytes | action, ...]
                        └── carry: action ─▶ PushHub / PushSession ─▶ bytes (or nothing)

A pushed session's other answers (the tail's tokens, failure reports) leave
through its ControlSink from other threads; ``sink_of(stream)`` tells the edge
whether this stream has one, ``serve_control`` is the gRPC edge's loop for it,
and ``stream_ended(stream)`` closes what the stream owned once its edge is done.

Failures: an action that fails ends the stream exactly as a failure inside
the core would (``SessionStream.fail``: a typed terminal ShardStatus, our own
bugs logged), and nothing else from that request is sent; a pushed open that
cannot be registered frees its KV first (``undo_open``).
"""
from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from proto import wire
from proto.errors import ProtocolViolation
from shard.errors import PermissionDenied, RangeMismatch
from shard.push.hub import ControlSink, PushSession, hub_of
from shard.session.stream import (
    CONTROL,
    HIDDEN,
    AttachFeeder,
    OpenPushed,
    Output,
    PushChunk,
    PushDecode,
    ReleasePushed,
    Repoint,
    SessionStream,
    decode_answer,
)

__all__ = ["receive", "carry", "sink_of", "serve_control", "stream_ended"]


def receive(stream: SessionStream, body: bytes) -> list[bytes]:
    """One request body through the core, its push actions carried out: the bodies to send."""
    return carry(stream, stream.receive(body))


def carry(stream: SessionStream, outputs: Iterable[Output]) -> list[bytes]:
    """Carry out ``outputs`` in order; the response bodies to send on ``stream``."""
    sent: list[bytes] = []
    for item in outputs:
        if isinstance(item, bytes):
            sent.append(item)
            continue
        try:
            sent += _CARRY[type(item)](stream, item)
        except Exception as exc:  # noqa: BLE001 - stream.fail maps every failure to a typed error answer
            opening = isinstance(item, (OpenPushed, AttachFeeder))   # no session yet: the open is refused
            session_id = "" if opening or stream.key is None else stream.key.session_id
            return sent + stream.fail(exc, f"carrying out {type(item).__name__}", session_id)
    return sent


def sink_of(stream: SessionStream) -> ControlSink | None:
    """A pushed control stream's sink (its answers come from other threads too); else None."""
    return _pushed(stream).sink if stream.push_role == CONTROL else None


def _pushed(stream: SessionStream) -> PushSession:
    """The pushed session the edge registered on ``stream`` (``attach_push``; opaque to the core)."""
    if not isinstance(stream.push, PushSession):
        raise ProtocolViolation("this stream carries no pushed session")
    return stream.push


def stream_ended(stream: SessionStream) -> None:
    """The edge is done with ``stream``: a control stream's pushed session (and its successor
    stream) goes too; a feeder owned nothing."""
    if stream.push_role == CONTROL and stream.push is not None:
        _pushed(stream).close()
    stream.attach_push(None, "")


def serve_control(stream: SessionStream, request_iterator: Iterator[bytes]):
    """The rest of a pushed control stream over gRPC: the stream's own requests go through the
    core in a pump thread (the hub's ThreadGroup); the handler yields whatever the sink holds,
    from any thread."""
    sink = sink_of(stream)
    assert sink is not None   # the edge serves control streams only here

    def pump() -> None:
        try:
            for body in request_iterator:
                for out in receive(stream, body):
                    sink.emit(out)
                if stream.closed:
                    break
        except Exception:  # noqa: BLE001 - the call ended (cancel, peer gone): nothing to answer
            pass
        finally:
            sink.end()

    hub_of(stream.service).threads.start(pump, name="control-pump")
    try:
        yield from sink.drain()
    finally:
        stream_ended(stream)


# -- one function per action -------------------------------------------------------------
def _open_pushed(stream: SessionStream, action: OpenPushed) -> list[bytes]:
    """The entry opened a pushed session (its KV is open): register it, then accept."""
    service = stream.service
    try:
        session = hub_of(service).register(action.key, action.open, service.backend.fingerprint,
                                           service.backend.layer_range.is_tail)
    except BaseException:
        stream.undo_open()
        raise
    session.sampling = stream.sampling
    session.owner_digest = stream.owner.token_digest   # what a feeder must prove (_attach_feeder)
    stream.attach_push(session, CONTROL)
    return [action.accepted]


def _attach_feeder(stream: SessionStream, action: AttachFeeder) -> list[bytes]:
    """The upstream hop attaches to the session the entry opened here (ranges already checked).

    Only a feeder holding this session's owner token (the entry gave it to the upstream hop in
    its PushTarget) may attach: anyone else gets PERMISSION_DENIED, whatever it knows."""
    session = hub_of(stream.service).get(action.key)
    if session.owner_digest and not hmac.compare_digest(action.owner.token_digest, session.owner_digest):
        raise PermissionDenied("only the hop the entry named may feed this session")
    if action.open.shard_range.effective_start_layer != session.effective_start:
        raise RangeMismatch("the feeder names another effective start than the entry opened")
    return stream.feeder_attached(session, effective_start=session.effective_start, tail=session.tail,
                                  sampling=session.sampling, open_msg=action.open)


def _push_chunk(stream: SessionStream, action: PushChunk) -> list[bytes]:
    """A pushed prefill chunk ran: the tail answers the entry (final chunk only; a looped tail
    first sends the token to the head), others push on."""
    session = _pushed(stream)
    env, sample = action.envelope, action.sample
    final = env.chunk.final_chunk if env.HasField("chunk") else True
    if session.is_tail:
        if final:
            if sample is not None:
                session.loop_token(env.position.first_position + env.position.token_count, sample.token_id)
            session.answer(wire.response_chunk(env, action.tensors, sample=sample))
        return []
    c = env.chunk
    session.push(env.position.first_position, action.tensors[HIDDEN], index=c.chunk_index,
                 count=max(1, c.chunk_count), final=final)
    return []


def _push_decode(stream: SessionStream, action: PushDecode) -> list[bytes]:
    """A pushed decode step ran: the tail answers the entry, others push the row on (one leg more)."""
    session = _pushed(stream)
    d, result = action.step, action.result
    if session.is_tail:
        if session.loop and not result.duplicate:       # the head waits for this one: it goes first
            session.loop_token(int(d.position) + 1, getattr(result.payload, "token", None))
        # the route's compute, summed along the way, for the entry's figures; this answer's leg too
        session.answer(decode_answer(d.idempotency_step, result.past_len, result.duplicate,
                                     result.execution_nanos + d.route_execution_nanos, result.payload,
                                     legs=d.legs + 1))
        return []
    if result.duplicate:
        return []   # a step that already ran: its rows went on when it first ran
    rows = result.payload
    assert isinstance(rows, dict)   # a hop that is not the tail steps to {HIDDEN: rows} (the core's poster)
    session.push(int(d.position), rows[HIDDEN], decode=True, legs=d.legs + 1,
                 execution=d.route_execution_nanos + result.execution_nanos)
    return []


def _repoint(stream: SessionStream, action: Repoint) -> list[bytes]:
    _pushed(stream).repoint(action.target)
    return []


def _release(stream: SessionStream, action: ReleasePushed) -> list[bytes]:
    """The entry released the session: forget it and close its successor stream."""
    _pushed(stream).release()
    return []


_CARRY: dict[type, Callable[[SessionStream, Any], list[bytes]]] = {   # by the action's type
    OpenPushed: _open_pushed, AttachFeeder: _attach_feeder, PushChunk: _push_chunk, PushDecode: _push_decode,
    Repoint: _repoint, ReleasePushed: _release,
}
