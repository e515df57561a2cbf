"""The fetch port: this node's holdings served to peers over TLS, rate-limited, behind inference.

    ChunkServer(holdings, cert, key, host).start() -> port
    accept thread ──▶ one thread per connection (at most MAX_CONNECTIONS):
        TLS handshake (bounded) ─▶ loop: read a 46-byte request (wire.py), answer it

Authentication is the dialer's: our certificate's SHA-256 is in our signed
capability record (the same certificate as the worker's ports), and the
dialer checks it before it sends a byte. Like the worker's ports, we do not
authenticate the dialer: model bytes of a root are served to whoever names
the root (the root is public in the DHT; weights the swarm serves are not
secret from its members).

Uploads yield to inference, two ways:

* a token bucket (``RateLimit``) over every connection: ``rate()`` bytes per
  second, asked before each piece is sent, so the operator's upload cap
  holds, and a busy node (its worker serving a generation: the daemon
  passes ``busy()``) sends at ``busy_rate()`` instead;
* the connection threads run at the lowest CPU priority (nice 19 via
  ``setpriority`` on the thread id, Linux): on a loaded machine the
  scheduler gives the worker's compute threads the cores first, so a
  generation's step time does not grow while a peer fetches from us.

Bounds: MAX_CONNECTIONS connections (more are closed at once), the handshake
within HANDSHAKE_TIMEOUT_S, an idle connection closed after IDLE_TIMEOUT_S, a
reply never above wire.MAX_RUN_BYTES. A malformed request gets BAD_REQUEST
and the connection is closed. Threads: the accept thread and every
connection thread belong to one ThreadGroup (proto/threads.py); ``stop``
shuts every connection's socket down (a blocked read or send returns) and
closes the group (every thread joined).
"""
from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable

from meshd.fetch import wire
from meshd.fetch.holdings import Holdings
from proto.errors import ProtocolError
from proto.threads import GroupStopped, ThreadGroup

log = logging.getLogger(__name__)

__all__ = ["ChunkServer", "RateLimit", "MAX_CONNECTIONS", "UPLOAD_NICE", "lower_priority", "server_context"]

# Peers fetching from us at once: a home swarm has a handful of joiners at a time, and each
# connection holds a thread.
MAX_CONNECTIONS = 16
HANDSHAKE_TIMEOUT_S = 10.0
# A dialer that keeps its connection for its next runs asks within seconds; an idle one goes.
IDLE_TIMEOUT_S = 60.0
# Sending blocks at most this long on a peer that stopped reading.
SEND_TIMEOUT_S = 60.0
# Upload threads' CPU priority: the lowest, so inference (nice 0) always runs first.
UPLOAD_NICE = 19
# The token bucket's depth: one piece (a chunk) may go at once.
BUCKET_SECONDS = 0.25
_ACCEPT_POLL_S = 0.25


class RateLimit:
    """A token bucket over all uploads; ``rate()`` bytes/s (0: unlimited), re-read every piece."""

    def __init__(self, rate: Callable[[], float], clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate, self.clock, self.sleep = rate, clock, sleep
        self._lock = threading.Lock()
        self._tokens = 0.0
        self._last = clock()
        self.waited_s = 0.0

    def acquire(self, n: int, stop: threading.Event) -> None:
        while not stop.is_set():
            with self._lock:
                rate = self.rate()
                now = self.clock()
                if rate <= 0:
                    self._last = now
                    return
                self._tokens = min(self._tokens + (now - self._last) * rate, max(rate * BUCKET_SECONDS, n))
                self._last = now
                if self._tokens >= n:
                    self._tokens -= n
                    return
                wait = (n - self._tokens) / rate
            self.waited_s += wait
            self.sleep(min(wait, 0.5))


def lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), UPLOAD_NICE)
    except (OSError, AttributeError):   # not Linux, or not allowed: the rate limit still holds
        pass


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


class ChunkServer:
    def __init__(self, holdings: Holdings, cert_file: str, key_file: str, host: str = "127.0.0.1", *,
                 port: int = 0, rate: Callable[[], float] = lambda: 0.0) -> None:
        self.holdings = holdings
        self.ctx = server_context(cert_file, key_file)
        self.host, self.port = host, port
        self.limit = RateLimit(rate)
        self._threads = ThreadGroup("fetch-port")
        self._stop = self._threads.stopping
        self._listener: socket.socket | None = None
        self._conns: dict[int, socket.socket] = {}   # connection thread's id -> its socket
        self._lock = threading.Lock()
        self._manifests: dict[bytes, bytes] = {}
        self.bytes_sent = 0
        self.requests = 0
        self.refused = 0

    # ------------------------------------------------------------------ life
    def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        ls = socket.socket(family, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((self.host, self.port))
        ls.listen(MAX_CONNECTIONS)
        ls.settimeout(_ACCEPT_POLL_S)
        self._listener = ls
        self.port = ls.getsockname()[1]
        self._threads.on_stop(self._shutdown_all)
        self._threads.start(self._accept_loop, ls, name="accept")
        return self.port

    def _shutdown_all(self) -> None:
        """The group's stop wake-up: every connection's blocked read or send returns now."""
        with self._lock:
            conns = list(self._conns.values())
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self) -> None:
        self._threads.stop()       # no new connection starts; the open ones are shut down
        try:
            self._threads.join()
        finally:
            if self._listener is not None:
                self._listener.close()

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            with self._lock:
                if len(self._threads) - 1 >= MAX_CONNECTIONS:   # the accept thread is one of them
                    self.refused += 1
                    conn.close()
                    continue
            try:
                self._threads.start(self._serve, conn, addr, name="upload")
            except GroupStopped:
                conn.close()
                return

    # ------------------------------------------------------------------ one connection
    def _serve(self, raw: socket.socket, addr) -> None:
        lower_priority()
        me = threading.get_ident()
        with self._lock:
            self._conns[me] = raw
        if self._stop.is_set():   # stopped between the accept and here: _shutdown_all missed us
            raw.close()
            with self._lock:
                self._conns.pop(me, None)
            return
        sock = None
        try:
            raw.settimeout(HANDSHAKE_TIMEOUT_S)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            sock = self.ctx.wrap_socket(raw, server_side=True)   # takes raw's descriptor over
            with self._lock:
                self._conns[me] = sock
            if self._stop.is_set():
                return
            while not self._stop.is_set():
                sock.settimeout(IDLE_TIMEOUT_S)
                data = self._exact(sock, wire.REQUEST_BYTES)
                if data is None:
                    return
                sock.settimeout(SEND_TIMEOUT_S)
                try:
                    req = wire.decode_request(data)
                except ProtocolError as exc:
                    log.info("fetch port: bad request from %s: %s", addr[0], exc)
                    sock.sendall(wire.encode_reply_head(wire.Status.BAD_REQUEST))
                    return
                self.requests += 1
                if not self._answer(sock, req):
                    return
        except (OSError, ssl.SSLError) as exc:
            log.debug("fetch port: connection from %s ended: %s", addr[0], exc)
        finally:
            for s in (sock, raw):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass
            with self._lock:
                self._conns.pop(me, None)

    @staticmethod
    def _exact(sock, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            got = sock.recv(n - len(buf))
            if not got:
                return None
            buf += got
        return bytes(buf)

    def _answer(self, sock, req: wire.Request) -> bool:
        if req.op == wire.Op.MANIFEST:
            manifest = self.holdings.manifest(req.root)
            if manifest is None:
                sock.sendall(wire.encode_reply_head(wire.Status.UNKNOWN_MODEL))
                return True
            raw = self._manifests.get(req.root)
            if raw is None:
                raw = self._manifests[req.root] = manifest.encode()
            sock.sendall(wire.encode_reply_head(wire.Status.OK, len(raw)) + raw)
            return True
        manifest = self.holdings.manifest(req.root)
        if manifest is None:
            sock.sendall(wire.encode_reply_head(wire.Status.UNKNOWN_MODEL))
            return True
        if req.entry >= len(manifest.entries) or req.first + req.count > len(manifest.entries[req.entry].chunks):
            sock.sendall(wire.encode_reply_head(wire.Status.BAD_REQUEST))
            return False
        total = sum(manifest.chunk_span(req.entry, c)[1] for c in range(req.first, req.first + req.count))
        if total > wire.MAX_RUN_BYTES:
            sock.sendall(wire.encode_reply_head(wire.Status.BAD_REQUEST))
            return False
        views = self.holdings.read(req.root, req.entry, req.first, req.count)
        if views is None:
            sock.sendall(wire.encode_reply_head(wire.Status.NOT_HELD))
            return True
        sock.sendall(wire.encode_reply_head(wire.Status.OK, total))
        for view in views:
            self.limit.acquire(len(view), self._stop)
            sock.sendall(view)
            with self._lock:            # connection threads add at once: += alone loses counts
                self.bytes_sent += len(view)
        return True

    def status(self) -> dict:
        with self._lock:
            live = len(self._conns)
        return {"port": self.port, "connections": live, "bytes_sent": self.bytes_sent, "requests": self.requests,
                "refused": self.refused, "throttled_s": round(self.limit.waited_s, 1)}
