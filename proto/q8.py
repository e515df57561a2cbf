"""q8 block encoding: 32 values share one float16 scale.

Layout of an encoded tensor of n values (TENSOR_ENCODING_Q8_BLOCK32):
    ceil(n/32) little-endian float16 scales, then n int8 values.
Value i decodes as int8[i] * scale[i // 32]; the last block may be partial.
34 bytes per 32 values = 1.0625 bytes/value.

Scale choice: the block's max |x| / 127, converted to float16 ROUNDED UP, so
|x| / scale <= 127 for every value and nothing is clamped: the only error is
the rounding of x / scale to an integer, at most half a scale. An all-zero
block gets scale 0; a tiny block gets the smallest subnormal float16 scale.
NaN/Inf inputs, or magnitudes whose scale would overflow float16
(|x| > 127 * 65504), are refused with LocalError (our argument, our fault).
On decode, a non-finite or negative scale is PayloadCorrupt.
Pure numpy; no state.
"""
from __future__ import annotations

import numpy as np

from proto.errors import LocalError, PayloadCorrupt

__all__ = ["BLOCK", "q8_encoded_size", "encode_q8", "decode_q8"]

BLOCK = 32          # values per block (seed 002: distributed-llama's block of 32)
_QMAX = 127         # symmetric int8 range; -128 is never produced
_SLICE_BLOCKS = 1024  # 32 Ki values per slice: 256 KiB float64 temporaries


def q8_encoded_size(n_values: int) -> int:
    """Bytes of the q8 encoding of n values: 2 per block scale + 1 per value."""
    return 2 * (-(-n_values // BLOCK)) + n_values


def _round_up_scales(scale: np.ndarray) -> np.ndarray:
    s16 = scale.astype(np.float16)
    for _ in range(2):  # the cast rounds to nearest: at most one step up is needed
        low = s16.astype(np.float64) < scale
        if not low.any():
            break
        s16[low] = np.nextafter(s16[low], np.float16(np.inf))
    return s16


def _encode_blocks(seg: np.ndarray, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(float16 scales, int8 values) of ``n_blocks`` blocks of ``seg`` (zero padded)."""
    work = np.zeros(n_blocks * BLOCK, dtype=np.float64)   # x, exact in float64
    work[:seg.size] = seg
    if not np.isfinite(work).all():
        raise LocalError("q8 cannot encode NaN or Inf values")
    blocks = work.reshape(n_blocks, BLOCK)
    amax = np.maximum(blocks.max(axis=1), -blocks.min(axis=1))
    with np.errstate(over="ignore"):
        scales = _round_up_scales(amax / _QMAX)
    if not np.isfinite(scales).all():
        raise LocalError(f"q8 cannot encode magnitudes above {_QMAX} * 65504 (float16 scale)")
    s64 = scales.astype(np.float64)[:, None]
    q = blocks / np.where(s64 > 0, s64, 1.0)   # x / s, rounded once in float64
    np.rint(q, out=q)
    # Fix the rare near-tie that rounding put on the wrong side, so |x - q*s| <= s/2
    # holds exactly (q*s and x - q*s are exact in float64).
    residual = q * s64
    np.subtract(blocks, residual, out=residual)
    half = s64 / 2
    np.add(q, residual > half, out=q)
    np.subtract(q, residual < -half, out=q)
    np.clip(q, -_QMAX, _QMAX, out=q)
    return scales, q.reshape(-1)


def encode_q8(values: np.ndarray) -> bytes:
    """Encode a floating array (any shape, flattened row-major) as q8 blocks.

    Works in slices of _SLICE_BLOCKS blocks so the float64 temporaries stay small
    and are reused by the allocator (fresh multi-MiB temporaries page-fault).
    """
    x = np.asarray(values)
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise LocalError(f"q8 encodes floating tensors only, not {x.dtype}")
    flat = x.reshape(-1)
    n = flat.size
    n_blocks = -(-n // BLOCK)
    scales = np.empty(n_blocks, dtype="<f2")
    q = np.empty(n_blocks * BLOCK, dtype=np.int8)
    for first in range(0, n_blocks, _SLICE_BLOCKS):
        last = min(n_blocks, first + _SLICE_BLOCKS)
        s, v = _encode_blocks(flat[first * BLOCK:last * BLOCK], last - first)
        scales[first:last] = s
        np.copyto(q[first * BLOCK:last * BLOCK], v, casting="unsafe")
    return scales.tobytes() + q[:n].tobytes()


def decode_q8(data, n_values: int, out_dtype: np.dtype) -> np.ndarray:
    """Decode q8 bytes (exactly ``q8_encoded_size(n_values)`` long) to a flat array.

    The caller has already checked the length against the declaration.
    """
    n_blocks = -(-n_values // BLOCK)
    scales = np.frombuffer(data, dtype="<f2", count=n_blocks)
    if n_blocks and not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise PayloadCorrupt("q8 block scales must be finite and non-negative")
    q = np.frombuffer(data, dtype=np.int8, count=n_values, offset=2 * n_blocks)
    out = q.astype(np.float32)
    full = (n_values // BLOCK) * BLOCK
    s32 = scales.astype(np.float32)
    out[:full].reshape(-1, BLOCK)[...] *= s32[: full // BLOCK, None]
    if full < n_values:
        out[full:] *= s32[-1]
    return out.astype(out_dtype, copy=False)
