"""DCUtR direct upgrade of relayed hops (meshd/reach/direct_upgrade.py, meshd/reach/relay_dial.py),
real hosts on loopback.

The home node advertises only a relayed address, but it is dialable on
loopback, so an upgrade can succeed: the second generation's hop then runs on
a direct connection (the relay forwards no more bytes) with the whole model's
tokens. A home node that stalls the DCUtR exchange, or does not speak it,
leaves the circuit in use, and generations through it succeed meanwhile.
"""
from __future__ import annotations

import logging
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import trio
from libp2p.exceptions import BaseLibp2pError
from libp2p.tools.anyio_service import background_trio_service

from meshd.generate.driver import GenerationRequest, SwarmDriver, collect
from meshd.generate.routes import AdsRouteSource, PeerConnector
from meshd.reach.direct_upgrade import (
    _IN_UPGRADE,
    RETRY_AFTER_S,
    UPGRADE_TIMEOUT_S,
    DirectUpgrader,
    UpgradePolicy,
    is_relayed,
    quiet_dcutr_logs,
)
from meshd.reach.relay_dial import RelayDialer
from relay.client import relayed_addrs, reserve, stop_service
from relay.hop import DEFAULT_HOP_LIMITS, HopService
from relay.portal import Portal
from relay.transport import SESSION_PROTOCOL, RelayedSessionServer
from shard.edges.unix_server import UnixFrameServer
from shard.model.reference import WholeModel
from tests._relay_helpers import ECHO_PREFIX, LOOPBACK, echo_once, echo_worker, info, new_host
from tests._swarm_helpers import start_shard
from tests.conftest import wait_until

TEST_TIMEOUT_S = 90
NUM_LAYERS = 6
PROMPT = tuple(range(5, 29))
NEW_TOKENS = 8
# Bound for the stalled-peer attempt: the attempt is cut here, the circuit stays.
SHORT_UPGRADE_TIMEOUT_S = 1.0
DCUTR = "/libp2p/dcutr"
MODEL_SEED = 5   # the shared ``model`` fixture's seed (tests/conftest.py)


# py-libp2p's top logger does not propagate to the root: watch it and the root.
WATCHED_LOGGERS = ("libp2p", "")
RELAY_LOGGER = "libp2p.relay.circuit_v2.protocol"


class NoisyRecords(logging.Handler):
    """Records above DEBUG from the library or from us: a silent fallback logs none."""

    def __enter__(self) -> NoisyRecords:
        for name in WATCHED_LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for name in WATCHED_LOGGERS:
            logging.getLogger(name).removeHandler(self)

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno > logging.DEBUG and record.name.startswith(("libp2p", "meshd")):
            self.records.append(record)


def test_policy_admits_a_peer_once_per_window_and_stays_bounded():
    policy = UpgradePolicy(retry_after_s=300.0, max_peers=4)
    assert policy.admit("p", 0.0)
    assert not policy.admit("p", 299.9)
    assert policy.admit("p", 300.0)
    assert policy.admit("q", 1.0)
    for i in range(10):
        policy.admit(f"x{i}", 2.0)
    assert len(policy._last) == 4
    with pytest.raises(ValueError):
        UpgradePolicy(retry_after_s=0)


def test_hole_punch_chatter_is_demoted_to_debug_only_inside_an_upgrade():
    quiet_dcutr_logs()
    with NoisyRecords() as seen:
        logging.getLogger("libp2p.relay.circuit_v2.dcutr").warning("punch failed")
        logging.getLogger("libp2p.transport.tcp.tcp").error("dial failed outside an upgrade")
        assert [r.getMessage() for r in seen.records] == ["dial failed outside an upgrade"]
        token = _IN_UPGRADE.set(True)
        try:
            logging.getLogger("libp2p.transport.tcp.tcp").error("dial failed in an upgrade")
        finally:
            _IN_UPGRADE.reset(token)
        assert len(seen.records) == 1


async def relay_and_home(nursery, worker_endpoint: str, home, *, home_upgrader: bool = True,
                         served_on: list[bool] | None = None, dialable: bool = True):
    """Start relay + home (reserved, serving sessions to ``worker_endpoint``); the home's relayed addrs.

    ``served_on`` collects, per session stream the home accepts, whether it arrived on a circuit.
    Not ``dialable``: once reserved (its connection to the relay is outbound), the home closes its
    listeners, as behind a NAT: any direct dial to it is refused, only the circuit reaches it."""
    relay = new_host()
    await nursery.start(_serve_host, relay)
    hop = HopService(relay, DEFAULT_HOP_LIMITS)
    await nursery.start(_run_service, hop)
    await nursery.start(_serve_host, home)
    await nursery.start(_run_stop_service, home)
    server = RelayedSessionServer(worker_endpoint)
    server.attach(home)
    if served_on is not None:
        async def recording(stream):
            served_on.append(is_relayed(stream.swarm_conn))
            await server._handle(stream)
        home.set_stream_handler(SESSION_PROTOCOL, recording)
    if home_upgrader:
        await nursery.start(DirectUpgrader(home).run)
    addrs = relayed_addrs(await reserve(home, info(relay)), home.get_id().to_base58())
    if not dialable:
        for listener in list(home.get_network().listeners.values()):
            await listener.close()
    return hop, addrs


async def _serve_host(host, task_status=trio.TASK_STATUS_IGNORED):
    async with host.run(LOOPBACK):
        task_status.started()
        await trio.sleep_forever()


async def _run_service(service, task_status=trio.TASK_STATUS_IGNORED):
    async with background_trio_service(service):
        await service.event_started.wait()
        task_status.started()
        await trio.sleep_forever()


async def _run_stop_service(host, task_status=trio.TASK_STATUS_IGNORED):
    async with stop_service(host):
        task_status.started()
        await trio.sleep_forever()


def test_relayed_hop_is_upgraded_and_the_next_generation_runs_direct_with_the_same_tokens(model):
    reference = WholeModel(model).generate(list(PROMPT), NEW_TOKENS, chunk_tokens=16).tokens
    home = new_host()
    home_id = home.get_id().to_base58()
    shards = [start_shard(model, "head", 0, 2), start_shard(model, home_id, 2, 4), start_shard(model, "tail", 4, 6)]
    head, middle, tail = shards
    middle_unix = UnixFrameServer(middle.service, Path(tempfile.mkdtemp(prefix="dcutr-")) / "w.sock").start()
    fp = head.service.backend.fingerprint
    ads = [head.ad(NUM_LAYERS), replace(middle.ad(NUM_LAYERS), relayed=True, grpc_endpoint=""), tail.ad(NUM_LAYERS)]

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                served_on: list[bool] = []
                hop, addrs = await relay_and_home(nursery, middle_unix.endpoint, home, served_on=served_on)
                dialer = new_host()
                await nursery.start(_serve_host, dialer)
                upgrader = DirectUpgrader(dialer)
                await nursery.start(upgrader.run)
                dial = RelayDialer(dialer, Portal.current(), upgrader=upgrader)
                connector = PeerConnector(self_peer_id="entry", insecure_loopback=True, relay_dialer=dial,
                                          relayed_addrs=lambda peer: addrs if peer == home_id else ())
                source = AdsRouteSource(lambda: ads, fp.model_artifact_digest, NUM_LAYERS, entry_peer_id="entry",
                                        recipe_digest=fp.runtime_recipe_digest)
                request = GenerationRequest(PROMPT, NEW_TOKENS, chunk_tokens=16)

                def generate():
                    return collect(SwarmDriver(source, connector, fingerprint=fp, replan_wait_s=0.0), request)

                first = await trio.to_thread.run_sync(generate)
                assert first == reference
                first_bytes = hop.snapshot()["bytes_forwarded"]
                assert first_bytes > 0 and served_on and all(served_on)   # the first generation: the circuit
                served_on.clear()
                await wait_until(lambda: upgrader.attempts == 1 and upgrader.in_flight == 0,
                                 UPGRADE_TIMEOUT_S + 10, "attempt done")
                conn = upgrader.direct(home_id)
                assert conn is not None, f"the home is dialable on loopback, yet no upgrade: {upgrader.snapshot()}"
                assert not is_relayed(conn) and "/p2p-circuit" not in str(conn.get_transport_addresses())

                # new session streams to the home node now open on the direct connection
                channel = await trio.to_thread.run_sync(dial.transport, home_id, addrs)
                assert channel.conn is conn
                relayed_bytes = hop.snapshot()["bytes_forwarded"]   # now includes the DCUtR exchange
                second = await trio.to_thread.run_sync(generate)
                assert second == reference
                # every session stream of the second generation arrived on the direct connection, and the
                # relay forwarded none of its frames (at most the tail of the DCUtR stream's close, a few
                # yamux frames, may still cross it: far below one generation's traffic)
                assert served_on and not any(served_on)
                assert hop.snapshot()["bytes_forwarded"] - relayed_bytes < first_bytes // 20
                # one attempt per peer per window: later generations ask for none
                assert upgrader.attempts == 1 and upgrader.snapshot()["direct_now"] == 1
                assert upgrader.snapshot()["sessions_direct"] >= 2   # our channel above + the hop's session

                # The direct connection dies (NAT mapping gone): a failed hop is retried on the same
                # peer, and new sessions take the circuit again (no new attempt within the window).
                await conn.close()
                assert await trio.to_thread.run_sync(dial.retry_same_peer, home_id)
                channel = await trio.to_thread.run_sync(dial.transport, home_id, addrs)
                assert is_relayed(channel.conn) and upgrader.attempts == 1
                served_on.clear()
                assert await trio.to_thread.run_sync(generate) == reference
                assert served_on and all(served_on)
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        middle_unix.close()
        for s in shards:
            s.kill()


async def _stall_dcutr(stream) -> None:
    """A hostile/stuck home node: accepts the DCUtR stream and never answers."""
    await trio.sleep_forever()


@pytest.mark.parametrize("home_kind", ["stalls", "no-dcutr"])
def test_a_failing_upgrade_keeps_the_circuit_and_generations_succeed_silently(home_kind):
    async def main(noisy: NoisyRecords):
        with trio.fail_after(TEST_TIMEOUT_S), echo_worker() as worker:
            async with trio.open_nursery() as nursery:
                home = new_host()
                home_id = home.get_id().to_base58()
                hop, addrs = await relay_and_home(nursery, worker, home, home_upgrader=False, dialable=False)
                if home_kind == "stalls":
                    home.set_stream_handler(DCUTR, _stall_dcutr)
                dialer = new_host()
                await nursery.start(_serve_host, dialer)
                # The home is not dialable and stalls the DCUtR exchange or does not speak it.
                now = [0.0]
                upgrader = DirectUpgrader(dialer, timeout_s=SHORT_UPGRADE_TIMEOUT_S, clock=lambda: now[0])
                assert not upgrader.request(home_id)      # not running yet: no attempt, no error
                await nursery.start(upgrader.run)
                dial = RelayDialer(dialer, Portal.current(), upgrader=upgrader)

                def through_circuit(body: bytes):
                    channel = dial.transport(home_id, addrs)
                    return is_relayed(channel.conn), echo_once(channel, body)

                noisy.records.clear()
                # while the attempt runs (or stalls), the hop works on the circuit
                assert await trio.to_thread.run_sync(through_circuit, b"one") == (True, [ECHO_PREFIX + b"one"])
                await wait_until(lambda: upgrader.attempts == 1, 30, "attempt started")
                assert await trio.to_thread.run_sync(through_circuit, b"two") == (True, [ECHO_PREFIX + b"two"])
                # the attempt ends (failed or cut by its bound): still the circuit, no second attempt
                await wait_until(lambda: not upgrader.in_flight, SHORT_UPGRADE_TIMEOUT_S + 10, "the attempt's end")
                assert upgrader.direct(home_id) is None and upgrader.upgraded == 0
                assert await trio.to_thread.run_sync(through_circuit, b"three") == (True, [ECHO_PREFIX + b"three"])
                assert upgrader.attempts == 1
                # after the policy window, the next circuit use tries once more (and falls back again)
                now[0] = RETRY_AFTER_S
                assert await trio.to_thread.run_sync(through_circuit, b"four") == (True, [ECHO_PREFIX + b"four"])
                await wait_until(lambda: upgrader.attempts == 2 and not upgrader.in_flight, 30, "second attempt")
                assert upgrader.direct(home_id) is None and upgrader.upgraded == 0
                # (the relay's own library logger complains about the reservation stream the home closed;
                # in a deployment that is the relay's process, not ours)
                assert [f"{r.name}: {r.getMessage()}" for r in noisy.records if r.name != RELAY_LOGGER] == []
                nursery.cancel_scope.cancel()

    with NoisyRecords() as noisy:
        trio.run(main, noisy)


def test_a_hole_punch_is_answered_only_over_a_circuit():
    """DCUtR makes us dial addresses the peer chose: a peer directly connected gets no answer."""
    from libp2p.relay.circuit_v2.pb.dcutr_pb2 import HolePunch
    from libp2p.relay.circuit_v2.utils import write_delimited_msg

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                home, peer = new_host(), new_host()
                await nursery.start(_serve_host, home)
                await nursery.start(_serve_host, peer)
                upgrader = DirectUpgrader(home)
                await nursery.start(upgrader.run)
                await peer.connect(info(home))
                with pytest.raises(BaseLibp2pError):   # reset by the home (even during negotiation), never answered
                    stream = await peer.new_stream(home.get_id(), [DCUTR])
                    await write_delimited_msg(stream, HolePunch(type=HolePunch.CONNECT, ObsAddrs=[]))
                    while True:
                        if not await stream.read(4096):
                            raise EOFError("closed")
                assert upgrader._dcutr.inbound_refused == 1
                nursery.cancel_scope.cancel()

    trio.run(main)
