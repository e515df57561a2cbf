"""The gRPC edge of a shard worker: ShardRuntime over grpcio (sync server).

Thin on purpose: every method hands raw request bodies to ``ShardService`` /
``SessionStream`` and sends back the bytes they return. EVERY method is
registered with *identity* (de)serializers, so request bodies reach our code
as bytes and we do the bounded parse:

- Session: the sans-I/O core parses each frame (``proto.frames`` /
  ``proto.zerocopy``) and answers a bad one with a typed ShardStatus on that
  stream alone, exactly as over relay framing;
- unary methods (GetCapability, Health, Release, Cancel): ``parse_unary``
  (at most proto.limits.MAX_UNARY_REQUEST_BYTES) inside the handler; a
  malformed or oversized body ends that call with INVALID_ARGUMENT whose
  details start with the ErrorCode name (``ERROR_CODE_PAYLOAD_CORRUPT: ...``).

Why not grpcio's request_deserializer: a deserializer that raises sends the
call down grpcio's failed-deserialization path, which keeps about 16-20 KB
per call alive for good (a bare grpcio 1.85.1 server does the same; figures:
docs/measurements/2026-12-01.md and 2026-12-02.md);
tests/test_shard_unary_memory.py measures both paths. Messages above
proto.limits.MAX_FRAME_BYTES are refused by gRPC itself (RESOURCE_EXHAUSTED
on that call only).

Who is calling (session ownership, shard/session/sessions.py): a call on the TLS
port is a remote peer, identified by its address (``addr:<ip>``) and the
owner_token it must send; a call on the plaintext port (loopback only: the
node's own daemon) is a private edge, "local", where the daemon may name a
relayed circuit's Noise peer id in the SessionOpen.

Threads: one per live call (bounded by MAX_STREAMS), in a ThreadGroup
(``GroupExecutor``) that ``GrpcEdge.stop`` joins with a bound; the service
lock serializes model work.
"""
from __future__ import annotations

import threading
from concurrent import futures

import grpc

from proto import shard_runtime_pb2 as pb
from proto.errors import ProtocolError
from proto.frames import parse_unary
from proto.limits import MAX_FRAME_BYTES
from proto.threads import GroupStopped, ThreadGroup
from shard.errors import MAX_DETAIL_CHARS
from shard.push.actions import receive, serve_control, sink_of
from shard.session.service import ShardService
from shard.session.sessions import LOCAL_OWNER
from shard.session.stream import SessionStream

SERVICE_NAME = "meshd.shard.v1.ShardRuntime"
# Concurrent RPCs one worker serves; each live Session stream holds a thread.
MAX_STREAMS = 64
# After the grace, grpc cancels the calls still live; their handlers return at their next read or
# write. This bounds the wait for grpc to say every call is done.
STOP_TIMEOUT_S = 10.0
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_FRAME_BYTES),
    ("grpc.max_receive_message_length", MAX_FRAME_BYTES),
    # Small activations: do not wait to coalesce writes.
    ("grpc.http2.write_buffer_size", 0),
]


def caller(context) -> tuple[str, bool]:
    """(peer, private) of a call: private for the plaintext (loopback) port, else the TLS client's address."""
    if context.auth_context().get("transport_security_type") == [b"insecure"]:
        return LOCAL_OWNER.peer, True
    address = context.peer()                       # "ipv4:1.2.3.4:5678" / "ipv6:[::1]:5678"
    host = address.split(":", 1)[-1].rpartition(":")[0] or address
    return "addr:" + host.strip("[]"), False


def _session(service: ShardService):
    def handler(request_iterator, context):
        peer, private = caller(context)
        stream = SessionStream(service, peer=peer, private=private)
        for body in request_iterator:
            yield from receive(stream, body)
            if stream.closed:
                return
            if sink_of(stream) is not None:   # pushed: answers also come from other streams
                yield from serve_control(stream, request_iterator)
                return
    return handler


def unary_refusal(exc: ProtocolError) -> str:
    """The details of a refused unary call: the ErrorCode name, then the reason (bounded)."""
    text = f"{pb.ErrorCode.Name(exc.code)}: {exc}"
    return text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 3] + "..."


def _unary(fn, request_cls, *, with_caller: bool = False):
    def handler(body: bytes, context):
        try:
            request = parse_unary(request_cls, body)
        except ProtocolError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, unary_refusal(exc))
        if with_caller:
            return fn(request, caller(context)[0]).SerializeToString()
        return fn(request).SerializeToString()
    return grpc.unary_unary_rpc_method_handler(handler, request_deserializer=None, response_serializer=None)


def generic_handler(service: ShardService) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "GetCapability": _unary(service.capability, pb.CapabilityRequest),
        "Health": _unary(service.health, pb.HealthRequest),
        "Session": grpc.stream_stream_rpc_method_handler(
            _session(service), request_deserializer=None, response_serializer=None),
        "Release": _unary(service.release, pb.ReleaseRequest, with_caller=True),
        "Cancel": _unary(service.cancel, pb.CancelRequest, with_caller=True),
    })


class GroupExecutor(futures.Executor):
    """grpc's handler pool as a ThreadGroup: one thread per RPC (grpc bounds them with
    ``maximum_concurrent_rpcs``), stopped and joined with a bound by ``shutdown``.

    Why not a ThreadPoolExecutor: grpc's ``stop`` does not join its pool, and a
    ThreadPoolExecutor's threads are joined at interpreter exit with no bound, so one handler
    that never returns would hold the worker's exit. A Session stream lives for a generation,
    so a thread per RPC costs nothing a pool would save."""

    def __init__(self, name: str = "shard-rpc", *, join_timeout_s: float | None = None) -> None:
        self.threads = ThreadGroup(name) if join_timeout_s is None else ThreadGroup(name, join_timeout_s=join_timeout_s)

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        future: futures.Future = futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - the future carries it, as a pool's would
                future.set_exception(exc)
            else:
                future.set_result(result)

        try:
            self.threads.start(run, name="rpc")
        except GroupStopped as exc:     # as a ThreadPoolExecutor after shutdown
            raise RuntimeError("cannot schedule new RPCs after shutdown") from exc
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False, timeout_s: float | None = None) -> None:
        """No new RPC thread; with ``wait``, join the running ones (ThreadsLeft past the bound)."""
        self.threads.stop()
        if wait:
            self.threads.join(timeout_s)


class GrpcEdge:
    """The worker's gRPC server and the pool its handlers run in: both ours to stop and join."""

    def __init__(self, service: ShardService, listen: str, *, tls_listen: str | None = None,
                 tls_cert: bytes | None = None, tls_key: bytes | None = None) -> None:
        self.pool = GroupExecutor()
        self.server, self.port, self.tls_port = build_server(service, listen, tls_listen=tls_listen,
                                                             tls_cert=tls_cert, tls_key=tls_key, pool=self.pool)
        self._stopped: threading.Event | None = None

    def start(self) -> GrpcEdge:
        self.server.start()
        return self

    def begin_stop(self, grace_s: float) -> None:
        """Refuse new RPCs now; the live ones get ``grace_s`` to end, then grpc cancels them."""
        if self._stopped is None:
            self._stopped = self.server.stop(grace=grace_s)

    def wait_stopped(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until grpc has ended every call; whether it has."""
        return self._stopped is not None and self._stopped.wait(timeout_s)

    def stop(self, grace_s: float, timeout_s: float | None = None) -> None:
        """``begin_stop``, wait (bounded) for grpc to end its calls, then join every handler thread
        (ThreadsLeft past the bound): a handler whose call grpc cancelled returns at its next read
        or write, or once the push hub has ended the control drain it waits in."""
        self.begin_stop(grace_s)
        self.wait_stopped(grace_s + (STOP_TIMEOUT_S if timeout_s is None else timeout_s))
        self.pool.shutdown(wait=True, timeout_s=timeout_s)


def build_server(service: ShardService, listen: str, *, tls_listen: str | None = None,
                 tls_cert: bytes | None = None, tls_key: bytes | None = None,
                 pool: futures.Executor | None = None) -> tuple[grpc.Server, int, int | None]:
    """A ready (not yet started) server; returns (server, port, tls_port). Its handlers run in
    ``pool`` (default: a GroupExecutor of its own; pass one to join it at stop, as GrpcEdge does)."""
    server = grpc.server(pool if pool is not None else GroupExecutor(),
                         options=GRPC_OPTIONS, maximum_concurrent_rpcs=MAX_STREAMS)
    server.add_generic_rpc_handlers((generic_handler(service),))
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    tls_port = None
    if tls_listen:
        creds = grpc.ssl_server_credentials([(tls_key, tls_cert)])
        tls_port = server.add_secure_port(tls_listen, creds)
        if tls_port == 0:
            raise OSError(f"cannot listen (TLS) on {tls_listen}")
    return server, port, tls_port
