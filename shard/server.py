"""The gRPC edge of a shard worker: ShardRuntime over grpcio (sync server).

Thin on purpose: every method hands protobuf messages or raw frame bodies to
``ShardService`` / ``SessionStream`` and sends back what they return. The
Session method is registered with *identity* (de)serializers, so request
bodies reach the sans-I/O core as bytes: the core does the bounded,
zero-copy parse and answers a bad frame with a typed ShardStatus on that
stream alone (``proto.frames`` / ``proto.zerocopy``), exactly as over relay
framing. Messages above proto.limits.MAX_FRAME_BYTES are refused by gRPC
itself (RESOURCE_EXHAUSTED on that call only).

Threads: one per live stream (bounded by MAX_STREAMS); the service lock
serializes model work.
"""
from __future__ import annotations

from concurrent import futures

import grpc

from proto import shard_runtime_pb2 as pb
from proto.limits import MAX_FRAME_BYTES
from shard.forward import serve_control
from shard.service import ShardService
from shard.stream import SessionStream

SERVICE_NAME = "meshd.shard.v1.ShardRuntime"
# Concurrent RPCs one worker serves; each live Session stream holds a thread.
MAX_STREAMS = 64
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_FRAME_BYTES),
    ("grpc.max_receive_message_length", MAX_FRAME_BYTES),
    # Small activations: do not wait to coalesce writes.
    ("grpc.http2.write_buffer_size", 0),
]


def _session(service: ShardService):
    def handler(request_iterator, context):
        stream = SessionStream(service)
        for body in request_iterator:
            for response in stream.receive(body):
                yield response
            if stream.closed:
                return
            if stream.push_sink is not None:   # pushed: answers also come from other streams
                yield from serve_control(stream, request_iterator)
                return
    return handler


def _unary(fn):
    def handler(request, context):
        return fn(request)
    return handler


def generic_handler(service: ShardService) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "GetCapability": grpc.unary_unary_rpc_method_handler(
            _unary(service.capability), request_deserializer=pb.CapabilityRequest.FromString,
            response_serializer=pb.CapabilityReport.SerializeToString),
        "Health": grpc.unary_unary_rpc_method_handler(
            _unary(service.health), request_deserializer=pb.HealthRequest.FromString,
            response_serializer=pb.HealthReport.SerializeToString),
        "Session": grpc.stream_stream_rpc_method_handler(
            _session(service), request_deserializer=None, response_serializer=None),
        "Release": grpc.unary_unary_rpc_method_handler(
            _unary(service.release), request_deserializer=pb.ReleaseRequest.FromString,
            response_serializer=pb.ReleaseResponse.SerializeToString),
        "Cancel": grpc.unary_unary_rpc_method_handler(
            _unary(service.cancel), request_deserializer=pb.CancelRequest.FromString,
            response_serializer=pb.CancelResponse.SerializeToString),
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
