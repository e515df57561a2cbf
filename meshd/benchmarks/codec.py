"""``meshd bench codec``: the codec's cost next to a plain memory copy, same run.

Measured (medians of many interleaved repeats, so machine load hits both sides):
  raw.ratio_vs_memcpy   time of ``np.copy`` of a 1 MiB bf16 chunk ([128, 4096])
                        divided by the time to serialize it into a SessionRequest
                        (proto.wire) and parse + decode + CRC-verify it back
                        (proto.zerocopy). 1.0 would be "as cheap as one copy".
  raw.naive_ratio_vs_memcpy   the same through plain protobuf (encode_bundle,
                        SerializeToString, parse_request, decode_bundle).
  zstd.*                the same chunk through zstd (level limits.ZSTD_LEVEL).
  q8.*                  q8 blocks on float32 activations: bytes per value and the
                        largest decode error in units of half a block scale.
  decode_step_overhead_bytes  serialized SessionRequest{decode} minus payload
                        bytes for one bf16 row of hidden size 4096.
"""
from __future__ import annotations

import gc
import statistics
import time

import ml_dtypes
import numpy as np

from proto import shard_runtime_pb2 as pb
from proto import wire
from proto.frames import parse_request
from proto.q8 import BLOCK
from proto.tensors import decode_bundle, decode_tensor, encode_bundle, encode_tensor
from proto.zerocopy import read_request

HIDDEN = 4096
CHUNK_TOKENS = 128            # 128 x 4096 x bf16 = 1 MiB


def _envelope() -> pb.Envelope:
    return pb.Envelope(
        schema_version=pb.SCHEMA_VERSION_1, work_id="a1b2c3d4e5f6a7b8",
        route_session_id="9f8e7d6c5b4a39281706f5e4d3c2b1a0", route_epoch=3,
        fingerprint=pb.Fingerprint(model_artifact_digest="sha256:" + "ab" * 32,
                                   runtime_recipe_digest="sha256:" + "cd" * 32),
        shard_range=pb.ShardRange(start_layer=8, end_layer=16, effective_start_layer=8),
        phase=pb.PHASE_PREFILL, position=pb.PositionSpan(first_position=256, token_count=128),
        idempotency_step=3, cache_expectation=pb.CacheExpectation(mode=pb.CACHE_MODE_PREFILL,
                                                                  expected_past_len=256),
        deadline_unix_nanos=1_767_225_600_000_000_000, chunk=pb.ChunkInfo(chunk_index=2,
                                                                         chunk_count=4))


def _interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, run round-robin so load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():           # warm-up (allocator, caches)
        fn()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    finally:
        if gc_was:
            gc.enable()
    return {name: statistics.median(ts) for name, ts in times.items()}


def _raw(chunk: np.ndarray, repeats: int) -> dict:
    env = _envelope()
    frame = wire.request_chunk(env, {"h": chunk})

    def fast_round_trip():
        _, out = read_request(wire.request_chunk(env, {"h": chunk}))
        return out

    def naive_round_trip():
        req = pb.SessionRequest(chunk=pb.ActivationChunk(envelope=env,
                                                         bundle=encode_bundle({"h": chunk})))
        return decode_bundle(parse_request(req.SerializeToString()).chunk.bundle)

    assert np.array_equal(fast_round_trip()["h"].view(np.uint16), chunk.view(np.uint16))
    assert np.array_equal(naive_round_trip()["h"].view(np.uint16), chunk.view(np.uint16))
    med = _interleaved({
        "memcpy": lambda: chunk.copy(),
        "round_trip": fast_round_trip,
        "encode": lambda: wire.request_chunk(env, {"h": chunk}),
        "decode": lambda: read_request(frame),
    }, repeats)
    # The protobuf path churns the allocator (1 MiB arena blocks); measured apart so
    # it does not slow the others, against its own memcpy baseline.
    naive = _interleaved({"memcpy": lambda: chunk.copy(), "naive": naive_round_trip},
                         max(5, repeats // 10))
    return {
        "ratio_vs_memcpy": med["memcpy"] / med["round_trip"],
        "naive_ratio_vs_memcpy": naive["memcpy"] / naive["naive"],
        "memcpy_us": med["memcpy"] * 1e6,
        "round_trip_us": med["round_trip"] * 1e6,
        "encode_us": med["encode"] * 1e6,
        "decode_us": med["decode"] * 1e6,
        "naive_round_trip_us": naive["naive"] * 1e6,
        "naive_memcpy_us": naive["memcpy"] * 1e6,   # its own baseline, measured beside it
        "payload_bytes": chunk.nbytes,
        "frame_bytes": len(frame),
    }


def _zstd(chunk: np.ndarray, repeats: int) -> dict:
    t = encode_tensor("h", chunk, compression=pb.COMPRESSION_ZSTD)
    wire_bytes = sum(len(f.payload) for f in t.fragments)
    med = _interleaved({
        "encode": lambda: encode_tensor("h", chunk, compression=pb.COMPRESSION_ZSTD),
        "decode": lambda: decode_tensor(t),
    }, repeats)
    mb = chunk.nbytes / 1e6
    return {"mb_s": mb / (med["encode"] + med["decode"]),
            "compress_mb_s": mb / med["encode"], "decompress_mb_s": mb / med["decode"],
            "ratio": wire_bytes / chunk.nbytes}


def _q8(rng: np.random.Generator, repeats: int) -> dict:
    x = rng.standard_normal((CHUNK_TOKENS, HIDDEN), dtype=np.float32)
    x[:, ::97] *= 40.0                                  # activation outliers, as in real models
    x[0, :BLOCK] = 0.0                                  # an all-zero block
    x[1, :BLOCK] = 1e-9                                 # a block with a subnormal scale
    t = encode_tensor("h", x, encoding=pb.TENSOR_ENCODING_Q8_BLOCK32)
    y = decode_tensor(t).astype(np.float64)
    body = t.fragments[0].payload
    n_blocks = -(-x.size // BLOCK)
    half = np.repeat(np.frombuffer(body, "<f2", count=n_blocks).astype(np.float64), BLOCK)[:x.size] / 2
    err = np.abs(y.reshape(-1) - x.astype(np.float64).reshape(-1))
    nonzero = half > 0
    assert np.all(err[~nonzero] == 0)
    med = _interleaved({"encode": lambda: encode_tensor(
        "h", x, encoding=pb.TENSOR_ENCODING_Q8_BLOCK32), "decode": lambda: decode_tensor(t)},
        max(3, repeats // 10))
    return {"bytes_per_value": t.total_bytes / x.size,
            "max_error_in_half_scales": float((err[nonzero] / half[nonzero]).max()),
            "dtype": "float32", "encode_mb_s": x.nbytes / 1e6 / med["encode"],
            "decode_mb_s": x.nbytes / 1e6 / med["decode"]}


def _decode_step_overhead() -> dict:
    row = np.ones((1, HIDDEN), ml_dtypes.bfloat16)
    step = pb.DecodeStep(idempotency_step=1_337, position=1_337, expected_past_len=1_337,
                         deadline_unix_nanos=1_767_225_630_000_000_000)
    data = wire.request_decode(step, "h", row)
    ref = pb.DecodeStep()
    ref.CopyFrom(step)
    ref.tensor.CopyFrom(encode_tensor("h", row))
    assert data == pb.SessionRequest(decode=ref).SerializeToString()
    return {"bytes": len(data) - row.nbytes, "frame_bytes": len(data)}


def run(quick: bool, progress=None, options=None) -> dict:
    def say(msg: str) -> None:
        if progress is not None:
            print(msg, file=progress, flush=True)

    repeats = 60 if quick else 400
    rng = np.random.default_rng(0)
    chunk = rng.standard_normal((CHUNK_TOKENS, HIDDEN), dtype=np.float32).astype(ml_dtypes.bfloat16)
    say(f"raw: {repeats} interleaved repeats of a {chunk.nbytes >> 20} MiB bf16 chunk ...")
    raw = _raw(chunk, repeats)
    say(f"raw: ratio_vs_memcpy {raw['ratio_vs_memcpy']:.3f}; zstd ...")
    zstd = _zstd(chunk, max(5, repeats // 10))
    say("q8 ...")
    q8 = _q8(rng, repeats)
    overhead = _decode_step_overhead()
    return {"raw": raw, "zstd": zstd, "q8": q8,
            "decode_step_overhead_bytes": overhead["bytes"],
            "decode_step_frame_bytes": overhead["frame_bytes"],
            "quick": quick, "repeats": repeats}
