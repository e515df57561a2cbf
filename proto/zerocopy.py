"""Parse a session message and decode its tensors without copying the payloads.

``parse_request`` + ``decode_bundle`` copy each payload twice (protobuf parses
it into its arena; reading ``fragment.payload`` copies it out again) and create
a Python wrapper per sub-message. Here one bounded pass (proto.wirescan) walks
the fields that lead to payloads and returns a *skeleton* (the message with the
payload fields removed), the payloads as memoryviews of the input, and each
canonical tensor's declared values. Protobuf parses only the small skeleton
(the caller gets a normal message whose fragments have EMPTY payloads); the
tensors are checked and decoded by ``proto.decoding.decode_header`` exactly as
``decode_tensor`` would, CRC32C runs on the views in place, and raw arrays are
read-only views of the input bytes (keep ``data`` immutable: it must be bytes).

Frames that carry no tensor go through ``parse_request``/``parse_response``
unchanged. Raises only ProtocolError types (LocalError for a non-bytes input).
"""
from __future__ import annotations

import numpy as np

from proto import shard_runtime_pb2 as pb
from proto.decoding import decode_headers, header_of
from proto.dtypes import BUNDLE_VERSION
from proto.errors import LimitExceeded, LocalError, PayloadCorrupt, ProtocolViolation
from proto.frames import parse_request, parse_response
from proto.limits import DEFAULT_LIMITS, Limits
from proto.wirescan import REQUEST, RESPONSE, TENSOR_FIELDS, scan, top_level_field

__all__ = ["read_request", "read_response"]


def _read(data, limits: Limits, top: int, parse):
    """(message, per-tensor (header or None, views)) or (message, None) without tensors."""
    if not isinstance(data, bytes):
        raise LocalError("zero-copy reads need an immutable bytes object")
    if len(data) > limits.max_frame_bytes:
        raise LimitExceeded(f"message of {len(data)} bytes > {limits.max_frame_bytes}")
    first = top_level_field(data)
    if first is None or first[2] != len(data) or first[0] not in TENSOR_FIELDS[top]:
        return parse(data, limits), None
    result = scan(data, top, limits)
    return parse(b"".join(result.skeleton), limits, _scanned=True), result.tensors


def _decode(bundle_version: int, messages, scanned: list, limits: Limits) -> dict[str, np.ndarray]:
    if len(messages) != len(scanned):
        raise PayloadCorrupt("non-canonical tensor layout")
    if len(scanned) > limits.max_tensors_per_bundle:
        raise LimitExceeded(f"bundle has {len(scanned)} tensors > {limits.max_tensors_per_bundle}")
    return decode_headers(bundle_version, [
        (header if header is not None else header_of(messages[i], limits), views)
        for i, (header, views) in enumerate(scanned)], limits)


def read_request(data: bytes, limits: Limits = DEFAULT_LIMITS
                 ) -> tuple[pb.SessionRequest, dict[str, np.ndarray]]:
    """Parse a SessionRequest and decode the tensors it carries (chunk bundle or decode
    step tensor; {} for other kinds). Arrays are read-only views of ``data``."""
    req, scanned = _read(data, limits, REQUEST, parse_request)
    kind = req.WhichOneof("kind")
    if scanned is None:
        return req, {}
    if kind == "chunk":
        bundle = req.chunk.bundle
        return req, _decode(bundle.bundle_version, bundle.tensors, scanned, limits)
    if kind == "decode":
        return req, _decode(BUNDLE_VERSION, [req.decode.tensor], scanned, limits)
    raise ProtocolViolation("tensors outside a chunk or decode step")


def read_response(data: bytes, limits: Limits = DEFAULT_LIMITS
                  ) -> tuple[pb.SessionResponse, dict[str, np.ndarray]]:
    """Parse a SessionResponse and decode the tensors of its chunk or decode result."""
    resp, scanned = _read(data, limits, RESPONSE, parse_response)
    kind = resp.WhichOneof("kind")
    if scanned is None:
        return resp, {}
    holder = resp.chunk if kind == "chunk" else resp.decode
    if not holder.HasField("bundle"):   # a sampling tail's token without tensors
        if scanned:
            raise PayloadCorrupt("tensors outside the bundle")
        return resp, {}
    bundle = holder.bundle
    return resp, _decode(bundle.bundle_version, bundle.tensors, scanned, limits)
