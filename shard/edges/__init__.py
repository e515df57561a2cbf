"""Edges: the thin servers that carry Session streams between a socket and the stream core.

Files and roles (one core, three socket edges and an in-memory twin; each only moves bytes):

    grpc_server.py    the grpcio edge: ShardRuntime with identity (de)serializers (Session stream,
                      unary RPCs), plaintext on loopback for the node's own daemon, TLS for peers;
                      its handlers run in a GroupExecutor (a ThreadGroup), joined at stop
    frame_server.py   the framed fast path for peers: Session frames over TLS/TCP (same stream
                      core, same certificate as the TLS gRPC port); ``serve_frames`` is the
                      frame loop every framed edge shares
    unix_server.py    the worker's private Unix frame socket, for its own daemon (same stream core)
    socket_server.py  the one server under the socket edges: an accept loop, one bounded thread
                      per connection, a stop that closes, shuts down and joins everything
    expert_server.py  an expert peer's TLS edge (shard/experts/server.py runs each connection)
    worker_edges.py   a shard worker's edges together: started at once, stopped in order
    memory.py         the in-memory twin: streams straight into a ShardService's core, with the
                      faults a test causes (a worker killed, frozen, refusing, sending bad frames)

Who owns what: each server owns its listening socket and a ThreadGroup (its
accept thread, one thread per live stream, bounded by MAX_STREAMS /
MAX_CONNECTIONS) and joins it when it stops; the in-memory edge has none (the
core runs in the thread that receives); the streams' state belongs to the
stream core (shard/session/stream.py), pushed sessions to shard/push/.
"""
from shard.edges.frame_server import TlsFrameServer, serve_frames
from shard.edges.grpc_server import GRPC_OPTIONS, MAX_STREAMS, SERVICE_NAME, build_server, generic_handler
from shard.edges.socket_server import SocketServer
from shard.edges.unix_server import UNIX_SCHEME, UnixFrameServer

__all__ = ["build_server", "generic_handler", "SERVICE_NAME", "GRPC_OPTIONS", "MAX_STREAMS",
           "TlsFrameServer", "serve_frames", "UnixFrameServer", "UNIX_SCHEME", "SocketServer"]
