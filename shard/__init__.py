"""Shard runtime: layer-range execution, per-session KV, the ShardRuntime gRPC worker."""
