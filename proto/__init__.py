"""meshd wire protocol: the ShardRuntime schema and its sans-I/O codec.

Nothing in this package opens a socket, starts a task or imports trio/grpc:
bytes and messages in, messages/arrays/bytes out. Transports (gRPC, relay
streams) are thin layers elsewhere that call these functions.

Files and roles:
    shard_runtime.proto      the schema (source of truth)
    shard_runtime_pb2*.py    generated stubs, committed; ``python -m proto.gen --check``
                             fails when they drift from the schema
    gen.py                   regenerates / checks the stubs with grpcio-tools
    errors.py                the error tree (whose fault: peer -> ProtocolError, us -> LocalError)
    limits.py                every bound as a named constant with its reason; ``Limits``
    checksum.py              CRC32C (google_crc32c native) over bytes or in-place buffers
    q8.py                    q8 block encoding (32 int8 behind one float16 scale)
    tensors.py               numpy <-> NamedTensor / TensorBundle, validated before allocation
"""
from proto import shard_runtime_pb2 as pb
from proto.errors import (FlowControlViolation, LimitExceeded, LocalError, MeshdError,
                          PayloadCorrupt, ProtocolError, ProtocolViolation, VersionUnsupported)
from proto.limits import DEFAULT_LIMITS, Limits
from proto.tensors import decode_bundle, decode_tensor, encode_bundle, encode_tensor

__all__ = [
    "pb", "MeshdError", "ProtocolError", "PayloadCorrupt", "LimitExceeded", "VersionUnsupported",
    "ProtocolViolation", "FlowControlViolation", "LocalError", "Limits", "DEFAULT_LIMITS",
    "encode_tensor", "decode_tensor", "encode_bundle", "decode_bundle",
]
