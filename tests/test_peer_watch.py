"""The dashboard's truth, as pure rules: liveness from the daemon's failure signals (meshd/daemon/peer_watch.py)
and the worker's speed from its recent real steps (shard/session/step_meter.py).

A killed node was shown healthy until its record expired (16 s): now its
libp2p connection closing and its Health failing make it "gone" at the first
probe after. Speeds shown were one validation pass at start, unlabelled: now
an EWMA of real steps, and a history of decode positions per second.
"""
from __future__ import annotations

from meshd.daemon.peer_watch import FAILS_FOR_GONE, HISTORY_EVERY_S, PeerLife
from shard.session.step_meter import ALPHA, StepMeter

HEALTH = {"rss_bytes": 600 << 20, "decode_positions": 0}


def test_a_connected_peer_whose_connection_closed_and_health_fails_is_gone_at_once():
    life = PeerLife("p")
    life.note(health=HEALTH, connected=True, now_ms=1_000)
    assert life.state == "ok" and life.since_ms == 1_000
    life.note(health=None, connected=False, now_ms=2_000)       # SIGKILL: connection closed, worker gone
    assert life.state == "gone" and life.since_ms == 2_000
    life.note(health=HEALTH, connected=True, now_ms=9_000)       # back (restarted)
    assert life.state == "ok" and life.since_ms == 9_000


def test_health_failing_while_connected_is_unreachable_not_gone():
    life = PeerLife("p")
    life.note(health=HEALTH, connected=True, now_ms=0)
    for t in range(1, 10):
        life.note(health=None, connected=True, now_ms=t * 1000)
    assert life.state == "unreachable" and life.since_ms == 1000


def test_a_peer_never_connected_to_us_is_gone_after_repeated_failures_only():
    life = PeerLife("p")
    for i in range(FAILS_FOR_GONE - 1):
        life.note(health=None, connected=False, now_ms=i)
        assert life.state == "unknown"
    life.note(health=None, connected=False, now_ms=99)
    assert life.state == "gone"


def test_history_is_decode_positions_per_second_and_survives_a_worker_restart():
    life = PeerLife("p")
    step_ms = int(HISTORY_EVERY_S * 1000)
    for i, positions in enumerate([0, 50, 150, 10, 60]):       # the worker restarted before the 4th sample
        life.note(health={**HEALTH, "decode_positions": positions}, connected=True, now_ms=i * step_ms)
    assert [rate for _, rate in life.history] == [10.0, 20.0, 10.0]


def test_step_meter_averages_recent_decode_and_prefill_separately():
    m = StepMeter()
    m.observe(1, 10, 0.020)                  # 2 ms per layer
    assert m.decode_ms_per_layer == 2.0 and m.decode_positions == 1
    m.observe(1, 10, 0.040)
    assert abs(m.decode_ms_per_layer - (2.0 + ALPHA * 2.0)) < 1e-12
    m.observe(64, 10, 0.5)                   # a prefill chunk: 128 positions/s
    assert m.prefill_tokens_per_s == 128.0 and m.prefill_positions == 64 and m.decode_positions == 2
    m.observe(0, 10, 1.0)
    assert m.prefill_positions == 64
