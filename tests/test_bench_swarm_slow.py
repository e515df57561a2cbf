"""``meshd bench swarm --quick --json`` on a fixed split of the tiny Llama: the product path's keys."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_swarm_times_the_daemons_and_prints_the_keys():
    from meshd.testing.models import build_random_llama
    from meshd.testing.procs import REPO_ROOT, child_env

    model = build_random_llama(seed=3)
    out = subprocess.run([sys.executable, "-m", "meshd", "bench", "swarm", "--quick", "--json",
                          "--model", str(model), "--layers", "0:3,3:6"],
                         cwd=REPO_ROOT, env=child_env(1), capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    print(json.dumps(result, sort_keys=True))
    assert result["path"] == "daemon" and result["layers"] == ["0:3", "3:6"] and result["nodes"] == 2
    assert result["tokens_equal"] is True and result["tokens_equal_with_failure"] is True
    assert result["tail_bytes_per_decode_step"] <= 64 and result["bare_split_tokens_equal"] is True
    assert len(result["route"]) == 2 and result["failovers"] == 1
    for key in ("decode_ratio", "decode_ratio_median", "prefill_ratio", "swarm_decode_tok_s", "whole_decode_tok_s",
                "per_hop_overhead_median_ms", "recovery_s", "failover_to_token_s", "route_plan_ms",
                "bare_split_decode_tok_s", "bare_split_ratio", "decode_ratio_vs_bare_split"):
        assert isinstance(result[key], (int, float)) and result[key] > 0, key
