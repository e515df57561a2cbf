"""Free KV in the capability record: when it is republished (FreeKvGate) and what the claim says."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.daemon.advertiser import claim_from_report
from meshd.daemon.free_kv import MIN_INTERVAL_S, MOVE_FRACTION, FreeKvGate
from proto import shard_runtime_pb2 as pb

BUDGET = 4096


def test_first_value_then_only_moves_over_ten_percent_of_the_budget():
    g = FreeKvGate()
    assert g.offer(BUDGET, BUDGET, 0.0)                 # the first value is always published
    assert not g.offer(BUDGET - 400, BUDGET, 10.0)      # 400 <= 409.6: not a move
    assert g.offer(BUDGET - 2048, BUDGET, 20.0)         # one 2,048-token session: 50%
    assert g.published == BUDGET - 2048
    assert g.offer(0, BUDGET, 30.0) and g.published == 0   # full: the record says so


def test_rate_limited_and_a_held_back_move_goes_out_after_the_interval():
    g = FreeKvGate()
    assert g.offer(BUDGET, BUDGET, 100.0)
    assert not g.offer(0, BUDGET, 100.0 + MIN_INTERVAL_S / 2)    # too soon
    assert g.published == BUDGET
    assert g.offer(0, BUDGET, 100.0 + MIN_INTERVAL_S)            # the next poll after the interval
    g.reset()
    assert g.published is None and g.offer(123, BUDGET, 100.0 + MIN_INTERVAL_S)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-10, 2 * BUDGET), st.floats(0, 5)), max_size=40))
def test_never_more_often_than_the_interval_and_always_in_range(offers):
    g, now, last = FreeKvGate(), 0.0, None
    for free, dt in offers:
        now += dt
        if g.offer(free, BUDGET, now):
            assert last is None or now - last >= MIN_INTERVAL_S
            assert 0 <= g.published <= BUDGET
            last = now
    assert MOVE_FRACTION == 0.10


def test_the_claim_carries_the_latest_free_kv():
    report = pb.CapabilityReport(kv_budget_tokens=BUDGET, num_layers=6, backend="torch",
                                 fingerprint=pb.Fingerprint(model_artifact_digest="sha256:ab"),
                                 shard_range=pb.ShardRange(start_layer=0, end_layer=3))
    kw = dict(grpc_endpoint="127.0.0.1:1", tls_cert_sha256=b"\0" * 32, direct_addrs=())
    assert claim_from_report(report, **kw).free_kv_tokens == BUDGET
    assert claim_from_report(report, free_kv_tokens=0, **kw).free_kv_tokens == 0
