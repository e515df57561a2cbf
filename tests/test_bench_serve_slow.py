"""``meshd bench serve --quick --json`` end to end: three 3-daemon swarms (llama.cpp shared KV pool,
llama.cpp one KV stream per session, torch)
behind the entry's /v1 API at concurrency 1, 4 and 8 (meshd/benchmarks/serve.py).

Checks the keys the issue names and that every concurrent request's greedy output equals the same
request alone on the torch lane. The llama.cpp lane's shared KV pool (``kv_unified``) lets
concurrent sessions' logits drift from the alone run with or without batching
(tests/test_batching_native.py measures it), so there its ``outputs_equal`` is reported, not assumed;
with one KV stream per session (``[worker] llama_kv_streams``) llama.cpp is exact and it is asserted.
No timing is asserted.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.native]
REPO = Path(__file__).resolve().parents[1]


def test_bench_serve_quick_json():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "meshd", "bench", "serve", "--quick", "--json"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1, sort_keys=True))
    for lane in ("llama.cpp", "torch", "llama.cpp-streams"):
        got = result["lanes"][lane]
        for key in ("aggregate_ratio_c8", "p95_itl_ratio_c8", "floor_batch8_throughput_ratio"):
            assert isinstance(got[key], float) and got[key] > 0, (lane, key)
        assert isinstance(got["outputs_equal"], bool)
        assert got["requests_compared"] == 16 and got["peak_streaming_c8"] >= 2
    assert result["lanes"]["torch"]["outputs_equal"] is True
    assert result["lanes"]["llama.cpp-streams"]["outputs_equal"] is True
    assert result["lanes"]["llama.cpp-streams"]["llama_kv_streams"] == 8
