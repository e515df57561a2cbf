"""The meshd error tree: every error says whose fault it is.

    MeshdError                      base of everything meshd raises on purpose
    ├── ProtocolError               the REMOTE peer sent something wrong; .code is the
    │   │                           pb.ErrorCode to put in a ShardError / ShardStatus
    │   ├── PayloadCorrupt          bytes do not parse, checksum or signature fails,
    │   │                           shape/size disagree          (ERROR_CODE_PAYLOAD_CORRUPT)
    │   ├── LimitExceeded           a size or count above a named limit (limits.py)
    │   │                                                        (ERROR_CODE_LIMIT_EXCEEDED)
    │   ├── VersionUnsupported      schema / bundle version we do not speak
    │   │                                                        (ERROR_CODE_SCHEMA_UNSUPPORTED)
    │   ├── ProtocolViolation       well-formed but not allowed (missing enum, wrong order)
    │   │                                                        (ERROR_CODE_PROTOCOL_VIOLATION)
    │   └── FlowControlViolation    a chunk without credit, a grant over the window
    │                                                            (ERROR_CODE_FLOW_CONTROL_VIOLATION)
    └── LocalError                  OUR misuse: bad arguments to a codec call. A bug in
                                    the caller; never sent to a peer.

Decoders in proto/ raise only ProtocolError subclasses for bad peer input (foreign
errors -- protobuf DecodeError, zstd errors -- are mapped with ``raise ... from exc``).
Encoders raise LocalError for bad local arguments. What to do next: a ProtocolError
ends the offending stream with a ShardStatus carrying ``.code``; a LocalError is a
bug to fix on this node.
"""
from __future__ import annotations

from proto import shard_runtime_pb2 as pb

__all__ = [
    "MeshdError", "ProtocolError", "PayloadCorrupt", "LimitExceeded", "VersionUnsupported",
    "ProtocolViolation", "FlowControlViolation", "LocalError",
]


class MeshdError(Exception):
    """Base class of every error meshd raises deliberately."""


class ProtocolError(MeshdError):
    """The remote peer's fault. ``code`` is the wire ErrorCode to report back."""

    code: pb.ErrorCode = pb.ERROR_CODE_PROTOCOL_VIOLATION


class PayloadCorrupt(ProtocolError):
    """Bytes that do not parse, a failed checksum or signature, a shape/size lie."""

    code = pb.ERROR_CODE_PAYLOAD_CORRUPT


class LimitExceeded(ProtocolError):
    """A declared or actual size/count above one of our named limits."""

    code = pb.ERROR_CODE_LIMIT_EXCEEDED


class VersionUnsupported(ProtocolError):
    """A schema or bundle version this build does not speak."""

    code = pb.ERROR_CODE_SCHEMA_UNSUPPORTED


class ProtocolViolation(ProtocolError):
    """Well-formed bytes that the protocol does not allow (e.g. an UNSPECIFIED enum)."""

    code = pb.ERROR_CODE_PROTOCOL_VIOLATION


class FlowControlViolation(ProtocolError):
    """The peer sent a chunk without credit or granted more than the window."""

    code = pb.ERROR_CODE_FLOW_CONTROL_VIOLATION


class LocalError(MeshdError):
    """Our own misuse of an API (bad arguments). Never sent to a peer."""
