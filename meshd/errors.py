"""Errors raised by meshd/, placed in the project's error tree (proto.errors).

The ground floor every room of meshd/ may import. Errors born lower down are
re-exported here so one import shows the whole tree::

    MeshdError
    ├── ProtocolError                  a remote peer's fault (proto.errors)
    │   └── ProtocolViolation
    │       ├── RecordRejected         a DHT record failed validation (dht.errors)
    │       └── CertificateMismatch    a gRPC peer's certificate is not the pinned one
    ├── LocalError                     our own misuse (proto.errors)
    │   ├── SizeError                  a human size we cannot read (--memory 4GiB)
    │   └── ConfigError                the user's configuration or command line
    │       ├── ModelPathMissing
    │       └── LayerRangeInvalid
    ├── IdentityError                  the key file is unusable (dht.errors)
    ├── HostError                      libp2p host: bad listen address, port in use,
    │                                  no bootstrap peer answered (dht.host.errors)
    ├── HopFailure                     one hop of a route failed or refused; the route
    │                                  driver fails over (.index, .peer_id, .code)
    └── DaemonError                    the environment failed us
        ├── WorkerFailed               the shard worker died or never became ready
        └── ControlUnavailable         no local daemon answers on the control socket

Every message says what to do next; the CLI prints it as one line.
"""
from __future__ import annotations

from dht.errors import IdentityError, RecordRejected
from dht.host.errors import BootstrapUnreachable, HostError, ListenAddressInvalid, PortInUse
from proto import shard_runtime_pb2 as pb
from proto.errors import LocalError, MeshdError, ProtocolViolation

__all__ = [
    "RecordRejected", "IdentityError", "HostError", "ListenAddressInvalid", "PortInUse", "BootstrapUnreachable",
    "SizeError", "ConfigError", "ModelPathMissing", "LayerRangeInvalid", "DaemonError", "WorkerFailed",
    "ControlUnavailable", "CertificateMismatch", "HopFailure",
]


class SizeError(LocalError, ValueError):
    """A human-written size (e.g. ``--memory 4GiB``) that cannot be read."""


class ConfigError(LocalError):
    """The configuration file or command line is wrong."""


class ModelPathMissing(ConfigError):
    pass


class LayerRangeInvalid(ConfigError):
    pass


class DaemonError(MeshdError):
    """The environment failed the daemon (ports, peers, the worker process)."""


class WorkerFailed(DaemonError):
    pass


class ControlUnavailable(DaemonError):
    pass


class CertificateMismatch(ProtocolViolation):
    """A gRPC peer presented a certificate other than the one its signed record pins."""


class HopFailure(MeshdError):
    """The hop at ``index`` (peer ``peer_id``) failed or refused; the route driver fails over."""

    def __init__(self, index: int, peer_id: str, detail: str, code: int = pb.ERROR_CODE_INTERNAL,
                 retry_after_ms: int = 0) -> None:
        super().__init__(f"hop {index} ({peer_id[:16]}): {detail}")
        self.index, self.peer_id, self.detail, self.code = index, peer_id, detail, code
        self.retry_after_ms = retry_after_ms   # RESOURCE_EXHAUSTED: the peer's retry hint
