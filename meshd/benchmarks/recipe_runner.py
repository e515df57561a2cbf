"""Child process of ``meshd bench recipes``: one whole-model recipe, measured alone.

``python -m meshd.benchmarks.recipe_runner SPEC.json`` loads one recipe
(``transformers`` on a safetensors artifact, or ``llama.cpp`` on a GGUF file
through ``LlamaRangeBackend`` over all layers), runs the plan's warm-ups and
measured requests (each concurrency level: per repeat and prompt, that many
simultaneous requests), and prints one JSON object: outcomes, per-level wall
times, and peak resident memory growth (VmHWM at the end minus VmRSS after
imports, so interpreter and library baselines cancel out for every recipe).
A separate process per recipe keeps one recipe's memory out of another's
figures. Progress lines go to stderr.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np

from meshd.benchmarks.recipe_plan import Outcome, Plan

Generate = Callable[[Sequence[int], int], tuple[list[int], float, float]]  # -> tokens, ttft_s, decode_s


def _proc_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _transformers(path: str, dtype: str, threads: int, chunk: int) -> Generate:
    import torch

    from shard.model.reference import WholeModel

    torch.set_num_threads(threads)
    model = WholeModel(path, dtype)

    def generate(ids: Sequence[int], n: int) -> tuple[list[int], float, float]:
        result = model.generate(list(ids), n, chunk_tokens=chunk)
        return result.tokens, result.prefill_s, result.decode_s
    return generate


def _llama(path: str, threads: int, chunk: int, max_tokens: int, sessions: int) -> Generate:
    from native.gguf_range import model_info, open_reader
    from native.llama_backend import LlamaBackendConfig, LlamaRangeBackend
    from shard.model.backend import LayerRange

    layers = model_info(open_reader(path)).num_layers
    config = LlamaBackendConfig(n_threads=threads, kv_budget_tokens=max_tokens * sessions, max_sessions=sessions)
    backend = LlamaRangeBackend(path, LayerRange(0, layers, layers), config, progress=sys.stderr)

    def generate(ids: Sequence[int], n: int) -> tuple[list[int], float, float]:
        cache = backend.new_cache(max_tokens)
        try:
            t0 = time.perf_counter()
            prompt = np.asarray(ids, np.int64)
            for first in range(0, len(prompt), chunk):
                logits = backend.forward(cache, prompt[first:first + chunk], effective_start=0)
            tokens = [int(np.argmax(logits))]
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            while len(tokens) < n:
                logits = backend.forward(cache, np.asarray(tokens[-1:], np.int64), effective_start=0)
                tokens.append(int(np.argmax(logits)))
            return tokens, ttft, time.perf_counter() - t0
        finally:
            cache.release()
    return generate


def measure(generate: Generate, prompts: dict[str, list[int]], plan: Plan,
            log=lambda message: None) -> tuple[list[Outcome], dict[str, float]]:
    """Warm up, then run every (level, repeat, prompt) cell; returns outcomes and wall time per level."""
    def one(prompt_id: str, level: int, repeat: int) -> Outcome:
        ids = prompts[prompt_id]
        try:
            tokens, ttft, decode = generate(ids, plan.output_tokens)
            return Outcome(prompt_id, level, repeat, True, len(ids), tuple(tokens), ttft, decode)
        except Exception as exc:  # a failed request is data here, counted against the recipe
            return Outcome(prompt_id, level, repeat, False, len(ids), error=f"{type(exc).__name__}: {exc}")

    for i in range(plan.warmups):
        for prompt_id in prompts:
            one(prompt_id, 0, -1 - i)
    outcomes: list[Outcome] = []
    walls: dict[str, float] = {}
    for level in plan.concurrency:
        wall = 0.0
        with ThreadPoolExecutor(max_workers=level) as pool:
            for repeat in range(plan.repeats):
                for prompt_id in prompts:
                    t0 = time.perf_counter()
                    outcomes += list(pool.map(lambda _, p=prompt_id, c=level, r=repeat: one(p, c, r), range(level)))
                    wall += time.perf_counter() - t0
        walls[str(level)] = wall
        log(f"concurrency {level}: {sum(o.ok for o in outcomes if o.concurrency == level)} requests ok")
    return outcomes, walls


def main(argv: list[str] | None = None) -> int:
    spec = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    plan = Plan(**{**spec["plan"], "concurrency": tuple(spec["plan"]["concurrency"])})
    prompts: dict[str, list[int]] = spec["prompts"]
    longest = max(len(v) for v in prompts.values()) + plan.output_tokens
    baseline_kib = _proc_kib("VmRSS")

    def log(message: str) -> None:
        print(f"[recipe {spec['id']}] {message}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    if spec["kind"] == "transformers":
        generate = _transformers(spec["path"], spec["dtype"], spec["threads"], plan.chunk_tokens)
    else:
        generate = _llama(spec["path"], spec["threads"], plan.chunk_tokens, longest,
                          max(plan.concurrency))
    log(f"loaded in {time.perf_counter() - t0:.1f}s")
    outcomes, walls = measure(generate, prompts, plan, log)
    peak_kib = _proc_kib("VmHWM")
    print(json.dumps({"outcomes": [asdict(o) for o in outcomes], "walls": walls,
                      "peak_rss_bytes": (peak_kib - baseline_kib) * 1024,
                      "process_peak_rss_bytes": peak_kib * 1024}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
