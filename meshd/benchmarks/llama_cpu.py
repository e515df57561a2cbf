"""Where a llama.cpp swarm's decode step goes, in CPU time (robust to a busy machine).

Wall-clock ratios on a shared 2-core machine swing with the neighbours'
load; CPU time per decode token moves much less. Two measurements for
``meshd bench swarm --backend llama.cpp``:

* ``process_cpu(swarm)`` / ``ProcessCpu``: utime + stime of every daemon and
  worker process of a swarm (``/proc/PID/stat``), snapshotted at the first
  token and at the end of a generation: CPU ms per decode token of the entry
  daemon (route driver, hop links), the entry's worker, the other daemons
  (idle duties: DHT, records) and the other workers.
* ``engine_cpu(model, specs, steps)``: the llama.cpp engines alone, in this
  process, on one thread (``thread_time``; with one thread llama.cpp computes
  on the caller's): the whole GGUF, each slice of the split (C residual
  capture), and the head slice again with the Python eval callback, decode
  steps alternating. The sum over slices against the whole says whether a
  split costs compute by itself; Python minus C is what capture.c saved per
  non-tail hop and step.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds; 0 for a process that is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK_S   # fields 14 and 15 of proc(5)


class ProcessCpu:
    """CPU per decode token of a swarm's processes, accumulated over generations."""

    def __init__(self, swarm, entry) -> None:
        self.groups: dict[str, list[int]] = {"entry_daemon": [entry.proc.pid], "entry_worker": entry.worker_pids(),
                                             "other_daemons": [], "other_workers": []}
        for daemon in swarm.daemons:
            if daemon is not entry:
                self.groups["other_daemons"].append(daemon.proc.pid)
                self.groups["other_workers"] += daemon.worker_pids()
        self.cpu_s = {name: 0.0 for name in self.groups}
        self.tokens = 0
        self._mark: dict[str, float] | None = None

    def _now(self) -> dict[str, float]:
        return {name: sum(_cpu_s(pid) for pid in pids) for name, pids in self.groups.items()}

    def on_token(self, count: int) -> None:
        if count == 1:
            self._mark = self._now()

    def done(self, tokens: int) -> None:
        if self._mark is None or tokens < 2:
            return
        now = self._now()
        for name in self.groups:
            self.cpu_s[name] += now[name] - self._mark[name]
        self.tokens += tokens - 1
        self._mark = None

    def per_token_ms(self) -> dict[str, float]:
        return {name: round(s * 1e3 / self.tokens, 3) if self.tokens else None for name, s in self.cpu_s.items()}


def engine_cpu(model: Path, specs: Sequence[str], steps: int = 64, prompt_tokens: int = 200) -> dict:
    """Median CPU ms per decode step of the whole GGUF, each slice, and the head slice's Python capture."""
    from native.gguf_range import model_info, open_reader
    from native.llama_engine import EngineConfig, LlamaEngine
    from native.slice import FAKE_VOCAB, slice_path
    from shard.model.backend import LayerRange

    info = model_info(open_reader(model))
    config = EngineConfig(n_threads=1, n_ctx=prompt_tokens + steps + 64, n_seq_max=1)
    ranges = [LayerRange.parse(spec, info.num_layers) for spec in specs]

    def load(path, part: LayerRange | None, capture: str):
        before = os.environ.get("MESHD_LLAMA_CAPTURE")
        os.environ["MESHD_LLAMA_CAPTURE"] = capture
        try:
            vocab = info.vocab_size if part is None or part.is_head or part.is_tail else FAKE_VOCAB
            return LlamaEngine(path, config, n_embd=info.hidden_size, n_vocab=vocab,
                               capture_layer=None if part is None or part.is_tail else part.count - 1)
        finally:
            if before is None:
                os.environ.pop("MESHD_LLAMA_CAPTURE", None)
            else:
                os.environ["MESHD_LLAMA_CAPTURE"] = before

    engines = {"whole": (load(model, None, "c"), True)}
    for part in ranges:
        engines[f"{part.start}:{part.end}"] = (load(slice_path(model, part, None), part, "c"), part.is_head)
    engines["head_python_capture"] = (load(slice_path(model, ranges[0], None), ranges[0], "python"), True)
    try:
        rng = np.random.default_rng(0)
        ids = rng.integers(3, info.vocab_size, prompt_tokens + steps).astype(np.int32)
        rows = rng.standard_normal((prompt_tokens + steps, info.hidden_size)).astype(np.float32)
        for engine, tokens in engines.values():
            for first in range(0, prompt_tokens, 128):
                x = ids[first:first + 128] if tokens else rows[first:first + 128]
                engine.decode(0, first, x[:prompt_tokens - first], want_hidden=engine.capture != "none")
        spent: dict[str, list[float]] = {name: [] for name in engines}
        for i in range(prompt_tokens, prompt_tokens + steps):
            for name, (engine, tokens) in engines.items():
                x = ids[i:i + 1] if tokens else rows[i:i + 1]
                t0 = time.thread_time()
                engine.decode(0, i, x, want_hidden=engine.capture != "none")
                spent[name].append(time.thread_time() - t0)
    finally:
        for engine, _ in engines.values():
            engine.close()
    ms = {name: statistics.median(v) * 1e3 for name, v in spent.items()}
    slices = sum(ms[f"{p.start}:{p.end}"] for p in ranges)
    return {"whole_cpu_ms": round(ms["whole"], 3), "slices_cpu_ms": round(slices, 3),
            "slices_vs_whole_cpu": round(slices / ms["whole"], 3),
            "per_slice_cpu_ms": {f"{p.start}:{p.end}": round(ms[f"{p.start}:{p.end}"], 3) for p in ranges},
            "python_capture_extra_cpu_ms": round(
                ms["head_python_capture"] - ms[f"{ranges[0].start}:{ranges[0].end}"], 3)}
