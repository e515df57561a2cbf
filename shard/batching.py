"""Continuous batching: the forwards of different sessions that are ready together run as one.

Where it sits: ``ShardService`` hands the ``SessionManager`` a ``BatchingBackend``
(this module) instead of the raw backend. The manager is unchanged: it calls
``forward(cache, inputs, effective_start=...)`` with the service lock held, as
before. That call queues the work and waits on a condition bound to the same
lock, so the lock is free while it waits and other streams' steps can enter the
manager and queue theirs.

Who computes (no extra thread): a waiting caller finding no batch running
becomes the leader. Under the lock it takes the queue's head items within the
token budget (``max_batch_tokens``; the first item always goes, so a large
prefill chunk never starves; later items that do not fit wait for the next
batch while one-token decode rows behind them still join), marks them running,
*releases* the lock, runs one ``forward_batch`` per effective start, takes the
lock back, posts each item's output or exception and wakes the waiters. Work
that arrives while a batch runs forms the next batch: decode steps of many
sessions merge without any waiting window, and a lone request (c=1) pays only
the queue bookkeeping. Prefill stays chunked by the driver (the
``max_prefill_chunk_tokens`` of the flow control, 128 by default), so a new
prompt delays running decodes by at most one chunk's forward.

State owned here (all under the service lock): the FIFO queue, the set of
caches queued or running, the running flag, and the releases deferred until
a cache's work is done. The manager may drop a session (release, cancel,
expiry, eviction) while its forward is queued or running; the cache wrapper
(``BatchedCache``) then defers the backend cache's release until that forward
has finished, so llama.cpp never hands a sequence id to a new session while
the old one's rows are still in a batch. A second step for a cache that
already has work queued (two streams on one session) is refused with a
ProtocolViolation instead of running two rows of one cache in one batch.

Backends: ``forward_batch(caches, inputs, effective_start) -> [ndarray |
Exception]`` (one result per item, in order; a per-item refusal is that item's
exception, the others run) when they implement it (torch Llama-family ranges,
llama.cpp); otherwise the batch runs as sequential ``forward`` calls, still
outside the lock. ``enabled=False`` (``meshd worker --no-batching``) makes
``forward`` call the backend directly under the lock, the old behaviour.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from proto.errors import ProtocolViolation

# Positions one batched forward may carry: llama.cpp's n_batch (512) bounds it,
# and 512 positions is ~4 driver prefill chunks -- a decode row waits at most
# that long behind a prompt.
DEFAULT_BATCH_TOKENS = 512


class BatchedCache:
    """A backend cache whose release waits until its queued or running forward is done."""

    __slots__ = ("inner", "_owner", "_release_pending")

    def __init__(self, inner, owner: "BatchingBackend") -> None:
        self.inner = inner
        self._owner = owner
        self._release_pending = False

    @property
    def past_len(self) -> int:
        return self.inner.past_len

    def release(self) -> None:   # called by the manager with the service lock held
        if id(self) in self._owner._busy:
            self._release_pending = True
        else:
            self.inner.release()


class _Item:
    __slots__ = ("cache", "inputs", "effective_start", "tokens", "output", "error", "done")

    def __init__(self, cache: BatchedCache, inputs: np.ndarray, effective_start: int) -> None:
        self.cache, self.inputs, self.effective_start = cache, inputs, effective_start
        self.tokens = int(inputs.shape[0]) if getattr(inputs, "ndim", 0) else 1
        self.output = self.error = None
        self.done = False


class BatchingBackend:
    """Wraps a RangeBackend for the SessionManager; see the module docstring."""

    def __init__(self, backend, lock: threading.Lock, *, enabled: bool = True,
                 max_batch_tokens: int | None = None) -> None:
        self.backend = backend
        self.enabled = enabled
        limit = getattr(backend, "max_batch_tokens", DEFAULT_BATCH_TOKENS)
        self.max_batch_tokens = max(1, min(limit, max_batch_tokens or limit))
        self._lock = lock
        self._cond = threading.Condition(lock)
        self._queue: deque[_Item] = deque()
        self._busy: set[int] = set()
        self._running = False
        self.batches = 0          # forwards run (counters for tests and health)
        self.batched_rows = 0     # items that shared a forward with another item
        self.last_batch_rows = 0  # items in the last batch (HealthReport.batch_occupancy)
        self.last_batch_ms = 0.0  # its wall time: the retry hint of a queue-depth refusal

    def __getattr__(self, name: str):   # layer_range, vocab_size, boundary_dtype, ...
        return getattr(self.backend, name)

    @property
    def queue_depth(self) -> int:
        """Steps waiting for the next forward (not the running batch); admission reads it."""
        return len(self._queue)

    def new_cache(self, max_tokens: int) -> BatchedCache:
        return BatchedCache(self.backend.new_cache(max_tokens), self)

    # -- the manager's forward (service lock held) -----------------------------------
    def forward(self, cache: BatchedCache, inputs: np.ndarray, *, effective_start: int) -> np.ndarray:
        if not self.enabled:
            return self.backend.forward(cache.inner, inputs, effective_start=effective_start)
        if id(cache) in self._busy:
            raise ProtocolViolation("another step of this session is still running (one stream per session)")
        item = _Item(cache, inputs, effective_start)
        self._queue.append(item)
        self._busy.add(id(cache))
        try:
            while not item.done:
                if self._running:
                    self._cond.wait()
                else:
                    self._lead()
        finally:
            if not item.done:   # interrupted while queued (never happens on a plain wait); unqueue it
                try:
                    self._queue.remove(item)
                except ValueError:
                    pass
                self._finish(item)
        if item.error is not None:
            raise item.error
        return item.output

    def _take(self) -> list[_Item]:
        batch: list[_Item] = []
        budget, kept = self.max_batch_tokens, deque()
        while self._queue:
            item = self._queue.popleft()
            if not batch or item.tokens <= budget:
                batch.append(item)
                budget -= item.tokens
            else:
                kept.append(item)
        self._queue = kept
        return batch

    def _finish(self, item: _Item) -> None:
        item.done = True
        self._busy.discard(id(item.cache))
        if item.cache._release_pending:
            item.cache._release_pending = False
            item.cache.inner.release()

    def _lead(self) -> None:
        batch = self._take()
        self._running = True
        self._lock.release()
        t0 = time.perf_counter()
        try:
            self._compute(batch)
        finally:
            self._lock.acquire()
            self._running = False
            self.batches += 1
            self.last_batch_rows, self.last_batch_ms = len(batch), (time.perf_counter() - t0) * 1e3
            if len(batch) > 1:
                self.batched_rows += len(batch)
            for item in batch:
                self._finish(item)
            self._cond.notify_all()

    def _compute(self, batch: list[_Item]) -> None:
        """Runs without the lock: one forward_batch per effective start."""
        groups: dict[int, list[_Item]] = {}
        for item in batch:
            groups.setdefault(item.effective_start, []).append(item)
        batched = getattr(self.backend, "forward_batch", None)
        for start, items in groups.items():
            if batched is not None and len(items) > 1:
                try:
                    results = batched([i.cache.inner for i in items], [i.inputs for i in items],
                                      effective_start=start)
                except Exception as exc:   # the whole forward failed: every row gets it
                    results = [exc] * len(items)
                for item, result in zip(items, results):
                    if isinstance(result, BaseException):
                        item.error = result
                    else:
                        item.output = result
                continue
            for item in items:
                try:
                    item.output = self.backend.forward(item.cache.inner, item.inputs, effective_start=start)
                except Exception as exc:   # the manager maps and logs it, as for an unbatched forward
                    item.error = exc
