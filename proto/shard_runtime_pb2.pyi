from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SchemaVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEMA_VERSION_UNSPECIFIED: _ClassVar[SchemaVersion]
    SCHEMA_VERSION_1: _ClassVar[SchemaVersion]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class ByteOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BYTE_ORDER_UNSPECIFIED: _ClassVar[ByteOrder]
    BYTE_ORDER_LITTLE_ENDIAN: _ClassVar[ByteOrder]
    BYTE_ORDER_BIG_ENDIAN: _ClassVar[ByteOrder]

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_UNSPECIFIED: _ClassVar[Compression]
    COMPRESSION_NONE: _ClassVar[Compression]
    COMPRESSION_ZSTD: _ClassVar[Compression]

class TensorEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_ENCODING_UNSPECIFIED: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_RAW: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_Q8_BLOCK32: _ClassVar[TensorEncoding]

class ChecksumAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_ALGORITHM_UNSPECIFIED: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_NONE: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_CRC32C: _ClassVar[ChecksumAlgorithm]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_PREFILL: _ClassVar[Phase]
    PHASE_DECODE: _ClassVar[Phase]
    PHASE_RELEASE: _ClassVar[Phase]
    PHASE_CANCEL: _ClassVar[Phase]

class CacheMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_MODE_UNSPECIFIED: _ClassVar[CacheMode]
    CACHE_MODE_STATELESS: _ClassVar[CacheMode]
    CACHE_MODE_PREFILL: _ClassVar[CacheMode]
    CACHE_MODE_DECODE: _ClassVar[CacheMode]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_SCHEMA_UNSUPPORTED: _ClassVar[ErrorCode]
    ERROR_CODE_FINGERPRINT_MISMATCH: _ClassVar[ErrorCode]
    ERROR_CODE_EPOCH_STALE: _ClassVar[ErrorCode]
    ERROR_CODE_SHARD_RANGE_MISMATCH: _ClassVar[ErrorCode]
    ERROR_CODE_CACHE_MISS: _ClassVar[ErrorCode]
    ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_PAYLOAD_CORRUPT: _ClassVar[ErrorCode]
    ERROR_CODE_CANCELLED: _ClassVar[ErrorCode]
    ERROR_CODE_DEADLINE_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_FLOW_CONTROL_VIOLATION: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_LIMIT_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_PROTOCOL_VIOLATION: _ClassVar[ErrorCode]
    ERROR_CODE_PERMISSION_DENIED: _ClassVar[ErrorCode]

class ServingState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVING_STATE_UNSPECIFIED: _ClassVar[ServingState]
    SERVING_STATE_SERVING: _ClassVar[ServingState]
    SERVING_STATE_DRAINING: _ClassVar[ServingState]
    SERVING_STATE_NOT_SERVING: _ClassVar[ServingState]

class RecordKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECORD_KIND_UNSPECIFIED: _ClassVar[RecordKind]
    RECORD_KIND_CAPABILITY: _ClassVar[RecordKind]
    RECORD_KIND_DIRECTIVE: _ClassVar[RecordKind]
    RECORD_KIND_RELAY: _ClassVar[RecordKind]
    RECORD_KIND_EXPERTS: _ClassVar[RecordKind]
    RECORD_KIND_EVIDENCE: _ClassVar[RecordKind]

class Backend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_UNSPECIFIED: _ClassVar[Backend]
    BACKEND_TORCH: _ClassVar[Backend]
    BACKEND_LLAMA_CPP: _ClassVar[Backend]

class DirectiveAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTIVE_ACTION_UNSPECIFIED: _ClassVar[DirectiveAction]
    DIRECTIVE_ACTION_LOAD_SHARD: _ClassVar[DirectiveAction]
    DIRECTIVE_ACTION_DROP_SHARD: _ClassVar[DirectiveAction]
SCHEMA_VERSION_UNSPECIFIED: SchemaVersion
SCHEMA_VERSION_1: SchemaVersion
DTYPE_UNSPECIFIED: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_UINT8: DType
DTYPE_INT8: DType
DTYPE_BOOL: DType
BYTE_ORDER_UNSPECIFIED: ByteOrder
BYTE_ORDER_LITTLE_ENDIAN: ByteOrder
BYTE_ORDER_BIG_ENDIAN: ByteOrder
COMPRESSION_UNSPECIFIED: Compression
COMPRESSION_NONE: Compression
COMPRESSION_ZSTD: Compression
TENSOR_ENCODING_UNSPECIFIED: TensorEncoding
TENSOR_ENCODING_RAW: TensorEncoding
TENSOR_ENCODING_Q8_BLOCK32: TensorEncoding
CHECKSUM_ALGORITHM_UNSPECIFIED: ChecksumAlgorithm
CHECKSUM_ALGORITHM_NONE: ChecksumAlgorithm
CHECKSUM_ALGORITHM_CRC32C: ChecksumAlgorithm
PHASE_UNSPECIFIED: Phase
PHASE_PREFILL: Phase
PHASE_DECODE: Phase
PHASE_RELEASE: Phase
PHASE_CANCEL: Phase
CACHE_MODE_UNSPECIFIED: CacheMode
CACHE_MODE_STATELESS: CacheMode
CACHE_MODE_PREFILL: CacheMode
CACHE_MODE_DECODE: CacheMode
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_SCHEMA_UNSUPPORTED: ErrorCode
ERROR_CODE_FINGERPRINT_MISMATCH: ErrorCode
ERROR_CODE_EPOCH_STALE: ErrorCode
ERROR_CODE_SHARD_RANGE_MISMATCH: ErrorCode
ERROR_CODE_CACHE_MISS: ErrorCode
ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode
ERROR_CODE_PAYLOAD_CORRUPT: ErrorCode
ERROR_CODE_CANCELLED: ErrorCode
ERROR_CODE_DEADLINE_EXCEEDED: ErrorCode
ERROR_CODE_FLOW_CONTROL_VIOLATION: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_LIMIT_EXCEEDED: ErrorCode
ERROR_CODE_PROTOCOL_VIOLATION: ErrorCode
ERROR_CODE_PERMISSION_DENIED: ErrorCode
SERVING_STATE_UNSPECIFIED: ServingState
SERVING_STATE_SERVING: ServingState
SERVING_STATE_DRAINING: ServingState
SERVING_STATE_NOT_SERVING: ServingState
RECORD_KIND_UNSPECIFIED: RecordKind
RECORD_KIND_CAPABILITY: RecordKind
RECORD_KIND_DIRECTIVE: RecordKind
RECORD_KIND_RELAY: RecordKind
RECORD_KIND_EXPERTS: RecordKind
RECORD_KIND_EVIDENCE: RecordKind
BACKEND_UNSPECIFIED: Backend
BACKEND_TORCH: Backend
BACKEND_LLAMA_CPP: Backend
DIRECTIVE_ACTION_UNSPECIFIED: DirectiveAction
DIRECTIVE_ACTION_LOAD_SHARD: DirectiveAction
DIRECTIVE_ACTION_DROP_SHARD: DirectiveAction

class Checksum(_message.Message):
    __slots__ = ("algorithm", "value")
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    algorithm: ChecksumAlgorithm
    value: bytes
    def __init__(self, algorithm: _Optional[_Union[ChecksumAlgorithm, str]] = ..., value: _Optional[bytes] = ...) -> None: ...

class TensorFragment(_message.Message):
    __slots__ = ("fragment_index", "fragment_count", "byte_offset", "payload")
    FRAGMENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    fragment_index: int
    fragment_count: int
    byte_offset: int
    payload: bytes
    def __init__(self, fragment_index: _Optional[int] = ..., fragment_count: _Optional[int] = ..., byte_offset: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class NamedTensor(_message.Message):
    __slots__ = ("name", "shape", "dtype", "byte_order", "total_bytes", "compression", "checksum", "fragments", "encoding")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BYTE_ORDER_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    byte_order: ByteOrder
    total_bytes: int
    compression: Compression
    checksum: Checksum
    fragments: _containers.RepeatedCompositeFieldContainer[TensorFragment]
    encoding: TensorEncoding
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., byte_order: _Optional[_Union[ByteOrder, str]] = ..., total_bytes: _Optional[int] = ..., compression: _Optional[_Union[Compression, str]] = ..., checksum: _Optional[_Union[Checksum, _Mapping]] = ..., fragments: _Optional[_Iterable[_Union[TensorFragment, _Mapping]]] = ..., encoding: _Optional[_Union[TensorEncoding, str]] = ...) -> None: ...

class TensorBundle(_message.Message):
    __slots__ = ("bundle_version", "tensors")
    BUNDLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    bundle_version: int
    tensors: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    def __init__(self, bundle_version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ...) -> None: ...

class Fingerprint(_message.Message):
    __slots__ = ("model_artifact_digest", "runtime_recipe_digest", "recipe_id", "recipe_version", "catalogue_version")
    MODEL_ARTIFACT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_RECIPE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RECIPE_ID_FIELD_NUMBER: _ClassVar[int]
    RECIPE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CATALOGUE_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_artifact_digest: str
    runtime_recipe_digest: str
    recipe_id: str
    recipe_version: str
    catalogue_version: str
    def __init__(self, model_artifact_digest: _Optional[str] = ..., runtime_recipe_digest: _Optional[str] = ..., recipe_id: _Optional[str] = ..., recipe_version: _Optional[str] = ..., catalogue_version: _Optional[str] = ...) -> None: ...

class ShardRange(_message.Message):
    __slots__ = ("start_layer", "end_layer", "effective_start_layer")
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_START_LAYER_FIELD_NUMBER: _ClassVar[int]
    start_layer: int
    end_layer: int
    effective_start_layer: int
    def __init__(self, start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., effective_start_layer: _Optional[int] = ...) -> None: ...

class PositionSpan(_message.Message):
    __slots__ = ("first_position", "token_count")
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    first_position: int
    token_count: int
    def __init__(self, first_position: _Optional[int] = ..., token_count: _Optional[int] = ...) -> None: ...

class ChunkInfo(_message.Message):
    __slots__ = ("chunk_index", "chunk_count", "final_chunk")
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    FINAL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk_index: int
    chunk_count: int
    final_chunk: bool
    def __init__(self, chunk_index: _Optional[int] = ..., chunk_count: _Optional[int] = ..., final_chunk: bool = ...) -> None: ...

class CacheExpectation(_message.Message):
    __slots__ = ("mode", "expected_past_len")
    MODE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_PAST_LEN_FIELD_NUMBER: _ClassVar[int]
    mode: CacheMode
    expected_past_len: int
    def __init__(self, mode: _Optional[_Union[CacheMode, str]] = ..., expected_past_len: _Optional[int] = ...) -> None: ...

class CacheResult(_message.Message):
    __slots__ = ("mode", "past_len", "cache_hit")
    MODE_FIELD_NUMBER: _ClassVar[int]
    PAST_LEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    mode: CacheMode
    past_len: int
    cache_hit: bool
    def __init__(self, mode: _Optional[_Union[CacheMode, str]] = ..., past_len: _Optional[int] = ..., cache_hit: bool = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("schema_version", "work_id", "route_session_id", "route_epoch", "fingerprint", "shard_range", "phase", "position", "idempotency_step", "cache_expectation", "deadline_unix_nanos", "chunk", "verify")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SHARD_RANGE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_STEP_FIELD_NUMBER: _ClassVar[int]
    CACHE_EXPECTATION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    work_id: str
    route_session_id: str
    route_epoch: int
    fingerprint: Fingerprint
    shard_range: ShardRange
    phase: Phase
    position: PositionSpan
    idempotency_step: int
    cache_expectation: CacheExpectation
    deadline_unix_nanos: int
    chunk: ChunkInfo
    verify: VerifyDrafts
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., work_id: _Optional[str] = ..., route_session_id: _Optional[str] = ..., route_epoch: _Optional[int] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., shard_range: _Optional[_Union[ShardRange, _Mapping]] = ..., phase: _Optional[_Union[Phase, str]] = ..., position: _Optional[_Union[PositionSpan, _Mapping]] = ..., idempotency_step: _Optional[int] = ..., cache_expectation: _Optional[_Union[CacheExpectation, _Mapping]] = ..., deadline_unix_nanos: _Optional[int] = ..., chunk: _Optional[_Union[ChunkInfo, _Mapping]] = ..., verify: _Optional[_Union[VerifyDrafts, _Mapping]] = ...) -> None: ...

class VerifyDrafts(_message.Message):
    __slots__ = ("draft_token_ids",)
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class ShardError(_message.Message):
    __slots__ = ("code", "detail", "retryable", "actual_past_len", "retry_after_ms")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_PAST_LEN_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    detail: str
    retryable: bool
    actual_past_len: int
    retry_after_ms: int
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., detail: _Optional[str] = ..., retryable: bool = ..., actual_past_len: _Optional[int] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class FlowControl(_message.Message):
    __slots__ = ("credits_granted", "max_inflight_chunks", "max_chunk_bytes", "max_prefill_chunk_tokens")
    CREDITS_GRANTED_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    credits_granted: int
    max_inflight_chunks: int
    max_chunk_bytes: int
    max_prefill_chunk_tokens: int
    def __init__(self, credits_granted: _Optional[int] = ..., max_inflight_chunks: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., max_prefill_chunk_tokens: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class TailOptions(_message.Message):
    __slots__ = ("return_logits", "sample", "sampling", "logprobs", "top_logprobs", "stop_token_ids", "return_hidden")
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    return_logits: bool
    sample: bool
    sampling: SamplingParams
    logprobs: bool
    top_logprobs: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    return_hidden: bool
    def __init__(self, return_logits: bool = ..., sample: bool = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., logprobs: bool = ..., top_logprobs: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., return_hidden: bool = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TailSample(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("schema_version", "route_session_id", "route_epoch", "fingerprint", "shard_range", "proposed_flow_control", "accepted_compression", "tail", "max_tokens", "owner_token", "relayed_peer_id", "push_next", "push", "push_feed", "push_loop", "push_loop_from")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SHARD_RANGE_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FLOW_CONTROL_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RELAYED_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PUSH_NEXT_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PUSH_FEED_FIELD_NUMBER: _ClassVar[int]
    PUSH_LOOP_FIELD_NUMBER: _ClassVar[int]
    PUSH_LOOP_FROM_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    route_session_id: str
    route_epoch: int
    fingerprint: Fingerprint
    shard_range: ShardRange
    proposed_flow_control: FlowControl
    accepted_compression: _containers.RepeatedScalarFieldContainer[Compression]
    tail: TailOptions
    max_tokens: int
    owner_token: bytes
    relayed_peer_id: str
    push_next: PushTarget
    push: bool
    push_feed: bool
    push_loop: bool
    push_loop_from: int
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., route_session_id: _Optional[str] = ..., route_epoch: _Optional[int] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., shard_range: _Optional[_Union[ShardRange, _Mapping]] = ..., proposed_flow_control: _Optional[_Union[FlowControl, _Mapping]] = ..., accepted_compression: _Optional[_Iterable[_Union[Compression, str]]] = ..., tail: _Optional[_Union[TailOptions, _Mapping]] = ..., max_tokens: _Optional[int] = ..., owner_token: _Optional[bytes] = ..., relayed_peer_id: _Optional[str] = ..., push_next: _Optional[_Union[PushTarget, _Mapping]] = ..., push: bool = ..., push_feed: bool = ..., push_loop: bool = ..., push_loop_from: _Optional[int] = ...) -> None: ...

class PushTarget(_message.Message):
    __slots__ = ("peer_id", "endpoint", "tls_cert_sha256", "shard_range", "route_epoch", "owner_token", "frames_endpoint")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TLS_CERT_SHA256_FIELD_NUMBER: _ClassVar[int]
    SHARD_RANGE_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FRAMES_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    endpoint: str
    tls_cert_sha256: bytes
    shard_range: ShardRange
    route_epoch: int
    owner_token: bytes
    frames_endpoint: str
    def __init__(self, peer_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., tls_cert_sha256: _Optional[bytes] = ..., shard_range: _Optional[_Union[ShardRange, _Mapping]] = ..., route_epoch: _Optional[int] = ..., owner_token: _Optional[bytes] = ..., frames_endpoint: _Optional[str] = ...) -> None: ...

class SessionAccepted(_message.Message):
    __slots__ = ("schema_version", "route_session_id", "route_epoch", "flow_control", "accepted_compression", "fingerprint", "past_len", "receipt_key")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FLOW_CONTROL_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PAST_LEN_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_KEY_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    route_session_id: str
    route_epoch: int
    flow_control: FlowControl
    accepted_compression: _containers.RepeatedScalarFieldContainer[Compression]
    fingerprint: Fingerprint
    past_len: int
    receipt_key: KeyDelegation
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., route_session_id: _Optional[str] = ..., route_epoch: _Optional[int] = ..., flow_control: _Optional[_Union[FlowControl, _Mapping]] = ..., accepted_compression: _Optional[_Iterable[_Union[Compression, str]]] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., past_len: _Optional[int] = ..., receipt_key: _Optional[_Union[KeyDelegation, _Mapping]] = ...) -> None: ...

class ActivationChunk(_message.Message):
    __slots__ = ("envelope", "bundle", "sample", "receipt", "verify")
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    envelope: Envelope
    bundle: TensorBundle
    sample: TailSample
    receipt: bytes
    verify: VerifyResult
    def __init__(self, envelope: _Optional[_Union[Envelope, _Mapping]] = ..., bundle: _Optional[_Union[TensorBundle, _Mapping]] = ..., sample: _Optional[_Union[TailSample, _Mapping]] = ..., receipt: _Optional[bytes] = ..., verify: _Optional[_Union[VerifyResult, _Mapping]] = ...) -> None: ...

class DecodeStep(_message.Message):
    __slots__ = ("idempotency_step", "position", "expected_past_len", "tensor", "work_id", "deadline_unix_nanos", "legs", "route_execution_nanos")
    IDEMPOTENCY_STEP_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_PAST_LEN_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    LEGS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EXECUTION_NANOS_FIELD_NUMBER: _ClassVar[int]
    idempotency_step: int
    position: int
    expected_past_len: int
    tensor: NamedTensor
    work_id: str
    deadline_unix_nanos: int
    legs: int
    route_execution_nanos: int
    def __init__(self, idempotency_step: _Optional[int] = ..., position: _Optional[int] = ..., expected_past_len: _Optional[int] = ..., tensor: _Optional[_Union[NamedTensor, _Mapping]] = ..., work_id: _Optional[str] = ..., deadline_unix_nanos: _Optional[int] = ..., legs: _Optional[int] = ..., route_execution_nanos: _Optional[int] = ...) -> None: ...

class DecodeResult(_message.Message):
    __slots__ = ("idempotency_step", "past_len", "duplicate", "execution_nanos", "bundle", "sample", "legs", "receipt")
    IDEMPOTENCY_STEP_FIELD_NUMBER: _ClassVar[int]
    PAST_LEN_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_NANOS_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    LEGS_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    idempotency_step: int
    past_len: int
    duplicate: bool
    execution_nanos: int
    bundle: TensorBundle
    sample: TailSample
    legs: int
    receipt: bytes
    def __init__(self, idempotency_step: _Optional[int] = ..., past_len: _Optional[int] = ..., duplicate: bool = ..., execution_nanos: _Optional[int] = ..., bundle: _Optional[_Union[TensorBundle, _Mapping]] = ..., sample: _Optional[_Union[TailSample, _Mapping]] = ..., legs: _Optional[int] = ..., receipt: _Optional[bytes] = ...) -> None: ...

class ReleaseSignal(_message.Message):
    __slots__ = ("route_session_id", "route_epoch", "work_id")
    ROUTE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    route_session_id: str
    route_epoch: int
    work_id: str
    def __init__(self, route_session_id: _Optional[str] = ..., route_epoch: _Optional[int] = ..., work_id: _Optional[str] = ...) -> None: ...

class CancelSignal(_message.Message):
    __slots__ = ("route_session_id", "route_epoch", "work_id", "reason")
    ROUTE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    route_session_id: str
    route_epoch: int
    work_id: str
    reason: str
    def __init__(self, route_session_id: _Optional[str] = ..., route_epoch: _Optional[int] = ..., work_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("work_id", "idempotency_step", "cache_result", "duplicate", "execution_nanos")
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_STEP_FIELD_NUMBER: _ClassVar[int]
    CACHE_RESULT_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_NANOS_FIELD_NUMBER: _ClassVar[int]
    work_id: str
    idempotency_step: int
    cache_result: CacheResult
    duplicate: bool
    execution_nanos: int
    def __init__(self, work_id: _Optional[str] = ..., idempotency_step: _Optional[int] = ..., cache_result: _Optional[_Union[CacheResult, _Mapping]] = ..., duplicate: bool = ..., execution_nanos: _Optional[int] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("work_id", "route_session_id", "idempotency_step", "error", "terminal", "failed_peer_id")
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_STEP_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    FAILED_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    work_id: str
    route_session_id: str
    idempotency_step: int
    error: ShardError
    terminal: bool
    failed_peer_id: str
    def __init__(self, work_id: _Optional[str] = ..., route_session_id: _Optional[str] = ..., idempotency_step: _Optional[int] = ..., error: _Optional[_Union[ShardError, _Mapping]] = ..., terminal: bool = ..., failed_peer_id: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("open", "chunk", "decode", "flow_control", "release", "cancel", "repoint")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    FLOW_CONTROL_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    REPOINT_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    chunk: ActivationChunk
    decode: DecodeStep
    flow_control: FlowControl
    release: ReleaseSignal
    cancel: CancelSignal
    repoint: PushRepoint
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., chunk: _Optional[_Union[ActivationChunk, _Mapping]] = ..., decode: _Optional[_Union[DecodeStep, _Mapping]] = ..., flow_control: _Optional[_Union[FlowControl, _Mapping]] = ..., release: _Optional[_Union[ReleaseSignal, _Mapping]] = ..., cancel: _Optional[_Union[CancelSignal, _Mapping]] = ..., repoint: _Optional[_Union[PushRepoint, _Mapping]] = ...) -> None: ...

class PushRepoint(_message.Message):
    __slots__ = ("next",)
    NEXT_FIELD_NUMBER: _ClassVar[int]
    next: PushTarget
    def __init__(self, next: _Optional[_Union[PushTarget, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("accepted", "chunk", "ack", "flow_control", "status", "decode")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    FLOW_CONTROL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    accepted: SessionAccepted
    chunk: ActivationChunk
    ack: Ack
    flow_control: FlowControl
    status: ShardStatus
    decode: DecodeResult
    def __init__(self, accepted: _Optional[_Union[SessionAccepted, _Mapping]] = ..., chunk: _Optional[_Union[ActivationChunk, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., flow_control: _Optional[_Union[FlowControl, _Mapping]] = ..., status: _Optional[_Union[ShardStatus, _Mapping]] = ..., decode: _Optional[_Union[DecodeResult, _Mapping]] = ...) -> None: ...

class CapabilityRequest(_message.Message):
    __slots__ = ("schema_version",)
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ...) -> None: ...

class CapabilityReport(_message.Message):
    __slots__ = ("schema_version", "fingerprint", "shard_range", "backend", "device", "validated", "detail", "max_concurrent_sessions", "max_context_tokens", "flow_control", "accepted_compression", "supported_schema_versions", "validated_at_unix_nanos", "num_layers", "hidden_size", "boundary_dtype", "decode_ms_per_layer", "prefill_tokens_per_s", "kv_budget_tokens", "model_id", "delegated_experts", "memory")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SHARD_RANGE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VALIDATED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FLOW_CONTROL_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_SCHEMA_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    VALIDATED_AT_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DELEGATED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    fingerprint: Fingerprint
    shard_range: ShardRange
    backend: str
    device: str
    validated: bool
    detail: str
    max_concurrent_sessions: int
    max_context_tokens: int
    flow_control: FlowControl
    accepted_compression: _containers.RepeatedScalarFieldContainer[Compression]
    supported_schema_versions: _containers.RepeatedScalarFieldContainer[SchemaVersion]
    validated_at_unix_nanos: int
    num_layers: int
    hidden_size: int
    boundary_dtype: DType
    decode_ms_per_layer: float
    prefill_tokens_per_s: float
    kv_budget_tokens: int
    model_id: str
    delegated_experts: _containers.RepeatedCompositeFieldContainer[ExpertRun]
    memory: MemoryFigures
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., shard_range: _Optional[_Union[ShardRange, _Mapping]] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., validated: bool = ..., detail: _Optional[str] = ..., max_concurrent_sessions: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., flow_control: _Optional[_Union[FlowControl, _Mapping]] = ..., accepted_compression: _Optional[_Iterable[_Union[Compression, str]]] = ..., supported_schema_versions: _Optional[_Iterable[_Union[SchemaVersion, str]]] = ..., validated_at_unix_nanos: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., boundary_dtype: _Optional[_Union[DType, str]] = ..., decode_ms_per_layer: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., kv_budget_tokens: _Optional[int] = ..., model_id: _Optional[str] = ..., delegated_experts: _Optional[_Iterable[_Union[ExpertRun, _Mapping]]] = ..., memory: _Optional[_Union[MemoryFigures, _Mapping]] = ...) -> None: ...

class MemoryFigures(_message.Message):
    __slots__ = ("weight_bytes", "kv_bytes", "working_bytes", "worker_base_bytes", "daemon_base_bytes")
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKING_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_BASE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DAEMON_BASE_BYTES_FIELD_NUMBER: _ClassVar[int]
    weight_bytes: int
    kv_bytes: int
    working_bytes: int
    worker_base_bytes: int
    daemon_base_bytes: int
    def __init__(self, weight_bytes: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., working_bytes: _Optional[int] = ..., worker_base_bytes: _Optional[int] = ..., daemon_base_bytes: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ("schema_version",)
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ...) -> None: ...

class HealthReport(_message.Message):
    __slots__ = ("schema_version", "state", "active_sessions", "queued_chunks", "batch_occupancy", "kv_pressure", "resident_bytes", "detail", "kv_tokens_used", "kv_budget_tokens", "expert_bytes_sent", "expert_bytes_received", "expert_positions", "expert_failovers", "push_streams_frames", "push_streams_grpc", "cpu_cores", "machine_memory_bytes", "recent_decode_ms_per_layer", "recent_prefill_tokens_per_s", "decode_positions", "prefill_positions")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BATCH_OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    KV_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    EXPERT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    PUSH_STREAMS_FRAMES_FIELD_NUMBER: _ClassVar[int]
    PUSH_STREAMS_GRPC_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    MACHINE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECENT_DECODE_MS_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    RECENT_PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    state: ServingState
    active_sessions: int
    queued_chunks: int
    batch_occupancy: int
    kv_pressure: float
    resident_bytes: int
    detail: str
    kv_tokens_used: int
    kv_budget_tokens: int
    expert_bytes_sent: int
    expert_bytes_received: int
    expert_positions: int
    expert_failovers: int
    push_streams_frames: int
    push_streams_grpc: int
    cpu_cores: int
    machine_memory_bytes: int
    recent_decode_ms_per_layer: float
    recent_prefill_tokens_per_s: float
    decode_positions: int
    prefill_positions: int
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., state: _Optional[_Union[ServingState, str]] = ..., active_sessions: _Optional[int] = ..., queued_chunks: _Optional[int] = ..., batch_occupancy: _Optional[int] = ..., kv_pressure: _Optional[float] = ..., resident_bytes: _Optional[int] = ..., detail: _Optional[str] = ..., kv_tokens_used: _Optional[int] = ..., kv_budget_tokens: _Optional[int] = ..., expert_bytes_sent: _Optional[int] = ..., expert_bytes_received: _Optional[int] = ..., expert_positions: _Optional[int] = ..., expert_failovers: _Optional[int] = ..., push_streams_frames: _Optional[int] = ..., push_streams_grpc: _Optional[int] = ..., cpu_cores: _Optional[int] = ..., machine_memory_bytes: _Optional[int] = ..., recent_decode_ms_per_layer: _Optional[float] = ..., recent_prefill_tokens_per_s: _Optional[float] = ..., decode_positions: _Optional[int] = ..., prefill_positions: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("schema_version", "route_session_id", "route_epoch", "owner_token")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    route_session_id: str
    route_epoch: int
    owner_token: bytes
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., route_session_id: _Optional[str] = ..., route_epoch: _Optional[int] = ..., owner_token: _Optional[bytes] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released", "error")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    released: bool
    error: ShardError
    def __init__(self, released: bool = ..., error: _Optional[_Union[ShardError, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("schema_version", "route_session_id", "route_epoch", "work_id", "reason", "owner_token")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    route_session_id: str
    route_epoch: int
    work_id: str
    reason: str
    owner_token: bytes
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., route_session_id: _Optional[str] = ..., route_epoch: _Optional[int] = ..., work_id: _Optional[str] = ..., reason: _Optional[str] = ..., owner_token: _Optional[bytes] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled_work_items", "error")
    CANCELLED_WORK_ITEMS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    cancelled_work_items: int
    error: ShardError
    def __init__(self, cancelled_work_items: _Optional[int] = ..., error: _Optional[_Union[ShardError, _Mapping]] = ...) -> None: ...

class SignedRecord(_message.Message):
    __slots__ = ("kind", "payload", "signature", "public_key")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    kind: RecordKind
    payload: bytes
    signature: bytes
    public_key: bytes
    def __init__(self, kind: _Optional[_Union[RecordKind, str]] = ..., payload: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., public_key: _Optional[bytes] = ...) -> None: ...

class Reachability(_message.Message):
    __slots__ = ("direct_addrs", "relayed_addrs", "grpc_endpoint", "tls_cert_sha256", "frames_endpoint", "fetch_endpoint")
    DIRECT_ADDRS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_ADDRS_FIELD_NUMBER: _ClassVar[int]
    GRPC_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TLS_CERT_SHA256_FIELD_NUMBER: _ClassVar[int]
    FRAMES_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    FETCH_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    direct_addrs: _containers.RepeatedScalarFieldContainer[str]
    relayed_addrs: _containers.RepeatedScalarFieldContainer[str]
    grpc_endpoint: str
    tls_cert_sha256: bytes
    frames_endpoint: str
    fetch_endpoint: str
    def __init__(self, direct_addrs: _Optional[_Iterable[str]] = ..., relayed_addrs: _Optional[_Iterable[str]] = ..., grpc_endpoint: _Optional[str] = ..., tls_cert_sha256: _Optional[bytes] = ..., frames_endpoint: _Optional[str] = ..., fetch_endpoint: _Optional[str] = ...) -> None: ...

class Throughput(_message.Message):
    __slots__ = ("decode_ms_per_layer", "prefill_tokens_per_s")
    DECODE_MS_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    decode_ms_per_layer: float
    prefill_tokens_per_s: float
    def __init__(self, decode_ms_per_layer: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ...) -> None: ...

class CapabilityPayload(_message.Message):
    __slots__ = ("schema_version", "peer_id", "model_artifact_digest", "runtime_recipe_digest", "shard_range", "backend", "dtypes", "memory_budget_bytes", "free_kv_tokens", "throughput", "reachability", "issued_at_unix_ms", "expires_at_unix_ms", "sequence", "model_id", "num_layers", "withdrawn", "delegated_experts", "memory", "held_start", "held_end", "artifact_sha256")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ARTIFACT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_RECIPE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SHARD_RANGE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    WITHDRAWN_FIELD_NUMBER: _ClassVar[int]
    DELEGATED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    HELD_START_FIELD_NUMBER: _ClassVar[int]
    HELD_END_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_SHA256_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    peer_id: str
    model_artifact_digest: str
    runtime_recipe_digest: str
    shard_range: ShardRange
    backend: Backend
    dtypes: _containers.RepeatedScalarFieldContainer[DType]
    memory_budget_bytes: int
    free_kv_tokens: int
    throughput: Throughput
    reachability: Reachability
    issued_at_unix_ms: int
    expires_at_unix_ms: int
    sequence: int
    model_id: str
    num_layers: int
    withdrawn: bool
    delegated_experts: _containers.RepeatedCompositeFieldContainer[ExpertRun]
    memory: MemoryFigures
    held_start: int
    held_end: int
    artifact_sha256: str
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., peer_id: _Optional[str] = ..., model_artifact_digest: _Optional[str] = ..., runtime_recipe_digest: _Optional[str] = ..., shard_range: _Optional[_Union[ShardRange, _Mapping]] = ..., backend: _Optional[_Union[Backend, str]] = ..., dtypes: _Optional[_Iterable[_Union[DType, str]]] = ..., memory_budget_bytes: _Optional[int] = ..., free_kv_tokens: _Optional[int] = ..., throughput: _Optional[_Union[Throughput, _Mapping]] = ..., reachability: _Optional[_Union[Reachability, _Mapping]] = ..., issued_at_unix_ms: _Optional[int] = ..., expires_at_unix_ms: _Optional[int] = ..., sequence: _Optional[int] = ..., model_id: _Optional[str] = ..., num_layers: _Optional[int] = ..., withdrawn: bool = ..., delegated_experts: _Optional[_Iterable[_Union[ExpertRun, _Mapping]]] = ..., memory: _Optional[_Union[MemoryFigures, _Mapping]] = ..., held_start: _Optional[int] = ..., held_end: _Optional[int] = ..., artifact_sha256: _Optional[str] = ...) -> None: ...

class RelayPayload(_message.Message):
    __slots__ = ("schema_version", "peer_id", "addrs", "issued_at_unix_ms", "expires_at_unix_ms", "sequence")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    peer_id: str
    addrs: _containers.RepeatedScalarFieldContainer[str]
    issued_at_unix_ms: int
    expires_at_unix_ms: int
    sequence: int
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., peer_id: _Optional[str] = ..., addrs: _Optional[_Iterable[str]] = ..., issued_at_unix_ms: _Optional[int] = ..., expires_at_unix_ms: _Optional[int] = ..., sequence: _Optional[int] = ...) -> None: ...

class ExpertRun(_message.Message):
    __slots__ = ("first_layer", "last_layer", "first_expert", "last_expert", "routed", "shared")
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_EXPERT_FIELD_NUMBER: _ClassVar[int]
    LAST_EXPERT_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    first_layer: int
    last_layer: int
    first_expert: int
    last_expert: int
    routed: bool
    shared: bool
    def __init__(self, first_layer: _Optional[int] = ..., last_layer: _Optional[int] = ..., first_expert: _Optional[int] = ..., last_expert: _Optional[int] = ..., routed: bool = ..., shared: bool = ...) -> None: ...

class ExpertPlacementPayload(_message.Message):
    __slots__ = ("schema_version", "peer_id", "model_artifact_digest", "runtime_recipe_digest", "runs", "num_layers", "num_experts", "endpoint", "tls_cert_sha256", "protocol_versions", "acts", "ms_per_expert_row", "weight_bytes", "issued_at_unix_ms", "expires_at_unix_ms", "sequence", "withdrawn")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ARTIFACT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_RECIPE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TLS_CERT_SHA256_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTS_FIELD_NUMBER: _ClassVar[int]
    MS_PER_EXPERT_ROW_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    WITHDRAWN_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    peer_id: str
    model_artifact_digest: str
    runtime_recipe_digest: str
    runs: _containers.RepeatedCompositeFieldContainer[ExpertRun]
    num_layers: int
    num_experts: int
    endpoint: str
    tls_cert_sha256: bytes
    protocol_versions: _containers.RepeatedScalarFieldContainer[int]
    acts: _containers.RepeatedScalarFieldContainer[int]
    ms_per_expert_row: float
    weight_bytes: int
    issued_at_unix_ms: int
    expires_at_unix_ms: int
    sequence: int
    withdrawn: bool
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., peer_id: _Optional[str] = ..., model_artifact_digest: _Optional[str] = ..., runtime_recipe_digest: _Optional[str] = ..., runs: _Optional[_Iterable[_Union[ExpertRun, _Mapping]]] = ..., num_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., endpoint: _Optional[str] = ..., tls_cert_sha256: _Optional[bytes] = ..., protocol_versions: _Optional[_Iterable[int]] = ..., acts: _Optional[_Iterable[int]] = ..., ms_per_expert_row: _Optional[float] = ..., weight_bytes: _Optional[int] = ..., issued_at_unix_ms: _Optional[int] = ..., expires_at_unix_ms: _Optional[int] = ..., sequence: _Optional[int] = ..., withdrawn: bool = ...) -> None: ...

class RebalanceDirective(_message.Message):
    __slots__ = ("schema_version", "directive_id", "action", "tracker_peer_id", "target_peer_id", "model_artifact_digest", "shard_range", "epoch", "issued_at_unix_ms", "expires_at_unix_ms")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TRACKER_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ARTIFACT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SHARD_RANGE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    directive_id: str
    action: DirectiveAction
    tracker_peer_id: str
    target_peer_id: str
    model_artifact_digest: str
    shard_range: ShardRange
    epoch: int
    issued_at_unix_ms: int
    expires_at_unix_ms: int
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., directive_id: _Optional[str] = ..., action: _Optional[_Union[DirectiveAction, str]] = ..., tracker_peer_id: _Optional[str] = ..., target_peer_id: _Optional[str] = ..., model_artifact_digest: _Optional[str] = ..., shard_range: _Optional[_Union[ShardRange, _Mapping]] = ..., epoch: _Optional[int] = ..., issued_at_unix_ms: _Optional[int] = ..., expires_at_unix_ms: _Optional[int] = ...) -> None: ...

class JoinAsk(_message.Message):
    __slots__ = ("schema_version", "model_artifact_digest", "memory_budget_bytes", "kv_budget_tokens", "held_start", "held_end", "prefer_start", "prefer_end")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ARTIFACT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HELD_START_FIELD_NUMBER: _ClassVar[int]
    HELD_END_FIELD_NUMBER: _ClassVar[int]
    PREFER_START_FIELD_NUMBER: _ClassVar[int]
    PREFER_END_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    model_artifact_digest: str
    memory_budget_bytes: int
    kv_budget_tokens: int
    held_start: int
    held_end: int
    prefer_start: int
    prefer_end: int
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., model_artifact_digest: _Optional[str] = ..., memory_budget_bytes: _Optional[int] = ..., kv_budget_tokens: _Optional[int] = ..., held_start: _Optional[int] = ..., held_end: _Optional[int] = ..., prefer_start: _Optional[int] = ..., prefer_end: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("directive", "refusal")
    DIRECTIVE_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    directive: SignedRecord
    refusal: str
    def __init__(self, directive: _Optional[_Union[SignedRecord, _Mapping]] = ..., refusal: _Optional[str] = ...) -> None: ...

class DirectiveAck(_message.Message):
    __slots__ = ("accepted", "reason", "detail")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    detail: str
    def __init__(self, accepted: bool = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class StepReceipt(_message.Message):
    __slots__ = ("route_session_id", "route_epoch", "start_layer", "end_layer", "first_position", "count", "input_sha256", "output_sha256", "peer_id", "history_sha256")
    ROUTE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    INPUT_SHA256_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHA256_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_SHA256_FIELD_NUMBER: _ClassVar[int]
    route_session_id: str
    route_epoch: int
    start_layer: int
    end_layer: int
    first_position: int
    count: int
    input_sha256: bytes
    output_sha256: bytes
    peer_id: str
    history_sha256: bytes
    def __init__(self, route_session_id: _Optional[str] = ..., route_epoch: _Optional[int] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., first_position: _Optional[int] = ..., count: _Optional[int] = ..., input_sha256: _Optional[bytes] = ..., output_sha256: _Optional[bytes] = ..., peer_id: _Optional[str] = ..., history_sha256: _Optional[bytes] = ...) -> None: ...

class KeyDelegation(_message.Message):
    __slots__ = ("node_public_key", "delegate_public_key", "not_after_unix_ms", "signature")
    NODE_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    DELEGATE_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    NOT_AFTER_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    node_public_key: bytes
    delegate_public_key: bytes
    not_after_unix_ms: int
    signature: bytes
    def __init__(self, node_public_key: _Optional[bytes] = ..., delegate_public_key: _Optional[bytes] = ..., not_after_unix_ms: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SignedReceipt(_message.Message):
    __slots__ = ("body", "signature")
    BODY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    body: bytes
    signature: bytes
    def __init__(self, body: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class EvidencePayload(_message.Message):
    __slots__ = ("schema_version", "peer_id", "accused_peer_id", "model_artifact_digest", "recipe_digest", "num_layers", "accused_receipt", "accused_key", "auditor_receipt", "auditor_key", "token_ids", "prompt_tokens", "chunk_tokens", "sampling", "issued_at_unix_ms", "expires_at_unix_ms")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ACCUSED_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ARTIFACT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RECIPE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ACCUSED_RECEIPT_FIELD_NUMBER: _ClassVar[int]
    ACCUSED_KEY_FIELD_NUMBER: _ClassVar[int]
    AUDITOR_RECEIPT_FIELD_NUMBER: _ClassVar[int]
    AUDITOR_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    schema_version: SchemaVersion
    peer_id: str
    accused_peer_id: str
    model_artifact_digest: str
    recipe_digest: str
    num_layers: int
    accused_receipt: bytes
    accused_key: KeyDelegation
    auditor_receipt: bytes
    auditor_key: KeyDelegation
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    chunk_tokens: int
    sampling: SamplingParams
    issued_at_unix_ms: int
    expires_at_unix_ms: int
    def __init__(self, schema_version: _Optional[_Union[SchemaVersion, str]] = ..., peer_id: _Optional[str] = ..., accused_peer_id: _Optional[str] = ..., model_artifact_digest: _Optional[str] = ..., recipe_digest: _Optional[str] = ..., num_layers: _Optional[int] = ..., accused_receipt: _Optional[bytes] = ..., accused_key: _Optional[_Union[KeyDelegation, _Mapping]] = ..., auditor_receipt: _Optional[bytes] = ..., auditor_key: _Optional[_Union[KeyDelegation, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., chunk_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., issued_at_unix_ms: _Optional[int] = ..., expires_at_unix_ms: _Optional[int] = ...) -> None: ...
