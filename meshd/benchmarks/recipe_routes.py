"""2-shard routes of local workers for ``meshd bench recipes``, plus the vocab-skip probe.

``measure_route(model, backend, cut, plan, prompts)`` starts two real
``meshd worker`` subprocesses (layers ``0:cut`` and ``cut:N``) on loopback,
drives every request of the plan through the route driver (SwarmDriver over
a fixed route, gRPC; one driver, i.e. one route session, per request), and
reports the same outcomes as a whole-model recipe plus the workers' summed
peak RSS (VmHWM, read from /proc before they are stopped). TTFT is the
driver's prefill time (until the tail's first token); decode time covers the
remaining tokens.

``vocab_projection_probe(gguf, cut)`` loads the head range twice in-process,
once stopping the graph after the last block (what meshd does) and once
letting llama.cpp finish the output norm and the full vocabulary projection,
and times the same prefill and decode steps on both.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import numpy as np

from meshd.benchmarks.recipe_plan import Plan
from meshd.benchmarks.recipe_runner import measure

WORKER_KV_TOKENS = 2048  # a few concurrent 300-token sessions; keeps llama.cpp's KV small


def _vmhwm_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure_route(model: Path, backend: str, cut: int, num_layers: int, plan: Plan,
                  prompts: dict[str, list[int]], threads: int, progress: TextIO | None):
    from meshd.generate.driver import GenerationRequest, SwarmDriver
    from meshd.generate.routes import PeerConnector, discover_fingerprint, fixed_route
    from meshd.testing.procs import spawn_worker

    extra = ["--backend", backend, "--kv-budget-tokens", str(WORKER_KV_TOKENS), "--max-sessions", "8"]
    workers = []
    try:
        for layers in (f"0:{cut}", f"{cut}:{num_layers}"):
            workers.append(spawn_worker(model, layers, threads=threads, extra=extra, stderr=None))
        source = fixed_route([(workers[0].endpoint, 0, cut), (workers[1].endpoint, cut, num_layers)], num_layers)
        connector = PeerConnector(insecure_loopback=True)
        fingerprint = discover_fingerprint(connector, source.route)  # validated once; every request reuses it

        def generate(ids: Sequence[int], n: int):
            driver = SwarmDriver(source, connector, fingerprint=fingerprint)
            tokens = [t.id for t in driver.generate(GenerationRequest(tuple(ids), n, chunk_tokens=plan.chunk_tokens))]
            times = driver.stats.token_times
            return tokens, driver.stats.prefill_s, times[-1] - times[0] if len(times) > 1 else 0.0

        def log(message: str) -> None:
            if progress is not None:
                print(f"[recipe route {backend} {model.name}] {message}", file=progress, flush=True)

        outcomes, walls = measure(generate, prompts, plan, log)
        rss = sum(_vmhwm_bytes(w.pid) for w in workers)
        return outcomes, walls, rss
    finally:
        for worker in workers:
            worker.stop()


def vocab_projection_probe(gguf: Path, cut: int, num_layers: int, prompt: Sequence[int],
                           decode_steps: int = 32, threads: int = 2) -> dict[str, float]:
    """Head range [0, cut): time with the vocabulary projection skipped vs computed."""
    from native.llama_backend import LlamaBackendConfig, LlamaRangeBackend
    from shard.model.backend import LayerRange

    figures: dict[str, float] = {}
    for skip in (True, False):
        config = LlamaBackendConfig(n_threads=threads, kv_budget_tokens=1024, max_sessions=2,
                                    skip_vocab_projection=skip)
        backend = LlamaRangeBackend(gguf, LayerRange(0, cut, num_layers), config, progress=None)
        try:
            best_prefill = best_decode = float("inf")
            for _ in range(3):  # best of 3: the machine is shared
                cache = backend.new_cache(len(prompt) + decode_steps + 1)
                t0 = time.perf_counter()
                backend.forward(cache, np.asarray(prompt, np.int64), effective_start=0)
                t1 = time.perf_counter()
                for i in range(decode_steps):
                    backend.forward(cache, np.asarray([i + 5], np.int64), effective_start=0)
                t2 = time.perf_counter()
                cache.release()
                best_prefill, best_decode = min(best_prefill, t1 - t0), min(best_decode, (t2 - t1) / decode_steps)
        finally:
            backend.close()
        tag = "skipped" if skip else "computed"
        figures[f"prefill_ms_projection_{tag}"] = round(best_prefill * 1000, 3)
        figures[f"decode_ms_per_token_projection_{tag}"] = round(best_decode * 1000, 3)
    figures["prefill_speedup_from_skip"] = round(
        figures["prefill_ms_projection_computed"] / figures["prefill_ms_projection_skipped"], 3)
    figures["decode_speedup_from_skip"] = round(
        figures["decode_ms_per_token_projection_computed"] / figures["decode_ms_per_token_projection_skipped"], 3)
    figures["head_layers"] = cut
    figures["prompt_tokens"] = len(prompt)
    return figures
