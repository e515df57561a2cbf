"""Shard runtime: one layer range of a model served as the ShardRuntime worker, in rooms by concern.

Rooms (data flows from the edges down to the model):

    edges/     the thin servers: gRPC (plaintext on loopback, TLS for peers), framed TLS, the
               worker's Unix socket, an expert peer's TLS port; each moves bytes between a
               socket and a core, on one SocketServer (or grpcio), and joins its threads at stop
               (and an in-memory twin for tests: the same stream core, no socket)
    push/      push forwarding: a hop sends its rows straight to its successor, the tail its
               token to the entry; the rows kept to re-feed a replacement successor
    session/   per-(route session, epoch) KV, continuous batching, admission, and the sans-I/O
               Session stream core (request bytes in, response bytes and push actions out)
    experts/   MoE: the MoE model families, expert dispatch, the holder's expert peers, an
               expert peer's store and its side of a connection
    model/     model execution and artifact identity: LayerRange and the backend protocols,
               the torch backend and its model families, the whole-model reference, digests,
               fingerprints, sampling
    errors.py  typed refusals (CACHE_MISS, EPOCH_STALE, RESOURCE_EXHAUSTED, ...), ArtifactError;
               foreign exceptions mapped (map_failure) and logged (log_failure)

Floors, top first; a room imports only the rooms below it (tests/test_layout_imports.py):

    edges > push > session | experts > model > errors.py

``session`` and ``experts`` share a floor and do not import each other.
Inside a room, modules import each other by their own path, never through
the room's ``__init__`` (which only re-exports a small, torch-free surface).

The ``meshd worker`` command that picks a backend lives in meshd/cli/worker.py, so
shard/ never imports native/.
"""
