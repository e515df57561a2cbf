"""The relay benchmark's floor probe and breakdown over real processes (no timing thresholds)."""
from __future__ import annotations

import pytest

from meshd.benchmarks import relay_harness as H

pytestmark = pytest.mark.slow


def test_a_bench_echo_home_node_sends_every_frame_back_through_the_relay(tmp_path):
    kids: list[H.Child] = []
    try:
        relay = H.spawn_relay(tmp_path, "/ip4/127.0.0.1/tcp/0")
        kids.append(relay)
        # No worker behind it: the echo protocol never touches the bridge (a Unix target, the only
        # kind a home node takes, that nothing listens on).
        home = H.spawn_home_node(tmp_path, "home", "/ip4/127.0.0.1/tcp/0", relay.ready["addrs"][0],
                                 f"unix:{tmp_path / 'no-worker.sock'}", bench_echo=True)
        kids.append(home)
        rtts = H.relayed_echo_rtts(home.ready["relayed_addrs"][0], frame_bytes=8192, count=5)
        assert len(rtts) == 5 and all(r > 0 for r in rtts)
        big = H.relayed_echo_rtts(home.ready["relayed_addrs"][0], frame_bytes=1 << 20, count=1)
        assert len(big) == 1
    finally:
        for kid in reversed(kids):
            kid.stop()
