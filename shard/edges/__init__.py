"""Edges: the thin servers that carry Session streams between a socket and the stream core.

Files and roles (one core, three socket edges and an in-memory twin; each only moves bytes):

    grpc_server.py    the grpcio edge: ShardRuntime with identity (de)serializers (Session stream,
                      unary RPCs), plaintext on loopback for the node's own daemon, TLS for peers
    frame_server.py   the framed fast path for peers: Session frames over TLS/TCP (same stream
                      core, same certificate as the TLS gRPC port); ``serve_frames`` is the
                      frame loop every framed edge shares
    unix_server.py    the worker's private Unix frame socket, for its own daemon (same stream core)
    memory.py         the in-memory twin: streams straight into a ShardService's core, with the
                      faults a test causes (a worker killed, frozen, refusing, sending bad frames)

Who owns what: each server owns its listening socket, its accept thread and
one thread per live stream (bounded by MAX_STREAMS / MAX_CONNECTIONS; the
in-memory edge has none: the core runs in the thread that receives); the
streams' state belongs to the stream core (shard/session/stream.py), pushed
sessions to shard/push/.
"""
from shard.edges.frame_server import TlsFrameServer, serve_frames
from shard.edges.grpc_server import GRPC_OPTIONS, MAX_STREAMS, SERVICE_NAME, build_server, generic_handler
from shard.edges.unix_server import UNIX_SCHEME, UnixFrameServer

__all__ = ["build_server", "generic_handler", "SERVICE_NAME", "GRPC_OPTIONS", "MAX_STREAMS",
           "TlsFrameServer", "serve_frames", "UnixFrameServer", "UNIX_SCHEME"]
