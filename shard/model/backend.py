"""The backend interface: one loaded layer range of one model artifact.

Data flow: the session manager (``shard/session/sessions.py``) owns one
``BackendCache`` per (route session, epoch) and calls
``RangeBackend.forward(cache, inputs, effective_start=...)`` for each prefill
chunk or decode step. The backend owns the weights; the cache owns the
session's KV for the owned layers only. Nothing here knows about gRPC,
sessions or the wire: the worker, the servicer and the session manager are
backend-agnostic over these two protocols, and ``native/`` plugs llama.cpp in
through the same shape.

Contract of ``forward``:
  * head (``effective_start == 0``): ``inputs`` are int64 token ids, shape [T];
    otherwise hidden states [T, hidden_size] in ``boundary_dtype``;
  * non-tail: returns the raw residual after the last owned layer,
    [T, hidden_size] in ``boundary_dtype``; tail: float32 logits of the last
    position, shape [vocab_size];
  * appends T positions to the cache; if it raises, the cache is unusable and
    the session layer drops it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from proto import shard_runtime_pb2 as pb

# A layer count above this is not a real transformer; it bounds ranges a peer
# can name before we compare them with the loaded model.
MAX_LAYERS = 4096


def ids_in_range(ids: np.ndarray, vocab_size: int) -> bool:
    """Every token id in ``0..vocab_size - 1`` (an empty array: True). A single id, every decode
    step's input, is read directly: numpy's min/max reductions cost more than the check."""
    if ids.size == 1:
        return 0 <= ids.item() < vocab_size
    return not ids.size or (int(ids.min()) >= 0 and int(ids.max()) < vocab_size)


@dataclass(frozen=True, slots=True)
class LayerRange:
    """The half-open layer range [start, end) of a model with num_layers layers."""

    start: int
    end: int
    num_layers: int

    def __post_init__(self) -> None:
        for name in ("start", "end", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"LayerRange.{name} must be an int, got {type(value).__name__}")
        if not 0 < self.num_layers <= MAX_LAYERS:
            raise ValueError(f"num_layers must be in 1..{MAX_LAYERS}, got {self.num_layers}")
        if not 0 <= self.start < self.end <= self.num_layers:
            raise ValueError(
                f"need 0 <= start < end <= num_layers, got [{self.start}, {self.end}) of {self.num_layers}"
            )

    @property
    def is_head(self) -> bool:
        return self.start == 0

    @property
    def is_tail(self) -> bool:
        return self.end == self.num_layers

    @property
    def count(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"{self.start}:{self.end}/{self.num_layers}"

    @classmethod
    def parse(cls, text: str, num_layers: int) -> LayerRange:
        """Parse the CLI form ``A:B`` (``A:`` means to the end)."""
        start_text, sep, end_text = text.partition(":")
        if not sep:
            raise ValueError(f"layer range must look like A:B, got {text!r}")
        start = int(start_text) if start_text else 0
        end = int(end_text) if end_text else num_layers
        return cls(start, end, num_layers)


@runtime_checkable
class BackendCache(Protocol):
    """KV state of one session for the owned layers only."""

    @property
    def past_len(self) -> int: ...

    def release(self) -> None: ...


@runtime_checkable
class RangeBackend(Protocol):
    """One loaded layer range of one model artifact."""

    layer_range: LayerRange
    hidden_size: int
    vocab_size: int
    boundary_dtype: np.dtype
    fingerprint: pb.Fingerprint
    backend_name: str

    def new_cache(self, max_tokens: int) -> BackendCache: ...

    def forward(self, cache: BackendCache, inputs: np.ndarray, *, effective_start: int) -> np.ndarray: ...
