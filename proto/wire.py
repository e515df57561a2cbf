"""Serialize session messages that carry tensors with one copy of the payload.

``msg.SerializeToString()`` after ``encode_tensor`` copies every payload twice
(into the message, then into the output). These builders produce the SAME bytes
(canonical protobuf: fields in number order, proto3 defaults omitted) with one
copy: small parts (envelope, step fields) are serialized by protobuf, tensor
headers and the length-delimited wrappers are written by hand
(``PreparedTensor.pieces``), and the payload goes straight from the array's
memory into one ``bytes.join``. With ``framed=True`` the 4-byte relay length
prefix is part of the same join.

    request_chunk(envelope, tensors)          SessionRequest{chunk{envelope, bundle}}
    request_decode(step, name, array)         SessionRequest{decode: DecodeStep{..., tensor}}
    response_chunk(envelope, tensors)         SessionResponse{chunk{envelope, bundle}}
    response_decode(result, tensors)          SessionResponse{decode: DecodeResult{..., bundle}}

``tensors`` maps names to arrays (encoded with the keyword arguments of
``encode_tensor``) or to ready ``PreparedTensor``s. Tests and a fuzz test check
byte equality with protobuf's own serialization. Stateless; raises LocalError.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from proto import shard_runtime_pb2 as pb
from proto.errors import LocalError
from proto.frames import frame_prefix
from proto.limits import MAX_FRAME_BYTES
from proto.tensors import PreparedTensor, bundle_pieces, prepare_bundle, varint

__all__ = ["request_chunk", "request_decode", "response_chunk", "response_decode"]


def _finish(tag: bytes, pieces: list, size: int, framed: bool) -> bytes:
    head = tag + varint(size)
    total = len(head) + size
    if total > MAX_FRAME_BYTES:
        raise LocalError(f"message of {total} bytes > MAX_FRAME_BYTES {MAX_FRAME_BYTES}; "
                         "send smaller chunks")
    return b"".join([frame_prefix(total), head, *pieces] if framed else [head, *pieces])


def _chunk(envelope: pb.Envelope, tensors, kwargs) -> tuple[list, int]:
    if not isinstance(envelope, pb.Envelope):
        raise LocalError("envelope must be a pb.Envelope")
    env = envelope.SerializeToString()
    pieces, size = bundle_pieces(prepare_bundle(tensors, **kwargs))
    head = b"\x0a" + varint(len(env)) + env + b"\x12" + varint(size)
    return [head, *pieces], len(head) + size


def request_chunk(envelope: pb.Envelope, tensors: Mapping[str, np.ndarray | PreparedTensor], *,
                  framed: bool = False, **encode_kwargs) -> bytes:
    """Serialized SessionRequest{chunk: ActivationChunk{envelope, bundle}}."""
    return _finish(b"\x12", *_chunk(envelope, tensors, encode_kwargs), framed)


def response_chunk(envelope: pb.Envelope, tensors: Mapping[str, np.ndarray | PreparedTensor], *,
                   framed: bool = False, **encode_kwargs) -> bytes:
    """Serialized SessionResponse{chunk: ActivationChunk{envelope, bundle}}."""
    return _finish(b"\x12", *_chunk(envelope, tensors, encode_kwargs), framed)


def request_decode(step: pb.DecodeStep, name: str, array: np.ndarray | PreparedTensor, *,
                   framed: bool = False, **encode_kwargs) -> bytes:
    """Serialized SessionRequest{decode: step with ``tensor`` set from ``array``}.

    ``step`` supplies the scalar fields (idempotency_step, position,
    expected_past_len, work_id, deadline_unix_nanos); its own tensor is ignored.
    """
    if not isinstance(step, pb.DecodeStep):
        raise LocalError("step must be a pb.DecodeStep")
    (prep,) = prepare_bundle({name: array}, **encode_kwargs)
    before = pb.DecodeStep(idempotency_step=step.idempotency_step, position=step.position,
                           expected_past_len=step.expected_past_len).SerializeToString()
    after = pb.DecodeStep(work_id=step.work_id,
                          deadline_unix_nanos=step.deadline_unix_nanos).SerializeToString()
    pieces, size = prep.pieces()
    head = before + b"\x22" + varint(size)
    return _finish(b"\x1a", [head, *pieces, after], len(head) + size + len(after), framed)


def response_decode(result: pb.DecodeResult, tensors: Mapping[str, np.ndarray | PreparedTensor],
                    *, framed: bool = False, **encode_kwargs) -> bytes:
    """Serialized SessionResponse{decode: result with ``bundle`` built from ``tensors``}."""
    if not isinstance(result, pb.DecodeResult):
        raise LocalError("result must be a pb.DecodeResult")
    head_msg = pb.DecodeResult()
    head_msg.CopyFrom(result)
    head_msg.ClearField("bundle")
    pieces, size = bundle_pieces(prepare_bundle(tensors, **encode_kwargs))
    head = head_msg.SerializeToString() + b"\x2a" + varint(size)
    return _finish(b"\x32", [head, *pieces], len(head) + size, framed)
