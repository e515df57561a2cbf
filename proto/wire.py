"""Serialize session messages that carry tensors without copying the payload twice.

``msg.SerializeToString()`` after ``encode_tensor`` copies every payload twice
(into the message, then into the output). These builders produce the SAME bytes
(canonical protobuf: fields in number order, proto3 defaults omitted) with one
copy: small parts (envelope, tensor headers) are serialized by protobuf, the
length-delimited wrappers are written here, and the payload goes straight from
the array's memory into one ``bytes.join``. With ``framed=True`` the 4-byte
relay length prefix is part of the same join.

    request_chunk(envelope, tensors)          SessionRequest{chunk{envelope, bundle}}
    request_decode(step, name, array)         SessionRequest{decode: DecodeStep{..., tensor}}
    response_chunk(envelope, tensors)         SessionResponse{chunk{envelope, bundle}}
    response_decode(result, tensors)          SessionResponse{decode: DecodeResult{..., bundle}}

``tensors`` maps names to arrays (encoded with the keyword arguments of
``encode_tensor``) or to ready ``PreparedTensor``s. A fuzz test checks byte
equality with protobuf's own serialization. Stateless; raises LocalError.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from proto import shard_runtime_pb2 as pb
from proto.errors import LocalError
from proto.frames import frame_prefix
from proto.limits import DEFAULT_LIMITS, MAX_FRAME_BYTES
from proto.tensors import BUNDLE_VERSION, PreparedTensor, prepare_tensor

__all__ = ["request_chunk", "request_decode", "response_chunk", "response_decode"]

_VARINT, _LEN = 0, 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


class _Parts:
    """A list of byte pieces with their total length (nothing joined until the end)."""

    __slots__ = ("items", "size")

    def __init__(self) -> None:
        self.items: list = []
        self.size = 0

    def add(self, piece) -> None:
        if len(piece):
            self.items.append(piece)
            self.size += len(piece)

    def add_varint_field(self, field: int, value: int) -> None:
        if value:
            self.add(_key(field, _VARINT) + _varint(value))

    def add_len_field(self, field: int, inner: _Parts) -> None:
        self.add(_key(field, _LEN) + _varint(inner.size))
        self.items.extend(inner.items)
        self.size += inner.size


def _tensor_parts(prep: PreparedTensor) -> _Parts:
    parts = _Parts()
    parts.add(prep.header.SerializeToString())          # fields 1-7
    for index, count, offset, payload in prep.fragments():
        frag = _Parts()
        frag.add_varint_field(1, index)
        frag.add_varint_field(2, count)
        frag.add_varint_field(3, offset)
        if len(payload):
            frag.add(_key(4, _LEN) + _varint(len(payload)))
            frag.add(payload)
        parts.add_len_field(8, frag)
    parts.add_varint_field(9, prep.encoding)
    return parts


def _prepare(tensors, kwargs) -> list[PreparedTensor]:
    if not isinstance(tensors, Mapping):
        raise LocalError("tensors must be a mapping of name -> array or PreparedTensor")
    if len(tensors) > DEFAULT_LIMITS.max_tensors_per_bundle:
        raise LocalError(f"a bundle holds at most {DEFAULT_LIMITS.max_tensors_per_bundle} tensors")
    out = []
    for name, value in tensors.items():
        if isinstance(value, PreparedTensor):
            if value.header.name != name:
                raise LocalError(f"PreparedTensor named {value.header.name!r} under key {name!r}")
            out.append(value)
        else:
            out.append(prepare_tensor(name, value, **kwargs))
    return out


def _bundle_parts(tensors, kwargs) -> _Parts:
    bundle = _Parts()
    bundle.add_varint_field(1, BUNDLE_VERSION)
    for prep in _prepare(tensors, kwargs):
        bundle.add_len_field(2, _tensor_parts(prep))
    return bundle


def _finish(field: int, inner: _Parts, framed: bool) -> bytes:
    outer = _Parts()
    outer.add_len_field(field, inner)
    if outer.size > MAX_FRAME_BYTES:
        raise LocalError(f"message of {outer.size} bytes > MAX_FRAME_BYTES {MAX_FRAME_BYTES}; "
                         "send smaller chunks")
    if framed:
        outer.items.insert(0, frame_prefix(outer.size))
    return b"".join(outer.items)


def _chunk(envelope: pb.Envelope, tensors, kwargs) -> _Parts:
    if not isinstance(envelope, pb.Envelope):
        raise LocalError("envelope must be a pb.Envelope")
    chunk = _Parts()
    env = _Parts()
    env.add(envelope.SerializeToString())
    chunk.add_len_field(1, env)
    chunk.add_len_field(2, _bundle_parts(tensors, kwargs))
    return chunk


def request_chunk(envelope: pb.Envelope, tensors: Mapping[str, np.ndarray | PreparedTensor], *,
                  framed: bool = False, **encode_kwargs) -> bytes:
    """Serialized SessionRequest{chunk: ActivationChunk{envelope, bundle}}."""
    return _finish(2, _chunk(envelope, tensors, encode_kwargs), framed)


def response_chunk(envelope: pb.Envelope, tensors: Mapping[str, np.ndarray | PreparedTensor], *,
                   framed: bool = False, **encode_kwargs) -> bytes:
    """Serialized SessionResponse{chunk: ActivationChunk{envelope, bundle}}."""
    return _finish(2, _chunk(envelope, tensors, encode_kwargs), framed)


def request_decode(step: pb.DecodeStep, name: str, array: np.ndarray | PreparedTensor, *,
                   framed: bool = False, **encode_kwargs) -> bytes:
    """Serialized SessionRequest{decode: step with ``tensor`` set from ``array``}.

    ``step`` supplies the scalar fields (idempotency_step, position,
    expected_past_len, work_id, deadline_unix_nanos); its own tensor is ignored.
    """
    if not isinstance(step, pb.DecodeStep):
        raise LocalError("step must be a pb.DecodeStep")
    (prep,) = _prepare({name: array}, encode_kwargs)
    inner = _Parts()
    inner.add(pb.DecodeStep(idempotency_step=step.idempotency_step, position=step.position,
                            expected_past_len=step.expected_past_len).SerializeToString())
    inner.add_len_field(4, _tensor_parts(prep))
    inner.add(pb.DecodeStep(work_id=step.work_id,
                            deadline_unix_nanos=step.deadline_unix_nanos).SerializeToString())
    return _finish(3, inner, framed)


def response_decode(result: pb.DecodeResult, tensors: Mapping[str, np.ndarray | PreparedTensor],
                    *, framed: bool = False, **encode_kwargs) -> bytes:
    """Serialized SessionResponse{decode: result with ``bundle`` built from ``tensors``}."""
    if not isinstance(result, pb.DecodeResult):
        raise LocalError("result must be a pb.DecodeResult")
    inner = _Parts()
    head = pb.DecodeResult()
    head.CopyFrom(result)
    head.ClearField("bundle")
    inner.add(head.SerializeToString())
    inner.add_len_field(5, _bundle_parts(tensors, encode_kwargs))
    return _finish(6, inner, framed)
