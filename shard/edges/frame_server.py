"""The worker's framed fast path for peers: the Session stream as length-prefixed frames over TLS/TCP.

Why: a decode step through gRPC pays grpcio's thread hand-offs on both ends
(the client's request-iterator thread, the server's poller and handler
threads) -- most of a hop's cost above its compute on a small CPU
(``meshd bench pipeline``: per_hop_overhead_ms beside
grpc_round_trip_floor_ms). The SAME frames (proto.frames: 4-byte big-endian
length || SessionRequest / SessionResponse body) that already travel on
relay circuits and the worker's Unix socket go here over TLS on a TCP port
of their own, to the SAME sans-I/O core (shard.session.stream.SessionStream): one
connection thread reads a frame, runs it, writes the answers; nothing else
is between the socket and the core.

    peer ── TLS/TCP ──▶ SocketServer (socket_server.py): accept thread ──▶ one thread per connection:
        TLS handshake (bounded) ─▶ serve_frames: FrameReader ─ body ─▶ push.actions.receive ─▶ sendall

gRPC stays the interoperable protocol and the fallback: the frames port is
advertised beside the gRPC endpoint in the node's signed capability record
(Reachability.frames_endpoint) and a dialer that does not know it, or cannot
reach it, uses gRPC.

Authentication: the same certificate and key as the worker's TLS gRPC port,
so the pin in the signed record (SHA-256 of the certificate's DER) covers
both; the dialer checks it right after the handshake, before sending a byte
(meshd/generate/transports.py TlsFrameTransport). Like the gRPC port, the
server does not authenticate the client: a session is bound to its stream.

Bounds: at most MAX_CONNECTIONS live connections (more are closed at once),
the handshake within HANDSHAKE_TIMEOUT_S, frames of at most MAX_FRAME_BYTES
(FrameReader refuses larger with a typed error), one frame decoded at a time
per connection; a connection idle for IDLE_TIMEOUT_S is closed (its session
lives on, bounded by the session TTL). A bad frame gets a typed ShardStatus
on that connection only, which is then closed.
"""
from __future__ import annotations

import select
import socket
import ssl
import threading

from proto.errors import ProtocolError
from proto.frames import FrameReader, encode_frame
from proto.limits import MAX_FRAME_BYTES
from shard.edges.grpc_server import MAX_STREAMS
from shard.edges.socket_server import SocketServer, tcp_listener
from shard.experts.transport import server_tls_context
from shard.push.actions import receive, sink_of, stream_ended
from shard.session.service import ShardService
from shard.session.stream import SessionStream, status_frame

__all__ = ["TlsFrameServer", "serve_frames", "MAX_CONNECTIONS", "HANDSHAKE_TIMEOUT_S", "IDLE_TIMEOUT_S"]

# The same bound as concurrent gRPC streams: each connection holds one thread.
MAX_CONNECTIONS = MAX_STREAMS
# A peer on the internet completes a TLS handshake in a few round trips.
HANDSHAKE_TIMEOUT_S = 10.0
# A route's entry may idle between tokens while its user reads; longer than any step deadline.
IDLE_TIMEOUT_S = 3600.0
# Bytes asked of the socket per read: a 1 MiB prefill chunk arrives in a few reads.
READ_BYTES = 256 * 1024


def serve_frames(conn, service: ShardService, *, idle_timeout_s: float | None = None,
                 peer: str | None = None) -> None:
    """Serve one Session stream on a connected socket until it closes, the core ends it, or a bad
    length prefix (answered with a terminal ShardStatus). Transport errors end it quietly.

    ``peer=None``: a private edge (the daemon's Unix socket), where the daemon may name a relayed
    caller; otherwise the public caller's address (TLS frames), never trusted to name anyone."""
    stream = SessionStream(service) if peer is None else SessionStream(service, peer=peer, private=False)
    reader = FrameReader(MAX_FRAME_BYTES)
    # A pushed session's answers are written by other threads (its sink) while this one reads.
    # An SSL object must not be read and written at once, so every read and write on ``conn``
    # holds ``io``; reads wait for readiness first (select), outside the lock.
    io = threading.Lock()

    def write(body: bytes) -> None:
        try:
            with io:
                conn.sendall(encode_frame(body))
        except (OSError, ssl.SSLError):
            pass                                # the peer went away; the stream's end cleans up

    def read() -> bytes:
        pending = getattr(conn, "pending", None)
        if not (pending and pending()):
            ready, _, _ = select.select([conn], [], [], idle_timeout_s)
            if not ready:
                raise TimeoutError("idle")
        with io:
            return conn.recv(READ_BYTES)

    conn.settimeout(idle_timeout_s)
    try:
        while not stream.closed:
            data = read()
            if not data:
                return                  # the peer ended the session's stream
            one = reader.take_one(data)     # the common case: one whole frame per read
            if one is None:
                try:
                    reader.feed(data)
                except ProtocolError as exc:    # bad length prefix: answer, then close
                    write(status_frame(exc, terminal=True))
                    return
            while not stream.closed and (body := one if one is not None else reader.next_frame()) is not None:
                one = None
                out = receive(stream, body)
                sink = sink_of(stream)          # pushed: other threads answer here too
                if sink is not None:
                    if not sink.attached:
                        sink.attach(write)
                    for r in out:
                        sink.emit(r)
                elif out:
                    with io:
                        conn.sendall(b"".join(encode_frame(r) for r in out))
    except (OSError, ssl.SSLError):
        pass                                # the peer went away or idled out: nothing to answer
    finally:
        stream_ended(stream)


class TlsFrameServer:
    """Serves Session frames over TLS on ``listen`` (HOST:PORT, port 0: any) until ``close()``."""

    def __init__(self, service: ShardService, listen: str, *, cert_file: str, key_file: str,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        host, _, port = listen.rpartition(":")
        self.service = service
        self.host = host.strip("[]") or "127.0.0.1"
        self.port = int(port or 0)
        self.tls = server_tls_context(cert_file, key_file)
        self.max_connections = max_connections
        self.server: SocketServer | None = None

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def start(self) -> TlsFrameServer:
        listener = tcp_listener(self.host, self.port)
        self.port = listener.getsockname()[1]
        self.server = SocketServer(listener, self._serve, name="shard-frames", max_connections=self.max_connections,
                                   tls=self.tls, handshake_timeout_s=HANDSHAKE_TIMEOUT_S).start()
        return self

    def _serve(self, sock: socket.socket, address: str) -> None:
        serve_frames(sock, self.service, idle_timeout_s=IDLE_TIMEOUT_S, peer=f"addr:{address}")

    def close_listener(self) -> None:
        """Refuse new connections (live ones are served until ``close``)."""
        if self.server is not None:
            self.server.close_listener()

    def close(self, timeout_s: float | None = None) -> None:
        """Close the listener and every connection; join every thread (ThreadsLeft past the bound)."""
        if self.server is not None:
            self.server.stop(timeout_s)
