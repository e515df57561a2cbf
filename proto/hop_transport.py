"""What the entry's route driver and a pushing hop need from a hop's byte stream: one small interface.

Every way of reaching a shard worker carries the same Session frames (the
bodies of proto.frames; a frame's meaning -- deadline, epoch, identity -- is
inside it, never in transport metadata), so the driver and the push machinery
need only this much of a transport (httpx's one-method ``BaseTransport`` is
the model):

    HopTransport.open_session()   -> HopStream: one bidi Session stream
        HopStream.send(body)          a request body (blocks only on backpressure)
        HopStream.receive()           the next response body; None: the peer ended the stream
        HopStream.close_send()        half-close: no more requests
        HopStream.cancel()            from any thread; a receive blocked elsewhere raises at once
    HopTransport.unary(method, body, timeout_s)  one of the worker's unary calls (Unary), when
                                  the transport carries them
    HopTransport.close()          done with the transport (its streams are cancelled or ended)

Implementations, thinnest first (each maps its own failures to ``TransportError``):

    shard/edges/memory.py        in memory, straight to a ShardService's stream core (tests)
    meshd/generate/transports.py gRPC (pinned TLS or loopback), the framed TLS port with gRPC as its
                                 fallback, the worker's Unix frame socket
    relay/syncchannel.py         a relayed circuit (libp2p stream in the daemon's trio loop)

Threads: a stream may be sent on from one thread while another receives
(a pushed route's reader threads); ``cancel`` and ``close`` are safe from
any thread. Nothing here starts one.

Errors: a transport's own failure (unreachable, reset, cancelled, a method it
does not carry) is a ``TransportError`` whose ``status`` names it with gRPC's
code names, so a caller's message reads the same whatever carried the hop.
What the worker answers inside a frame (a ShardStatus) is not a transport
error: it arrives as a body like any other.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol

from proto import shard_runtime_pb2 as pb
from proto.errors import MeshdError

__all__ = ["HopStream", "HopTransport", "PushDialer", "TransportError", "TransportStatus", "Unary"]


class Unary(enum.Enum):
    """The worker's unary calls a driver may make (the value is the RPC's method name)."""

    CAPABILITY = "GetCapability"
    HEALTH = "Health"
    RELEASE = "Release"


class TransportStatus(enum.Enum):
    """Why a transport failed (gRPC's status names, whatever the transport)."""

    UNAVAILABLE = "UNAVAILABLE"              # cannot connect, reset, the peer went away
    CANCELLED = "CANCELLED"                  # our own cancel (the watchdog, a cancelled generation)
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # a unary call or a send past its timeout
    UNIMPLEMENTED = "UNIMPLEMENTED"          # a method this transport does not carry
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # a frame over the transport's limit
    INTERNAL = "INTERNAL"                    # a bad frame on the wire, a library surprise


class TransportError(MeshdError):
    """A hop's transport failed; ``status`` says how, ``detail`` says what happened."""

    def __init__(self, detail: str, status: TransportStatus = TransportStatus.UNAVAILABLE) -> None:
        super().__init__(f"{status.value}: {detail}")
        self.detail, self.status = detail, status


class HopStream(Protocol):
    """One Session stream to a worker (see the module doc for the threads rule)."""

    def send(self, body: bytes, timeout_s: float | None = None) -> None:
        """Queue or write one request body; waits at most ``timeout_s`` for room (TransportError:
        DEADLINE_EXCEEDED), and never raises for a stream that already ended (the next receive
        says why)."""
        ...

    def receive(self) -> bytes | None:
        """The next response body, blocking; None when the peer ended the stream cleanly."""
        ...

    def close_send(self) -> None:
        """No more requests (the peer sees the end of its request stream)."""
        ...

    def cancel(self) -> None:
        """End the stream now, from any thread: a blocked ``receive`` raises TransportError."""
        ...


class HopTransport(Protocol):
    """How one hop's worker is reached (see the module doc)."""

    @property
    def kind(self) -> str:
        """What carries the sessions: "grpc", "frames", "unix", "relayed" or "memory" (known once
        a session is open: a framed transport may fall back to gRPC)."""
        ...

    def open_session(self) -> HopStream:
        """A new Session stream (connecting if needed); TransportError when it cannot."""
        ...

    def unary(self, method: Unary, body: bytes, timeout_s: float) -> bytes:
        """One unary call's response body; TransportError (UNIMPLEMENTED when not carried)."""
        ...

    def close(self) -> None:
        ...


# How a worker reaches the successor an entry named in a push target (shard/push/successor.py).
PushDialer = Callable[[pb.PushTarget], HopTransport]
