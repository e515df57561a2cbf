"""The entry's own worker, reached from the driver's thread over its Unix frame socket.

The worker serves the Session stream on a private Unix socket too
(shard/unix_server.py: the same frames, 4-byte length || body, the same
sans-I/O core). The route driver runs in a plain thread and blocks on each
hop anyway, so the leanest link to the worker next door is a blocking
socket in that thread: a request is written by ``sendall`` from the
driver's own thread (``RequestQueue.attach``), a response is read by
``recv`` in the same thread when the driver asks for it. No gRPC, no event
loop, no thread hand-off on a decode step -- the kernel's socket is the only
queue between the two processes (one frame in flight per hop, credits bound
the rest).

``UnixFrameChannel`` mimics the part of ``grpc.Channel`` the hop link uses
(``stream_stream(...)(requests, timeout)`` -> a call to iterate and
``cancel()``, ``close()``); unary methods are not carried (the link's
in-stream release is enough; a failed one falls back to the session TTL).
Failures surface as ``grpc.RpcError`` subclasses, as from gRPC, so the hop
link maps them to HopFailure like any transport error. ``cancel()`` (the
watchdog, a cancellation) shuts the socket down from any thread, which wakes
a blocked ``recv``.
"""
from __future__ import annotations

import socket
import threading

import grpc

from proto.errors import ProtocolError
from proto.frames import FrameReader, encode_frame
from proto.limits import MAX_FRAME_BYTES

__all__ = ["UnixFrameChannel", "UnixLinkError"]

# Bytes asked of the socket per read: a decode step's answer is a few KiB, a
# prefill chunk's a few MiB (read in a few calls).
READ_BYTES = 256 * 1024
# Connecting to a local socket is immediate, or the worker is gone.
CONNECT_TIMEOUT_S = 5.0


class UnixLinkError(grpc.RpcError):
    """The worker's socket failed (gone, reset, a bad frame): what the hop link sees as a transport error."""

    def __init__(self, detail: str, status: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__(detail)
        self._detail, self._status = detail, status

    def code(self) -> grpc.StatusCode:
        return self._status

    def details(self) -> str:
        return self._detail


class _UnixCall:
    """One Session stream over one connection (iterate for response bodies)."""

    def __init__(self, path: str, requests) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise UnixLinkError(f"cannot reach the worker at {path}: {exc}") from exc
        self._sock.settimeout(None)
        self._reader = FrameReader(MAX_FRAME_BYTES)
        self._cancelled = threading.Event()
        self._send_lock = threading.Lock()
        if hasattr(requests, "attach"):   # our RequestQueue: bodies are written from the caller's thread
            requests.attach(self._write, self._end_writes)
        else:                             # any other iterator: a pump thread (tests)
            threading.Thread(target=self._pump, args=(requests,), name="unix-pump", daemon=True).start()

    def _write(self, body: bytes) -> None:
        if self._cancelled.is_set():
            return                        # the call is over; the next read reports it
        try:
            with self._send_lock:
                self._sock.sendall(encode_frame(body))
        except OSError:
            self.cancel()

    def _end_writes(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _pump(self, requests) -> None:
        for body in requests:
            self._write(body)
        self._end_writes()

    def __iter__(self) -> "_UnixCall":
        return self

    def __next__(self) -> bytes:
        while True:
            try:
                body = self._reader.next_frame()
            except ProtocolError as exc:
                self.cancel()
                raise UnixLinkError(f"bad frame from the worker: {exc}", grpc.StatusCode.INTERNAL) from exc
            if body is not None:
                return body
            if self._cancelled.is_set():
                raise UnixLinkError("the call was cancelled", grpc.StatusCode.CANCELLED)
            try:
                data = self._sock.recv(READ_BYTES)
            except OSError as exc:
                raise UnixLinkError(f"the worker's socket failed: {exc}") from exc
            if not data:
                if self._cancelled.is_set():
                    raise UnixLinkError("the call was cancelled", grpc.StatusCode.CANCELLED)
                raise StopIteration
            try:
                self._reader.feed(data)
            except ProtocolError as exc:
                self.cancel()
                raise UnixLinkError(f"bad frame from the worker: {exc}", grpc.StatusCode.INTERNAL) from exc

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)   # wakes a recv blocked in another thread
        except OSError:
            pass
        self._sock.close()


class UnixFrameChannel:
    """``unix:/path`` of a worker's frame socket, as a channel for the hop link."""

    def __init__(self, endpoint: str) -> None:
        self.path = endpoint[len("unix:"):] if endpoint.startswith("unix:") else endpoint

    def stream_stream(self, method: str, request_serializer=None, response_deserializer=None):
        if request_serializer is not None or response_deserializer is not None:
            raise ValueError("the frame socket carries serialized frames: use raw-bytes (de)serializers")
        if not method.endswith("/Session"):
            raise ValueError(f"only the Session method travels over the frame socket, not {method}")
        return lambda requests, timeout=None: _UnixCall(self.path, requests)

    def unary_unary(self, method: str, **_):
        def call(*args, **kwargs):
            raise UnixLinkError(f"{method} is not carried over the frame socket", grpc.StatusCode.UNIMPLEMENTED)
        return call

    def close(self) -> None:
        pass
