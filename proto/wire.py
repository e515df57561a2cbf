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
    response_chunk(envelope, tensors, sample) SessionResponse{chunk{envelope, bundle, sample}}
    response_decode(result, tensors)          SessionResponse{decode: DecodeResult{..., bundle, sample}}

A sampling tail's answer carries a ``TailSample`` (``sample=`` for a chunk,
``result.sample`` for a decode step); with no tensors beside it the bundle is
left out, so a token-only decode step is ~20 bytes.

``tensors`` maps names to arrays (encoded with the keyword arguments of
``encode_tensor``) or to ready ``PreparedTensor``s. Tests and a fuzz test check
byte equality with protobuf's own serialization. Stateless; raises LocalError.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from proto import fastpath
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


def _chunk(envelope: pb.Envelope, tensors, kwargs,
           sample: pb.TailSample | None = None) -> tuple[list[bytes | memoryview], int]:
    if not isinstance(envelope, pb.Envelope):
        raise LocalError("envelope must be a pb.Envelope")
    env = envelope.SerializeToString()
    head = b"\x0a" + varint(len(env)) + env
    out: list[bytes | memoryview] = [head]
    size = len(head)
    if tensors or sample is None:
        pieces, bundle_size = bundle_pieces(prepare_bundle(tensors, **kwargs))
        tag = b"\x12" + varint(bundle_size)
        out += [tag, *pieces]
        size += len(tag) + bundle_size
    if sample is not None:
        field = _sample_field(b"\x1a", sample)
        out.append(field)
        size += len(field)
    return out, size


def _sample_field(tag: bytes, sample: pb.TailSample) -> bytes:
    if not isinstance(sample, pb.TailSample):
        raise LocalError("sample must be a pb.TailSample")
    body = sample.SerializeToString()
    return tag + varint(len(body)) + body


def request_chunk(envelope: pb.Envelope, tensors: Mapping[str, np.ndarray | PreparedTensor], *,
                  framed: bool = False, **encode_kwargs) -> bytes:
    """Serialized SessionRequest{chunk: ActivationChunk{envelope, bundle}}."""
    return _finish(b"\x12", *_chunk(envelope, tensors, encode_kwargs), framed)


def response_chunk(envelope: pb.Envelope, tensors: Mapping[str, np.ndarray | PreparedTensor], *,
                   sample: pb.TailSample | None = None, framed: bool = False, receipt: bytes = b"",
                   verify: pb.VerifyResult | None = None, **encode_kwargs) -> bytes:
    """Serialized SessionResponse{chunk: ActivationChunk{envelope, bundle, sample, receipt, verify}}."""
    out, size = _chunk(envelope, tensors, encode_kwargs, sample)
    if receipt:
        field = b"\x22" + varint(len(receipt)) + receipt
        out.append(field)
        size += len(field)
    if verify is not None:   # a verify chunk's verdict (speculative decoding): a few bytes
        if not isinstance(verify, pb.VerifyResult):
            raise LocalError("verify must be a pb.VerifyResult")
        body = verify.SerializeToString()
        field = b"\x2a" + varint(len(body)) + body
        out.append(field)
        size += len(field)
    return _finish(b"\x12", out, size, framed)


def request_decode(step: pb.DecodeStep, name: str, array: np.ndarray | PreparedTensor, *,
                   framed: bool = False, **encode_kwargs) -> bytes:
    """Serialized SessionRequest{decode: step with ``tensor`` set from ``array``}.

    ``step`` supplies the scalar fields (idempotency_step, position,
    expected_past_len, work_id, deadline_unix_nanos, legs, route_execution_nanos); its own
    tensor is ignored.
    """
    if not isinstance(step, pb.DecodeStep):
        raise LocalError("step must be a pb.DecodeStep")
    if not encode_kwargs and isinstance(array, np.ndarray) and isinstance(name, str):
        body = fastpath.decode_request_bytes(
            step.idempotency_step, step.position, step.expected_past_len, name, array, work_id=step.work_id,
            deadline_unix_nanos=step.deadline_unix_nanos, legs=step.legs,
            route_execution_nanos=step.route_execution_nanos)
        if body is not None:      # the same bytes, built by hand (proto.fastpath)
            return frame_prefix(len(body)) + body if framed else body
    (prep,) = prepare_bundle({name: array}, **encode_kwargs)
    before = pb.DecodeStep(idempotency_step=step.idempotency_step, position=step.position,
                           expected_past_len=step.expected_past_len).SerializeToString()
    after = pb.DecodeStep(work_id=step.work_id, deadline_unix_nanos=step.deadline_unix_nanos,
                          legs=step.legs, route_execution_nanos=step.route_execution_nanos).SerializeToString()
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
    sample = None
    if head_msg.HasField("sample"):
        sample = _sample_field(b"\x32", head_msg.sample)   # field 6 follows the bundle (5)
        head_msg.ClearField("sample")
    head = head_msg.SerializeToString()
    out: list[bytes | memoryview] = [head]
    size = len(head)
    if tensors or sample is None:
        pieces, bundle_size = bundle_pieces(prepare_bundle(tensors, **encode_kwargs))
        tag = b"\x2a" + varint(bundle_size)
        out += [tag, *pieces]
        size += len(tag) + bundle_size
    if sample is not None:
        out.append(sample)
        size += len(sample)
    return _finish(b"\x32", out, size, framed)
