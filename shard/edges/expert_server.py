"""An expert peer's edge: the expert exchange over TLS, one bounded thread per connection.

``ExpertServer(store, ...)`` listens on one TCP port with the node's
certificate (its hash is the pin in the node's signed expert record):

    holder ── TLS/TCP ──▶ SocketServer (socket_server.py): accept thread ──▶ one thread per
        connection (at most MAX_CONNECTIONS): TLS handshake (bounded) ─▶
        shard/experts/server.serve_connection: hello, then requests answered from the store

Compute runs under one lock (CPU experts gain nothing from running
concurrently), with the torch thread count set in each connection thread
(an OpenMP thread count is per thread, and the experts' numerics depend on
it: the holder computes with the same count to stay exact). ``close()``
closes the listener and every connection and joins every thread.
"""
from __future__ import annotations

import logging
import socket
import threading

from shard.edges.socket_server import SocketServer, tcp_listener
from shard.experts.server import ExpertCompute, ServerStats, serve_connection
from shard.experts.transport import server_tls_context

log = logging.getLogger(__name__)

__all__ = ["ExpertServer", "MAX_CONNECTIONS", "HANDSHAKE_TIMEOUT_S"]

# Holders keep one connection per expert peer; 64 covers a large swarm's holders.
MAX_CONNECTIONS = 64
# The TLS handshake and the hello must complete quickly.
HANDSHAKE_TIMEOUT_S = 10.0


class ExpertServer:
    """TCP (+TLS) listener; one bounded thread per connection. ``start()`` then ``close()``."""

    def __init__(self, store: ExpertCompute, *, artifact: str, recipe: str, listen: str,
                 tls_cert: str | None, tls_key: str | None, max_connections: int = MAX_CONNECTIONS,
                 threads: int | None = None) -> None:
        host, _, port = listen.rpartition(":")
        self.store = store
        self.artifact, self.recipe = artifact, recipe
        self.host = host.strip("[]") or "127.0.0.1"
        self.port = int(port or 0)
        self.tls = server_tls_context(tls_cert, tls_key) if tls_cert and tls_key else None
        self.stats = ServerStats()
        self.threads = threads              # torch threads of each connection thread (module docstring)
        self.max_connections = max_connections
        self._compute = threading.Lock()
        self.server: SocketServer | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> ExpertServer:
        listener = tcp_listener(self.host, self.port)
        self.port = listener.getsockname()[1]
        self.server = SocketServer(listener, self._serve, name="expert", max_connections=self.max_connections,
                                   tls=self.tls, handshake_timeout_s=HANDSHAKE_TIMEOUT_S).start()
        return self

    def _serve(self, sock: socket.socket, _address: str) -> None:
        with self.stats.lock:
            self.stats.connections += 1
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)
        why = serve_connection(sock, self.store, artifact=self.artifact, recipe=self.recipe,
                               compute_lock=self._compute, stats=self.stats)
        log.debug("expert connection ended: %s", why)

    def close(self, timeout_s: float | None = None) -> None:
        """Close the listener and every connection; join every thread (ThreadsLeft past the bound)."""
        if self.server is not None:
            self.server.stop(timeout_s)
