"""``meshd bench swarm --backend llama.cpp --quick --json``: llama.cpp daemons against whole-model llama.cpp."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.native]


def test_bench_swarm_llama_cpp_prints_the_keys_and_equal_tokens():
    from meshd.testing.procs import REPO_ROOT, child_env

    out = subprocess.run([sys.executable, "-m", "meshd", "bench", "swarm", "--backend", "llama.cpp", "--quick",
                          "--json"], cwd=REPO_ROOT, env=child_env(1), capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    print(json.dumps(result, sort_keys=True))
    assert result["path"] == "daemon" and result["backend"] == "llama.cpp" and result["tokens_equal"] is True
    assert len(result["route_2"]) == 2 and len(result["route_3"]) == 3
    assert result["threads_per_daemon"] == result["reference_threads"]
    assert result["floor_tokens_equal"] is True and result["capture"] in ("c", "python")
    for n in (2, 3):
        assert result[f"tail_bytes_per_decode_step_{n}"] <= 64
        for key in ("decode_ratio", "prefill_ratio", "swarm_decode_tok_s", "whole_decode_tok_s",
                    "floor_decode_ratio", "floor_decode_tok_s", "product_vs_floor", "floor_prefill_ratio",
                    "whole_step_ms", "floor_step_ms", "step_ms", "execution_ms"):
            assert isinstance(result[f"{key}_{n}"], (int, float)) and result[f"{key}_{n}"] > 0, key
        # the ratios are the rates they name, divided (rounding aside)
        assert abs(result[f"product_vs_floor_{n}"]
                   - result[f"swarm_decode_tok_s_{n}"] / result[f"floor_decode_tok_s_{n}"]) < 0.01
        assert abs(result[f"floor_decode_ratio_{n}"]
                   - result[f"floor_decode_tok_s_{n}"] / result[f"whole_decode_tok_s_{n}"]) < 0.01
        # a step is its hops' execution plus the rest; the floor's is a real (positive) time
        assert result[f"execution_ms_{n}"] <= result[f"step_ms_{n}"]
        assert isinstance(result[f"transport_ms_{n}"], (int, float))
        # CPU breakdown: every process group burned CPU per decode token; one engine time per slice
        cpu = result[f"cpu_ms_per_token_{n}"]
        assert set(cpu) == {"entry_daemon", "entry_worker", "other_daemons", "other_workers"}
        assert cpu["entry_worker"] > 0 and cpu["other_workers"] > 0 and cpu["entry_daemon"] > 0
        assert len(result[f"per_slice_cpu_ms_{n}"]) == n and result[f"whole_cpu_ms_{n}"] > 0
        assert abs(sum(result[f"per_slice_cpu_ms_{n}"].values()) - result[f"slices_cpu_ms_{n}"]) < 0.01
        assert isinstance(result[f"python_capture_extra_cpu_ms_{n}"], (int, float))
