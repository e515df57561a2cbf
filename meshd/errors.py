"""Errors raised by the daemon, placed in the project's error tree (proto.errors).

    MeshdError
    ├── ProtocolError                  a remote peer's fault (proto.errors)
    │   └── ProtocolViolation
    │       ├── RecordRejected         a DHT record failed validation; .reason says why
    │       └── CertificateMismatch    a gRPC peer's certificate is not the pinned one
    ├── LocalError                     our own misuse (proto.errors)
    │   └── ConfigError                the user's configuration or command line
    │       ├── ModelPathMissing
    │       └── LayerRangeInvalid
    └── DaemonError                    the environment failed us
        ├── IdentityError              the key file is unusable
        ├── PortInUse
        ├── BootstrapUnreachable
        ├── WorkerFailed               the shard worker died or never became ready
        └── ControlUnavailable         no local daemon answers on the control socket

Every message says what to do next; the CLI prints it as one line.
"""
from __future__ import annotations

from proto.errors import LocalError, MeshdError, ProtocolViolation


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


class ConfigError(LocalError):
    """The configuration file or command line is wrong."""


class ModelPathMissing(ConfigError):
    pass


class LayerRangeInvalid(ConfigError):
    pass


class DaemonError(MeshdError):
    """The environment failed the daemon (ports, peers, the worker process)."""


class IdentityError(DaemonError):
    pass


class PortInUse(DaemonError):
    pass


class BootstrapUnreachable(DaemonError):
    pass


class WorkerFailed(DaemonError):
    pass


class ControlUnavailable(DaemonError):
    pass


class CertificateMismatch(ProtocolViolation):
    """A gRPC peer presented a certificate other than the one its signed record pins."""
