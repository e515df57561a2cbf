"""meshd wire protocol: the ShardRuntime schema and its sans-I/O codec.

Nothing in this package opens a socket, starts a task or imports trio/grpc:
bytes and messages in, messages/arrays/bytes out. Transports (gRPC, relay
streams) are thin layers elsewhere that call these functions. (One module
that is not codec lives here: threads.py, the house's owned-thread helper.)

Files and roles:
    shard_runtime.proto      the schema (source of truth)
    shard_runtime_pb2*.py    generated stubs, committed; ``python -m proto.gen --check``
                             fails when they drift from the schema
    gen.py                   regenerates / checks the stubs with grpcio-tools
    errors.py                the error tree (whose fault: peer -> ProtocolError, us -> LocalError)
    limits.py                every bound as a named constant with its reason; ``Limits``
    checksum.py              CRC32C (google_crc32c native) over bytes or in-place buffers
    q8.py                    q8 block encoding (32 int8 behind one float16 scale)
    dtypes.py                wire enums <-> numpy dtypes; the values the codec accepts
    tensors.py               encode: numpy -> NamedTensor / TensorBundle (PreparedTensor keeps
                             the payload as a view); re-exports decode_tensor / decode_bundle
    decoding.py              decode: every declaration checked before allocation, bounded zstd,
                             CRC32C, read-only array views
    wirescan.py              one bounded pass over a tensor frame's wire bytes: refuses element
                             counts protobuf would amplify; skeleton + payload views + headers
    frames.py                bounded parse_request / parse_response; 4-byte length-prefixed
                             frames (encode_frame, FrameReader for bytes in any pieces)
    wire.py                  hand-built serialization of tensor-carrying messages around the
                             payload (one copy; byte-identical to protobuf's)
    zerocopy.py              read_request / read_response: parse + decode with payloads left
                             in place (CRC and arrays over the received bytes)
    flow.py                  flow-control negotiation (strictest wins) and credit accounting
    chunking.py              token-aligned prefill chunk plans (default 128 tokens)
    records.py               Ed25519-signed DHT records and directives (sign, verify, parse)
    receipts.py              step receipts: a hop's signed statement of one step (digests, history), key certificates
    threads.py               ThreadGroup: how every process of the house starts, stops and joins its
                             threads (here because every folder may import proto; the codec
                             modules never import it, and it opens no socket)
    moe/                     the expert exchange: its codec (hello, rows once + per-expert indices,
                             f32 / q8; bounded decoder) and sans-I/O link states
    golden/                  committed golden frames and their generator (python -m proto.golden)

Typical use: a sender builds bytes with ``wire.request_chunk(envelope, {"h": hidden})``;
a receiver calls ``zerocopy.read_request(data)`` (or ``frames.parse_request`` +
``tensors.decode_bundle``) and maps any ``ProtocolError`` to a ShardStatus with ``.code``.
On gRPC, use these as the stream's (de)serializers -- not the stubs' FromString,
which skips every bound -- and ``limits.MAX_FRAME_BYTES`` as
grpc.max_send_message_length / grpc.max_receive_message_length. Avoid building
tensor messages with protobuf constructors on the hot path: copying a MiB payload
into a message costs milliseconds here (see ``meshd bench codec``, naive path).

Rules the parsers enforce: exactly one top-level field per SessionRequest /
SessionResponse; frames without tensors <= MAX_CONTROL_FRAME_BYTES;
SessionOpen / SessionAccepted / Envelope carry SCHEMA_VERSION_1.
"""
from proto import shard_runtime_pb2 as pb
from proto.chunking import plan_prefill_chunks
from proto.errors import (
                          FlowControlViolation,
                          LimitExceeded,
                          LocalError,
                          MeshdError,
                          PayloadCorrupt,
                          ProtocolError,
                          ProtocolViolation,
                          VersionUnsupported,
)
from proto.flow import CreditLedger, CreditWindow, negotiate
from proto.frames import FrameReader, encode_frame, parse_request, parse_response
from proto.limits import DEFAULT_LIMITS, Limits
from proto.records import RECORD_DOMAIN, sign_record, verify_record_signature
from proto.tensors import decode_bundle, decode_tensor, encode_bundle, encode_tensor
from proto.zerocopy import read_request, read_response

__all__ = [
    "pb", "MeshdError", "ProtocolError", "PayloadCorrupt", "LimitExceeded", "VersionUnsupported",
    "ProtocolViolation", "FlowControlViolation", "LocalError", "Limits", "DEFAULT_LIMITS",
    "encode_tensor", "decode_tensor", "encode_bundle", "decode_bundle",
    "parse_request", "parse_response", "encode_frame", "FrameReader",
    "negotiate", "CreditWindow", "CreditLedger", "plan_prefill_chunks",
    "RECORD_DOMAIN", "sign_record", "verify_record_signature", "read_request", "read_response",
]
