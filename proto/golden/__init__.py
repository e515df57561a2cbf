"""Golden frames: fixed inputs -> exact bytes, committed beside this file.

    python -m proto.golden --write     regenerate the *.bin files
    python -m proto.golden --check     exit 1 if a committed file differs

Every input is fixed (no RNG, no clock): values from arange, a fixed envelope,
an Ed25519 key from a fixed seed (Ed25519 signatures are deterministic). A peer
written in another language can parse these files and must produce the same
arrays; tests/test_codec_golden.py rebuilds them byte for byte.
"""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from proto import shard_runtime_pb2 as pb
from proto import wire
from proto.records import sign_record

__all__ = ["GOLDEN_DIR", "SEED", "build_all", "expected_arrays"]

GOLDEN_DIR = Path(__file__).resolve().parent
SEED = bytes(range(32))          # the fixed Ed25519 seed of the capability record
HIDDEN = 16                      # hidden size of the golden activations


def golden_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(SEED)


def expected_arrays() -> dict[str, dict[str, np.ndarray]]:
    """The arrays each golden frame carries (what a decoder must get back)."""
    hidden = (np.arange(3 * HIDDEN, dtype=np.float32).reshape(3, HIDDEN) / 8 - 3).astype(
        ml_dtypes.bfloat16)
    return {
        "session_request_chunk": {"h": hidden, "token_ids": np.array([1, 22, 333], np.int64)},
        "decode_step": {"h": (np.arange(HIDDEN, dtype=np.float32).reshape(1, HIDDEN) / 4)
                        .astype(ml_dtypes.bfloat16)},
    }


def golden_envelope() -> pb.Envelope:
    return pb.Envelope(
        schema_version=pb.SCHEMA_VERSION_1, work_id="work-0001", route_session_id="session-a",
        route_epoch=2,
        fingerprint=pb.Fingerprint(model_artifact_digest="sha256:" + "11" * 32,
                                   runtime_recipe_digest="sha256:" + "22" * 32,
                                   recipe_id="torch-fp32", recipe_version="1"),
        shard_range=pb.ShardRange(start_layer=4, end_layer=8, effective_start_layer=5),
        phase=pb.PHASE_PREFILL, position=pb.PositionSpan(first_position=128, token_count=3),
        idempotency_step=7,
        cache_expectation=pb.CacheExpectation(mode=pb.CACHE_MODE_PREFILL, expected_past_len=128),
        deadline_unix_nanos=1_767_225_600_000_000_000,
        chunk=pb.ChunkInfo(chunk_index=1, chunk_count=2, final_chunk=True))


def capability_payload() -> pb.CapabilityPayload:
    return pb.CapabilityPayload(
        schema_version=pb.SCHEMA_VERSION_1, peer_id="12D3KooWGoldenPeer",
        model_artifact_digest="sha256:" + "11" * 32, runtime_recipe_digest="sha256:" + "22" * 32,
        shard_range=pb.ShardRange(start_layer=0, end_layer=15, effective_start_layer=0),
        backend=pb.BACKEND_TORCH, dtypes=[pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT32],
        memory_budget_bytes=8 << 30, free_kv_tokens=32768,
        throughput=pb.Throughput(decode_ms_per_layer=0.75, prefill_tokens_per_s=900.0),
        reachability=pb.Reachability(direct_addrs=["/ip4/127.0.0.1/tcp/4001"],
                                     grpc_endpoint="127.0.0.1:50051",
                                     tls_cert_sha256=bytes(range(32))),
        issued_at_unix_ms=1_767_225_600_000, expires_at_unix_ms=1_767_225_900_000, sequence=1,
        model_id="smollm2-135m", num_layers=30)


def build_all() -> dict[str, bytes]:
    """file name -> exact bytes."""
    arrays = expected_arrays()
    chunk = wire.request_chunk(golden_envelope(), arrays["session_request_chunk"],
                               max_fragment_bytes=40)            # h: 96 bytes in 3 fragments
    step = pb.DecodeStep(idempotency_step=131, position=131, expected_past_len=131,
                         deadline_unix_nanos=1_767_225_630_000_000_000)
    decode = wire.request_decode(step, "h", arrays["decode_step"]["h"])
    record = sign_record(pb.RECORD_KIND_CAPABILITY, capability_payload().SerializeToString(),
                         golden_key())
    return {
        "session_request_chunk.bin": chunk,
        "decode_step.bin": decode,
        "decode_step_framed.bin": wire.request_decode(step, "h", arrays["decode_step"]["h"],
                                                 framed=True),
        "capability_record.bin": record.SerializeToString(),
    }
