"""Errors of the DHT side, placed in the project's error tree (proto/errors.py).

    MeshdError
    ├── ProtocolViolation
    │   └── RecordRejected     a DHT record failed validation; .reason says why
    └── IdentityError          the node's key file is unusable (fix or remove it)
"""
from __future__ import annotations

from proto.errors import MeshdError, ProtocolViolation

__all__ = ["RecordRejected", "IdentityError"]


class RecordRejected(ProtocolViolation):
    """A signed DHT record was refused; ``reason`` is one of ``REASONS``."""

    REASONS = frozenset({
        "malformed", "signature", "peer_id", "schema", "expired", "future", "replayed",
        "too_large", "key_mismatch", "kind",
    })

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in self.REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        super().__init__(f"record rejected ({reason}): {detail}")
        self.reason = reason


class IdentityError(MeshdError):
    """The node's identity key file is unusable; the message says which file and why."""
