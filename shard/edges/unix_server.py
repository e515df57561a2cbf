"""The worker's local frame edge: the Session stream over a Unix socket, for its own daemon.

Why: a relayed session reaches the home daemon as length-prefixed frames on a
libp2p stream; forwarding them to the worker over loopback gRPC would cost a
full gRPC round trip, most of it grpcio's thread hand-offs, on every decode
step (docs/measurements/2026-11-29.md). This edge carries the SAME frames
(proto.frames: 4-byte big-endian length || SessionRequest / SessionResponse body) to the SAME
sans-I/O core (shard.session.stream.SessionStream over the worker's ShardService), so
one core now has three edges: gRPC, TLS gRPC, and this socket.

    daemon (trio) ── unix stream ──▶ accept thread ──▶ one thread per connection:
        shard.edges.frame_server.serve_frames: FrameReader ─ body ─▶ push.actions.receive ─▶ sendall

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
import threading
from pathlib import Path

from shard.edges.frame_server import serve_frames
from shard.edges.grpc_server import MAX_STREAMS
from shard.session.service import ShardService

__all__ = ["UnixFrameServer", "MAX_CONNECTIONS", "UNIX_SCHEME"]

# The same bound as concurrent gRPC streams: each connection holds one thread.
MAX_CONNECTIONS = MAX_STREAMS
# Endpoint spelling for a worker's socket (``unix:/path``), as gRPC spells it.
UNIX_SCHEME = "unix:"
_BACKLOG = 16


class UnixFrameServer:
    """Serves Session streams on ``path`` until ``close()``; ``start()`` returns at once."""

    def __init__(self, service: ShardService, path: str | os.PathLike) -> None:
        self.service = service
        self.path = Path(path)
        self._sock: socket.socket | None = None
        self._live = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = threading.Event()

    @property
    def endpoint(self) -> str:
        return UNIX_SCHEME + str(self.path)

    def start(self) -> UnixFrameServer:
        self.path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)               # the socket file is born 0600
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        sock.listen(_BACKLOG)
        self._sock = sock
        threading.Thread(target=self._accept, name="shard-unix-accept", daemon=True).start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return                      # closed
            if not self._live.acquire(blocking=False):
                conn.close()                # over MAX_CONNECTIONS: refused at once
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), name="shard-unix", daemon=True)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                serve_frames(conn, self.service)
        finally:
            self._live.release()

