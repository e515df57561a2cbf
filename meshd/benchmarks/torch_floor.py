"""The bare torch split floor: the same slices in bare processes, rows over a ring of pipes.

``meshd bench pipeline`` and ``meshd bench swarm`` compare the product
(``meshd join`` daemons) with the whole model in one process. A split has a cost of its own on any
machine, before meshd adds anything: each hop is another process whose
caches were cooled by the others while it waited, and the rows cross a
process boundary. This runs the split with nothing of meshd on the path, so
the benchmark can say how much of the gap is the split and how much meshd:

    one process per range   ``shard.model.torch_backend.TorchRangeBackend`` (the
                            worker's own backend) for that range, ``threads``
                            compute threads, one cache, no sessions, no
                            batching, no validation beyond the backend's own
    the ring                multiprocessing pipes: head -> ... -> tail -> head;
                            raw float32 rows forward, the tail's greedy token
                            (8 bytes) back to the head -- the looped route's
                            shape, with no entry on the token's path
    a generation            the head prefills in ``chunk_tokens`` chunks (each
                            crossing the ring), then decodes one token per
                            step and times each step

``TorchFloor(model, specs, threads)`` starts the processes (each loads its
range once); ``generate(ids, n)`` returns a FloorRun (tokens: callers check
they equal the whole model's; prefill_s; step_ms per decode step);
``close()`` stops them. State: the processes and the driver's control pipe
to the head; every wait is bounded (``poll`` with a deadline), a process
that fails or overruns is killed.
"""
from __future__ import annotations

import multiprocessing as mp
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["FloorRun", "TorchFloor"]

# Loading a range of a small model: well under a minute; a wedged process is killed.
LOAD_TIMEOUT_S = 600.0
# One generation of a few hundred tokens of a small model: minutes at most on a loaded machine.
RUN_TIMEOUT_S = 600.0
NEW = b"N"      # ring message: a new generation (each hop drops its cache and passes it on)
STOP = b"S"     # ring message: exit (each hop passes it on, then returns)
_TOKEN = struct.Struct("<q")


@dataclass
class FloorRun:
    tokens: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    step_ms: list[float] = field(default_factory=list)

    @property
    def decode_tok_s(self) -> float:
        return 1000.0 * len(self.step_ms) / sum(self.step_ms) if self.step_ms else 0.0


def _hop(model: str, start: int, end: int, threads: int, rx, tx, control) -> None:
    """One range: rows in from ``rx``, rows (or the tail's token) out on ``tx``; the head also drives."""
    import numpy as np
    import torch

    from shard.model.torch_backend import TorchRangeBackend

    torch.set_num_threads(threads)
    backend = TorchRangeBackend.load(model, start, end, dtype="float32", progress=None)
    head, tail = backend.layer_range.start == 0, backend.layer_range.is_tail
    hidden = backend.hidden_size
    cache = backend.new_cache(1 << 14)

    def forward(inputs):
        out = backend.forward(cache, inputs, effective_start=start)
        if tail:
            return _TOKEN.pack(int(np.argmax(out)))
        return out.astype(np.float32, copy=False).tobytes()

    control.send_bytes(b"R")
    if not head:
        while True:
            data = rx.recv_bytes()
            if data in (NEW, STOP):
                cache = backend.new_cache(1 << 14)
                tx.send_bytes(data)
                if data == STOP:
                    return
                continue
            tx.send_bytes(forward(np.frombuffer(data, dtype=np.float32).reshape(-1, hidden)))
    while True:   # the head: one generation per control message
        msg = control.recv()
        if msg is None:
            tx.send_bytes(STOP)
            rx.recv_bytes()
            return
        ids, n, chunk = msg
        cache = backend.new_cache(1 << 14)
        tx.send_bytes(NEW)
        rx.recv_bytes()
        t0 = time.perf_counter()
        for first in range(0, len(ids), chunk):
            tx.send_bytes(forward(np.asarray(ids[first:first + chunk], dtype=np.int64)))
            token = _TOKEN.unpack(rx.recv_bytes())[0]
        prefill_s = time.perf_counter() - t0
        tokens, steps = [token], []
        for _ in range(n - 1):
            t0 = time.perf_counter()
            tx.send_bytes(forward(np.asarray([token], dtype=np.int64)))
            token = _TOKEN.unpack(rx.recv_bytes())[0]
            steps.append((time.perf_counter() - t0) * 1000)
            tokens.append(token)
        control.send((tokens, prefill_s, steps))


class TorchFloor:
    """The bare split's processes (see the module docstring)."""

    def __init__(self, model: Path, specs: Sequence[str], threads: int) -> None:
        ctx = mp.get_context("spawn")
        ranges = [tuple(int(x) for x in spec.split(":")) for spec in specs]
        if not ranges or ranges[0][0] != 0:
            raise ValueError("a floor needs contiguous ranges from layer 0")
        links = [ctx.Pipe(duplex=False) for _ in ranges]     # link i: hop i -> hop i+1 (the last: tail -> head)
        self._controls = []
        self.procs = []
        for i, (start, end) in enumerate(ranges):
            mine, theirs = ctx.Pipe()
            self._controls.append(mine)
            rx = links[i - 1][0]
            tx = links[i][1]
            self.procs.append(ctx.Process(target=_hop, args=(str(model), start, end, threads, rx, tx, theirs),
                                          daemon=True, name=f"torch-floor-{start}:{end}"))
        for proc in self.procs:
            proc.start()
        try:
            for control in self._controls:
                self._wait(control, LOAD_TIMEOUT_S, "load its range")
                control.recv_bytes()
        except BaseException:
            self.close()
            raise

    def _wait(self, control, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not control.poll(0.5):
            dead = [p.name for p in self.procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"bare torch floor: {', '.join(dead)} exited before it could {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"bare torch floor: no answer in {timeout_s:g} s ({what})")

    def generate(self, ids: Sequence[int], n: int, chunk_tokens: int = 128) -> FloorRun:
        head = self._controls[0]
        head.send((list(ids), n, chunk_tokens))
        self._wait(head, RUN_TIMEOUT_S, "generate")
        tokens, prefill_s, steps = head.recv()
        return FloorRun(tokens=tokens, prefill_s=prefill_s, step_ms=steps)

    def close(self) -> None:
        try:
            if self.procs and self.procs[0].is_alive():
                self._controls[0].send(None)
        except OSError:
            pass
        deadline = time.monotonic() + 10
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for control in self._controls:
            control.close()

    def __enter__(self) -> TorchFloor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
