"""``meshd bench serve``: many users at once through the entry's ``/v1`` API, both lanes, one run.

For each lane -- llama.cpp on the packaged SmolLM2 GGUF in the default
layout (one KV stream per session), sized for c=8: ``[worker] llama_kv_streams = 8``,
8 streams of 512 tokens from the 4096-token budget (``auto`` would make 2 of 2048), the same with the shared
KV pool (``llama.cpp-shared``, ``llama_kv_streams = 0``, opt-in), torch on the
SmolLM2 safetensors artifact -- three ``meshd join`` daemons on fixed ranges
(0:10, 10:20, 20:30; ``meshd.daemon.local_swarm.LocalSwarm``, one compute thread each,
``--api-listen 127.0.0.1:0``); node0 is the entry. Its config sets
``[api] max_running = 8``: the default (4) would queue half of the c=8
requests at the entry and hide what the workers do; ``peak_streaming_c8``
(the most requests whose tokens were arriving at once, from the client's
clock) shows whether anything still capped them.

Rounds: the same 8 distinct chat prompts (greedy, ``temperature`` 0, the same
token budget) are sent one at a time (c=1: every request alone -- these are
also the reference outputs), then 4 and 8 at once (streaming
``/v1/chat/completions`` read with httpx, one client per request thread).
Repeated ``rounds`` times in alternating order (1,4,8 then 8,4,1).
Per concurrency, from each token chunk's arrival time at the client: the
aggregate decode rate, the inter-token gaps (p50, p95) and their ratios to
c=1, and whether every concurrent request's answer equals the same request
alone (it must on ``llama.cpp`` and ``torch``; ``llama.cpp-shared``'s shared
pool can drift). Every key is listed in docs/benchmarks.md (serve).

What the machine allows (per lane, no timing of its own): with P = min(cores, hops) hops
computing at once and each forward of 8 sessions' rows F times the throughput of one row
(``floor_batch8_throughput_ratio``), a round of 8 tokens costs at least hops x 8 t / (F P) where
one token alone costs hops x t: ``bound_aggregate_ratio_c8`` = F P and ``bound_p50_itl_ratio_c8``
= 8 / (F P) (``parallel_hops`` = P). A target above the first (or below the second) is out of
this machine's reach for that backend.

``itl_gap_causes_c8`` (per lane): what the slowest 5% of the c=8 gaps overlapped in the
workers' own batch traces (``MESHD_BATCH_TRACE``, shard/session/batching.py).

Where the CPU goes (per lane, from ``/proc``): the CPU time of every swarm process and of this
client over the rounds' wall time says whether the lane is CPU-bound at c=8 (busy cores near
``machine_cores``: then only less CPU per token makes it faster), and the CPU per token at c=1
over c=8 is the batching gain the product achieved, to set against the floor. Together they bound
c=8 a second way: ``cpu_bound_aggregate_ratio_c8`` = ``machine_cores`` / ``cpu_cores_busy_c1`` x
the floor (optimistic: the entry's and the wire's share does not batch).

``load_average`` is the 1-minute load at the end (other work on the machine
makes absolute numbers noisy; every ratio is side by side in this run).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from meshd.benchmarks.sse import choices
from shard.session.batching import TRACE_ENV

PROMPTS = (
    "Tell me about the history of Rome.", "What is a transformer model?", "Write a short poem about the sea.",
    "How do bees make honey?", "Explain how a bicycle stays upright.", "What is the capital of France?",
    "Give me three tips for learning to cook.", "Why is the sky blue?",
)
CUTS = ("0:10", "10:20", "20:30")
MAX_RUNNING = 8
KV_TOKENS = 4096   # the product default budget
REQUEST_TIMEOUT_S = 900.0
START_TIMEOUT_S = 600.0
# The third lane: llama.cpp with the shared KV pool, the opt-in layout ([worker] llama_kv_streams = 0).
SHARED_TOML = "llama_kv_streams = 0"
# The llama.cpp lane: the default layout (a stream per session), 8 streams for 8 users at once.
STREAMS = 8
STREAMS_TOML = f"llama_kv_streams = {STREAMS}"
FLOOR_THREADS = 1   # a LocalSwarm worker's compute threads (meshd/daemon/local_swarm.py THREADS)


def _say(progress: TextIO | None, line: str) -> None:
    if progress is not None:
        print(f"serve bench: {line}", file=progress, flush=True)


def _stream(url: str, model_id: str, prompt: str, n: int) -> tuple[list[str], list[float]]:
    import httpx

    body = {"model": model_id, "messages": [{"role": "user", "content": prompt}], "max_tokens": n,
            "temperature": 0, "stream": True}
    pieces, arrivals = [], []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            for choice in choices(r):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    pieces.append(delta)
                    arrivals.append(time.perf_counter())
    return pieces, arrivals


def _wave(url: str, model_id: str, indices: list[int], n: int) -> list[tuple[int, list[str], list[float]]]:
    """``indices`` prompts at once, one thread each; every wait bounded."""
    out: list = [None] * len(indices)
    errors: list[BaseException] = []

    def one(slot: int, index: int) -> None:
        try:
            out[slot] = (index, *_stream(url, model_id, PROMPTS[index], n))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(s, i), daemon=True) for s, i in enumerate(indices)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a request did not finish within {REQUEST_TIMEOUT_S:g} s")
    return out


def _peak(runs) -> int:
    spans = [(a[0], a[-1]) for _, _, a in runs if a]
    return max(sum(1 for s, e in spans if s <= t <= e) for t, _ in spans) if spans else 0


class _Stats:
    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.spans: list[tuple[float, float]] = []   # each gap's (previous token, next token) arrival
        self.windows: list[tuple[float, float]] = []  # each round's first to last arrival
        self.rates: list[float] = []
        self.peak = 0

    def add(self, runs, concurrent: bool) -> None:
        runs = [r for r in runs if len(r[2]) > 1]
        for _, _, a in runs:
            self.gaps += [y - x for x, y in zip(a, a[1:])]
            self.spans += list(zip(a, a[1:]))
        if runs:
            self.windows.append((min(a[0] for _, _, a in runs), max(a[-1] for _, _, a in runs)))
        if concurrent:
            span = max(a[-1] for _, _, a in runs) - min(a[0] for _, _, a in runs)
            self.rates.append(sum(len(a) - 1 for _, _, a in runs) / span)
            self.peak = max(self.peak, _peak(runs))
        else:
            self.rates += [(len(a) - 1) / (a[-1] - a[0]) for _, _, a in runs]

    def quantile(self, q: float) -> float:
        gaps = sorted(self.gaps)
        return gaps[min(len(gaps) - 1, int(q * len(gaps)))]


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads); None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Cpu:
    """CPU time of the swarm's processes plus this client's, accumulated per concurrency."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.cpu_s: dict[int, float] = {}
        self.wall_s: dict[int, float] = {}
        self.tokens: dict[int, int] = {}

    def _now(self) -> dict[int, float | None]:
        return {pid: _cpu_seconds(pid) for pid in self.pids}

    def measure(self, c: int, wave):
        """Runs ``wave()`` (its runs returned) and books its CPU, wall time and tokens under ``c``."""
        before, own, t0 = self._now(), time.process_time(), time.perf_counter()
        runs = wave()
        wall, own = time.perf_counter() - t0, time.process_time() - own
        after = self._now()
        pairs = [(before[p], after[p]) for p in self.pids]
        used = own + sum(b - a for a, b in pairs if a is not None and b is not None)   # an exited one: left out
        self.cpu_s[c] = self.cpu_s.get(c, 0.0) + used
        self.wall_s[c] = self.wall_s.get(c, 0.0) + wall
        self.tokens[c] = self.tokens.get(c, 0) + sum(len(pieces) for _, pieces, _ in runs)
        return runs

    def report(self) -> dict:
        out: dict = {"machine_cores": len(os.sched_getaffinity(0))}
        for c in sorted(self.cpu_s):
            out[f"cpu_cores_busy_c{c}"] = round(self.cpu_s[c] / self.wall_s[c], 3)
            out[f"cpu_ms_per_token_c{c}"] = round(1e3 * self.cpu_s[c] / max(1, self.tokens[c]), 3)
        if {1, 8} <= self.cpu_s.keys():
            out["cpu_per_token_ratio_c8"] = round(out["cpu_ms_per_token_c1"] / out["cpu_ms_per_token_c8"], 3)
        return out


def _read_traces(root: Path) -> list[list[dict]]:
    """Every worker's batch trace (shard/session/batching.py, MESHD_BATCH_TRACE): one list per hop."""
    hops = []
    for path in sorted(root.glob("batch-trace.*.jsonl")):
        with path.open() as fh:
            hops.append([json.loads(line) for line in fh if line.endswith("\n")])
    return hops


def _gap_causes(stats: dict[int, _Stats], hops: list[list[dict]]) -> dict:
    """What the slowest 5% of the c=8 inter-token gaps overlapped in the workers' batch traces.

    A gap (one request's token k to k+1, client clock) is ``with_prefill`` when a forward on some
    hop that overlapped it held a prefill chunk (an item of more than one position), else
    ``decode_only``. ``hop_busy_share``: the mean share of a tail gap during which a hop was
    computing (the rest is wire, entry and scheduling time); ``queue_wait_ms``: the mean, over
    the forwards overlapping tail gaps, of their longest item wait (queued behind a running forward).
    Decode-only forwards' mean time and rows in the c=1 and c=8 rounds say what one step costs."""
    def inside(batch, windows):
        return any(lo <= batch["t0"] <= hi for lo, hi in windows)

    out: dict = {"hops_traced": len(hops)}
    for c in (1, 8):
        decode = [b for hop in hops for b in hop if b["max_item"] == 1 and inside(b, stats[c].windows)]
        out[f"decode_forward_ms_c{c}"] = (round(1e3 * statistics.fmean(b["t1"] - b["t0"] for b in decode), 3)
                                          if decode else None)
        out[f"decode_forward_rows_c{c}"] = round(statistics.fmean(b["rows"] for b in decode), 2) if decode else None
    s8 = stats[8]
    if not s8.gaps or not hops:
        return out
    threshold = s8.quantile(0.95)
    tail = [span for gap, span in zip(s8.gaps, s8.spans) if gap >= threshold]
    prefill, busy = 0, 0.0
    waits: list[float] = []
    for a, b in tail:
        over = [[x for x in hop if x["t1"] > a and x["t0"] < b] for hop in hops]
        prefill += any(x["max_item"] > 1 for hop in over for x in hop)
        busy += statistics.fmean(sum(min(b, x["t1"]) - max(a, x["t0"]) for x in hop) / (b - a) for hop in over)
        waits += [x["wait_max"] for hop in over for x in hop]
    out.update({"tail_gaps": len(tail), "tail_threshold_s": round(threshold, 4), "with_prefill": prefill,
                "decode_only": len(tail) - prefill, "hop_busy_share": round(busy / len(tail), 3),
                "queue_wait_ms": round(1e3 * statistics.fmean(waits), 3) if waits else None})
    return out


def _lane(name: str, model: Path, backend: str, quick: bool, progress, worker_toml: str = "") -> dict:
    import httpx

    from meshd.daemon.local_swarm import LocalSwarm

    new_tokens = 16 if quick else 48
    rounds = 1 if quick else 2
    root = Path(tempfile.mkdtemp(prefix=f"meshd-bench-serve-{backend}-"))
    config, workers = root / "entry.toml", root / "worker.toml"
    config.write_text(f"[api]\nmax_running = {MAX_RUNNING}\n" + (f"[worker]\n{worker_toml}\n" if worker_toml else ""))
    workers.write_text(f"[worker]\n{worker_toml}\n")
    traced = os.environ.get(TRACE_ENV)
    os.environ[TRACE_ENV] = str(root / "batch-trace")   # the workers inherit it (and only they read it)
    swarm = LocalSwarm(root, model, kv_budget_tokens=KV_TOKENS, backend=backend)
    try:
        daemons = [swarm.add(layers=cut, extra=("--config", str(config if i == 0 else workers)))
                   for i, cut in enumerate(CUTS)]
        for d in daemons:
            swarm.wait_serving(d, START_TIMEOUT_S)
        swarm.wait_covered(START_TIMEOUT_S, peers=len(CUTS))
        url = daemons[0].api_url()
        model_id = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        _say(progress, f"{name}: swarm covered, entry {url}; {rounds} round(s), {new_tokens} tokens per request")
        _stream(url, model_id, PROMPTS[0], 4)   # warm the route
        cpu = _Cpu([pid for d in daemons for pid in (d.proc.pid, *d.worker_pids())])
        stats = {c: _Stats() for c in (1, 4, 8)}
        alone: dict[int, list[str]] = {}
        equal, compared, together = True, 0, []
        everyone = list(range(len(PROMPTS)))
        for r in range(rounds):
            for c in ((1, 4, 8) if r % 2 == 0 else (8, 4, 1)):
                if c == 1:
                    runs = cpu.measure(1, lambda: [_wave(url, model_id, [i], new_tokens)[0] for i in everyone])
                    for index, pieces, _ in runs:
                        if index in alone and alone[index] != pieces:
                            equal = False   # the same request alone twice gave two answers
                        alone.setdefault(index, pieces)
                else:
                    waves = [everyone[k:k + c] for k in range(0, len(everyone), c)]
                    runs = cpu.measure(c, lambda waves=waves: [run for wave in waves
                                                               for run in _wave(url, model_id, wave, new_tokens)])
                stats[c].add(runs, concurrent=c > 1)
                _say(progress, f"{name} round {r + 1} c={c}: {len(runs)} requests done")
                if c > 1:
                    together += runs
        same = 0
        for index, pieces, _ in together:   # after every round: alone[] is complete
            compared += 1
            same += pieces == alone[index]
        equal = equal and same == compared
        agg = {c: statistics.median(stats[c].rates) for c in stats}
        p50 = {c: stats[c].quantile(0.50) for c in stats}
        p95 = {c: stats[c].quantile(0.95) for c in stats}
        out: dict[str, Any] = {"requests_compared": compared, "requests_equal": same, "outputs_equal": equal,
               "new_tokens": new_tokens, "rounds": rounds,
               "peak_streaming_c8": stats[8].peak, "api_max_running": MAX_RUNNING,
               "aggregate_ratio_c8": round(agg[8] / agg[1], 3), "aggregate_ratio_c4": round(agg[4] / agg[1], 3),
               "p95_itl_ratio_c8": round(p95[8] / p95[1], 3), "p95_itl_ratio_c4": round(p95[4] / p95[1], 3)}
        for c in stats:
            out[f"aggregate_tokens_per_s_c{c}"] = round(agg[c], 3)
            out[f"p50_itl_s_c{c}"] = round(p50[c], 4)
            out[f"p95_itl_s_c{c}"] = round(p95[c], 4)
        out["itl_gap_causes_c8"] = _gap_causes(stats, _read_traces(root))
        out.update(cpu.report())
        return out
    finally:
        if traced is None:
            os.environ.pop(TRACE_ENV, None)
        else:
            os.environ[TRACE_ENV] = traced
        swarm.close()
        shutil.rmtree(root, ignore_errors=True)


def _floor(backend, rounds: int) -> float:
    """Tokens/s of 8 sessions' decode rows in one batched forward over one session's row alone."""
    import numpy as np

    caches = [backend.new_cache(256) for _ in range(8)]
    start = backend.layer_range.start
    try:
        backend.forward_batch(caches, [np.asarray([1, 2, 3, 4], np.int64)] * 8, effective_start=start)
        one = eight = 0.0
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(4):
                backend.forward(caches[0], np.asarray([5], np.int64), effective_start=start)
            one += time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(4):
                backend.forward_batch(caches[1:] + caches[:1], [np.asarray([5], np.int64)] * 8,
                                      effective_start=start)
            eight += time.perf_counter() - t
        return round(8 * one / eight, 3)
    finally:
        for cache in caches:
            cache.release()


def _floors(gguf: Path, artifact: Path, quick: bool, names: tuple[str, ...] = ()) -> dict[str, float]:
    import torch

    from native.gguf_range import model_info, open_reader
    from native.llama_backend import LlamaBackendConfig, LlamaRangeBackend
    from shard.model.backend import LayerRange
    from shard.model.torch_backend import TorchRangeBackend

    rounds = 2 if quick else 4
    layers = model_info(open_reader(gguf)).num_layers
    floors = {}
    for name, streams in (("llama.cpp", STREAMS), ("llama.cpp-shared", 0)):
        if names and name not in names:
            continue
        config = LlamaBackendConfig(n_threads=FLOOR_THREADS, kv_budget_tokens=KV_TOKENS,
                                    max_sessions=streams or 16, kv_unified=not streams)
        llama = LlamaRangeBackend(gguf, LayerRange(0, layers, layers), config, progress=None)
        try:
            floors[name] = _floor(llama, rounds)
        finally:
            llama.close()
    if names and "torch" not in names:
        return floors
    threads = torch.get_num_threads()
    torch.set_num_threads(FLOOR_THREADS)
    try:
        floors["torch"] = _floor(TorchRangeBackend.load(artifact, 0, None, progress=None), rounds)
    finally:
        torch.set_num_threads(threads)
    return floors


def bounds(floor: float, hops: int, cores: int | None = None, concurrency: int = 8) -> dict:
    """What this machine allows at c=8 at best (module doc): the hops compute on at most
    min(cores, hops) cores at once, each batching at most as well as the backend's own 8-row forward."""
    parallel = max(1, min(cores or os.cpu_count() or 1, hops))
    best = floor * parallel
    return {"bound_aggregate_ratio_c8": round(best, 3),
            "bound_p50_itl_ratio_c8": round(concurrency / best, 3), "parallel_hops": parallel}


def run(quick: bool = False, progress: TextIO | None = None, options=None) -> dict:
    from native.packaged import smollm2_artifact, smollm2_gguf_path

    gguf, artifact = smollm2_gguf_path(), smollm2_artifact()
    every = (("llama.cpp", gguf, "llama.cpp", STREAMS_TOML), ("torch", artifact, "torch", ""),
             ("llama.cpp-shared", gguf, "llama.cpp", SHARED_TOML))
    only = getattr(options, "lane", None)    # --lane: one lane of the three (a shorter run)
    chosen = tuple(lane for lane in every if only in (None, lane[0]))   # the CLI checks the name
    _say(progress, "in-process floor: 8 rows in one batched forward vs 1 row")
    floors = _floors(gguf, artifact, quick, tuple(lane[0] for lane in chosen))
    lanes = {}
    for name, model, backend, worker_toml in chosen:
        lanes[name] = _lane(name, model, backend, quick, progress, worker_toml)
        lanes[name]["floor_batch8_throughput_ratio"] = floors[name]
        lanes[name].update(bounds(floors[name], len(CUTS)))
        lanes[name]["cpu_bound_aggregate_ratio_c8"] = round(
            lanes[name]["machine_cores"] / lanes[name]["cpu_cores_busy_c1"] * floors[name], 3)
    if "llama.cpp" in lanes:
        lanes["llama.cpp"]["llama_kv_streams"] = STREAMS
    if "llama.cpp-shared" in lanes:
        lanes["llama.cpp-shared"]["llama_kv_streams"] = 0
    return {"lanes": lanes, "nodes": len(CUTS), "layers": list(CUTS), "prompts": len(PROMPTS),
            "load_average": round(os.getloadavg()[0], 2),
            "targets": {"aggregate_ratio_c8": {"llama.cpp": 3.0, "torch": 2.0}, "p95_itl_ratio_c8": 2.5}}
