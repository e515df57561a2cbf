"""Serve the API app on the daemon's own trio loop with Hypercorn's trio HTTP/1.1 (and h2c) protocol.

``serve_api`` is a child of the daemon's nursery (``nursery.start``): it binds,
reports the bound address through ``task_status`` and serves until
cancelled. It uses Hypercorn's per-connection server (``TCPServer``) under its
own accept loop so the number of connections is bounded: at most
``max_connections`` are served at once; the next ones wait in the kernel's
listen backlog (nothing is accepted that cannot be served). Header bytes,
HTTP/2 streams and idle keep-alive are bounded in the Hypercorn config;
bodies are bounded by the app (meshd/api/app.py).
"""
from __future__ import annotations

import errno
import logging
import socket

import trio
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.utils import wrap_app

from meshd.errors import DaemonError

log = logging.getLogger(__name__)

# Request line + headers of one request while incomplete (h11's bound); the
# app checks the parsed headers against the same size (meshd/api/app.py).
MAX_HEADER_BYTES = 16 * 1024
# HTTP/2 (h2c upgrade): header list and concurrent streams per connection.
H2_MAX_HEADER_LIST_BYTES = 16 * 1024
H2_MAX_STREAMS = 16
# An idle keep-alive connection is closed after this long.
KEEP_ALIVE_S = 5.0
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


async def serve_api(app, sock: socket.socket, *, max_connections: int,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on the bound, listening ``sock`` until cancelled; started() with "http://host:port"."""
    config = hypercorn_config()
    asgi = wrap_app(app, config.wsgi_max_body_size, "asgi")
    context = WorkerContext(None)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    slots = trio.Semaphore(max_connections)
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def connection(stream: trio.SocketStream) -> None:
        try:
            await TCPServer(asgi, config, context, {}, stream)
        except Exception:  # noqa: BLE001 - one connection's failure must not stop the API
            log.exception("API connection failed")
        finally:
            slots.release()

    async with listener, trio.open_nursery() as nursery:
        task_status.started(url)
        try:
            while True:
                await slots.acquire()
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    slots.release()
                    if exc.errno not in _CAPACITY_ERRNOS:
                        raise
                    await trio.sleep(CAPACITY_SLEEP_S)
                    continue
                nursery.start_soon(connection, stream)
        finally:
            await context.terminated.set()   # idle keep-alive connections close at once
