"""Every edge of one shard worker, started together and stopped in order, every thread joined.

    WorkerEdges(service, listen=..., tls_listen=..., unix_listen=..., frames_listen=...)
    ├── grpc      GrpcEdge: ShardRuntime on the loopback port (+ the TLS port); a thread
    │             per call in its GroupExecutor
    ├── unix      UnixFrameServer (SocketServer): the daemon's frame socket
    ├── frames    TlsFrameServer (SocketServer): the peers' framed fast path
    └── push      the service's PushHub: successor readers, gRPC control pumps

``stop(grace_s)``, in this order (each step bounded; a step that fails is
logged and the next one still runs):

    1. refuse newcomers: the socket listeners close, grpc refuses new calls
    2. live gRPC calls get ``grace_s`` to end (an entry mid-generation fails over)
    3. the push hub ends every pushed session: successor streams closed, control
       drains ended -- nothing waits on a successor or an entry any more
    4. the frame and Unix connections are shut down, their threads joined
    5. grpc cancels what is left; its handler threads are joined
    6. the push threads are joined; every session's KV is released

It returns the problems (a thread that outlived its bound, a thread's
error), so the caller can say so and exit non-zero; none on a clean stop.
"""
from __future__ import annotations

import logging
from pathlib import Path

from shard.edges.frame_server import TlsFrameServer
from shard.edges.grpc_server import GrpcEdge
from shard.edges.unix_server import UnixFrameServer
from shard.push.hub import hub_of
from shard.session.service import ShardService

log = logging.getLogger(__name__)

__all__ = ["WorkerEdges", "STOP_GRACE_S"]

# Live gRPC calls get this long to end before grpc cancels them: an entry mid-generation sees its
# stream end and fails over; a second is plenty for one in-flight step to be answered.
STOP_GRACE_S = 1.0


class WorkerEdges:
    """The worker's servers (module docstring); ``start()`` then ``stop()``."""

    def __init__(self, service: ShardService, *, listen: str, tls_listen: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, unix_listen: str | None = None,
                 frames_listen: str | None = None) -> None:
        self.service = service
        self.push = hub_of(service)
        cert = Path(tls_cert).read_bytes() if tls_listen and tls_cert else None
        key = Path(tls_key).read_bytes() if tls_listen and tls_key else None
        self.grpc = GrpcEdge(service, listen, tls_listen=tls_listen, tls_cert=cert, tls_key=key)
        host = listen.rpartition(":")[0]
        self.listen = f"{host}:{self.grpc.port}"
        self.tls_listen = f"{tls_listen.rpartition(':')[0]}:{self.grpc.tls_port}" if tls_listen else None
        self.unix = UnixFrameServer(service, unix_listen) if unix_listen else None
        self.frames = (TlsFrameServer(service, frames_listen, cert_file=tls_cert, key_file=tls_key)
                       if frames_listen and tls_cert and tls_key else None)

    def start(self) -> WorkerEdges:
        self.grpc.start()
        if self.unix is not None:
            self.unix.start()
        if self.frames is not None:
            self.frames.start()
        return self

    def ready(self) -> dict:
        """Where each edge listens (the worker's ready file)."""
        return {"listen": self.listen, "tls_listen": self.tls_listen,
                "unix": self.unix.endpoint if self.unix else None,
                "frames_tls": self.frames.endpoint if self.frames else None}

    def stop(self, grace_s: float = STOP_GRACE_S, timeout_s: float | None = None) -> list[BaseException]:
        """Stop every edge in order (module docstring); the problems met, each logged (none: clean)."""
        problems: list[BaseException] = []

        def step(what: str, fn, *args) -> None:
            try:
                fn(*args)
            except Exception as exc:
                log.error("stopping the worker: %s failed", what, exc_info=exc)
                problems.append(exc)

        sockets = [s for s in (self.unix, self.frames) if s is not None]
        for server in sockets:                                  # 1. refuse newcomers
            step("closing a listener", server.close_listener)
        self.grpc.begin_stop(grace_s)
        step("the gRPC grace", self.grpc.wait_stopped, grace_s)   # 2. live calls may end
        step("ending pushed sessions", self.push.close)         # 3.
        for server in sockets:                                  # 4.
            step(f"stopping {server.endpoint}", server.close, timeout_s)
        step("stopping gRPC", self.grpc.stop, grace_s, timeout_s)   # 5.
        step("joining the push threads", self.push.join, timeout_s)  # 6.
        step("releasing the sessions", self.service.release_all)
        return problems
