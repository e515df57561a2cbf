"""Token selection from a float32 logits row: greedy, temperature, top-k, top-p; log-probabilities.

Stateless: the draw for the token at position ``p`` is a pure function of
``(seed, p)`` and the logits, so any tail that runs position ``p`` -- the
first one, or its replacement after a failover -- draws the same token.

    greedy          temperature 0: argmax, ties to the lowest token id; top-k
                    and top-p are ignored and no uniform is drawn.
    uniform u       ``draw_uniform(seed, p)``: the first 64-bit output of
                    Philox4x64-10 keyed by ``seed`` with counter ``p``
                    (numpy's ``Philox(key=seed, counter=p).random_raw()``),
                    shifted to 53 bits: u = (raw >> 11) * 2**-53, in [0, 1).
    weights         w = exp((logit - max logit) / temperature), in float64.
    sorted order    descending logits, ties to the lowest id (a stable sort).
    top-k           keep the first k of the sorted order (k = 0: all).
    mass            with top-k: the running sum of the k kept weights (in
                    sorted order); without: sum(w) over the vocabulary in
                    id order.
    top-p           keep the shortest prefix whose running sum (in sorted
                    order) reaches p * mass; mass becomes that prefix's sum.
    inverse CDF     the token is the first kept one whose running sum
                    exceeds u * mass (the last kept one if rounding leaves
                    none).

Only the head of the sorted order that the answer can depend on is sorted
(a partial selection that keeps every tie, grown until it holds the k, p or
u mass needed), so a sampled step costs a partition, not a full sort of the
vocabulary; the result equals the full sort's by construction.

``token_logprobs`` reports the model's own distribution: log-softmax of the
raw logits (temperature 1, before any filtering), for the chosen token and
the ``top`` most likely ids (sorted as above).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from proto import shard_runtime_pb2 as pb
from proto.errors import LimitExceeded, ProtocolViolation
from proto.limits import MAX_TOP_LOGPROBS

# Temperatures above this make the distribution uniform for any real logits;
# bound it so a peer cannot ask for NaN-producing arithmetic.
MAX_TEMPERATURE = 100.0
# First size of the partial selection; it grows by GROWTH until it holds the
# mass the draw needs (a peaked distribution rarely needs a second round).
FIRST_SELECTION = 64
GROWTH = 8
_U53 = 2.0 ** -53


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
    def from_pb(cls, params: pb.SamplingParams) -> SamplingSpec:
        # proto3 has no "unset" for floats: top_p 0 means "no nucleus cut".
        return cls(temperature=float(params.temperature), top_k=int(params.top_k),
                   top_p=float(params.top_p) if params.top_p > 0 else 1.0, seed=int(params.seed))

    def to_pb(self) -> pb.SamplingParams:
        return pb.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)


def check_top_logprobs(count: int) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_TOP_LOGPROBS:
        raise LimitExceeded(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {count!r}")
    return count


def greedy_token(logits: np.ndarray) -> int:
    """argmax; np.argmax returns the first (lowest-id) maximum."""
    return int(np.argmax(logits))


def draw_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) for position ``position`` of a generation seeded ``seed`` (see the module doc)."""
    raw = int(np.random.Philox(key=seed, counter=position).random_raw())
    return (raw >> 11) * _U53


def _head_order(values: np.ndarray, size: int) -> np.ndarray:
    """The first >= ``size`` ids of the stable descending order of ``values`` (every tie at the cut kept)."""
    if size >= values.size:
        return np.argsort(-values, kind="stable")
    threshold = np.partition(values, values.size - size)[values.size - size]
    ids = np.flatnonzero(values >= threshold)          # ascending ids: the stable sort keeps them in order
    return ids[np.argsort(-values[ids], kind="stable")]


def sample_token(logits: np.ndarray, spec: SamplingSpec, position: int) -> int:
    """The token for ``position`` (rules in the module docstring)."""
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError("logits must be a non-empty vector")
    if spec.greedy:
        return greedy_token(logits)
    x = np.asarray(logits, dtype=np.float32)   # its order is the order of logits / temperature
    peak, temperature, vocab = float(x.max()), spec.temperature, x.size

    def weights(values: np.ndarray) -> np.ndarray:
        return np.exp((values.astype(np.float64) - peak) / temperature)

    u = draw_uniform(spec.seed, position)
    k = min(spec.top_k, vocab) if spec.top_k else 0
    size = max(k, min(FIRST_SELECTION, vocab))
    total = 0.0 if k else float(weights(x).sum())        # the unfiltered mass, in id order (top-k: unused)
    while True:
        order = _head_order(x, size)
        if k:
            order = order[:k]
        running = np.cumsum(weights(x[order]))
        complete = bool(k) or order.size == vocab
        mass = float(running[-1]) if k else total
        if spec.top_p < 1.0:
            cut = int(np.searchsorted(running, spec.top_p * mass))
            if cut < order.size:                          # the nucleus ends inside the selection
                running = running[:cut + 1]
                mass = float(running[-1])
            elif not complete:
                size *= GROWTH
                continue
        index = int(np.searchsorted(running, u * mass, side="right"))
        if index < running.size:
            return int(order[index])
        if complete or running.size < order.size:          # rounding left u * mass past the end
            return int(order[running.size - 1])
        size *= GROWTH


def token_logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """log p(token) and the ``top`` most likely (id, log p), from log-softmax of the raw logits."""
    x = logits.astype(np.float64)
    peak = x.max()
    lse = peak + np.log(np.exp(x - peak).sum())
    best: tuple[tuple[int, float], ...] = ()
    if top:
        order = _head_order(x, min(top, x.size))[:top]
        best = tuple((int(i), float(x[i] - lse)) for i in order)
    return float(x[token] - lse), best
