"""Reachability: dial-back probe over real hosts, reservation schedule with a fake clock."""
from __future__ import annotations

import functools
import socket
import time

import pytest
import trio
import trio.testing

from relay.client import Reservation
from relay.errors import RelayUnreachable
from relay.reachability import RENEW_MIN_DELAY_S, Verdict, keep_reserved, probe, renew_delay, serve_dialback
from tests._relay_helpers import LOOPBACK, info, new_host, triangle


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dial_back_says_public_for_a_listening_address_and_private_for_a_dead_one():
    async def main():
        me, helper = new_host(), new_host()
        async with me.run(LOOPBACK), helper.run(LOOPBACK):
            serve_dialback(helper)
            await me.connect(info(helper))
            mine = [str(a).split("/p2p/")[0] for a in me.get_addrs()]
            assert await probe(me, [helper.get_id()], mine) == Verdict.PUBLIC
            dead = [f"/ip4/127.0.0.1/tcp/{_closed_port()}"]
            assert await probe(me, [helper.get_id()], dead) == Verdict.PRIVATE
            # an address on another IP than the one the helper observes is never dialed
            assert await probe(me, [helper.get_id()], ["/ip4/10.255.255.1/tcp/4001"]) == Verdict.PRIVATE
            # a helper without the service answers nothing
            assert await probe(helper, [me.get_id()], mine) == Verdict.UNKNOWN

    trio.run(main)


def _res(expires: int) -> Reservation:
    return Reservation(relay_peer_id="12D3KooWx", expires_at_unix=expires, relay_addrs=(),
                       limit_duration_s=0, limit_data_bytes=0)


@pytest.mark.parametrize("remaining,expected", [(1800, 900.0), (6, RENEW_MIN_DELAY_S), (-5, RENEW_MIN_DELAY_S)])
def test_renewal_is_at_half_the_remaining_life_but_not_too_soon(remaining, expected):
    assert renew_delay(_res(10_000 + remaining), 10_000) == expected


def test_keeper_holds_a_real_reservation_and_reports_its_address():
    seen: list[tuple[str, ...]] = []

    async def main():
        async with triangle(reserve_home=False, connect=False) as t:
            async with trio.open_nursery() as nursery:
                addrs = await nursery.start(functools.partial(
                    keep_reserved, t.home, lambda: [info(t.relay)], seen.append, wall=time.time))
                assert addrs and addrs[0].endswith(f"/p2p-circuit/p2p/{t.home.get_id()}")
                assert t.hop.snapshot()["reservations_active"] == 1
                nursery.cancel_scope.cancel()

    trio.run(main)
    assert len(seen) == 1


class _FakeHost:
    def get_id(self):
        class _Id:
            def to_base58(self):
                return "12D3KooWself"
        return _Id()


class _Relay:
    def __init__(self, name):
        self.peer_id = name


def test_keeper_schedule_renewals_and_failover_with_a_fake_clock():
    """Relay A answers twice then fails; the keeper renews at half-life and moves to B."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    calls: list[tuple[float, str]] = []
    seen: list[tuple[str, ...]] = []
    ttl = 600

    async def fake_reserve(host, relay):
        now = trio.current_time()
        calls.append((now, relay.peer_id))
        if relay.peer_id == "A" and len([c for c in calls if c[1] == "A"]) > 2:
            raise RelayUnreachable("A is gone")
        return Reservation(relay_peer_id=relay.peer_id, expires_at_unix=int(now) + ttl,
                           relay_addrs=(f"/ip4/1.2.3.4/tcp/1/p2p/{relay.peer_id}",),
                           limit_duration_s=0, limit_data_bytes=0)

    async def main():
        with trio.move_on_after(1000):
            await keep_reserved(_FakeHost(), lambda: [_Relay("A"), _Relay("B")], seen.append,
                                wall=trio.current_time, reserve_fn=fake_reserve)

    trio.run(main, clock=clock)
    # t=0 A, t=300 A (renew at half of 600), t=600 A fails -> B at once, t=900 B
    assert calls == [(0, "A"), (300, "A"), (600, "A"), (600, "B"), (900, "B")]
    assert seen == [("/ip4/1.2.3.4/tcp/1/p2p/A/p2p-circuit/p2p/12D3KooWself",),
                    ("/ip4/1.2.3.4/tcp/1/p2p/B/p2p-circuit/p2p/12D3KooWself",)]
