"""A lying backend for the audit tests: a RangeBackend wrapper that answers wrongly on purpose.

Test-only: nothing in meshd's product path imports this module, and no CLI
flag or config key can name it (tests/test_liar.py checks both). It wraps a
real backend and keeps its identity (layer range, fingerprint, dims), so the
route planner and the session open accept it as an honest replica; only its
answers lie, in one of three ways a real cheater would:

    Perturb(share, scale, seed)   a seeded share of its forwards gets noise added to the output
                                  rows (or the tail's logits): poisoned rows
    Skip(layers)                  every forward starts ``layers`` layers late: it serves fewer
                                  layers than it claims (a non-head hop: the head's input is
                                  token ids, not rows to skip ahead with)
    Substitute(other)             every forward runs on ``other``: the same range at another
                                  dtype or quantization (inputs and outputs cast to this
                                  backend's boundary dtype)

``lies`` counts the forwards whose answer was a lie. State: the seeded RNG
and that counter; the caches belong to the wrapped (or substitute) backend.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class Perturb:
    share: float = 1.0      # the fraction of forwards that lie
    scale: float = 1e-2     # the noise's standard deviation, relative to the rows' own
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Skip:
    layers: int = 2


@dataclass(frozen=True, slots=True)
class Substitute:
    other: Any              # a RangeBackend over the same layers (another dtype or quantization)


Lie = Perturb | Skip | Substitute


class LyingBackend:
    """``inner``'s identity, ``lie``'s answers (see the module doc)."""

    def __init__(self, inner: Any, lie: Lie) -> None:
        self.inner, self.lie = inner, lie
        self.lies = 0
        self._rng = random.Random(lie.seed if isinstance(lie, Perturb) else 0)
        if isinstance(lie, Skip) and not 0 < lie.layers < inner.layer_range.count:
            raise ValueError(f"a skipping liar skips 1..{inner.layer_range.count - 1} of its layers")

    def __getattr__(self, name: str) -> Any:     # layer_range, fingerprint, dims, weight_bytes...
        return getattr(self.inner, name)

    @property
    def _compute(self) -> Any:
        return self.lie.other if isinstance(self.lie, Substitute) else self.inner

    def new_cache(self, max_tokens: int) -> Any:
        return self._compute.new_cache(max_tokens)

    def _start(self, effective_start: int) -> int:
        if isinstance(self.lie, Skip):
            if effective_start == 0:
                raise ValueError("a skipping liar cannot be the head")
            return min(effective_start + self.lie.layers, self.inner.layer_range.end - 1)
        return effective_start

    def _in(self, inputs: np.ndarray) -> np.ndarray:
        if isinstance(self.lie, Substitute) and inputs.dtype != np.int64:
            return inputs.astype(self.lie.other.boundary_dtype)
        return inputs

    def _out(self, output: np.ndarray) -> np.ndarray:
        lie = self.lie
        if isinstance(lie, Perturb):
            if self._rng.random() >= lie.share:
                return np.array(output, copy=True)
            self.lies += 1
            scale = float(np.std(output)) * lie.scale or lie.scale
            noise = np.random.default_rng(self._rng.getrandbits(32)).normal(0.0, scale, output.shape)
            return (output + noise).astype(output.dtype)
        self.lies += 1
        if isinstance(lie, Substitute):   # a tail answers float32 logits; other hops boundary rows
            tail = self.inner.layer_range.is_tail
            return np.asarray(output).astype(np.float32 if tail else self.inner.boundary_dtype)
        return np.array(output, copy=True)

    def forward(self, cache: Any, inputs: np.ndarray, *, effective_start: int, **_lend: Any) -> np.ndarray:
        out = self._compute.forward(cache, self._in(inputs), effective_start=self._start(effective_start))
        return self._out(out)

    def forward_batch(self, caches: list[Any], inputs: list[np.ndarray], *,
                      effective_start: int) -> list[np.ndarray | Exception]:
        compute = self._compute
        batched = getattr(compute, "forward_batch", None)
        start = self._start(effective_start)
        rows = [self._in(x) for x in inputs]
        if batched is None:
            results: list[np.ndarray | Exception] = []
            for cache, x in zip(caches, rows):
                try:
                    results.append(compute.forward(cache, x, effective_start=start))
                except Exception as exc:  # noqa: BLE001 - that session's failure only, as the real backends
                    results.append(exc)
        else:
            results = batched(caches, rows, effective_start=start)
        return [r if isinstance(r, Exception) else self._out(r) for r in results]
