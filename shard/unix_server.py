"""The worker's local frame edge: the Session stream over a Unix socket, for its own daemon.

Why: a relayed session reaches the home daemon as length-prefixed frames on a
libp2p stream; forwarding them to the worker over loopback gRPC cost a full
gRPC round trip (~1.7 ms on a small VM, most of it grpcio's thread hand-offs)
on every decode step. This edge carries the SAME frames (proto.frames: 4-byte
big-endian length || SessionRequest / SessionResponse body) to the SAME
sans-I/O core (shard.stream.SessionStream over the worker's ShardService), so
one core now has three edges: gRPC, TLS gRPC, and this socket.

    daemon (trio) ── unix stream ──▶ accept thread ──▶ one thread per connection:
        FrameReader ─ body ─▶ SessionStream.receive ─ bodies ─▶ encode_frame ─▶ sendall

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

from proto.errors import ProtocolError
from proto.frames import FrameReader, encode_frame
from proto.limits import MAX_FRAME_BYTES
from shard.server import MAX_STREAMS
from shard.service import ShardService
from shard.stream import SessionStream, _status

__all__ = ["UnixFrameServer", "MAX_CONNECTIONS", "UNIX_SCHEME"]

# The same bound as concurrent gRPC streams: each connection holds one thread.
MAX_CONNECTIONS = MAX_STREAMS
# Bytes asked of the socket per read: a 1 MiB prefill chunk arrives in a few reads.
READ_BYTES = 256 * 1024
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

    def start(self) -> "UnixFrameServer":
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
        stream = SessionStream(self.service)
        reader = FrameReader(MAX_FRAME_BYTES)
        try:
            with conn:
                while not stream.closed:
                    data = conn.recv(READ_BYTES)
                    if not data:
                        return                  # the daemon ended the session's stream
                    try:
                        reader.feed(data)
                    except ProtocolError as exc:    # bad length prefix: answer, then close
                        conn.sendall(encode_frame(_status(exc, terminal=True)))
                        return
                    while not stream.closed and (body := reader.next_frame()) is not None:
                        out = stream.receive(body)
                        sink = stream.push_sink     # pushed: other threads answer here too
                        if sink is not None:
                            if not sink.attached:
                                sink.attach(_writer(conn))
                            for r in out:
                                sink.emit(r)
                        elif out:
                            conn.sendall(b"".join(encode_frame(r) for r in out))
        except OSError:
            pass                                # the peer went away: nothing to answer
        finally:
            stream.push_closed()
            self._live.release()


def _writer(conn: socket.socket):
    def write(body: bytes) -> None:
        try:
            conn.sendall(encode_frame(body))
        except OSError:
            pass                                # the daemon went away; the stream's end cleans up
    return write
