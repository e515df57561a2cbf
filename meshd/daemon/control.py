"""Local control API: one JSON object per line over a unix socket in the data dir.

The socket file is created mode 0600 inside the 0700 data directory: only
the user who runs the daemon can talk to it. One request per connection:
``{"op": "status"}`` -> one JSON object back (``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``). Requests are bounded (``MAX_REQUEST_BYTES``,
JSON nesting ``MAX_JSON_DEPTH`` via meshd/api/jsonbody.py) and so is the time
a client may take to send one. A connection's failure, whatever it is, ends
that connection only: the server keeps serving.

Server side is trio (``serve_control``); the client (``request``) is plain
blocking sockets, for the CLI.
"""
from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import trio

from meshd.api.jsonbody import BadJson, loads_bounded, loads_object
from meshd.errors import ControlUnavailable, DaemonError

log = logging.getLogger(__name__)

# A request is a tiny JSON object; anything bigger is not from our CLI.
MAX_REQUEST_BYTES = 64 * 1024
# Status replies carry the coverage map: bounded by the index bounds (128 peers per model).
MAX_REPLY_BYTES = 16 * 1024 * 1024
REQUEST_READ_TIMEOUT_S = 5.0
# A streamed answer comes as JSON lines; one line is one token's text.
MAX_LINE_BYTES = 1 << 20
# Generous: the first event waits for the route and the prefill.
IDLE_TIMEOUT_S = 600.0
OPS = ("ping", "status", "swarm")
# Ops answered with a stream of JSON lines (one per event) until the reply
# ends; the client closing its socket cancels the work (meshd/generate/service.py).
STREAM_OPS = ("generate",)

Handler = Callable[[dict], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
StreamHandler = Callable[[dict, Send], Awaitable[None]]


def _socket_is_live(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
            return True
        except OSError:
            return False


def _clear_stale_socket(path: Path) -> None:
    """Remove a socket file no daemon answers on (a killed one's); refuse a live one."""
    if path.exists():
        if _socket_is_live(path):
            raise DaemonError(f"another meshd is already running with this data dir ({path}); "
                              "stop it or use --data-dir")
        path.unlink()


async def serve_control(path: Path, handler: Handler, *, stream_handler: StreamHandler | None = None,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    # The probe may block up to its 1 s connect timeout: off the loop.
    await trio.to_thread.run_sync(_clear_stale_socket, path)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        await sock.bind(str(path))
    except OSError as exc:  # e.g. a path over the 107-byte AF_UNIX limit
        sock.close()
        raise DaemonError(f"cannot create the control socket {path}: {exc.strerror or exc}; "
                          "use a shorter --data-dir") from exc
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    try:
        task_status.started(path)
        await trio.serve_listeners(lambda stream: _serve_one(stream, handler, stream_handler), [listener])
    finally:
        # Synchronous on purpose: it must run when cancelled, and unlinking takes microseconds.
        path.unlink(missing_ok=True)  # noqa: ASYNC240


async def _serve_one(stream: trio.SocketStream, handler: Handler, stream_handler: StreamHandler | None) -> None:
    try:
        await _serve_request(stream, handler, stream_handler)
    except Exception:  # noqa: BLE001 - one bad connection must never stop the control server (or the daemon)
        log.exception("control connection failed")


async def _serve_request(stream: trio.SocketStream, handler: Handler, stream_handler: StreamHandler | None) -> None:
    async with stream:
        buf = b""
        with trio.move_on_after(REQUEST_READ_TIMEOUT_S):
            while b"\n" not in buf and len(buf) <= MAX_REQUEST_BYTES:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                buf += chunk
        request = _streamed_request(buf) if stream_handler is not None else None
        if request is not None:
            await _serve_stream(stream, request, stream_handler)
            return
        reply = await _answer(buf, handler)
        try:
            await stream.send_all(json.dumps(reply, sort_keys=True).encode() + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def _streamed_request(buf: bytes) -> dict | None:
    if len(buf) > MAX_REQUEST_BYTES or b"\n" not in buf:
        return None
    try:
        request = loads_object(buf.split(b"\n", 1)[0], max_bytes=MAX_REQUEST_BYTES)
    except BadJson:
        return None  # answered by _answer with the parser's message
    return request if isinstance(request, dict) and request.get("op") in STREAM_OPS else None


async def _serve_stream(stream: trio.SocketStream, request: dict, stream_handler: StreamHandler) -> None:
    """Lines ``{"ok": true, ...}`` per event, then ``{"ok": false, "error"}`` on failure; EOF cancels."""

    async def send(event: dict) -> None:
        await stream.send_all(json.dumps({"ok": True, **event}, sort_keys=True).encode() + b"\n")

    async with trio.open_nursery() as nursery:
        async def client_gone() -> None:
            while await stream.receive_some(4096):
                pass  # nothing more is expected from the client; EOF means it left
            nursery.cancel_scope.cancel()

        async def work() -> None:
            try:
                await stream_handler(request, send)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client left mid-reply
            except Exception as exc:  # noqa: BLE001 - report the failure to the client, keep serving others
                while getattr(exc, "exceptions", None):  # the first leaf of an exception group
                    exc = exc.exceptions[0]
                try:
                    await stream.send_all(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                                          .encode() + b"\n")
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            nursery.cancel_scope.cancel()

        nursery.start_soon(client_gone)
        nursery.start_soon(work)


async def _answer(buf: bytes, handler: Handler) -> dict:
    if len(buf) > MAX_REQUEST_BYTES or b"\n" not in buf:
        return {"ok": False, "error": "request too large or incomplete"}
    try:
        request = loads_bounded(buf.split(b"\n", 1)[0], max_bytes=MAX_REQUEST_BYTES)
    except BadJson as exc:
        return {"ok": False, "error": f"bad request (not JSON we accept): {exc}"}
    if not isinstance(request, dict) or request.get("op") not in OPS:
        return {"ok": False, "error": f"op must be one of {', '.join(OPS)}"}
    try:
        return {"ok": True, **await handler(request)}
    except Exception as exc:  # the handler's fault must not kill the control server
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def request(path: Path, op: str, timeout_s: float = 30.0) -> dict:
    """Blocking client: send ``{"op": op}``, return the reply object."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ControlUnavailable(f"no meshd daemon is running for {path.parent} "
                                     "(start one with `meshd join`, or pass its --data-dir)") from exc
        sock.sendall(json.dumps({"op": op}).encode() + b"\n")
        chunks, total = [], 0
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            total += len(chunk)
            if total > MAX_REPLY_BYTES:
                raise ControlUnavailable("the daemon's reply is too large")
            chunks.append(chunk)
    try:
        reply = json.loads(b"".join(chunks))
    except ValueError as exc:
        raise ControlUnavailable("the daemon's reply is not JSON") from exc
    if not reply.get("ok"):
        raise ControlUnavailable(f"the daemon refused: {reply.get('error')}")
    return reply


def stream_events(control_socket: Path, request: dict, timeout_s: float = IDLE_TIMEOUT_S) -> Iterator[dict]:
    """Send one streaming request to the daemon and yield its events (blocking)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(control_socket))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ControlUnavailable(f"no meshd daemon is running for {control_socket.parent} "
                                     "(start one with `meshd join`, or pass its --data-dir)") from exc
        sock.sendall(json.dumps(request).encode() + b"\n")
        buf = b""
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                event = json.loads(line)
                if not event.get("ok"):
                    raise ControlUnavailable(f"the daemon refused: {event.get('error')}")
                yield event
                if event.get("done"):
                    return
            chunk = sock.recv(65536)
            if not chunk:
                raise ControlUnavailable("the daemon closed the connection before the answer ended")
            buf += chunk
            if len(buf) > MAX_LINE_BYTES:
                raise ControlUnavailable("the daemon sent an oversized line")
