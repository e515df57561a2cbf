"""``meshd bench moe``: expert delegation on a seeded Qwen3-MoE (hidden 256, 8 experts, top-2), same run.

1. Bytes and drift, against a real ``meshd worker --experts 0-5:E0-E7``
   subprocess (TLS, its own process): a holder (the product's range backend
   and ExpertRouter) that holds every expert but offloads them all runs a
   fixed teacher-forced prompt set (4 x 16 = 64 positions) three ways --
   v1 row copies per item (f32), v2 rows once (f32), v2 rows once with q8
   rows -- next to the same backend computing its experts locally.
   ``copies_vs_rows_once_ratio``: bytes sent per position, copies / rows once;
   ``q8_bytes_ratio_vs_f32``: bytes sent + received, q8 / f32 (rows once);
   ``f32_max_abs_logit_diff``: delegated f32 against local (both layouts);
   ``q8_mismatch_positions``: argmax of the q8 run differing from local f32.
   This process and the worker both compute with one thread (the numerics
   of a product depend on the thread count; the benchmarks give every worker one).
2. Decode through the daemon path, alternating rounds: swarm "local" (one
   ``meshd join --layers 0:6``) and swarm "delegated" (``--layers 0:6
   --experts 0-5:E0-E3`` plus an expert peer ``--experts 0-5:E4-E7``);
   ``decode_tok_s_local`` / ``decode_tok_s_delegated`` are the medians of the
   rounds' decode tok/s as the entry reports them, with their ratio, and
   whether both swarms produced the same tokens.
Every process started is stopped at the end. Machine load (``uptime``) is
reported: compare ratios, not absolute numbers.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import TextIO

PROMPT_SET = [list(range(5 + 7 * i, 21 + 7 * i)) for i in range(4)]
GEN_PROMPT = "The quick brown fox"


def _say(progress: TextIO | None, line: str) -> None:
    if progress is not None:
        print(f"moe bench: {line}", file=progress, flush=True)


def _teacher_forced(backend) -> tuple[list[int], list, float]:
    from meshd.testing.experts import teacher_forced

    teacher_forced(backend, PROMPT_SET[0][:4])   # warm-up: first-call allocations, the peer's connection
    t0 = time.perf_counter()
    runs = [teacher_forced(backend, seq) for seq in PROMPT_SET]
    elapsed = time.perf_counter() - t0
    return [t for a, _ in runs for t in a], [row for _, rows in runs for row in rows], elapsed


def _bytes_and_drift(path: Path, root: Path, progress) -> dict:
    import numpy as np

    import shard.experts.adapters  # noqa: F401 - the MoE families register themselves
    from meshd.testing.experts import spawn_expert_worker, tls_files
    from proto import moe as W
    from shard.experts.pool import ExpertRouter
    from shard.model.torch_backend import TorchRangeBackend

    local = TorchRangeBackend.load(path, 0, 6, progress=None)
    want, want_logits, local_s = _teacher_forced(local)
    positions = len(want)
    tls = tls_files(root / "tls")
    _say(progress, "starting an expert worker subprocess (experts 0-5:E0-E7)")
    worker = spawn_expert_worker(path, "0-5:E0-E7", tls, root / "expert-worker", threads=1)
    out: dict = {"positions": positions}
    try:
        fp = local.fingerprint
        runs = {}
        for name, version, act in (("copies_f32", W.VERSION_COPIES, W.ACT_F32),
                                   ("rows_once_f32", W.VERSION_ROWS_ONCE, W.ACT_F32),
                                   ("rows_once_q8", W.VERSION_ROWS_ONCE, W.ACT_Q8)):
            router = ExpertRouter(artifact=fp.model_artifact_digest, recipe=fp.runtime_recipe_digest,
                                  version=version, act=act, prefer_remote=True)
            router.set_placements([worker.placement])
            holder = TorchRangeBackend.load(path, 0, 6, progress=None, exchange=router)
            got, logits, elapsed = _teacher_forced(holder)
            stats = router.stats()
            runs[name] = (got, logits, stats, elapsed)
            _say(progress, f"{name}: {stats['bytes_sent'] / stats['positions']:.0f} B/position sent, "
                           f"{stats['bytes_received'] / stats['positions']:.0f} received")
    finally:
        worker.stop()

    def diff(name):
        return max(float(np.abs(a - b).max()) for a, b in zip(runs[name][1], want_logits))

    for name, (_, _, stats, elapsed) in runs.items():   # the router counts the warm-up positions too
        out[f"{name}_bytes_sent_per_position"] = round(stats["bytes_sent"] / stats["positions"], 1)
        out[f"{name}_bytes_received_per_position"] = round(stats["bytes_received"] / stats["positions"], 1)
        out[f"{name}_steps_per_s_in_process"] = round(positions / elapsed, 2)
    out["local_steps_per_s_in_process"] = round(positions / local_s, 2)
    f32, q8 = runs["rows_once_f32"][2], runs["rows_once_q8"][2]
    out["f32_max_abs_logit_diff"] = max(diff("copies_f32"), diff("rows_once_f32"))
    out["f32_tokens_equal"] = runs["copies_f32"][0] == want and runs["rows_once_f32"][0] == want
    out["q8_max_abs_logit_diff"] = round(diff("rows_once_q8"), 5)
    out["q8_mismatch_positions"] = sum(a != b for a, b in zip(runs["rows_once_q8"][0], want))
    out["q8_bytes_ratio_vs_f32"] = round((q8["bytes_sent"] + q8["bytes_received"])
                                         / (f32["bytes_sent"] + f32["bytes_received"]), 4)
    out["copies_vs_rows_once_ratio"] = round(runs["copies_f32"][2]["bytes_sent"] / f32["bytes_sent"], 4)
    return out


def _decode(path: Path, root: Path, quick: bool, progress) -> dict:
    from meshd.daemon.local_swarm import LocalSwarm

    new_tokens, rounds = (8, 1) if quick else (32, 3)
    out: dict = {"decode_new_tokens": new_tokens, "decode_rounds": rounds}
    for sub in ("local", "delegated"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    local_swarm = LocalSwarm(root / "local", path, record_ttl_s=8.0)
    deleg_swarm = LocalSwarm(root / "delegated", path, record_ttl_s=8.0)
    try:
        _say(progress, "starting the daemons (local: 1; delegated: an expert peer and a holder)")
        peer = deleg_swarm.add(layers=None, name="experts", extra=("--experts", "0-5:E4-E7"))
        local = local_swarm.add(layers="0:6", name="local")
        holder = deleg_swarm.add(layers="0:6", name="holder", extra=("--experts", "0-5:E0-E3"))
        local_swarm.wait_covered(900, peers=1, via=local)
        deleg_swarm.wait_covered(900, peers=1, via=holder)
        speeds: dict[str, list[float]] = {"local": [], "delegated": []}
        tokens: dict[str, list[int]] = {}
        for r in range(rounds):
            for name, daemon in (("local", local), ("delegated", holder)):
                done = [e for e in daemon.generate(GEN_PROMPT, max_tokens=new_tokens, temperature=0, raw=True)
                        if e.get("done")][-1]
                speeds[name].append(float(done.get("decode_tokens_per_s") or 0.0))
                tokens.setdefault(name, done["tokens"])
                _say(progress, f"round {r}: {name} {speeds[name][-1]:.1f} tok/s")
        from meshd.daemon.local_swarm import wait_for

        try:   # the worker's health (polled every 5 s) carries the exchange's bytes per position
            status = wait_for(lambda: (lambda s: s if (s.get("worker") or {}).get("health", {}).get("experts")
                                       else None)(holder.query("status") or {}), "the holder's expert health", 20)
        except Exception:  # noqa: BLE001 - reported as missing, the figures above stand
            status = {}
        out["decode_tok_s_local"] = statistics.median(speeds["local"])
        out["decode_tok_s_delegated"] = statistics.median(speeds["delegated"])
        out["delegated_vs_local_decode_ratio"] = round(out["decode_tok_s_delegated"] / out["decode_tok_s_local"], 3) \
            if out["decode_tok_s_local"] else None
        out["daemon_tokens_equal"] = tokens["local"] == tokens["delegated"]
        out["holder_exchange"] = (status.get("worker") or {}).get("health", {}).get("experts")
        del peer
    finally:
        local_swarm.close()
        deleg_swarm.close()
    return out


def run(quick: bool = False, progress: TextIO | None = None, options=None) -> dict:
    import torch
    from transformers import AutoConfig

    from meshd.testing.models import build_random_qwen3_moe

    torch.set_num_threads(1)   # like every meshd worker (worker.torch_threads)
    path = build_random_qwen3_moe(hidden_size=256, head_dim=64)
    config = AutoConfig.from_pretrained(path)
    result: dict = {"model": "random Qwen3-MoE (6 layers, hidden 256, 8 experts, float32, torch)",
                    "top_k": int(config.num_experts_per_tok), "num_experts": int(config.num_experts),
                    "load_average_before": os.getloadavg()[0]}
    root = Path(tempfile.mkdtemp(prefix="meshd-bench-moe-"))
    try:
        result.update(_bytes_and_drift(path, root, progress))
        result.update(_decode(path, root, quick, progress))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["load_average_after"] = os.getloadavg()[0]
    return result
