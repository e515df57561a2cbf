"""Serve the API app on the daemon's own trio loop with Hypercorn's trio HTTP/1.1 (and h2c) protocol.

``serve_api`` is a child of the daemon's nursery (``nursery.start``): it binds,
reports the bound address through ``task_status`` and serves until
cancelled. It runs Hypercorn's per-connection server (``TCPServer``, or the
version-gated subclass of meshd/api/hypercorn_compat.py) under its own accept
loop, and the slots are meshd's (meshd/api/connections.py):

    accept (always: a full listen backlog would drop a newcomer's SYN for seconds)
      -> table.admit(peer)    a slot, or room made by closing an idle connection, or
                              refused (closed at once)
      -> connection task      Hypercorn's TCPServer in a cancel scope, beside a watcher
                              that closes the connection at its deadline (no whole
                              request yet, or idle) -- cancelling the scope closes it
    the app is wrapped by ``tracked``: each request marks its connection busy, so
    the table knows what the app is doing, whatever Hypercorn believes.

Header bytes, HTTP/2 streams and idle keep-alive are bounded in the Hypercorn
config; bodies by the app (meshd/api/app.py). Refusals, evictions and
timeouts are counted (``ConnectionTable.snapshot``, in ``meshd status``) and
logged at most once per LOG_EVERY_S.
"""
from __future__ import annotations

import errno
import logging
import socket

import trio
from hypercorn.config import Config
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.utils import wrap_app

from meshd.api import hypercorn_compat
from meshd.api.connections import ConnectionTable
from meshd.errors import DaemonError

log = logging.getLogger(__name__)

# Request line + headers of one request while incomplete (h11's bound); the
# app checks the parsed headers against the same size (meshd/api/app.py).
MAX_HEADER_BYTES = 16 * 1024
# HTTP/2 (h2c upgrade): header list and concurrent streams per connection.
H2_MAX_HEADER_LIST_BYTES = 16 * 1024
H2_MAX_STREAMS = 16
# An idle keep-alive connection is closed after this long (Hypercorn's timer; the table's IDLE_S agrees).
KEEP_ALIVE_S = 5.0
# Refused / evicted / timed-out connections are logged as one line of counts at most this often.
LOG_EVERY_S = 60.0
LISTEN_BACKLOG = 128
# accept() errors that mean "out of file descriptors / memory for now": wait, then retry.
_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
CAPACITY_SLEEP_S = 0.1


def hypercorn_config() -> Config:
    config = Config()
    config.h11_max_incomplete_size = MAX_HEADER_BYTES
    config.h2_max_header_list_size = H2_MAX_HEADER_LIST_BYTES
    config.h2_max_concurrent_streams = H2_MAX_STREAMS
    config.keep_alive_timeout = KEEP_ALIVE_S
    config.accesslog = None
    config.errorlog = logging.getLogger("meshd.api.http")
    config.include_server_header = False
    return config


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise DaemonError(f"the API cannot listen on {host}:{port}: {exc.strerror or exc}; "
                          "pass --api-listen HOST:PORT (port 0: any free one) or --api-listen off") from exc
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


def tracked(app, table: ConnectionTable):
    """ASGI middleware: each HTTP request marks its connection (the peer's host, port) busy while it runs."""
    async def asgi(scope, receive, send) -> None:
        conn = table.find(scope.get("client")) if scope["type"] == "http" else None
        if conn is None:
            await app(scope, receive, send)
            return
        table.request_started(conn)
        try:
            await app(scope, receive, send)
        finally:
            table.request_ended(conn, trio.current_time())
    return asgi


class _Log:
    """One warning line of what the table closed, at most every LOG_EVERY_S."""

    def __init__(self, table: ConnectionTable) -> None:
        self.table, self.logged, self.at = table, dict(table.counts), -LOG_EVERY_S

    def maybe(self) -> None:
        now = trio.current_time()
        if now - self.at < LOG_EVERY_S or self.table.counts == self.logged:
            return
        news = {k: v - self.logged.get(k, 0) for k, v in self.table.counts.items() if v != self.logged.get(k, 0)}
        self.logged, self.at = dict(self.table.counts), now
        log.warning("API connections closed since the last report: %s (%d open, at most %d, %d per address)",
                    ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in news.items()), len(self.table.conns),
                    self.table.max_connections, self.table.per_address)


async def serve_api(app, sock: socket.socket, *, max_connections: int, table: ConnectionTable | None = None,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on the bound, listening ``sock`` until cancelled; started() with "http://host:port"."""
    config = hypercorn_config()
    table = table if table is not None else ConnectionTable(max_connections)
    asgi = wrap_app(tracked(app, table), config.wsgi_max_body_size, "asgi")
    server_class = hypercorn_compat.server_class()
    context = WorkerContext(None)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    scopes: dict[int, trio.CancelScope] = {}
    report = _Log(table)

    async def watch(conn, scope: trio.CancelScope) -> None:
        while True:
            deadline = table.deadline(conn)
            now = trio.current_time()
            if deadline is not None and table.expire(conn, now):
                report.maybe()
                scope.cancel()
                return
            await trio.sleep_until(deadline if deadline is not None else now + table.idle_s)

    async def connection(stream: trio.SocketStream, conn) -> None:
        try:
            with trio.CancelScope() as scope:
                scopes[conn.id] = scope
                async with trio.open_nursery() as inner:
                    inner.start_soon(watch, conn, inner.cancel_scope)
                    try:
                        # hypercorn annotates an SSLStream; its own trio worker serves plain SocketStreams too.
                        await server_class(asgi, config, context, {}, stream)  # type: ignore[arg-type]
                    except Exception:  # one connection's failure must not stop the API
                        log.exception("API connection failed")
                    inner.cancel_scope.cancel()
        finally:
            scopes.pop(conn.id, None)
            table.remove(conn.id)
            await trio.aclose_forcefully(stream)

    async with listener, trio.open_nursery() as nursery:
        task_status.started(url)
        try:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    if exc.errno not in _CAPACITY_ERRNOS:
                        raise
                    await trio.sleep(CAPACITY_SLEEP_S)
                    continue
                try:
                    peer = tuple(stream.socket.getpeername()[:2])
                except OSError:          # gone before we looked
                    await trio.aclose_forcefully(stream)
                    continue
                admission = table.admit(peer, trio.current_time())
                for victim in admission.evict:
                    if victim in scopes:
                        scopes[victim].cancel()
                if admission.conn is None:
                    await trio.aclose_forcefully(stream)
                else:
                    nursery.start_soon(connection, stream, admission.conn)
                if admission.evict or admission.conn is None:
                    report.maybe()
        finally:
            await context.terminated.set()   # idle keep-alive connections close at once
