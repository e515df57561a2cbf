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

Threads: one per live stream (bounded by MAX_STREAMS); the service lock
serializes model work.
"""
from __future__ import annotations

from concurrent import futures

import grpc

from proto import shard_runtime_pb2 as pb
from proto.errors import ProtocolError
from proto.frames import parse_unary
from proto.limits import MAX_FRAME_BYTES
from shard.errors import MAX_DETAIL_CHARS
from shard.push.actions import receive, serve_control, sink_of
from shard.session.service import ShardService
from shard.session.sessions import LOCAL_OWNER
from shard.session.stream import SessionStream

SERVICE_NAME = "meshd.shard.v1.ShardRuntime"
# Concurrent RPCs one worker serves; each live Session stream holds a thread.
MAX_STREAMS = 64
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


def build_server(service: ShardService, listen: str, *, tls_listen: str | None = None,
                 tls_cert: bytes | None = None, tls_key: bytes | None = None) -> tuple[grpc.Server, int, int | None]:
    """A started-ready (not yet started) server; returns (server, port, tls_port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_STREAMS, thread_name_prefix="shard-rpc"),
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
