"""Timing logic under trio's MockClock: republish, withdrawal, expiry, restart backoff."""
from __future__ import annotations

import pytest
import trio
import trio.testing

from dht.records import live, merge_records, validate_capability
from meshd.daemon.advertiser import Advertiser
from meshd.daemon.supervisor import Backoff, Supervisor, WorkerReady
from meshd.errors import WorkerFailed
from proto import shard_runtime_pb2 as pb
from tests._daemon_helpers import NOW_MS, claim, identity

TTL_S = 30.0


def _run(fn):
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def wall_ms() -> int:
    return NOW_MS + int(trio.current_time() * 1000)


def test_a_stalled_publish_does_not_delay_the_next_one():
    """A remote store stuck on a dead-but-connected peer is cut at the interval,
    so our own record is re-stored on cadence and never lapses (seen in CI with
    an 8 s TTL after a peer was SIGKILLed)."""
    starts: list[float] = []

    async def publish(rec):
        starts.append(trio.current_time())
        await trio.sleep(TTL_S)                       # a store that never answers in time
        return 0

    async def main():
        t0 = trio.current_time()
        adv = Advertiser(identity(52), publish, ttl_s=TTL_S, wall_ms=wall_ms)
        async with trio.open_nursery() as nursery:
            await nursery.start(adv.run)
            adv.set_claim(claim())
            await trio.sleep(35)
            nursery.cancel_scope.cancel()
        assert [round(t - t0, 3) for t in starts] == [0.0, 10.0, 20.0, 30.0]
        assert adv.status().advertising

    _run(main)


def test_republish_every_third_of_ttl_and_withdraw_at_once():
    published: list[tuple[float, object]] = []

    async def publish(rec):
        published.append((trio.current_time(), rec))
        return 3

    async def main():
        t0 = trio.current_time()
        adv = Advertiser(identity(51), publish, ttl_s=TTL_S, wall_ms=wall_ms)
        async with trio.open_nursery() as nursery:
            await nursery.start(adv.run)
            await trio.sleep(5)
            assert published == []                    # nothing to advertise yet
            adv.set_claim(claim())
            await trio.sleep(25.5)                    # t = 30.5: published at 5, 15, 25
            adv.set_claim(None)                       # worker died
            await trio.sleep(100)
            nursery.cancel_scope.cancel()
        times = [round(t - t0, 3) for t, _ in published]
        assert times == [5.0, 15.0, 25.0, 30.5]
        recs = [r for _, r in published]
        assert [r.withdrawn for r in recs] == [False, False, False, True]
        seqs = [r.sequence for r in recs]
        assert seqs == sorted(set(seqs))              # strictly increasing
        # every live record still valid when the next one is due: no gap in coverage
        for (_, rec), (t_next, _) in zip(published, published[1:]):
            validate_capability(rec.raw, NOW_MS + int((t_next - t0) * 1000))
        # the withdrawal hides the last live record in any index it meets
        assert live(merge_records(recs[:3], recs[3:], NOW_MS + 31_000), NOW_MS + 31_000) == []
        assert adv.status().withdrawn

    _run(main)


def test_failed_publish_retries_soon():
    calls: list[float] = []

    async def flaky(rec):
        calls.append(trio.current_time())
        if len(calls) == 1:
            raise OSError("swarm unreachable")
        return 1

    async def main():
        t0 = trio.current_time()
        adv = Advertiser(identity(52), flaky, ttl_s=TTL_S, wall_ms=wall_ms)
        adv.set_claim(claim())
        async with trio.open_nursery() as nursery:
            await nursery.start(adv.run)
            await trio.sleep(13)
            nursery.cancel_scope.cancel()
        assert [round(c - t0, 3) for c in calls] == [0.0, 2.0, 12.0]

    _run(main)


def test_record_expires_exactly_at_ttl():
    async def main():
        got = []
        adv = Advertiser(identity(53), lambda rec: _append(got, rec), ttl_s=TTL_S, wall_ms=wall_ms)
        adv.set_claim(claim())
        async with trio.open_nursery() as nursery:
            await nursery.start(adv.run)
            await trio.sleep(1)
            nursery.cancel_scope.cancel()  # node crashes: no withdrawal, no republish
        rec = got[0]
        assert rec.expires_at_ms - rec.issued_at_ms == TTL_S * 1000
        assert live([rec], rec.expires_at_ms - 1) == [rec]
        assert live([rec], rec.expires_at_ms) == []

    _run(main)


async def _append(out, rec):
    out.append(rec)
    return 0


def test_backoff_doubles_caps_and_resets():
    b = Backoff(1.0, 8.0)
    assert [b.after_death(0.1) for _ in range(5)] == [1, 2, 4, 8, 8]
    assert b.after_death(8.0) == 1.0  # a long healthy life resets it
    with pytest.raises(ValueError):
        Backoff(0, 1)
    # the defaults: doubling up to 5 minutes, reset after 2 minutes of service
    from meshd.config import WorkerConfig

    w = WorkerConfig()
    assert (w.restart_backoff_s, w.restart_backoff_max_s, w.restart_backoff_reset_s) == (1.0, 300.0, 120.0)
    b = Backoff(w.restart_backoff_s, w.restart_backoff_max_s, w.restart_backoff_reset_s)
    assert [b.after_death(0) for _ in range(11)] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]
    assert b.after_death(119.9) == 300 and b.after_death(120.0) == 1


def test_supervisor_restarts_with_backoff_and_withdraws_meanwhile():
    events: list[tuple[float, str]] = []
    lives = iter([2.0, 0.5, 0.5, 20.0, 100.0])  # how long each worker lives after ready

    async def life(on_ready, state):
        events.append((trio.current_time(), "start"))
        await trio.sleep(1.0)  # loading
        await on_ready(WorkerReady("127.0.0.1:1", "", 1, pb.CapabilityReport()))
        await trio.sleep(next(lives))
        return -9

    async def on_ready(ready):
        events.append((trio.current_time(), "ready"))

    async def on_down():
        events.append((trio.current_time(), "down"))

    async def main():
        t0 = trio.current_time()
        sup = Supervisor(life, on_ready=on_ready, on_down=on_down, backoff=Backoff(1.0, 8.0))
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            await trio.sleep(40)
            assert sup.state.restarts == 4 and sup.state.state == "ready"
            nursery.cancel_scope.cancel()
        got = [(round(t - t0, 3), what) for t, what in events]
        assert got == [
            (0.0, "start"), (1.0, "ready"), (3.0, "down"),      # lived 3 s: backoff 1
            (4.0, "start"), (5.0, "ready"), (5.5, "down"),      # backoff 2
            (7.5, "start"), (8.5, "ready"), (9.0, "down"),      # backoff 4
            (13.0, "start"), (14.0, "ready"), (34.0, "down"),   # lived 21 s >= cap: reset to 1
            (35.0, "start"), (36.0, "ready"),
        ]

    _run(main)


def test_worker_failing_before_first_ready_ends_a_supervisor_that_gives_up():
    async def life(on_ready, state):
        state.stderr_tail.append("ValueError: no such layer")
        await trio.sleep(0.2)
        return 2

    async def noop(*_):
        pass

    async def main():
        sup = Supervisor(life, on_ready=noop, on_down=noop, backoff=Backoff(1.0, 8.0), give_up_before_ready=True)
        with pytest.raises(WorkerFailed, match="code 2 before it was ready: ValueError: no such layer"):
            await sup.run()
        assert sup.state.state == "failed"
        failure = sup.state.as_dict()["last_failure"]
        assert failure["exit_code"] == 2 and failure["next_restart_in_s"] is None and not failure["was_ready"]

    _run(main)
