"""An expert peer's server: expert exchange connections over TLS, answered from an ExpertStore.

``ExpertServer(store, ...)`` listens on one TCP port (TLS with the node's
certificate; its hash is the pin in the node's signed expert record) and
runs one thread per connection, at most ``MAX_CONNECTIONS`` at once:

    accept -> TLS handshake -> ServerLink (proto/moe/link.py):
      hello   -> WELCOME, or REFUSE (naming our versions and acts) and close
      request -> every item served here? compute each expert on its rows
                 (under one compute lock: CPU experts gain nothing from running
                 concurrently) -> REPLY; otherwise FAILURE naming the expert
      bad bytes, EOF, a timeout -> close the connection

``serve_connection(sock, ...)`` is that loop for one already connected
socket (tests drive it over a socket pair). Counters (connections, requests,
rows, bytes) are kept for the worker's health report.
"""
from __future__ import annotations

import logging
import socket
import ssl
import threading
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from proto import moe as W
from proto.errors import ProtocolError
from proto.moe.link import PREFIX_BYTES, ServerLink
from shard.experts.transport import recv_exactly, server_tls_context

log = logging.getLogger(__name__)

__all__ = ["ExpertServer", "ExpertCompute", "serve_connection", "ServerStats", "MAX_CONNECTIONS"]

# Holders keep one connection per expert peer; 64 covers a large swarm's holders.
MAX_CONNECTIONS = 64
# A holder idles between generations; an idle connection is closed after this.
IDLE_TIMEOUT_S = 600.0
# The TLS handshake and the hello must complete quickly.
HANDSHAKE_TIMEOUT_S = 10.0


class ExpertCompute(Protocol):
    hidden_size: int

    def serves(self, layer: int, expert: int) -> bool: ...

    def compute(self, layer: int, expert: int, rows: np.ndarray) -> np.ndarray: ...


@dataclass
class ServerStats:
    connections: int = 0
    refused: int = 0
    requests: int = 0
    rows: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_dict(self) -> dict:
        with self.lock:
            return {k: getattr(self, k) for k in ("connections", "refused", "requests", "rows",
                                                  "bytes_received", "bytes_sent")}


def _answer(store: ExpertCompute, link: ServerLink, req: W.Request, compute_lock: threading.Lock) -> bytes:
    if req.hidden != store.hidden_size:
        return link.failure(req, W.FAILURE_BAD_REQUEST, f"hidden size {req.hidden}; this model's is "
                                                         f"{store.hidden_size}")
    missing = [i.expert for i in req.items if not store.serves(req.layer, i.expert)]
    if missing:
        return link.failure(req, W.FAILURE_NOT_SERVED, f"layer {req.layer}: experts {missing[:8]} are not "
                                                        "served here")
    with compute_lock:
        outputs = [store.compute(req.layer, item.expert, req.item_rows(item)) for item in req.items]
    return link.reply(req, outputs)


def serve_connection(sock, store: ExpertCompute, *, artifact: str, recipe: str,
                     compute_lock: threading.Lock | None = None, stats: ServerStats | None = None,
                     versions: tuple[int, ...] = W.SUPPORTED_VERSIONS, acts: tuple[int, ...] = W.ACTS,
                     idle_timeout_s: float = IDLE_TIMEOUT_S) -> str:
    """Serve one connection until it closes; returns why it ended."""
    link = ServerLink(artifact=artifact, recipe=recipe, versions=versions, acts=acts)
    lock = compute_lock or threading.Lock()
    stats = stats or ServerStats()
    try:
        sock.settimeout(idle_timeout_s)
        while True:
            try:
                length = link.frame_length(recv_exactly(sock, PREFIX_BYTES))
                out, req = link.receive(recv_exactly(sock, length))
            except ProtocolError as exc:
                return f"protocol error: {exc}"
            if out:
                sock.sendall(out)
            if link.closed:
                with stats.lock:
                    stats.refused += 1
                return f"refused: {link.close_reason}"
            if req is not None:
                reply = _answer(store, link, req, lock)
                sock.sendall(reply)
                with stats.lock:
                    stats.requests += 1
                    stats.rows += sum(len(i.index) for i in req.items)
    except (OSError, ssl.SSLError) as exc:
        return f"transport: {exc}"
    finally:
        with stats.lock:
            stats.bytes_received += link.bytes_received
            stats.bytes_sent += link.bytes_sent


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
        # Compute threads of each connection thread: an OpenMP thread count is per thread, and the
        # experts' numerics depend on it (the holder must compute with the same count to stay exact).
        self.threads = threads
        self._slots = threading.BoundedSemaphore(max_connections)
        self._compute = threading.Lock()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._conns: set = set()
        self._conns_lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> ExpertServer:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(16)
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="expert-accept", daemon=True)
        self._thread.start()
        return self

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()   # over the bound: the holder retries or fails over
                continue
            threading.Thread(target=self._serve, args=(conn,), name="expert-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._conns_lock:
            self._conns.add(conn)
        with self.stats.lock:
            self.stats.connections += 1
        sock = conn
        try:
            if self.threads is not None:
                import torch

                torch.set_num_threads(self.threads)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                sock = self.tls.wrap_socket(conn, server_side=True)   # takes over conn's descriptor
                with self._conns_lock:
                    self._conns.discard(conn)
                    self._conns.add(sock)
            why = serve_connection(sock, self.store, artifact=self.artifact, recipe=self.recipe,
                                   compute_lock=self._compute, stats=self.stats)
            log.debug("expert connection ended: %s", why)
        except (OSError, ssl.SSLError) as exc:
            log.debug("expert connection failed: %s", exc)
        finally:
            try:
                sock.close()
            except OSError:
                pass
            with self._conns_lock:
                self._conns.discard(conn)
                self._conns.discard(sock)
            self._slots.release()

    def close(self) -> None:
        self._closing.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)   # wakes the accept() of the loop thread (Linux)
            except OSError:
                pass
            self._sock.close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
