"""Shard runtime: layer-range execution, per-session KV, the ShardRuntime gRPC worker.

Files and roles (data flows top to bottom):

    backend.py        LayerRange; RangeBackend / BackendCache protocols (torch and llama.cpp)
    artifact.py       artifact digest, recipe digest, pb.Fingerprint builder
    digests.py        digests computed once per file: on-disk cache keyed by (path, size, mtime_ns, inode)
    adapters.py       per-family build/load/forward pieces (Llama family, Gemma 3)
    moe_adapters.py   Qwen3-MoE / Qwen2-MoE ranges (per-expert keys stacked, eager experts, held subsets)
    moe.py            MoeDispatch: router and additions here, missing experts through an ExpertExchange
    expert_spec.py    ExpertSpec: which (layer, expert) pairs a node holds ("0-3:E4-E7")
    expert_store.py   an expert peer's weights (experts without their layers), compute, validation
    expert_pool.py    ExpertRouter: the holder's expert peers, rows once per peer, failover, byte counters
    expert_transport.py  the one exchange function: framed request/reply over a (pinned TLS) socket
    expert_server.py  the expert peer's TLS server (thread per connection, bounded)
    torch_backend.py  TorchRangeBackend: meta build + safe_open range loading, exact forward
    reference.py      the whole-model reference (transformers CausalLM in one process)
    sessions.py       sans-I/O SessionManager: epochs, idempotency, cache miss, TTL, budget,
                      owners (token + peer), per-peer quota, eviction only under pressure
    session_ids.py    SessionKey (route session id + epoch) and Owner (peer + owner-token digest)
    sampling.py       greedy / temperature / top-k / top-p, a pure function of (seed, position); logprobs
    errors.py         typed refusals (CACHE_MISS, EPOCH_STALE, RESOURCE_EXHAUSTED, ...), ArtifactError;
                      foreign exceptions mapped (map_failure) and logged (log_failure)
    worklog.py        the worker's stderr log: one line per record, traceback lines marked
    batching.py       continuous batching: streams' ready steps share one forward (leader, outside the lock)
    torch_batch.py    the torch lane's ragged batched forward (row-wise ops batched, attention per session)
    service.py        ShardService: backend + sessions + lock + batcher; capability (validated), health
    stream.py         sans-I/O Session stream core: request bytes in, response bytes out
    forward.py        push topology: pushed sessions, feeders, the entry's control stream answered
                      from other threads (ControlSink), the hooks stream.py calls
    forwarder.py      a pushed hop's stream to its successor (framed TLS fast path or gRPC); the rows it
                      keeps for a replacement
    request_queue.py  request bodies of one Session call, from the caller's thread to the transport
    server.py         the grpcio edge (identity-serialized Session stream, unary RPCs)
    frame_server.py   the framed fast path for peers: Session frames over TLS/TCP (same stream core,
                      same certificate as the TLS gRPC port); serve_frames is shared with unix_server
    unix_server.py    the worker's private Unix frame socket (same stream core)

The ``meshd worker`` command that picks a backend lives in meshd/cli/worker.py, so
shard/ never imports native/.
"""
