"""`meshd bench swarm --rtt-ms 20 --quick`: star vs push through daemons in namespaces, same run.

Runs the real command (daemons in network namespaces, the hub's delaying
forwarder between them, a client-only entry in a namespace of its own) on a
small seeded model and checks what it must show besides speed: both
topologies ran, the same tokens, the entry on no hop, push's legs per token
as the hops counted them == hops + 1 (looped: hops of them on the token's
path) and the star's == 2 x hops, the whole
model's compute per token and the arithmetic beside, loopback figures too.
No timing threshold (noisy machine): the ratio is printed.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshd.daemon.local_swarm import REPO_ROOT, child_env
from meshd.testing.models import build_random_llama

pytestmark = [pytest.mark.netns, pytest.mark.slow]


def test_bench_swarm_rtt_compares_star_with_push_and_counts_legs():
    model = build_random_llama(seed=5)
    done = subprocess.run([sys.executable, "-m", "meshd", "bench", "swarm", "--rtt-ms", "20", "--quick", "--json",
                           "--model", str(model)], cwd=REPO_ROOT, env=child_env(1), capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    print(json.dumps(result, indent=1))
    assert result["rtt_ms"] == 20 and result["hops"] == 3
    assert result["topologies_run"] == ["push", "star"] and result["tokens_equal"]
    assert result["legs_per_token"] == result["hops"] + 1
    assert result["star_legs_per_token"] == 2 * result["hops"]
    assert result["push_vs_star_decode_ratio"] > 0
    assert result["looped"] and result["critical_legs_per_token"] == result["hops"]
    assert result["entry_serves_layers"] is False and result["legs_ceiling_ratio"] == 2.0
    assert result["compute_ms_per_token"] > 0
    a = result["arithmetic"]
    assert a["star"]["legs"] == 6 and a["push"]["legs"] == 3 and a["star"]["delay_ms"] == 60.0
    assert a["ratio_from_delay_and_compute"] > 1 and a["compute_ms"] > 0 and a["compute_ms_for_1_4"] == 45.0
    loop = result["loopback"]
    assert loop["legs_per_token"] == 4 and loop["looped"] and loop["tokens_equal"]
    assert loop["push_vs_star_decode_ratio"] > 0
    assert loop["entry_serves_layers"] is False and loop["star_legs_per_token"] == 6
    assert loop["compute_ms_per_token"] > 0 and loop["arithmetic"]["push"]["delay_ms"] == 0
