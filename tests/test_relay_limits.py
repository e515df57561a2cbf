"""Abuse limits of the hop service and of the relayed session server (real hosts on loopback)."""
from __future__ import annotations

import pytest
import trio
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode

from relay.client import dial_relayed, reserve
from relay.errors import RelayRefused, RelayUnreachable
from relay.framing import ByteBudget
from relay.hop import HopLimits, admit
from relay.transport import RelayedSessionServer, open_session_channel
from tests._relay_helpers import ECHO_PREFIX, LOOPBACK, echo_worker, info, new_host, triangle

SMALL = HopLimits(circuits_per_destination=1, circuits_per_source=1, circuits_total=2)


@pytest.mark.parametrize("reserved,dest,source,total,expected", [
    (False, 0, 0, 0, StatusCode.NO_RESERVATION),
    (True, 0, 0, 0, StatusCode.OK),
    (True, 1, 0, 0, StatusCode.RESOURCE_LIMIT_EXCEEDED),   # destination at its cap
    (True, 0, 1, 0, StatusCode.RESOURCE_LIMIT_EXCEEDED),   # source at its cap
    (True, 0, 0, 2, StatusCode.RESOURCE_LIMIT_EXCEEDED),   # relay full
])
def test_admission_table(reserved, dest, source, total, expected):
    assert admit(SMALL, dest_reserved=reserved, dest_circuits=dest, source_circuits=source,
                 total_circuits=total) == expected


def test_limits_are_validated():
    with pytest.raises(ValueError):
        HopLimits(circuits_total=0)


def test_circuits_over_a_destinations_or_a_sources_limit_are_refused():
    async def main():
        async with triangle(limits=SMALL) as t:     # dialer -> home: 1 circuit open
            other_dialer, other_home = new_host(), new_host()
            async with other_dialer.run(LOOPBACK), other_home.run(LOOPBACK):
                from relay.client import stop_service
                async with stop_service(other_home):
                    await reserve(other_home, info(t.relay))
                    # home already carries its one circuit
                    with pytest.raises(RelayRefused) as err:
                        await dial_relayed(other_dialer, info(t.relay), t.home.get_id())
                    assert err.value.status == "RESOURCE_LIMIT_EXCEEDED"
                    # dialer already uses its one circuit
                    with pytest.raises(RelayRefused) as err:
                        await dial_relayed(t.dialer, info(t.relay), other_home.get_id())
                    assert err.value.status == "RESOURCE_LIMIT_EXCEEDED"
                    # a fresh pair is within every limit
                    await dial_relayed(other_dialer, info(t.relay), other_home.get_id())
                    snap = t.hop.snapshot()
                    assert snap["circuits_refused"] == {"RESOURCE_LIMIT_EXCEEDED": 2}
                    assert snap["circuits_active"] == 2 and snap["circuits_opened"] == 2

    trio.run(main)


def test_a_circuit_past_its_byte_cap_is_cut():
    async def main():
        with echo_worker() as target:
            async with triangle(limits=HopLimits(circuit_max_bytes=256 * 1024)) as t:
                server = RelayedSessionServer(target)
                server.attach(t.home)
                try:
                    channel = await open_session_channel(t.dialer, t.home.get_id())
                    await channel.send(b"small")
                    assert await channel.receive() == ECHO_PREFIX + b"small"
                    with pytest.raises(RelayUnreachable), trio.fail_after(20):
                        for _ in range(8):
                            await channel.send(b"z" * 65536)
                            await channel.receive()
                finally:
                    server.close()

    trio.run(main)


def test_a_frame_over_the_nodes_buffer_budget_ends_only_that_session():
    async def main():
        with echo_worker() as target:
            async with triangle() as t:
                server = RelayedSessionServer(target, budget=ByteBudget(4096))
                server.attach(t.home)
                try:
                    greedy = await open_session_channel(t.dialer, t.home.get_id())
                    await greedy.send(b"g" * 8192)
                    with trio.fail_after(10):
                        try:
                            got = await greedy.receive()
                        except RelayUnreachable as exc:
                            got = exc
                    # py-libp2p reports a reset by the far side as end-of-stream
                    assert got is None or isinstance(got, RelayUnreachable)
                    assert server.budget.refused == 1 and server.budget.in_use == 0
                    polite = await open_session_channel(t.dialer, t.home.get_id())
                    await polite.send(b"p" * 1000)
                    assert await polite.receive() == ECHO_PREFIX + b"p" * 1000
                finally:
                    server.close()

    trio.run(main)


def test_a_destination_that_never_reads_cannot_make_the_relay_buffer():
    """Back-pressure: the end-to-end yamux window stops the sender; the relay holds no backlog."""
    from relay.transport import SESSION_PROTOCOL

    stalled = trio.Event()

    async def never_read(stream):
        stalled.set()
        await trio.sleep_forever()

    async def main():
        async with triangle() as t:
            t.home.set_stream_handler(SESSION_PROTOCOL, never_read)
            stream = await t.dialer.new_stream(t.home.get_id(), [SESSION_PROTOCOL])
            chunk = b"h" * 65536
            pushed = 0          # bytes handed to write(), the blocked write included: yamux
            stopped = False     # sends the part of a chunk its window allows before blocking
            with trio.move_on_after(10) as blocked:
                try:
                    while pushed < 64 * 1024 * 1024:
                        pushed += len(chunk)
                        await stream.write(chunk)
                except Exception:  # noqa: BLE001 - py-libp2p gives up after 5 s without a window update
                    stopped = True
            forwarded = t.hop.snapshot()["bytes_forwarded"]
            print(f"dialer pushed {pushed} bytes before blocking, relay forwarded {forwarded}")
            assert stalled.is_set() and (stopped or blocked.cancelled_caught), "the sender was never stopped"
            assert pushed <= 16 * 1024 * 1024            # yamux's largest window, not 64 MiB
            assert forwarded <= pushed + 64 * 1024        # the relay forwarded, it did not hoard

    trio.run(main)


def test_reservations_over_the_relays_total_are_refused_and_renewal_keeps_the_slot():
    async def main():
        async with triangle(limits=HopLimits(reservations_total=1), connect=False) as t:  # home holds the slot
            again = await reserve(t.home, info(t.relay))        # renewal in place, same slot
            assert again.relay_peer_id == t.relay.get_id().to_base58()
            with pytest.raises(RelayRefused) as err:
                await reserve(t.dialer, info(t.relay))
            assert err.value.status == "RESOURCE_LIMIT_EXCEEDED"
            assert t.hop.snapshot()["reservations_active"] == 1

    trio.run(main)


def test_concurrent_circuits_cannot_race_past_a_destinations_cap():
    async def main():
        async with triangle(limits=HopLimits(circuits_per_destination=1), connect=False) as t:
            second = new_host()
            async with second.run(LOOPBACK):
                outcomes: list[str] = []

                async def dial(host):
                    try:
                        await dial_relayed(host, info(t.relay), t.home.get_id())
                        outcomes.append("ok")
                    except RelayRefused as exc:
                        outcomes.append(exc.status)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(dial, t.dialer)
                    nursery.start_soon(dial, second)
                assert sorted(outcomes) == ["RESOURCE_LIMIT_EXCEEDED", "ok"]

    trio.run(main)
