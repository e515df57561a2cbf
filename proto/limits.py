"""Every bound the codec enforces, as a named constant with its reason.

A receiver checks declared sizes and counts against these BEFORE it allocates
anything, so a peer can neither crash a node nor make it allocate past a bound.
``Limits`` groups them for one receiver (frozen, validated when built);
``DEFAULT_LIMITS`` is what every decoder uses unless told otherwise. Senders use
the same constants so that what we send is always something we would accept.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from proto.errors import LocalError

KIB = 1024
MIB = 1024 * KIB

# One serialized SessionRequest/SessionResponse (gRPC message or relay frame).
# The largest legitimate frame is a prefill chunk: 128 tokens x hidden 16384 x
# fp32 = 8 MiB, or a big-vocab logits row; 32 MiB leaves 4x headroom and is
# also the gRPC max send/receive message length (grpc's 4 MiB default is too
# small for a 128-token chunk of a 8k-hidden model).
MAX_FRAME_BYTES = 32 * MIB

# Sender's default fragment size: 1 MiB keeps one fragment of a typical decode
# or small prefill chunk whole (no join on receive) while bounding the size of
# any single bytes object a receiver materialises.
DEFAULT_FRAGMENT_BYTES = 1 * MIB

# Receiver's bound on one fragment: larger than our own default so a peer that
# picked bigger fragments still works, but never a whole frame in one piece.
MAX_FRAGMENT_BYTES = 8 * MIB

# MAX_FRAME_BYTES / DEFAULT_FRAGMENT_BYTES = 32; twice that for peers with
# smaller fragments. Bounds the per-tensor bookkeeping a peer can cause.
MAX_FRAGMENTS_PER_TENSOR = 64

# A boundary bundle carries a handful of tensors (hidden state, token ids,
# logits, masks); 32 leaves room for multi-tensor boundaries (e.g. MoE rows).
MAX_TENSORS_PER_BUNDLE = 32

# Decoded (uncompressed, encoded) bytes of one tensor: a zstd body may expand
# to this and no further. Equal to the frame bound: a tensor never needs more.
MAX_TENSOR_BYTES = MAX_FRAME_BYTES

# Decoded bytes of a whole bundle, checked from the declarations before any
# tensor is decoded: two frames' worth allows a compressed bundle to expand.
MAX_BUNDLE_BYTES = 2 * MAX_FRAME_BYTES

# Transformer boundaries are rank <= 3 ([batch, tokens, hidden]); 8 is generous
# and bounds the shape loop.
MAX_RANK = 8

# One dimension: 16 Mi covers vocabularies (~256 Ki), hidden sizes and context
# lengths with room; the byte bound catches products.
MAX_DIM = 16 * MIB

# Tensor names are short boundary names ("h", "token_ids", "logits").
MAX_NAME_LEN = 64

# zstd window a peer may make us hold while decompressing (C-side memory):
# level-1 frames of <= 32 MiB use at most a 2 MiB window; 8 MiB allows other
# levels while keeping decompression memory bounded.
MAX_ZSTD_WINDOW_BYTES = 8 * MIB

# Frames that carry no tensor (open, accepted, flow control, ack, status,
# release, cancel) are a few hundred bytes; bounding them keeps protobuf's
# per-element allocation (e.g. a packed repeated enum: 4 bytes per input byte)
# far from memory trouble.
MAX_CONTROL_FRAME_BYTES = 64 * KIB
# The same bound makes a small tensor frame (a decode step: a few KiB) safe to
# hand to protobuf without the Python wire scan (proto.wirescan): at most
# ~32 k elements of a few dozen bytes each, a couple of MiB at worst; the
# tensor decoder then checks every count and size before it allocates.
MAX_UNSCANNED_FRAME_BYTES = MAX_CONTROL_FRAME_BYTES

# One unary request (GetCapability, Health, Release, Cancel): a schema version,
# a route session id (<= 128 chars), an epoch, a work id and a short reason --
# well under 1 KiB. 4 KiB is the whole bound; anything larger is refused before
# protobuf sees it.
MAX_UNARY_REQUEST_BYTES = 4 * KIB

# Signed DHT records: a capability payload with a few addresses is < 1 KiB;
# 16 KiB bounds what a record can make a validator parse.
MAX_RECORD_BYTES = 16 * KIB

# Flow control defaults (negotiation takes the strictest of both sides; these
# apply when neither side states a bound).
DEFAULT_MAX_INFLIGHT_CHUNKS = 8
# Hard cap whatever the peers propose: bounds a worker's queued work per stream.
MAX_INFLIGHT_CHUNKS = 64
DEFAULT_MAX_CHUNK_BYTES = MAX_FRAME_BYTES
# Token-aligned prefill chunks (seed ADR-0008 uses 128).
DEFAULT_PREFILL_CHUNK_TOKENS = 128
# A single chunk never carries more than this many tokens (activations of 4096
# tokens x 4096 hidden x bf16 = 32 MiB = MAX_FRAME_BYTES).
MAX_PREFILL_CHUNK_TOKENS = 4096

# What a sampling tail sends back per decode step without logprobs: the token
# id in a TailSample plus the step fields (measured ~20 bytes); the driver
# counts every tail response byte against this figure in its stats.
MAX_TAIL_BYTES_PER_DECODE_STEP = 64
# Alternatives a tail reports with top_logprobs: OpenAI's bound (20); each
# costs ~10 bytes per step, so a step stays a few hundred bytes.
MAX_TOP_LOGPROBS = 20

# zstd level used by senders: activations compress little whatever the level;
# level 1 is the fastest and keeps the window small.
ZSTD_LEVEL = 1


@dataclass(frozen=True, slots=True)
class Limits:
    """The bounds one receiver enforces. All positive integers, checked when built."""

    max_frame_bytes: int = MAX_FRAME_BYTES
    max_fragment_bytes: int = MAX_FRAGMENT_BYTES
    max_fragments_per_tensor: int = MAX_FRAGMENTS_PER_TENSOR
    max_tensors_per_bundle: int = MAX_TENSORS_PER_BUNDLE
    max_tensor_bytes: int = MAX_TENSOR_BYTES
    max_bundle_bytes: int = MAX_BUNDLE_BYTES
    max_rank: int = MAX_RANK
    max_dim: int = MAX_DIM
    max_name_len: int = MAX_NAME_LEN
    max_zstd_window_bytes: int = MAX_ZSTD_WINDOW_BYTES
    max_record_bytes: int = MAX_RECORD_BYTES

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LocalError(f"Limits.{f.name} must be a positive int, got {value!r}")
        if self.max_tensor_bytes > self.max_bundle_bytes:
            raise LocalError("Limits.max_tensor_bytes must not exceed max_bundle_bytes")


DEFAULT_LIMITS = Limits()

# A looped tail's stop tokens (TailOptions.stop_token_ids): a tokenizer has a few.
MAX_STOP_TOKENS = 64
# A pushed head's decode inputs are numbered DECODE_STEP_BASE + position (by the entry
# and by a looped tail alike): above any step a generation's counter reaches before them.
DECODE_STEP_BASE = 1 << 40

# Drafted tokens one verify chunk may carry (Envelope.verify): the tail draws
# one token per position, every hop computes 1 + this many positions, and the
# acceptance of a draft decays geometrically with its depth (a draft 16 deep
# is rarely all accepted), so longer drafts only add compute that is thrown away.
MAX_DRAFT_TOKENS = 16
