"""The round-trip floor probe beside ``bench pipeline``: a real gRPC echo subprocess and a
forked socket peer; it returns finite figures for both."""
from __future__ import annotations

import math

import pytest

from meshd.benchmarks import hopfloor


def test_floor_probe_measures_both_transports():
    out = hopfloor.measure(hold_ms=1.0, size=2400, rounds=5)
    assert set(out) == {"grpc_round_trip_floor_ms", "socket_round_trip_floor_ms", "floor_hold_ms",
                        "floor_frame_bytes"}
    # median(round trip) - hold: a round trip contains the hold, so never far below 0.
    for key in ("grpc_round_trip_floor_ms", "socket_round_trip_floor_ms"):
        assert math.isfinite(out[key]) and out[key] > -0.5, (key, out[key])


@pytest.mark.slow
def test_hop_transport_probe_runs_every_transport_through_a_real_worker():
    from meshd.benchmarks import hoptransport

    out = hoptransport.measure(steps=5)
    overhead = out["hop_transport_overhead_ms"]
    assert set(overhead) == {"grpc_tls", "frames_tls", "unix"}
    # step wall time minus the worker's own execution: a round trip is never free
    assert all(math.isfinite(v) and v > 0 for v in overhead.values()), overhead
    assert out["frames_vs_grpc_overhead_ratio"] == overhead["frames_tls"] / overhead["grpc_tls"]
