"""``meshd bench pipeline``: fixed splits through ``meshd join`` daemons vs the whole model, one run.

    meshd bench pipeline [--quick] [--json] [--model DIR] [--layers A:B,C:D]

Default model: SmolLM2-135M-Instruct dequantized to fp32 (30 layers). In one
run, side by side:

* the whole model in this process (shard/model/reference.py: transformers CausalLM,
  sdpa, DynamicCache, ``THREADS`` compute threads);
* (torch lane) the bare split floor (meshd/benchmarks/torch_floor.py): the
  same ranges in bare processes on the worker's own backend, rows over a ring
  of pipes, no meshd on the path -- what any split of this model costs here;
* 2 daemons (layers 0:15, 15:30) and 3 daemons (0:10, 10:20, 20:30) -- or the
  one split ``--layers`` names --, each a ``meshd join --layers A:B`` process
  with its worker (``THREADS`` threads), a swarm of their own; generation goes
  through the layer-0 daemon's control socket (the generate op), so the route
  driver, its hop links, pinned TLS and the worker frame socket are all the
  product's (``path: "daemon"``).

Every configuration runs the same prompt (chunked prefill, 128 tokens per
chunk) and greedy decode; rounds alternate between configurations and the
best round of each is kept, so load from other processes hurts all alike. The
tail sends back only the token. One more pass per split drives the same
daemons' workers from this process with the route driver, asking the tail for
its logits, for ``max_abs_logit_diff``; its tokens must match as well.

Reported: the splits' tokens and logits against the whole model, decode and
prefill ratios, the hop overhead (decode step wall time minus the hops' own
execution, per hop, as the entry's driver measured it) beside the bare floor
and the machine's round-trip floors measured in the same run
(meshd/benchmarks/hopfloor.py), one hop's decode step over each transport
(meshd/benchmarks/hoptransport.py), and a half-range worker's resident memory
against a whole-model worker's. Every key is in docs/benchmarks.md (pipeline).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from meshd.daemon.local_swarm import THREADS

# A decode step's hidden-row frame for SmolLM2 (576 fp32 + headers), for the floor echo.
FLOOR_FRAME_BYTES = 576 * 4 + 64


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

    code = (f"import torch, transformers, sys; torch.set_num_threads({THREADS}); "
            "from transformers import AutoModelForCausalLM, LlamaConfig; "
            "print(open('/proc/self/status').read())")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(THREADS), capture_output=True,
                         text=True, check=True, timeout=300).stdout
    line = next(row for row in out.splitlines() if row.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def run(quick: bool = False, progress=None, options=None) -> dict:
    import numpy as np

    from meshd.benchmarks import daemon_runs as R
    from meshd.plan.modelinfo import model_num_layers
    from native.packaged import smollm2_artifact

    path = R.bench_model(options, smollm2_artifact)
    num_layers = model_num_layers(path)
    rounds, new_tokens = (2, R.QUICK_NEW_TOKENS) if quick else (3, R.NEW_TOKENS)
    layers = getattr(options, "layers", None)
    splits = [R.parse_splits(layers, num_layers)] if layers else [R.even_splits(num_layers, n) for n in (2, 3)]
    configs = {len(specs): specs for specs in splits}
    prompt = R.PROMPT_TEXT
    root = Path(tempfile.mkdtemp(prefix="meshd-bench-pipeline-"))
    swarms, floors = {}, {}
    bare_floor = getattr(options, "backend", None) in (None, "torch")
    try:
        _say(progress, f"starting {sum(len(s) for s in configs.values())} daemons ({THREADS} thread each): "
                       + "; ".join(", ".join(s) for s in configs.values()))
        for n, specs in configs.items():
            swarms[n] = R.start_split(root / f"split{n}", path, specs, backend=getattr(options, "backend", None))
        entries = {n: R.entry_of(s) for n, s in swarms.items()}
        if bare_floor:
            from meshd.benchmarks.torch_floor import TorchFloor

            for n, specs in configs.items():
                _say(progress, f"starting the bare split floor: {n} processes, rows over pipes")
                floors[n] = TorchFloor(path, specs, THREADS)
        _say(progress, "loading the whole model in this process")
        reference = R.Reference(path, THREADS)
        reference.generate(prompt, 2)                    # warm-up
        for entry in entries.values():
            R.generate(entry, prompt, 2)
        best: dict = {}
        for r in range(rounds):
            _say(progress, f"round {r + 1}/{rounds}: whole model, {new_tokens} tokens")
            tokens, rate, prefill_s, ref = reference.generate(prompt, new_tokens)
            if "whole" not in best or ref.decode_s < best["whole"][3].decode_s:
                best["whole"] = (tokens, rate, prefill_s, ref)
            best["whole_prefill"] = min(best.get("whole_prefill", prefill_s), prefill_s)
            for n, entry in entries.items():
                _say(progress, f"round {r + 1}/{rounds}: {n} daemons")
                fig = R.RunFigures.of(R.generate(entry, prompt, new_tokens))
                key = f"split{n}"
                if key not in best or fig.decode_tok_s > best[key].decode_tok_s:
                    best[key] = fig
                best[f"{key}_prefill"] = min(best.get(f"{key}_prefill", fig.prefill_s), fig.prefill_s)
                if n in floors:
                    _say(progress, f"round {r + 1}/{rounds}: bare floor, {n} processes")
                    run = floors[n].generate(reference.ids(prompt), new_tokens)
                    if f"floor{n}" not in best or run.decode_tok_s > best[f"floor{n}"].decode_tok_s:
                        best[f"floor{n}"] = run
        ids = reference.ids(prompt)
        for n, entry in entries.items():
            _say(progress, f"logits pass: {n} daemons' workers, driven from here")
            best[f"logits{n}"] = R.route_logits(entry, ids, new_tokens)
    finally:
        for floor in floors.values():
            floor.close()
        for swarm in swarms.values():
            swarm.close()
        shutil.rmtree(root, ignore_errors=True)
    whole_tokens, whole_rate, _, ref = best["whole"]
    steps = new_tokens - 1
    whole_step_ms = ref.decode_s / steps * 1000
    out: dict[str, object] = {
        "path": "daemon", "model": str(path), "dtype": "float32", "threads": THREADS,
        "prompt_tokens": len(reference.ids(prompt)), "new_tokens": new_tokens, "rounds": rounds,
        "splits": {str(n): specs for n, specs in configs.items()},
        "whole_decode_tok_s": whole_rate, "whole_prefill_tok_s": len(ids) / best["whole_prefill"],
    }
    for n in configs:
        fig, (checked_tokens, logits, transports) = best[f"split{n}"], best[f"logits{n}"]
        out[f"logits_pass_hop_transports_{n}"] = transports
        diff = max(float(np.abs(a - b).max()) for a, b in zip(logits, ref.logits))
        out[f"tokens_equal_{n}"] = fig.tokens == whole_tokens and checked_tokens[:len(whole_tokens)] == whole_tokens
        out[f"max_abs_logit_diff_{n}"] = diff
        out[f"decode_tok_s_{n}"] = fig.decode_tok_s
        out[f"decode_ratio_{n}"] = fig.decode_tok_s / whole_rate
        out[f"prefill_ratio_{n}"] = best["whole_prefill"] / best[f"split{n}_prefill"]
        out[f"tail_bytes_per_decode_step_{n}"] = fig.tail_bytes
        out[f"looped_{n}"] = fig.looped
        out[f"per_hop_overhead_ms_{n}"] = fig.overhead_per_hop_mean_ms
        out[f"per_hop_overhead_median_ms_{n}"] = fig.overhead_per_hop_median_ms
        out[f"per_hop_overhead_vs_whole_ms_{n}"] = (1000 / fig.decode_tok_s - whole_step_ms) / n
        floor = best.get(f"floor{n}")
        if floor is not None:
            out[f"floor_tokens_equal_{n}"] = floor.tokens[:len(whole_tokens)] == whole_tokens
            out[f"floor_decode_tok_s_{n}"] = floor.decode_tok_s
            out[f"floor_decode_ratio_{n}"] = floor.decode_tok_s / whole_rate
            out[f"product_vs_floor_{n}"] = fig.decode_tok_s / floor.decode_tok_s
            out[f"floor_step_ms_{n}"] = sorted(floor.step_ms)[len(floor.step_ms) // 2]
    first = min(configs)
    out["tokens_equal"] = all(out[f"tokens_equal_{n}"] for n in configs)
    if floors:
        out["floor_tokens_equal"] = all(out[f"floor_tokens_equal_{n}"] for n in configs)
    out["max_abs_logit_diff"] = max(out[f"max_abs_logit_diff_{n}"] for n in configs)
    out["tail_bytes_per_decode_step"] = max(out[f"tail_bytes_per_decode_step_{n}"] or 0 for n in configs)
    out["per_hop_overhead_ms"] = out[f"per_hop_overhead_ms_{first}"]
    from meshd.benchmarks import hopfloor

    fig = best[f"split{first}"]
    hold_ms = sum(fig.step_execution_ms) / len(fig.step_execution_ms) / first
    _say(progress, f"round-trip floors (peer holds {hold_ms:.1f} ms, like a hop)")
    out.update(hopfloor.measure(hold_ms, FLOOR_FRAME_BYTES, rounds=40 if quick else 100))
    from meshd.benchmarks import hoptransport

    _say(progress, "one hop's decode step over TLS gRPC, framed TLS and the Unix socket, alternating")
    out.update(hoptransport.measure(80 if quick else 200))
    out["per_hop_overhead_above_grpc_floor_ms"] = out["per_hop_overhead_ms"] - out["grpc_round_trip_floor_ms"]
    out["per_hop_overhead_median_above_grpc_floor_ms"] = (out[f"per_hop_overhead_median_ms_{first}"]
                                                          - out["grpc_round_trip_floor_ms"])
    out.update(_memory(path, num_layers, progress))
    return out


def _memory(path, num_layers: int, progress) -> dict:
    from meshd.testing.procs import spawn_workers

    _say(progress, "measuring resident memory: bare process, middle-half worker, whole-model worker")
    base = _baseline_rss()
    quarter = num_layers // 4
    half, whole = spawn_workers(path, [f"{quarter}:{quarter + num_layers // 2}", f"0:{num_layers}"],
                                threads=THREADS)
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
