"""The client side of the hop transports (proto.hop_transport): gRPC, the framed TLS port, the Unix socket.

``PeerConnector`` (routes.py) picks one per hop; a pushing worker's dialer
(meshd/cli/worker.py) picks between the first two. Each maps its own failures
to ``TransportError`` at the edge (grpc.RpcError, OSError, a bad frame), so the
hop link and the push machinery catch one type.

``GrpcTransport`` wraps a ready ``grpc.Channel`` (TLS pinned to the peer's
advertised certificate, or loopback plaintext to the node's own worker,
meshd/reach/tls.py). Its Session stream is grpcio's synchronous bidi call: the
request bodies wait in a bounded ``RequestQueue`` that grpcio drains on a
thread of its own; it carries the unary calls too.

``UnixFrameTransport`` is the worker's private Unix frame socket
(shard/edges/unix_server.py: the same frames, 4-byte length || body, the same
sans-I/O core). The route driver runs in a plain thread and blocks on each
hop anyway, so the leanest link to the worker next door is a blocking socket
in that thread: a request is written by ``sendall`` from the sender's own
thread, a response is read by ``recv`` in the receiving thread. No gRPC, no
event loop, no thread hand-off on a decode step -- the kernel's socket is the
only queue between the two processes (one frame in flight per hop, credits
bound the rest). Unary calls are not carried (UNIMPLEMENTED: the link's
in-stream release is enough; a failed one falls back to the session TTL).

``TlsFrameTransport`` is the same stream over TLS/TCP to a peer worker's
frames port (shard/edges/frame_server.py), the fast path beside its gRPC
port: the certificate must hash to the pin in the peer's signed record
(checked right after the handshake, before a byte is sent:
CertificateMismatch, never fallen back from); if the port cannot be reached,
the session goes to the pinned gRPC fallback, which also carries the unary
calls. ``kind`` says which one carried the last session. Both framed
transports cost at most about half of pinned gRPC's overhead above the hop's
compute (``meshd bench pipeline``'s ``hop_transport_overhead_ms``; figures:
docs/measurements/2026-12-01.md and 2026-12-04.md).

A framed stream's ``cancel()`` (the watchdog, a cancellation) shuts the socket
down from any thread, which wakes a blocked ``recv``.
"""
from __future__ import annotations

import hashlib
import queue
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
from proto.hop_transport import HopStream, HopTransport, TransportError, TransportStatus, Unary
from proto.limits import MAX_FRAME_BYTES
from shard.edges.grpc_server import SERVICE_NAME
from shard.experts.transport import client_tls_context
from shard.session.request_queue import RequestQueue

__all__ = ["GrpcTransport", "UnixFrameTransport", "TlsFrameTransport", "FrameStream", "SESSION_METHOD",
           "transport_error"]

SESSION_METHOD = f"/{SERVICE_NAME}/Session"
# Request bodies queued per gRPC stream before send() blocks; credit windows are smaller anyway.
SEND_QUEUE_DEPTH = 32
# No gRPC stream outlives this, whatever happens (a wedged peer is also cut by the step deadline).
STREAM_TIMEOUT_S = 6 * 3600.0
# Bytes asked of a socket per read: a decode step's answer is a few KiB, a
# prefill chunk's a few MiB (read in a few calls).
READ_BYTES = 256 * 1024
# Connecting to a local socket is immediate, or the worker is gone.
CONNECT_TIMEOUT_S = 5.0
# A peer's frames port that does not answer within this is given up for its gRPC port.
FRAMES_CONNECT_TIMEOUT_S = 3.0


def transport_error(exc: grpc.RpcError) -> TransportError:
    """grpcio's failure as ours (the status keeps gRPC's code name)."""
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    name = code.name if code is not None else "UNAVAILABLE"
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    try:
        status = TransportStatus(name)
    except ValueError:
        status = TransportStatus.INTERNAL if name != "OK" else TransportStatus.UNAVAILABLE
        details = f"{name}: {details}"
    return TransportError(details or name, status)


# -- gRPC ---------------------------------------------------------------------------------------
class GrpcStream:
    """One grpcio Session call: requests through a RequestQueue, responses by iterating the call."""

    def __init__(self, requests: RequestQueue, responses) -> None:
        self._requests, self._responses = requests, responses

    def send(self, body: bytes, timeout_s: float | None = None) -> None:
        try:
            self._requests.put(body, timeout=timeout_s)
        except queue.Full:
            raise TransportError(f"the stream took no request for {timeout_s:.0f} s",
                                 TransportStatus.DEADLINE_EXCEEDED) from None

    def receive(self) -> bytes | None:
        try:
            return next(self._responses)
        except StopIteration:
            return None
        except grpc.RpcError as exc:
            raise transport_error(exc) from exc

    def close_send(self) -> None:
        self._requests.finish()

    def cancel(self) -> None:
        self._responses.cancel()


class GrpcTransport:
    """A HopTransport over a ready grpc.Channel (see the module doc)."""

    kind = "grpc"

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel

    def open_session(self) -> GrpcStream:
        requests = RequestQueue(SEND_QUEUE_DEPTH)
        call = self.channel.stream_stream(SESSION_METHOD, request_serializer=None, response_deserializer=None)
        try:
            return GrpcStream(requests, call(requests, timeout=STREAM_TIMEOUT_S))
        except grpc.RpcError as exc:
            raise transport_error(exc) from exc

    def unary(self, method: Unary, body: bytes, timeout_s: float) -> bytes:
        call = self.channel.unary_unary(f"/{SERVICE_NAME}/{method.value}", request_serializer=None,
                                        response_deserializer=None)
        try:
            return call(body, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise transport_error(exc) from exc

    def close(self) -> None:
        self.channel.close()


# -- frames ---------------------------------------------------------------------------------------
class FrameStream:
    """One Session stream over one connected socket (Unix or TLS): a proto.hop_transport.HopStream.

    A TLS connection must not be read and written at once (a pushed route's reader thread reads
    while the driver writes): reads wait for data outside the lock, then read under the lock
    every write holds."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reader = FrameReader(MAX_FRAME_BYTES)
        self._cancelled = threading.Event()
        self._io = threading.Lock()

    def send(self, body: bytes, timeout_s: float | None = None) -> None:
        if self._cancelled.is_set():
            return                        # the stream is over; the next receive reports it
        try:
            with self._io:
                self._sock.sendall(encode_frame(body))
        except OSError:
            self.cancel()

    def close_send(self) -> None:
        try:
            socket.socket.shutdown(self._sock, socket.SHUT_WR)   # the raw socket's, also under TLS
        except OSError:
            pass

    def _bad_frame(self, exc: ProtocolError) -> TransportError:
        self.cancel()
        return TransportError(f"bad frame from the worker: {exc}", TransportStatus.INTERNAL)

    def _cancelled_error(self) -> TransportError:
        return TransportError("the call was cancelled", TransportStatus.CANCELLED)

    def receive(self) -> bytes | None:
        while True:
            try:
                body = self._reader.next_frame()
            except ProtocolError as exc:
                raise self._bad_frame(exc) from exc
            if body is not None:
                return body
            if self._cancelled.is_set():
                raise self._cancelled_error()
            try:
                pending = getattr(self._sock, "pending", None)
                if not (pending and pending()):
                    select.select([self._sock], [], [])
                with self._io:
                    data = self._sock.recv(READ_BYTES)
            except (OSError, ValueError) as exc:   # ssl.SSLError is an OSError; ValueError: closed by cancel
                if self._cancelled.is_set():
                    raise self._cancelled_error() from exc
                raise TransportError(f"the peer's socket failed: {exc}") from exc
            if not data:
                if self._cancelled.is_set():
                    raise self._cancelled_error()
                return None
            one = self._reader.take_one(data)   # one whole frame in one read: no buffering
            if one is not None:
                return one
            try:
                self._reader.feed(data)
            except ProtocolError as exc:
                raise self._bad_frame(exc) from exc

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
        raise TransportError(f"cannot reach the worker at {path}: {exc}") from exc
    sock.settimeout(None)
    return sock


def _not_carried(method: Unary, what: str) -> TransportError:
    return TransportError(f"{method.value} is not carried over {what}", TransportStatus.UNIMPLEMENTED)


class UnixFrameTransport:
    """``unix:/path`` of a worker's frame socket (see the module doc)."""

    kind = "unix"

    def __init__(self, endpoint: str) -> None:
        self.path = endpoint[len("unix:"):] if endpoint.startswith("unix:") else endpoint

    def open_session(self) -> FrameStream:
        return FrameStream(_connect_unix(self.path))

    def unary(self, method: Unary, body: bytes, timeout_s: float) -> bytes:
        raise _not_carried(method, "the frame socket")

    def close(self) -> None:
        pass


def _connect_tls(endpoint: str, pin: bytes, timeout_s: float) -> ssl.SSLSocket:
    """A TLS connection to ``endpoint`` whose certificate hashes to ``pin`` (checked before any byte
    of ours is sent); CertificateMismatch when it does not, TransportError when it cannot connect."""
    host, port = split_endpoint(endpoint)
    try:
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise TransportError(f"cannot reach the frames port {endpoint}: {exc}") from exc
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = client_tls_context().wrap_socket(raw, server_hostname=PEER_TLS_NAME)
    except (OSError, ssl.SSLError) as exc:
        raw.close()
        raise TransportError(f"TLS with the frames port {endpoint} failed: {exc}") from exc
    der = sock.getpeercert(binary_form=True) or b""
    if hashlib.sha256(der).digest() != pin:
        sock.close()
        raise CertificateMismatch(f"{endpoint} presented a certificate that does not match the pin in its "
                                  "signed record; refusing to talk to it")
    sock.settimeout(None)
    return sock


class TlsFrameTransport:
    """The framed fast path to a peer's worker, with a gRPC transport as the fallback (module doc).

    ``fallback()`` makes the pinned gRPC transport when first needed: for a session whose frames
    port cannot be reached (or whose TLS fails), and for every unary call. A certificate that does
    not match the pin is never fallen back from (CertificateMismatch)."""

    def __init__(self, endpoint: str, pin: bytes, fallback: Callable[[], HopTransport] | None = None, *,
                 connect_timeout_s: float = FRAMES_CONNECT_TIMEOUT_S) -> None:
        if len(pin) != 32:
            raise CertificateMismatch("a pin is a 32-byte SHA-256")
        self.endpoint, self.pin = endpoint, pin
        self._fallback_factory = fallback
        self._fallback: HopTransport | None = None
        self.connect_timeout_s = connect_timeout_s
        self.kind = ""             # "frames", or "grpc" when a session fell back ("": no session yet)
        self.fallback_reason = ""

    def _grpc(self) -> HopTransport:
        if self._fallback is None:
            if self._fallback_factory is None:
                raise TransportError(f"the frames port {self.endpoint} failed and there is no gRPC fallback")
            self._fallback = self._fallback_factory()
        return self._fallback

    def open_session(self) -> HopStream:
        try:
            sock = _connect_tls(self.endpoint, self.pin, self.connect_timeout_s)
        except TransportError as exc:
            if self._fallback_factory is None:
                raise
            self.kind, self.fallback_reason = "grpc", exc.detail
            return self._grpc().open_session()
        self.kind = "frames"
        return FrameStream(sock)

    def unary(self, method: Unary, body: bytes, timeout_s: float) -> bytes:
        return self._grpc().unary(method, body, timeout_s)

    def close(self) -> None:
        if self._fallback is not None:
            self._fallback.close()
