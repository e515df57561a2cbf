"""One server for the worker's socket edges: an accept loop and one bounded thread per connection.

The frames port (TLS), the daemon's Unix socket and an expert peer's exchange
port (TLS) differ only in what runs on a connection; the rest is here, once:

    SocketServer(listener, handle, name=..., max_connections=..., tls=...)
    start()   one accept thread in the server's ThreadGroup:
                accept ─▶ over max_connections, or stopping? closed at once (the dialer falls
                │         back to gRPC / fails over: refusing is cheaper than queueing)
                └──────▶ connection thread (same group): TCP_NODELAY, the TLS handshake
                         (bounded by handshake_timeout_s), then handle(sock, address) -- the
                         edge's loop -- until it returns; the socket is closed after it
    stop(t)   close the listener (accept returns), shut every live connection down (a
              blocked recv / select / sendall returns at once), join every thread
              against one bound: ThreadsLeft names any left, a handler's unexpected
              error is raised (both logged where they happen, too)

Who owns what: the server owns its listener, its ThreadGroup and the live
sockets; ``handle`` owns nothing beyond its call. Transport errors on a
connection (OSError, SSLError: the peer went away, the handshake failed) end
that connection quietly; anything else is a bug and reaches ``stop``.

Shutting a connection down uses the plain socket's shutdown also under TLS:
it wakes the thread without an SSL close_notify racing that thread's own
read (an SSL object must not be used from two threads at once).
"""
from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path

from proto.threads import GroupStopped, ThreadGroup

log = logging.getLogger(__name__)

__all__ = ["SocketServer", "tcp_listener", "unix_listener", "STOP_TIMEOUT_S", "BACKLOG"]

# Connections waiting for accept(): the accept thread takes them at once, a burst fits.
BACKLOG = 16
# Every connection is shut down before the join, so its thread returns from one blocking call;
# a handler in the middle of a forward finishes it first (seconds on a busy 2-core machine).
STOP_TIMEOUT_S = 10.0

Handler = Callable[[socket.socket, str], object]


def tcp_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0: any (read it back with getsockname)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def unix_listener(path: str | os.PathLike) -> socket.socket:
    """A listening Unix socket at ``path`` (a stale file there is replaced), born mode 0600."""
    Path(path).unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    return sock


class SocketServer:
    """Serves connections on ``listener`` with ``handle`` until ``stop()`` (see the module docstring)."""

    def __init__(self, listener: socket.socket, handle: Handler, *, name: str, max_connections: int,
                 tls: ssl.SSLContext | None = None, handshake_timeout_s: float | None = None,
                 stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        self.listener = listener
        self.handle = handle
        self.max_connections = max_connections
        self.tls = tls
        self.handshake_timeout_s = handshake_timeout_s
        self.threads = ThreadGroup(name, join_timeout_s=stop_timeout_s)
        self.accepted = 0
        self.refused = 0                    # over max_connections (or arriving while stopping)
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._started = False

    @property
    def address(self):
        return self.listener.getsockname()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._live)

    def start(self) -> SocketServer:
        if not self._started:
            self._started = True
            self.threads.on_stop(self._close_listener)
            self.threads.start(self._accept_loop, name="accept")
        return self

    # -- the accept thread ----------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self.threads.stopping.is_set():
            try:
                conn, address = self.listener.accept()
            except OSError:
                return                      # the listener was closed: stop()
            if not self._admit(conn):
                self.refused += 1
                conn.close()
                continue
            try:
                self.threads.start(self._serve, conn, _address_text(address), name="conn")
            except GroupStopped:
                self._drop(conn)
                conn.close()
                return
            self.accepted += 1

    def _admit(self, conn: socket.socket) -> bool:
        with self._lock:
            if self.threads.stopping.is_set() or len(self._live) >= self.max_connections:
                return False
            self._live.add(conn)
            return True

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._live.discard(sock)

    # -- a connection thread --------------------------------------------------------------
    def _serve(self, conn: socket.socket, address: str) -> None:
        sock = conn
        try:
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                wrapped = self._handshake(conn)
                if wrapped is None:
                    return
                sock = wrapped
            self.handle(sock, address)
        except (OSError, ssl.SSLError) as exc:
            log.debug("%s: connection from %s ended: %s", self.threads.name, address, exc)
        finally:
            self._drop(conn)
            self._drop(sock)
            try:
                sock.close()
            except OSError:
                pass

    def _handshake(self, conn: socket.socket) -> ssl.SSLSocket | None:
        """The TLS handshake, bounded; the wrapped socket replaces ``conn`` among the live ones
        (wrap_socket takes over conn's descriptor). None when stop() came first."""
        conn.settimeout(self.handshake_timeout_s)
        assert self.tls is not None
        sock = self.tls.wrap_socket(conn, server_side=True)
        with self._lock:
            self._live.discard(conn)
            if self.threads.stopping.is_set():
                sock.close()
                return None
            self._live.add(sock)
        return sock

    # -- stopping -------------------------------------------------------------------------
    def _close_listener(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)   # wakes the accept() of the accept thread
        except OSError:
            pass
        self.listener.close()

    def close_listener(self) -> None:
        """Refuse new connections now (the live ones keep being served until ``stop``)."""
        self._close_listener()

    def stop(self, timeout_s: float | None = None) -> None:
        """Close the listener, shut every connection down, join every thread (module docstring)."""
        self.threads.stop()                 # the listener closes first: no newcomer after this
        if not self._started:
            self._close_listener()
        with self._lock:
            live = list(self._live)
        for sock in live:
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass
        self.threads.join(timeout_s)


def _address_text(address) -> str:
    if isinstance(address, tuple) and address:
        return str(address[0])
    return "?"                              # a Unix socket's peer has no address
