"""A full worker's record says so: a real `meshd join` daemon republishes its free KV.

One daemon serves all 6 layers of the seeded random Llama with a 512-token
KV budget. A session that reserves the whole budget on its worker makes the
daemon's signed record (read back from the DHT by `meshd status`) show 0 free
KV within seconds; releasing it brings the record back to 512.
"""
from __future__ import annotations

import pytest

from proto import shard_runtime_pb2 as pb
from tests._shard_helpers import RawStream
from tests.conftest import wait_until_blocking
from tests.test_daemon_e2e import POLL_S, Daemon
from tests.test_shard_e2e import unary

pytestmark = pytest.mark.slow

BUDGET = 512
READY_TIMEOUT_S = 300
# Health poll (1 s) + the 2 s rate limit + a DHT put and read: well under this.
RECORD_TIMEOUT_S = 60


def own_free_kv(daemon) -> int | None:
    s = daemon.status()
    if not s or not s.get("coverage"):
        return None
    (entries,) = s["coverage"].values()
    return entries[0].get("free_kv_tokens") if entries else None   # the model known, no record read yet


def test_the_record_follows_the_workers_free_kv(tmp_path):
    from meshd.testing.models import build_random_llama

    model = build_random_llama(seed=0)
    d = Daemon(tmp_path, 0, model, (0, 6), None, extra=["--kv-budget-tokens", str(BUDGET)])
    try:
        wait_until_blocking(d.alive(lambda: own_free_kv(d) == BUDGET), READY_TIMEOUT_S,
                            "the first record with the whole budget free", poll_s=POLL_S)
        endpoint = d.status()["worker"]["endpoint"]
        fp = unary(endpoint, "GetCapability", pb.CapabilityRequest(schema_version=1), pb.CapabilityReport).fingerprint
        hog = RawStream(endpoint)
        try:
            hog.send(pb.SessionRequest(open=pb.SessionOpen(
                schema_version=1, route_session_id="hog", fingerprint=fp, max_tokens=BUDGET,
                shard_range=pb.ShardRange(start_layer=0, end_layer=6))).SerializeToString())
            assert hog.recv()[0].WhichOneof("kind") == "accepted"
            wait_until_blocking(d.alive(lambda: own_free_kv(d) == 0), RECORD_TIMEOUT_S,
                                "the record showing the worker full", poll_s=POLL_S)
            hog.send(pb.SessionRequest(release=pb.ReleaseSignal(route_session_id="hog")).SerializeToString())
            assert hog.recv()[0].WhichOneof("kind") == "ack"
        finally:
            hog.close()
        wait_until_blocking(d.alive(lambda: own_free_kv(d) == BUDGET), RECORD_TIMEOUT_S,
                            "the record showing room again", poll_s=POLL_S)
    finally:
        assert d.stop() == 0
