"""Token selection from a float32 logits row: greedy, temperature, top-k, top-p.

``Sampler`` is built from a validated ``SamplingSpec`` and owns a
``numpy.random.Generator`` seeded per session, so the same seed and logits
always give the same tokens, wherever the tail runs. Greedy (temperature 0)
is argmax with ties broken to the lowest token id and never touches the RNG.
Order for stochastic sampling: temperature, then top-k, then top-p (nucleus,
keep the smallest prefix of the sorted distribution whose mass reaches p;
always at least one token), then one draw.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from proto import shard_runtime_pb2 as pb
from proto.errors import ProtocolViolation

# Temperatures above this make the distribution uniform for any real logits;
# bound it so a peer cannot ask for NaN-producing arithmetic.
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= MAX_TEMPERATURE) or self.temperature != self.temperature:
            raise ProtocolViolation(f"temperature must be in 0..{MAX_TEMPERATURE}")
        if self.top_k < 0:
            raise ProtocolViolation("top_k must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ProtocolViolation("top_p must be in (0, 1]")
        if not 0 <= self.seed < 2**64:
            raise ProtocolViolation("seed must fit in 64 bits")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_pb(cls, params: pb.SamplingParams) -> "SamplingSpec":
        # proto3 has no "unset" for floats: top_p 0 means "no nucleus cut".
        return cls(temperature=float(params.temperature), top_k=int(params.top_k),
                   top_p=float(params.top_p) if params.top_p > 0 else 1.0, seed=int(params.seed))


def greedy_token(logits: np.ndarray) -> int:
    """argmax; np.argmax returns the first (lowest-id) maximum."""
    return int(np.argmax(logits))


class Sampler:
    """Per-session token selection; see the module docstring."""

    __slots__ = ("spec", "_rng")

    def __init__(self, spec: SamplingSpec) -> None:
        self.spec = spec
        self._rng = np.random.Generator(np.random.PCG64(spec.seed))

    def __call__(self, logits: np.ndarray) -> int:
        spec = self.spec
        if logits.ndim != 1 or logits.size == 0:
            raise ValueError("logits must be a non-empty vector")
        if spec.greedy:
            return greedy_token(logits)
        scaled = logits.astype(np.float64) / spec.temperature
        order = np.argsort(-scaled, kind="stable")  # ties keep the lowest id first
        if spec.top_k:
            order = order[: spec.top_k]
        kept = scaled[order]
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        if spec.top_p < 1.0:
            cutoff = int(np.searchsorted(np.cumsum(probs), spec.top_p)) + 1
            order, probs = order[:cutoff], probs[:cutoff]
            probs /= probs.sum()
        return int(order[self._rng.choice(len(order), p=probs)])
