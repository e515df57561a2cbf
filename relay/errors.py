"""Errors of the relay layer, placed in the project's tree (proto.errors).

    MeshdError
    ├── ProtocolError                 a remote peer's fault (bad frame, oversized length)
    └── RelayError                    a relayed path is not available right now
        ├── RelayRefused              the relay answered with a non-OK status (.status):
        │                             no reservation at the destination, a limit reached,
        │                             permission denied. Try another relay or a direct path.
        ├── RelayUnreachable          the relay, the circuit or the far peer went away
        │   │                         (dial failed, stream reset, timeout). Re-plan the hop.
        │   └── LoopStopped           the trio loop a plain thread reached through a portal
        │                             (relay/portal.py) has stopped: the node is ending.
        └── WorkerUnavailable         the node's own worker did not take the session
                                      (its frame socket failed). Restart or wait for the worker.

libp2p, trio and grpc exceptions are mapped to these at the edge with
``raise ... from exc``; nothing else leaves relay/ for I/O failures. (The
host's own errors -- listen address, port, bootstrap -- are dht/host/errors.py.)
"""
from __future__ import annotations

from proto.errors import MeshdError

__all__ = ["RelayError", "RelayRefused", "RelayUnreachable", "LoopStopped", "WorkerUnavailable"]


class RelayError(MeshdError):
    """A relayed path failed; the route driver re-plans the hop."""


class RelayRefused(RelayError):
    """The relay refused a reservation or circuit; ``status`` is the circuit v2 status name."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(f"relay refused ({status}): {detail}")
        self.status = status


class RelayUnreachable(RelayError):
    """The relay, the circuit or the far peer is gone (dial failure, reset, timeout)."""


class LoopStopped(RelayUnreachable):
    """The trio loop behind a portal has stopped: whatever was asked of it will not happen."""


class WorkerUnavailable(RelayError):
    """The local shard worker did not accept or serve a relayed session."""
