"""``meshd bench pipeline``: a split model through local worker processes vs the whole model.

Default model: SmolLM2-135M-Instruct dequantized to fp32 (``meshd.testing.models``),
30 layers. In one run, side by side:

* whole model in this process (transformers CausalLM, sdpa, DynamicCache);
* 2 workers (layers 0:15, 15:30) and 3 workers (0:10, 10:20, 20:30), each a
  ``meshd worker`` subprocess on loopback, driven by ``meshd.benchmarks.star_driver.RouteDriver``.

Every configuration runs the same prompt (chunked prefill, 128 tokens per
chunk) and greedy decode; rounds alternate between configurations and the
best round of each is kept, so load from other processes hurts all alike.
Torch threads are equal everywhere (``THREADS``). Timed split rounds run as a
user's generation does: the tail picks the token and sends only its id. One
more pass per split then asks the tail for its logits too, for
``max_abs_logit_diff``; its tokens must match as well.

Reported: ``tokens_equal`` / ``max_abs_logit_diff`` (2 and 3 workers against
the whole model), ``decode_ratio_2|3`` and ``prefill_ratio_2|3`` (tokens/s
split / whole), ``per_hop_overhead_ms`` (decode: wall time per step minus the
hops' own execution time, per hop; ``_median_`` variants take the median step
instead of the mean, robust to a stray scheduling stall on a shared machine), ``per_hop_overhead_vs_whole_ms`` (split
step minus whole step, per hop), the machine's round-trip floors measured in
the same run (``meshd.benchmarks.hopfloor``: a bare gRPC stream and a raw
socket whose peer holds for the hops' execution time) and
``per_hop_overhead_above_grpc_floor_ms``, and ``half_range_rss_ratio``: resident
memory above a bare python+torch+transformers process of a worker holding the
middle half of the layers, divided by the same for a whole-model worker.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys

# One compute thread everywhere: on a small shared machine two OpenMP threads
# per process degrade badly under contention (measured: prefill 10x slower),
# and equal settings keep the ratios honest.
THREADS = 1
CHUNK_TOKENS = 128
# A decode step's hidden-row frame for SmolLM2 (576 fp32 + headers), for the floor echo.
FLOOR_FRAME_BYTES = 576 * 4 + 64
PROMPT_TEXT = ("A shard is a contiguous range of transformer layers. Each home machine serves one range, "
               "and activations travel from node to node until the last one picks the next token. ")


def _say(progress, message: str) -> None:
    if progress is not None:
        print(f"[bench pipeline] {message}", file=progress, flush=True)


def _rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _baseline_rss() -> int:
    """RSS of a bare process with torch and transformers imported (no weights)."""
    from meshd.testing.procs import child_env

    code = ("import torch, transformers, sys; torch.set_num_threads(%d); "
            "from transformers import AutoModelForCausalLM, LlamaConfig; "
            "print(open('/proc/self/status').read())" % THREADS)
    out = subprocess.run([sys.executable, "-c", code], env=child_env(THREADS), capture_output=True,
                         text=True, check=True, timeout=300).stdout
    line = next(l for l in out.splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _route(workers, specs, num_layers):
    from shard.backend import LayerRange
    from meshd.benchmarks.star_driver import Hop

    hops = []
    for w, spec in zip(workers, specs):
        a, b = (int(x) for x in spec.split(":"))
        hops.append(Hop(w.endpoint, LayerRange(a, b, num_layers), a))
    return hops


def run(quick: bool = False, progress=None) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from meshd.benchmarks.star_driver import RouteDriver
    from meshd.testing.procs import spawn_workers
    from shard.reference import WholeModel
    from native.packaged import smollm2_artifact

    torch.set_num_threads(THREADS)
    rounds, new_tokens = (2, 32) if quick else (3, 64)
    _say(progress, "preparing SmolLM2-135M-Instruct fp32 (built once, cached)")
    path = smollm2_artifact("float32")
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer(PROMPT_TEXT * (2 if quick else 3))["input_ids"]
    num_layers = 30
    configs = {2: ["0:15", "15:30"], 3: ["0:10", "10:20", "20:30"]}
    _say(progress, f"starting {sum(len(v) for v in configs.values())} workers ({THREADS} threads each)")
    workers = {n: spawn_workers(path, specs, threads=THREADS)
               for n, specs in configs.items()}
    try:
        _say(progress, "loading the whole model in this process")
        whole = WholeModel(path, "float32")
        whole.generate(prompt[:8], 2, chunk_tokens=CHUNK_TOKENS)  # warm-up
        best: dict[str, object] = {}
        for r in range(rounds):
            _say(progress, f"round {r + 1}/{rounds}: whole model, {new_tokens} tokens")
            res = whole.generate(prompt, new_tokens, chunk_tokens=CHUNK_TOKENS)
            if "whole" not in best or res.decode_s < best["whole"].decode_s:
                best["whole"] = res
            best.setdefault("whole_prefill", res.prefill_s)
            best["whole_prefill"] = min(best["whole_prefill"], res.prefill_s)
            for n, specs in configs.items():
                _say(progress, f"round {r + 1}/{rounds}: {n} workers")
                with RouteDriver(_route(workers[n], specs, num_layers), chunk_tokens=CHUNK_TOKENS,
                                 tail_logits=False) as driver:
                    res = driver.generate(prompt, new_tokens)
                key = f"split{n}"
                if key not in best or res.decode_s < best[key].decode_s:
                    best[key] = res
                best.setdefault(f"{key}_prefill", res.prefill_s)
                best[f"{key}_prefill"] = min(best[f"{key}_prefill"], res.prefill_s)
        for n, specs in configs.items():
            _say(progress, f"logits pass: {n} workers")
            with RouteDriver(_route(workers[n], specs, num_layers), chunk_tokens=CHUNK_TOKENS) as driver:
                best[f"logits{n}"] = driver.generate(prompt, new_tokens)
    finally:
        for ws in workers.values():
            for w in ws:
                w.stop()
    ref = best["whole"]
    steps = new_tokens - 1
    out: dict[str, object] = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32), torch backend",
        "dtype": "float32", "threads": THREADS, "prompt_tokens": len(prompt), "new_tokens": new_tokens,
        "rounds": rounds, "whole_decode_tok_s": steps / ref.decode_s,
        "whole_prefill_tok_s": len(prompt) / best["whole_prefill"],
    }
    for n in configs:
        res, checked = best[f"split{n}"], best[f"logits{n}"]
        diff = max(float(np.abs(a - b).max()) for a, b in zip(checked.logits, ref.logits))
        out[f"tokens_equal_{n}"] = res.tokens == ref.tokens == checked.tokens
        out[f"max_abs_logit_diff_{n}"] = diff
        out[f"decode_tok_s_{n}"] = steps / res.decode_s
        out[f"decode_ratio_{n}"] = ref.decode_s / res.decode_s
        out[f"prefill_ratio_{n}"] = best["whole_prefill"] / best[f"split{n}_prefill"]
        exec_s = sum(res.hop_execution_ns) / 1e9
        out[f"per_hop_overhead_ms_{n}"] = (res.decode_s - exec_s) / steps / n * 1000
        out[f"per_hop_overhead_median_ms_{n}"] = statistics.median(
            w - e for w, e in zip(res.step_wall_ns, res.step_execution_ns)) / n / 1e6
        out[f"per_hop_overhead_vs_whole_ms_{n}"] = (res.decode_s - ref.decode_s) / steps / n * 1000
    out["tokens_equal"] = bool(out["tokens_equal_2"] and out["tokens_equal_3"])
    out["max_abs_logit_diff"] = max(out["max_abs_logit_diff_2"], out["max_abs_logit_diff_3"])
    out["per_hop_overhead_ms"] = out["per_hop_overhead_ms_2"]
    from meshd.benchmarks import hopfloor

    res2 = best["split2"]
    hold_ms = sum(res2.hop_execution_ns) / 1e6 / steps / 2
    _say(progress, f"round-trip floors (peer holds {hold_ms:.1f} ms, like a hop)")
    out.update(hopfloor.measure(hold_ms, FLOOR_FRAME_BYTES, rounds=40 if quick else 100))
    out["per_hop_overhead_above_grpc_floor_ms"] = out["per_hop_overhead_ms"] - out["grpc_round_trip_floor_ms"]
    out["per_hop_overhead_median_above_grpc_floor_ms"] = (out["per_hop_overhead_median_ms_2"]
                                                          - out["grpc_round_trip_floor_ms"])
    out.update(_memory(path, progress))
    return out


def _memory(path, progress) -> dict:
    from meshd.testing.procs import spawn_workers

    _say(progress, "measuring resident memory: bare process, middle-half worker, whole-model worker")
    base = _baseline_rss()
    half, whole = spawn_workers(path, ["8:23", "0:30"], threads=THREADS)
    try:
        rss_half, rss_whole = _rss_of(half.pid), _rss_of(whole.pid)
    finally:
        half.stop()
        whole.stop()
    return {
        "baseline_rss_mb": base / 2**20, "half_range_rss_mb": rss_half / 2**20,
        "whole_model_rss_mb": rss_whole / 2**20,
        "half_range_rss_ratio": (rss_half - base) / (rss_whole - base),
    }
