"""Continuous batching: the forwards of different sessions that are ready together run as one.

Where it sits: ``ShardService`` hands the ``SessionManager`` a ``BatchingBackend``
(this module) instead of the raw backend. The manager is unchanged: it calls
``forward(cache, inputs, effective_start=...)`` with the service lock held.
That call queues the work and waits on a condition bound to the same lock, so
the lock is free while it waits and other streams' steps can enter the
manager and queue theirs.

Who computes (no extra thread): a waiting caller finding no batch running
becomes the leader. A short gather, no long waiting window: with one session
active a row starts its forward at once (a lone user's hop pays nothing); with
others active (a forward within ``ACTIVE_S``, not released) the row that would
start a forward alone first waits, the lock free, while more rows keep
arriving -- until a quiet period passes with none, three at most -- so the
rows an upstream hop sent back to back from one batched forward stay one
forward here instead of the first running alone and the rest waiting through
it (the cohorts would split at every hop). The quiet period is 15% of a
one-row decode forward's wall time (moving average), 0.5-3 ms: what pays
depends on the backend, and a long window does not pay at all -- every hop
waits, the sessions settle into cohorts half a round apart, and on a CPU a
forward of n rows of a small model costs a large part of n single rows, so
the overlap of pipeline stages is worth more (docs/measurements/2026-12-02.md,
2026-12-06.md).

Under the lock the leader takes the queue in order: every one-position decode
row, and prefill chunks while their positions fit the step's prefill budget
(``PREFILL_TOKENS_PER_FORWARD``, within ``max_batch_tokens``), so a burst of
new prompts delays running decodes by about one short chunk per step instead
of all of them at once, and the next hop starts on the first prompts while
this one runs the rest. The first item always goes, so nothing starves, and a
chunk is never cut (its rows stay one kernel call, the same as alone). It
marks them running, *releases* the lock, runs one ``forward_batch`` per
effective start, takes the lock back, posts each item's output or exception
and wakes the waiters. Work that arrives while a batch runs forms the next
batch. Prefill stays chunked by the driver (the ``max_prefill_chunk_tokens``
of the flow control, 128 by default).

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
``forward`` call the backend directly under the lock: one forward at a time.

Trace (measurement only): with ``MESHD_BATCH_TRACE=PREFIX`` in the environment
each batcher appends one JSON line per forward to ``PREFIX.<pid>.jsonl``
(start and end on ``time.perf_counter``, i.e. CLOCK_MONOTONIC, comparable across
the processes of one machine; rows, positions, the largest item, the longest
queue wait), at most ``MAX_TRACE_LINES`` lines. ``meshd bench serve`` reads it
to tell what each slow inter-token gap waited for.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import deque

import numpy as np

from proto.errors import ProtocolViolation

# Positions one batched forward may carry: llama.cpp's n_batch (512) bounds it,
# and 512 positions is ~4 driver prefill chunks -- a decode row waits at most
# that long behind a prompt.
DEFAULT_BATCH_TOKENS = 512
# Prefill positions one forward takes (a longer chunk still goes when it is first): short, so
# decode rows riding along wait little and the next hop pipelines the prompts (module doc).
PREFILL_TOKENS_PER_FORWARD = 64
TRACE_ENV = "MESHD_BATCH_TRACE"
# The gather (module doc): with other sessions active, a row that would start a forward alone
# first waits while rows keep arriving -- until a quiet period passes with none, three quiet
# periods at most. The quiet period is GATHER_SHARE of a one-row decode forward's wall time
# (a moving average), within GATHER_QUIET_MIN_S..GATHER_QUIET_MAX_S. A session counts as
# active for ACTIVE_S after its last forward.
GATHER_SHARE = 0.15
GATHER_QUIET_MIN_S = 0.0005
GATHER_QUIET_MAX_S = 0.003
GATHER_QUIETS = 3
ACTIVE_S = 0.5
# A bench run makes ~20k forwards per worker; the cap bounds a trace left on by mistake.
MAX_TRACE_LINES = 200_000


class BatchedCache:
    """A backend cache whose release waits until its queued or running forward is done."""

    __slots__ = ("inner", "_owner", "_release_pending")

    def __init__(self, inner, owner: BatchingBackend) -> None:
        self.inner = inner
        self._owner = owner
        self._release_pending = False

    @property
    def past_len(self) -> int:
        return self.inner.past_len

    def release(self) -> None:   # called by the manager with the service lock held
        self._owner.forget(self)
        if id(self) in self._owner._busy:
            self._release_pending = True
        else:
            self.inner.release()


class _Item:
    __slots__ = ("cache", "inputs", "effective_start", "tokens", "output", "error", "done", "queued_at", "lend")

    def __init__(self, cache: BatchedCache, inputs: np.ndarray, effective_start: int) -> None:
        self.cache, self.inputs, self.effective_start = cache, inputs, effective_start
        self.tokens = int(inputs.shape[0]) if getattr(inputs, "ndim", 0) else 1
        self.output = self.error = None
        self.done = False
        self.lend = False
        self.queued_at = time.perf_counter()


class _Trace:
    """One JSON line per forward to ``PREFIX.<pid>.jsonl`` (see the module docstring)."""

    def __init__(self, prefix: str) -> None:
        # line-buffered: a killed worker loses nothing
        self._file = open(f"{prefix}.{os.getpid()}.jsonl", "a", buffering=1)
        self._left = MAX_TRACE_LINES

    def batch(self, batch: list[_Item], t0: float, t1: float) -> None:
        if self._left <= 0:
            return
        self._left -= 1
        line = {"t0": round(t0, 6), "t1": round(t1, 6), "rows": len(batch),
                "tokens": sum(i.tokens for i in batch), "max_item": max(i.tokens for i in batch),
                "wait_max": round(max(t0 - i.queued_at for i in batch), 6)}
        self._file.write(json.dumps(line) + "\n")


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
        self._active: dict[int, float] = {}   # id(cache) -> its last forward (perf_counter)
        self._gathering = False
        self.row_s = 0.0              # moving average of a one-row decode forward's wall time (s)
        self.batches = 0          # forwards run (counters for tests and health)
        self.batched_rows = 0     # items that shared a forward with another item
        self.last_batch_rows = 0  # items in the last batch (HealthReport.batch_occupancy)
        self.last_batch_ms = 0.0  # its wall time: the retry hint of a queue-depth refusal
        prefix = os.environ.get(TRACE_ENV)
        self._trace = _Trace(prefix) if prefix and enabled else None

    def __getattr__(self, name: str):   # layer_range, vocab_size, boundary_dtype, ...
        return getattr(self.backend, name)

    @property
    def queue_depth(self) -> int:
        """Steps waiting for the next forward (not the running batch); admission reads it."""
        return len(self._queue)

    def new_cache(self, max_tokens: int) -> BatchedCache:
        return BatchedCache(self.backend.new_cache(max_tokens), self)

    # -- the manager's forward (service lock held) -----------------------------------
    @property
    def lends_outputs(self) -> bool:
        return getattr(self.backend, "lends_outputs", False)

    def forward(self, cache: BatchedCache, inputs: np.ndarray, *, effective_start: int,
                lend: bool = False) -> np.ndarray:
        """``lend``: the caller reads the output before it releases the service lock, so a backend
        that lends outputs (llama.cpp's logits buffer) may skip the copy -- only when this forward
        runs alone, the next one starting only after that lock is free (``_alone``, or unbatched)."""
        lend = lend and self.lends_outputs
        if not self.enabled:
            return self.backend.forward(cache.inner, inputs, effective_start=effective_start,
                                        **({"lend": True} if lend else {}))
        if id(cache) in self._busy:
            raise ProtocolViolation("another step of this session is still running (one stream per session)")
        gather = self._note_active(cache)
        if not self._running and not self._queue and not gather:
            return self._alone(cache, inputs, effective_start, lend)
        item = _Item(cache, inputs, effective_start)
        self._queue.append(item)
        self._busy.add(id(cache))
        if gather and not self._running and not self._gathering and len(self._queue) == 1:
            self._gather()
        try:
            while not item.done:
                if self._running or self._gathering:
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

    def _note_active(self, cache: BatchedCache) -> bool:
        """Marks ``cache`` active; True when another session is active too (then a row gathers)."""
        now = time.perf_counter()
        self._active[id(cache)] = now
        if len(self._active) > 1:
            self._active = {k: t for k, t in self._active.items() if now - t < ACTIVE_S}
        return len(self._active) > 1

    def _gather(self) -> None:
        """The first row of a forward waits (the lock free) while more rows arrive: until a quiet
        period passes with none, GATHER_QUIETS of them at most. Rows arriving meanwhile wait for it
        to lead."""
        quiet = min(GATHER_QUIET_MAX_S, max(GATHER_QUIET_MIN_S, GATHER_SHARE * self.row_s))
        deadline = time.perf_counter() + GATHER_QUIETS * quiet
        self._gathering = True
        try:
            while (left := deadline - time.perf_counter()) > 0:
                seen = len(self._queue)
                self._cond.wait(min(left, quiet))
                if len(self._queue) == seen:
                    break
        finally:
            self._gathering = False

    def _note_row(self, seconds: float) -> None:
        """A one-row decode forward took ``seconds``: the moving average the gather scales by."""
        self.row_s += 0.2 * (seconds - self.row_s)

    def forget(self, cache: BatchedCache) -> None:
        """A released session is no longer active (service lock held)."""
        self._active.pop(id(cache), None)

    def _alone(self, cache: BatchedCache, inputs: np.ndarray, effective_start: int, lend: bool) -> np.ndarray:
        """Nothing queued and nothing running: this caller leads a batch of one at once, which is
        ``_lead`` without the queue's bookkeeping (a lone session's every decode step)."""
        item = _Item(cache, inputs, effective_start)
        item.lend = lend
        self._busy.add(id(cache))
        self._run([item])
        if item.error is not None:
            raise item.error
        return item.output

    def _take(self) -> list[_Item]:
        prefill_budget = min(self.max_batch_tokens, PREFILL_TOKENS_PER_FORWARD)
        batch: list[_Item] = []
        budget, kept = self.max_batch_tokens, deque()
        while self._queue:
            item = self._queue.popleft()
            fits = item.tokens <= budget and (item.tokens == 1 or item.tokens <= prefill_budget)
            if not batch or fits:
                batch.append(item)
                budget -= item.tokens
                if item.tokens > 1:
                    prefill_budget -= item.tokens
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
        self._run(self._take())

    def _run(self, batch: list[_Item]) -> None:
        """Runs ``batch`` with the lock released, then (the lock held again) its bookkeeping: the
        counters, the one-row moving average, the trace, each item's completion, the waiters."""
        self._running = True
        self._lock.release()
        t0 = time.perf_counter()
        try:
            self._compute(batch)
        finally:
            self._lock.acquire()
            self._running = False
            self.batches += 1
            t1 = time.perf_counter()
            self.last_batch_rows, self.last_batch_ms = len(batch), (t1 - t0) * 1e3
            if len(batch) == 1 and batch[0].tokens == 1:
                self._note_row(t1 - t0)
            if self._trace is not None:
                self._trace.batch(batch, t0, t1)
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
                    item.output = self.backend.forward(item.cache.inner, item.inputs, effective_start=start,
                                                       **({"lend": True} if item.lend else {}))
                except Exception as exc:   # the manager maps and logs it, as for an unbatched forward
                    item.error = exc
