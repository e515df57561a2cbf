"""Helpers for the batching tests: sessions driven through ShardServices the way a stream does."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from shard.session.service import ShardService
from shard.session.sessions import SessionKey, SessionPolicy

WAIT_S = 60.0   # bound of every wait in these tests


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)


def services(backends, *, batching: bool = True) -> list[ShardService]:
    return [ShardService(b, SessionPolicy(kv_budget_tokens=8192, max_sessions=32), batching=batching)
            for b in backends]


def step(service: ShardService, key: SessionKey, index: int, position: int, inputs: np.ndarray):
    """One step of a session exactly as shard/session/stream.py runs it (the service lock held)."""
    with service.lock:
        return service.manager.step(key, step=index, position=position, expected_past_len=position,
                                    inputs=inputs, effective_start=service.backend.layer_range.start).payload


def generate(chain: list[ShardService], name: str, prompt, n_new: int, chunk: int = 0) -> Run:
    """Greedy decode of ``prompt`` through ``chain`` (head first); ``chunk`` > 0 splits the prefill."""
    key = SessionKey(name, 0)
    for service in chain:
        with service.lock:
            service.manager.open(key, 512)
    run, inputs, pos, index = Run(), np.asarray(prompt, np.int64), 0, 0
    pieces = [inputs[i:i + chunk] for i in range(0, len(inputs), chunk)] if chunk else [inputs]
    try:
        for _ in range(n_new):
            for piece in pieces:
                x = piece
                for service in chain:
                    x = step(service, key, index, pos, x)
                pos, index = pos + len(piece), index + 1
            run.logits.append(x)
            run.tokens.append(int(np.argmax(x)))
            pieces = [np.asarray([run.tokens[-1]], np.int64)]
        return run
    finally:
        for service in chain:
            with service.lock:
                service.manager.release(key)


def concurrent(chain: list[ShardService], prompts, n_new: int, chunk: int = 0) -> list[Run]:
    """Every prompt in its own thread at once (the worker's one-thread-per-stream shape)."""
    results: list = [None] * len(prompts)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = generate(chain, f"s{i}", prompts[i], n_new, chunk)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + WAIT_S * 4
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a generation did not finish in time"
    assert not errors, errors
    return results


def max_diff(a: Run, b: Run) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a.logits, b.logits))


def hold_batches(service: ShardService) -> tuple[threading.Event, threading.Event]:
    """Every batch of ``service`` waits, once started, until ``proceed`` is set (real forwards
    after that): ``started`` tells that a batch is running, so the lock is free and others queue."""
    started, proceed = threading.Event(), threading.Event()
    compute = service.batcher._compute

    def held(batch) -> None:
        started.set()
        assert proceed.wait(WAIT_S)
        compute(batch)

    service.batcher._compute = held
    return started, proceed


class Gate:
    """Holds the first batch of a service until ``count`` more items are queued behind it, so the
    next batch certainly merges them (real forwards; only their start is delayed)."""

    def __init__(self, service: ShardService, count: int) -> None:
        self.batcher, self.count = service.batcher, count
        self.inner = self.batcher._compute
        self.batcher._compute = self._compute
        self.opened = False

    def _compute(self, batch) -> None:
        if not self.opened:
            self.opened = True
            deadline = time.monotonic() + WAIT_S
            while len(self.batcher._queue) < self.count and time.monotonic() < deadline:
                time.sleep(0.005)
        self.inner(batch)
