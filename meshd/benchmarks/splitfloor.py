"""The floor under a split: the same layer ranges in bare processes, no meshd between them.

Why: a route's decode steps alternate between processes, and on a small
machine that alone costs compute -- each process resumes with caches the
other one just evicted (measured here: the two halves of a 58M Llama took
~15% more CPU per token in two processes than in one). ``decode_ratio``
against the whole model in one process includes that; this floor shows
how much of it any split would pay, with nothing of meshd on the path.

    one process per range   shard.torch_backend.TorchRangeBackend (the workers' own
                            backend), 1 compute thread, started with multiprocessing
                            ("spawn") so each loads only its range
    a decode step           the parent sends the token (or hidden row) down a pipe to
                            the first range's process, passes its output to the next,
                            and takes the argmax of the last one's logits

``measure(model, specs, prompt_ids, n)`` returns decode tok/s over ``n``
tokens (greedy) and the tokens, so callers check they equal the route's.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Sequence

import numpy as np

# Loading a range and answering one step: generous bounds, never a hang.
START_TIMEOUT_S = 300.0
STEP_TIMEOUT_S = 60.0


def _serve(model: str, start: int, end: int, conn) -> None:
    import torch

    torch.set_num_threads(1)
    from shard.torch_backend import TorchRangeBackend

    backend = TorchRangeBackend.load(model, start, end, progress=None)
    cache = None
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        if isinstance(msg, int):
            if cache is not None:
                cache.release()
            cache = backend.new_cache(msg)
            conn.send("ok")
            continue
        conn.send(backend.forward(cache, msg, effective_start=start))


class SplitFloor:
    """Bare processes serving ``specs`` ("A:B") of ``model``; ``close()`` stops them."""

    def __init__(self, model: Path, specs: Sequence[str]) -> None:
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for spec in specs:
            start, end = (int(x) for x in spec.split(":"))
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(str(model), start, end, child), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        for pipe in self.pipes:
            self._recv(pipe, START_TIMEOUT_S)

    @staticmethod
    def _recv(pipe, timeout_s: float):
        if not pipe.poll(timeout_s):
            raise TimeoutError("a split-floor process did not answer in time")
        return pipe.recv()

    def _step(self, x: np.ndarray) -> np.ndarray:
        for pipe in self.pipes:
            pipe.send(x)
            x = self._recv(pipe, STEP_TIMEOUT_S)
        return x

    def measure(self, prompt_ids: Sequence[int], n: int) -> tuple[float, list[int]]:
        """(decode tok/s, greedy tokens) for ``n`` new tokens after ``prompt_ids``."""
        for pipe in self.pipes:
            pipe.send(len(prompt_ids) + n + 1)
            self._recv(pipe, STEP_TIMEOUT_S)
        logits = self._step(np.asarray(prompt_ids, dtype=np.int64))
        tokens = [int(np.argmax(logits))]
        t0 = time.perf_counter()
        for _ in range(n - 1):
            logits = self._step(np.array([tokens[-1]], dtype=np.int64))
            tokens.append(int(np.argmax(logits)))
        return (n - 1) / (time.perf_counter() - t0), tokens

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
