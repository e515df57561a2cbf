"""The worker's local frame edge: the Session stream over a Unix socket, for its own daemon.

Why: a relayed session reaches the home daemon as length-prefixed frames on a
libp2p stream; forwarding them to the worker over loopback gRPC would cost a
full gRPC round trip, most of it grpcio's thread hand-offs, on every decode
step (docs/measurements/2026-11-29.md). This edge carries the SAME frames
(proto.frames: 4-byte big-endian length || SessionRequest / SessionResponse body) to the SAME
sans-I/O core (shard.session.stream.SessionStream over the worker's ShardService), so
one core now has three edges: gRPC, TLS gRPC, and this socket.

    daemon (trio) ── unix stream ──▶ SocketServer (socket_server.py): accept thread ──▶ one thread
        per connection: frame_server.serve_frames: FrameReader ─ body ─▶ push.actions.receive ─▶ sendall

Who may connect: the socket is created inside the daemon's private run
directory with mode 0600 (owner only); it never listens on a network.
Bounds: at most MAX_CONNECTIONS live connections (more are closed at once),
frames of at most MAX_FRAME_BYTES (FrameReader refuses larger with a typed
error), one frame decoded at a time per connection. A bad frame gets a typed
ShardStatus from the core on that connection only, which is then closed.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

from shard.edges.frame_server import serve_frames
from shard.edges.grpc_server import MAX_STREAMS
from shard.edges.socket_server import SocketServer, unix_listener
from shard.session.service import ShardService

__all__ = ["UnixFrameServer", "MAX_CONNECTIONS", "UNIX_SCHEME"]

# The same bound as concurrent gRPC streams: each connection holds one thread.
MAX_CONNECTIONS = MAX_STREAMS
# Endpoint spelling for a worker's socket (``unix:/path``), as gRPC spells it.
UNIX_SCHEME = "unix:"


class UnixFrameServer:
    """Serves Session streams on ``path`` until ``close()``; ``start()`` returns at once."""

    def __init__(self, service: ShardService, path: str | os.PathLike) -> None:
        self.service = service
        self.path = Path(path)
        self.server: SocketServer | None = None

    @property
    def endpoint(self) -> str:
        return UNIX_SCHEME + str(self.path)

    def start(self) -> UnixFrameServer:
        self.server = SocketServer(unix_listener(self.path), self._serve, name="shard-unix",
                                   max_connections=MAX_CONNECTIONS).start()
        return self

    def _serve(self, sock: socket.socket, _address: str) -> None:
        serve_frames(sock, self.service)

    def close_listener(self) -> None:
        """Refuse new connections (live ones are served until ``close``)."""
        if self.server is not None:
            self.server.close_listener()
        self.path.unlink(missing_ok=True)

    def close(self, timeout_s: float | None = None) -> None:
        """Close the listener and every connection; join every thread (ThreadsLeft past the bound)."""
        try:
            if self.server is not None:
                self.server.stop(timeout_s)
        finally:
            self.path.unlink(missing_ok=True)
