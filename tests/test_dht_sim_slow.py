"""The 200-node DHT simulation (issue 17 item 2), as ``meshd bench dht --json`` runs it.

200 real py-libp2p hosts with meshd's DhtNode in 5 processes on loopback
(meshd/benchmarks/dht_sim.py); about 10 minutes on 2 cores. Must show: every
published record is found by every sampled node within ceil(log2 N) + 2
lookup rounds; after 20% of the nodes die at once, every sampled survivor's
view holds every surviving record again within one republish interval, and
republishing keeps every model key replicated.

The republish interval is the bench's 60 s, stretched to three times what
this machine takes to publish the survivors' 160 records when that is longer
(``interval_stretched_to_cpu``): 200 nodes share 2 cores here, where each real
node has a CPU of its own, and that publish keeps both cores busy
(``cores_busy_publishing``). The bench reports both intervals, the floor and
the cores its nodes kept busy after the kill.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 2400


# Its own bound is the subprocess timeout: pytest-timeout's suite-wide 600 s would cut a run that
# takes its usual ~10 minutes on a loaded 2-core machine (it did once in CI, at 600 s).
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_two_hundred_nodes_find_every_record_and_converge_after_churn():
    out = subprocess.run([sys.executable, "-m", "meshd", "bench", "dht", "--json"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    print(json.dumps(result, sort_keys=True))
    print(out.stderr[-6000:], file=sys.stderr)      # its progress: on a failure, which reads missed what
    assert result["nodes"] == 200 and result["killed_nodes"] == 40
    assert result["found_fraction"] == 1.0
    assert result["max_lookup_rounds"] <= result["round_bound"] == 10
    assert result["max_lookup_rounds_after_churn"] <= result["round_bound"]
    assert result["churn_converged_s"] is not None
    assert result["churn_converged_s"] <= result["republish_interval_s"]
    assert result["republish_interval_s"] >= result["republish_interval_base_s"] == 60
    assert result["republished_s"] is not None
    assert result["complete_after_republish"]
    assert result["min_replicas_after_republish"] >= 20      # k = 20 closest per publisher
