"""The bare llama.cpp split floor: the same slices in bare native processes, rows over pipes.

A llama.cpp swarm's decode step alternates between processes and crosses a
transport per hop. This runs the same split with nothing of meshd on the
path, to show what any split costs here by itself:

    one process per range   ``llama_floor`` (native/csrc/llama_floor.c, built by
                            native/cbuild.py): the range's slice (native/slice.py, the
                            file a worker loads), a worker's context settings
                            (flash attention, unified KV of ``n_ctx`` cells), the
                            same residual capture (capture.c), ``n_threads`` threads
    the chain               a ring of pipes: head -> ... -> tail -> head; raw
                            float32 rows forward, the tail's argmax token back
    a generation            the head prefills in ``chunk_tokens`` chunks, then
                            decodes one token per step, greedy, and times both

``floor_generate(source, ranges, prompt, n, ...)`` returns a FloorRun with
the tokens (callers check they equal the whole model's) and the timings.

State: none kept; the processes live for one call and are killed if it
fails or overruns ``RUN_TIMEOUT_S``.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from native.cbuild import floor_binary
from native.errors import RuntimeUnavailable
from native.gguf_range import model_info, open_reader
from native.llama_engine import MAX_BATCH_TOKENS
from native.slice import slice_path
from proto.limits import DEFAULT_PREFILL_CHUNK_TOKENS
from shard.model.backend import LayerRange

__all__ = ["FloorRun", "floor_generate"]

# Load + prefill + a few hundred decode steps of a small model: minutes at
# most even on a loaded machine; a wedged process is killed, never waited on.
RUN_TIMEOUT_S = 600.0
# llama_floor.c's own bounds (MAX_PROMPT, MAX_STOPS).
MAX_PROMPT_TOKENS = 4096
MAX_STOP_IDS = 16


@dataclass(frozen=True, slots=True)
class FloorRun:
    tokens: tuple[int, ...]
    prefill_s: float
    decode_s: float
    processes: int

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.tokens) - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


def floor_generate(source: str | Path, ranges: Sequence[LayerRange], prompt: Sequence[int], max_new_tokens: int, *,
                   n_threads: int = 1, n_ctx: int = 1024, chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
                   stop_ids: frozenset[int] = frozenset()) -> FloorRun:
    """Greedy generation through one bare process per range (see the module docstring)."""
    if len(ranges) < 2 or not ranges[0].is_head or not ranges[-1].is_tail:
        raise ValueError("a split floor needs at least two ranges, from the head to the tail")
    if any(a.end != b.start for a, b in zip(ranges, ranges[1:])):
        raise ValueError("ranges must be contiguous")
    if not 1 <= len(prompt) <= MAX_PROMPT_TOKENS or len(stop_ids) > MAX_STOP_IDS or max_new_tokens < 1:
        raise ValueError(f"prompt of 1..{MAX_PROMPT_TOKENS} tokens, <= {MAX_STOP_IDS} stop ids, max_new_tokens >= 1")
    if len(prompt) + max_new_tokens > n_ctx or not 1 <= chunk_tokens <= MAX_BATCH_TOKENS:
        raise ValueError("prompt + max_new_tokens must fit n_ctx; chunk_tokens in 1..MAX_BATCH_TOKENS")
    source = Path(source)
    n_embd = model_info(open_reader(source)).hidden_size
    binary = floor_binary()
    paths = [slice_path(source, part, None) for part in ranges]
    with tempfile.TemporaryDirectory(prefix="meshd-llama-floor-") as tmp:
        report = Path(tmp) / "report.json"
        # pipes[i]: process i writes, process i + 1 (the head for the tail) reads
        pipes = [os.pipe() for _ in ranges]
        procs: list[subprocess.Popen] = []
        try:
            for i, (part, path) in enumerate(zip(ranges, paths)):
                args = [str(binary), "--model", str(path), "--threads", str(n_threads), "--ctx", str(n_ctx),
                        "--embd", str(n_embd), "--batch", str(MAX_BATCH_TOKENS),
                        "--capture", str(-1 if part.is_tail else part.count - 1)]
                if i == 0:
                    args += ["--prompt", ",".join(str(int(t)) for t in prompt), "--new", str(max_new_tokens),
                             "--chunk", str(chunk_tokens), "--stops", ",".join(str(s) for s in sorted(stop_ids)),
                             "--report", str(report)]
                procs.append(subprocess.Popen(args, stdin=pipes[i - 1][0], stdout=pipes[i][1],
                                              stderr=subprocess.PIPE))
            for r, w in pipes:
                os.close(r)
                os.close(w)
            pipes = []
            for proc in procs:
                _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
                if proc.returncode != 0:
                    raise RuntimeUnavailable(f"llama_floor exited with {proc.returncode}: "
                                             f"{err.decode(errors='replace')[-1000:]}")
            done = json.loads(report.read_text())
        except subprocess.TimeoutExpired as exc:
            raise RuntimeUnavailable(f"the llama.cpp floor took over {RUN_TIMEOUT_S:.0f} s") from exc
        finally:
            for r, w in pipes:
                os.close(r)
                os.close(w)
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return FloorRun(tuple(done["tokens"]), done["prefill_s"], done["decode_s"], len(ranges))
