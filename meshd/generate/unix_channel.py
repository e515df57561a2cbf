"""Frame channels for the driver's thread: the own worker's Unix socket, a peer's framed TLS port.

The worker serves the Session stream on a private Unix socket too
(shard/edges/unix_server.py: the same frames, 4-byte length || body, the same
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

``TlsFrameChannel`` is the same call over TLS/TCP to a peer worker's frames
port (shard/edges/frame_server.py), the fast path beside its gRPC port: the
certificate must hash to the pin in the peer's signed record (checked right
after the handshake, before a byte is sent); if the port cannot be reached
the call goes to the pinned gRPC fallback, which also carries the unary
methods. Both frame channels cost at most about half of pinned gRPC's
overhead above the hop's compute (``meshd bench pipeline``'s
``hop_transport_overhead_ms``; figures: docs/measurements/2026-12-01.md and
2026-12-04.md).
"""
from __future__ import annotations

import hashlib
import select
import socket
import ssl
import threading
from collections.abc import Callable

import grpc

from meshd.errors import CertificateMismatch
from meshd.reach.tls import PEER_TLS_NAME, split_endpoint
from proto.errors import ProtocolError
from proto.frames import FrameReader, encode_frame
from proto.limits import MAX_FRAME_BYTES
from proto.threads import ThreadGroup
from shard.experts.transport import client_tls_context

__all__ = ["UnixFrameChannel", "TlsFrameChannel", "UnixLinkError"]

# Bytes asked of the socket per read: a decode step's answer is a few KiB, a
# prefill chunk's a few MiB (read in a few calls).
READ_BYTES = 256 * 1024
# Connecting to a local socket is immediate, or the worker is gone.
CONNECT_TIMEOUT_S = 5.0
# A peer's frames port that does not answer within this is given up for its gRPC port.
FRAMES_CONNECT_TIMEOUT_S = 3.0


class UnixLinkError(grpc.RpcError):
    """The worker's socket failed (gone, reset, a bad frame): what the hop link sees as a transport error."""

    def __init__(self, detail: str, status: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__(detail)
        self._detail, self._status = detail, status

    def code(self) -> grpc.StatusCode:
        return self._status

    def details(self) -> str:
        return self._detail


class _FrameCall:
    """One Session stream over one connected socket (iterate for response bodies)."""

    def __init__(self, sock, requests, *, tls: bool = False) -> None:
        self._sock = sock
        self._reader = FrameReader(MAX_FRAME_BYTES)
        self._cancelled = threading.Event()
        self._send_lock = threading.Lock()
        if hasattr(requests, "attach"):   # our RequestQueue: bodies are written from the caller's thread
            requests.attach(self._write, self._end_writes)
        elif tls:                         # one TLS connection must not be read and written from two threads
            raise ValueError("a TLS frame call takes a RequestQueue (bodies written from the reading thread)")
        else:                             # any other iterator (tests): a pump thread, which ends with
            self._threads = ThreadGroup("frame-call")   # the iterator (the driver always attaches)
            self._threads.start(self._pump, requests, name="pump")

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
            socket.socket.shutdown(self._sock, socket.SHUT_WR)   # the raw socket's, also under TLS
        except OSError:
            pass

    def _pump(self, requests) -> None:
        for body in requests:
            self._write(body)
        self._end_writes()

    def __iter__(self) -> _FrameCall:
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
                # A TLS connection must not be read and written at once (a pushed route's reader
                # thread reads while the driver writes): wait for data outside the lock, then read
                # under the lock every write holds.
                pending = getattr(self._sock, "pending", None)
                if not (pending and pending()):
                    select.select([self._sock], [], [])
                with self._send_lock:
                    data = self._sock.recv(READ_BYTES)
            except (OSError, ValueError) as exc:   # ssl.SSLError is an OSError; ValueError: closed by cancel
                if self._cancelled.is_set():
                    raise UnixLinkError("the call was cancelled", grpc.StatusCode.CANCELLED) from exc
                raise UnixLinkError(f"the peer's socket failed: {exc}") from exc
            if not data:
                if self._cancelled.is_set():
                    raise UnixLinkError("the call was cancelled", grpc.StatusCode.CANCELLED)
                raise StopIteration
            one = self._reader.take_one(data)   # one whole frame in one read: no buffering
            if one is not None:
                return one
            try:
                self._reader.feed(data)
            except ProtocolError as exc:
                self.cancel()
                raise UnixLinkError(f"bad frame from the worker: {exc}", grpc.StatusCode.INTERNAL) from exc

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        try:   # the raw socket's shutdown (also under TLS): wakes a recv blocked in another thread
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _connect_unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT_S)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise UnixLinkError(f"cannot reach the worker at {path}: {exc}") from exc
    sock.settimeout(None)
    return sock


class UnixFrameChannel:
    """``unix:/path`` of a worker's frame socket, as a channel for the hop link."""

    def __init__(self, endpoint: str) -> None:
        self.path = endpoint[len("unix:"):] if endpoint.startswith("unix:") else endpoint

    def stream_stream(self, method: str, request_serializer=None, response_deserializer=None):
        if request_serializer is not None or response_deserializer is not None:
            raise ValueError("the frame socket carries serialized frames: use raw-bytes (de)serializers")
        if not method.endswith("/Session"):
            raise ValueError(f"only the Session method travels over the frame socket, not {method}")
        return lambda requests, timeout=None: _FrameCall(_connect_unix(self.path), requests)

    def unary_unary(self, method: str, **_):
        def call(*args, **kwargs):
            raise UnixLinkError(f"{method} is not carried over the frame socket", grpc.StatusCode.UNIMPLEMENTED)
        return call

    def close(self) -> None:
        pass


def _connect_tls(endpoint: str, pin: bytes, timeout_s: float) -> ssl.SSLSocket:
    """A TLS connection to ``endpoint`` whose certificate hashes to ``pin`` (checked before any byte
    of ours is sent); CertificateMismatch when it does not, UnixLinkError when it cannot connect."""
    host, port = split_endpoint(endpoint)
    try:
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise UnixLinkError(f"cannot reach the frames port {endpoint}: {exc}") from exc
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = client_tls_context().wrap_socket(raw, server_hostname=PEER_TLS_NAME)
    except (OSError, ssl.SSLError) as exc:
        raw.close()
        raise UnixLinkError(f"TLS with the frames port {endpoint} failed: {exc}") from exc
    der = sock.getpeercert(binary_form=True) or b""
    if hashlib.sha256(der).digest() != pin:
        sock.close()
        raise CertificateMismatch(f"{endpoint} presented a certificate that does not match the pin in its "
                                  "signed record; refusing to talk to it")
    sock.settimeout(None)
    return sock


class TlsFrameChannel:
    """The framed fast path to a peer's worker (shard/edges/frame_server.py), with gRPC as the fallback.

    ``stream_stream`` opens the Session over frames on ``endpoint`` (TLS, the certificate pinned by
    ``pin`` -- the same pin as the peer's gRPC port); when the port cannot be reached or its TLS
    fails, the call goes to ``fallback()`` (a pinned gRPC channel) instead, and ``used`` says which
    one carried it. A certificate that does not match the pin is never fallen back from
    (CertificateMismatch). Unary methods (capability, release) always go through the fallback.
    """

    def __init__(self, endpoint: str, pin: bytes, fallback: Callable[[], grpc.Channel] | None = None, *,
                 connect_timeout_s: float = FRAMES_CONNECT_TIMEOUT_S) -> None:
        if len(pin) != 32:
            raise CertificateMismatch("a pin is a 32-byte SHA-256")
        self.endpoint, self.pin = endpoint, pin
        self._fallback_factory = fallback
        self._fallback: grpc.Channel | None = None
        self.connect_timeout_s = connect_timeout_s
        self.used = ""           # "frames" or "grpc", once a Session call is made
        self.fallback_reason = ""

    def _grpc(self) -> grpc.Channel:
        if self._fallback is None:
            if self._fallback_factory is None:
                raise UnixLinkError(f"the frames port {self.endpoint} failed and there is no gRPC fallback")
            self._fallback = self._fallback_factory()
        return self._fallback

    def stream_stream(self, method: str, request_serializer=None, response_deserializer=None):
        if request_serializer is not None or response_deserializer is not None:
            raise ValueError("frames carry serialized messages: use raw-bytes (de)serializers")
        if not method.endswith("/Session"):
            raise ValueError(f"only the Session method travels over frames, not {method}")

        def call(requests, timeout=None):
            try:
                sock = _connect_tls(self.endpoint, self.pin, self.connect_timeout_s)
            except UnixLinkError as exc:
                if self._fallback_factory is None:
                    raise
                self.used, self.fallback_reason = "grpc", exc.details()
                return self._grpc().stream_stream(method, request_serializer=None,
                                                  response_deserializer=None)(requests, timeout=timeout)
            self.used = "frames"
            return _FrameCall(sock, requests, tls=True)
        return call

    def unary_unary(self, method: str, **kwargs):
        return self._grpc().unary_unary(method, **kwargs)

    def close(self) -> None:
        if self._fallback is not None:
            self._fallback.close()
