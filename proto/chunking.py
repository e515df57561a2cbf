"""Token-aligned prefill chunk planning (pure).

A prompt of n tokens is prefilled in chunks of at most ``chunk_tokens``
positions (default 128, seed ADR-0008), each chunk a whole number of tokens,
in order, covering [first_position, first_position + n) exactly once.
"""
from __future__ import annotations

from proto.errors import LocalError
from proto.limits import DEFAULT_PREFILL_CHUNK_TOKENS, MAX_PREFILL_CHUNK_TOKENS

__all__ = ["plan_prefill_chunks"]


def plan_prefill_chunks(n_tokens: int, chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS, *,
                        first_position: int = 0) -> list[tuple[int, int]]:
    """[(first_position, count), ...] covering n_tokens; [] when n_tokens == 0."""
    for label, value in (("n_tokens", n_tokens), ("first_position", first_position)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise LocalError(f"{label} must be a non-negative int, got {value!r}")
    if (not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool)
            or not 1 <= chunk_tokens <= MAX_PREFILL_CHUNK_TOKENS):
        raise LocalError(f"chunk_tokens must be in 1..{MAX_PREFILL_CHUNK_TOKENS}")
    return [(first_position + start, min(chunk_tokens, n_tokens - start))
            for start in range(0, n_tokens, chunk_tokens)]
