"""``meshd bench serve --quick --json`` end to end: three 3-daemon swarms (llama.cpp in its default
layout, one KV stream per session; llama.cpp with the opt-in shared KV pool; torch)
behind the entry's /v1 API at concurrency 1, 4 and 8 (meshd/benchmarks/serve.py).

Checks the keys the issue names and that every concurrent request's greedy output equals the same
request alone on the default llama.cpp lane and the torch lane. The shared pool (``kv_unified``,
``llama_kv_streams = 0``) lets running sessions' logits drift from the alone run once another
session's cells are refilled (tests/test_batching_native.py), so there ``outputs_equal`` is
reported, not assumed. The batch-trace breakdown (``itl_gap_causes_c8``) and the CPU accounting
(``cpu_cores_busy_cN``, ``cpu_ms_per_token_cN``) are present on every lane.
No timing is asserted.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.testing.procs import child_env

pytestmark = [pytest.mark.slow, pytest.mark.native]
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("lane", ["llama.cpp", "torch", "llama.cpp-shared"])
def test_bench_serve_quick_json(lane):
    """One lane per test (``--lane``): each stays well inside a test's time; without it the bench
    runs the three side by side."""
    env = child_env()   # this checkout first on PYTHONPATH, the caller's entries kept
    done = subprocess.run([sys.executable, "-m", "meshd", "bench", "serve", "--quick", "--json", "--lane", lane],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1, sort_keys=True))
    assert list(result["lanes"]) == [lane]
    got = result["lanes"][lane]
    for key in ("aggregate_ratio_c8", "p95_itl_ratio_c8", "floor_batch8_throughput_ratio",
                "bound_aggregate_ratio_c8", "bound_p50_itl_ratio_c8"):
        assert isinstance(got[key], float) and got[key] > 0, (lane, key)
    assert got["bound_aggregate_ratio_c8"] == round(got["floor_batch8_throughput_ratio"] * got["parallel_hops"], 3)
    assert isinstance(got["outputs_equal"], bool)
    assert got["requests_compared"] == 16 and got["peak_streaming_c8"] >= 2
    for c in (1, 4, 8):
        assert 0 < got[f"cpu_cores_busy_c{c}"] and got[f"cpu_ms_per_token_c{c}"] > 0, (lane, c)
    assert got["machine_cores"] >= 1 and got["cpu_per_token_ratio_c8"] > 0
    assert got["cpu_bound_aggregate_ratio_c8"] == round(
        got["machine_cores"] / got["cpu_cores_busy_c1"] * got["floor_batch8_throughput_ratio"], 3)
    causes = got["itl_gap_causes_c8"]
    assert causes["hops_traced"] == 3 and causes["with_prefill"] + causes["decode_only"] == causes["tail_gaps"] > 0
    if lane in ("torch", "llama.cpp"):
        assert got["outputs_equal"] is True
    if lane == "llama.cpp":
        assert got["llama_kv_streams"] == 8
    if lane == "llama.cpp-shared":
        assert got["llama_kv_streams"] == 0


def test_bench_serve_refuses_an_unknown_lane_and_lane_on_other_benches():
    for argv in (["serve", "--lane", "gpu"], ["swarm", "--lane", "torch"]):
        done = subprocess.run([sys.executable, "-m", "meshd", "bench", *argv, "--json"], cwd=REPO, env=child_env(),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (argv, done.stderr[-500:])
