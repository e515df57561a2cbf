"""Shard runtime: layer-range execution, per-session KV, the ShardRuntime gRPC worker.

Files and roles (data flows top to bottom):

    backend.py        LayerRange; RangeBackend / BackendCache protocols (torch and llama.cpp)
    artifact.py       artifact digest, recipe digest, pb.Fingerprint builder
    adapters.py       per-family build/load/forward pieces (Llama family, Gemma 3)
    torch_backend.py  TorchRangeBackend: meta build + safe_open range loading, exact forward
    reference.py      the whole-model reference (transformers CausalLM in one process)
    sessions.py       sans-I/O SessionManager: epochs, idempotency, cache miss, TTL, LRU, budget
    sampling.py       greedy / temperature / top-k / top-p, a pure function of (seed, position); logprobs
    errors.py         typed refusals (CACHE_MISS, EPOCH_STALE, RESOURCE_EXHAUSTED, ...)
    service.py        ShardService: backend + sessions + lock; capability (validated), health
    stream.py         sans-I/O Session stream core: request bytes in, response bytes out
    server.py         the grpcio edge (identity-serialized Session stream, unary RPCs)
    unix_server.py    the worker's private Unix frame socket (same stream core)

The ``meshd worker`` command that picks a backend lives in meshd/cli/worker.py, so
shard/ never imports native/.
"""
