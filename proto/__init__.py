"""meshd wire protocol: the ShardRuntime schema and its sans-I/O codec.

Files and roles (grows with the codec):
    shard_runtime.proto      the schema (source of truth)
    shard_runtime_pb2*.py    generated stubs, committed; ``python -m proto.gen --check``
                             fails when they drift from the schema
    gen.py                   regenerates / checks the stubs with grpcio-tools
"""
