"""Relay records (dht/relay_records.py): signature, expiry, future-dating, replay; the DHT
validator under /meshd/relays/v1; a real 3-node DHT carrying a relay's announcement."""
from __future__ import annotations

import time
from contextlib import AsyncExitStack

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from dht import keys as K
from dht.host.bootstrap import connect_bootstrap
from dht.host.build import running_host
from dht.identity import Identity
from dht.node import DhtNode
from dht.records import MAX_CLOCK_SKEW_MS, encode_record_set
from dht.relay_records import MAX_RELAY_ADDRS, parse_relay_set_lenient, sign_relay, validate_relay, validate_relay_set
from dht.validator import MeshdValidator, check_value
from meshd.errors import RecordRejected
from proto import shard_runtime_pb2 as pb
from proto.records import sign_record
from relay.announce import announce_relay, public_addrs

NOW = 1_800_000_000_000
TTL = 60_000


def ident(n: int) -> Identity:
    return Identity.from_seed(bytes([n]) * 32)


A, B = ident(41), ident(42)


def addr(who: Identity, port: int = 4001) -> str:
    return f"/ip4/203.0.113.7/tcp/{port}/p2p/{who.peer_id}"


def rec(who: Identity = A, *, seq: int = 1, now: int = NOW, ttl: int = TTL, addrs=None) -> bytes:
    return sign_relay(addrs or [addr(who)], who.signing_key, peer_id=who.peer_id, sequence=seq,
                      now_ms=now, ttl_ms=ttl)


def test_valid_relay_record_round_trips():
    r = validate_relay(rec(seq=7), NOW)
    assert (r.peer_id, r.sequence, r.addrs, r.expires_at_ms) == (A.peer_id, 7, (addr(A),), NOW + TTL)
    assert not r.withdrawn and not r.expired(NOW) and r.expired(NOW + TTL)


def _forged() -> dict[str, bytes]:
    good = pb.SignedRecord.FromString(rec())
    payload = pb.RelayPayload.FromString(good.payload)
    other_peer = pb.RelayPayload()
    other_peer.CopyFrom(payload)
    other_peer.peer_id = B.peer_id
    other_peer.addrs[:] = [addr(B)]
    tampered = pb.SignedRecord()
    tampered.CopyFrom(good)
    tampered.payload = good.payload.replace(b"203.0.113.7", b"203.0.113.8")
    bad_addr = pb.RelayPayload()
    bad_addr.CopyFrom(payload)
    bad_addr.addrs[:] = [addr(A) + "/p2p-circuit/p2p/" + B.peer_id]
    no_addr = pb.RelayPayload()
    no_addr.CopyFrom(payload)
    del no_addr.addrs[:]
    capability_kind = sign_record(pb.RECORD_KIND_CAPABILITY, good.payload, A.signing_key)
    return {
        "signature": tampered.SerializeToString(),
        "peer_id": sign_record(pb.RECORD_KIND_RELAY, other_peer.SerializeToString(), A.signing_key)
        .SerializeToString(),
        "malformed": sign_record(pb.RECORD_KIND_RELAY, bad_addr.SerializeToString(), A.signing_key)
        .SerializeToString(),
        "kind": capability_kind.SerializeToString(),
        "too_large": b"\x00" * 5000,
        "future": rec(now=NOW + MAX_CLOCK_SKEW_MS + 1),
        "expired": rec(now=NOW - TTL),
        "malformed ": sign_record(pb.RECORD_KIND_RELAY, no_addr.SerializeToString(), A.signing_key)
        .SerializeToString(),
    }


@pytest.mark.parametrize("reason", list(_forged()))
def test_forged_or_stale_relay_records_are_refused_with_their_reason(reason):
    with pytest.raises(RecordRejected) as err:
        validate_relay(_forged()[reason], NOW)
    assert err.value.reason == reason.strip()


def test_sign_relay_refuses_bad_local_input():
    with pytest.raises(ValueError):
        rec(addrs=[addr(B)])                      # someone else's address
    with pytest.raises(ValueError):
        rec(addrs=[addr(A, p) for p in range(MAX_RELAY_ADDRS + 1)])
    with pytest.raises(ValueError):
        rec(ttl=0)


def test_validator_under_the_relays_key_selects_by_news_and_refuses_replays():
    key = K.relays_key()
    assert K.parse_key(key).kind == "relays"
    with pytest.raises(ValueError):
        K.parse_key("/meshd/relays/v2")
    old = validate_relay(rec(seq=1), NOW)
    new = validate_relay(rec(seq=2), NOW)
    other = validate_relay(rec(B, seq=1), NOW)
    v = MeshdValidator(lambda: NOW)
    assert check_value(key, encode_record_set([old, other]), NOW) == sorted([old, other], key=lambda r: r.peer_id)
    # newer wins; a replay of the old one (no news) never replaces what is stored
    assert v.select(key, [encode_record_set([old]), encode_record_set([new])]) == 1
    assert v.select(key, [encode_record_set([new]), encode_record_set([old])]) == 0
    # a capability record under the relays key is refused (kind), as is a relay record under a model key
    with pytest.raises(RecordRejected):
        check_value(key, b"MSR1\x00\x00", NOW)
    with pytest.raises(RecordRejected):
        check_value(K.model_key("sha256:" + "0" * 64), encode_record_set([new]), NOW)
    one = old.raw
    dup = b"MSR1" + (2).to_bytes(2, "big") + 2 * (len(one).to_bytes(4, "big") + one)
    with pytest.raises(RecordRejected):
        validate_relay_set(dup, NOW)
    # a stored set whose record expired since reads as empty, not as an error
    assert parse_relay_set_lenient(encode_record_set([old]), NOW + TTL) == []


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_relay_parsers_only_raise_typed_errors(data):
    for fn in (lambda: validate_relay(data, NOW), lambda: validate_relay_set(b"MSR1" + data, NOW),
               lambda: check_value(K.relays_key(), data, NOW)):
        try:
            fn()
        except RecordRejected:
            pass


@settings(max_examples=100, deadline=None)
@given(st.integers(0, len(rec()) - 1), st.integers(1, 255))
def test_fuzz_bit_flips_never_validate_as_another_relay(pos, flip):
    data = bytearray(rec())
    data[pos] ^= flip
    try:
        r = validate_relay(bytes(data), NOW)
    except RecordRejected:
        return
    assert (r.peer_id, r.addrs, r.sequence) == (A.peer_id, (addr(A),), 1)


def test_public_addrs_drop_unspecified_unless_advertised():
    pid = A.peer_id
    listen = [f"/ip4/0.0.0.0/tcp/4001/p2p/{pid}", f"/ip4/10.0.0.5/tcp/4001/p2p/{pid}"]
    assert public_addrs(listen, pid) == (f"/ip4/10.0.0.5/tcp/4001/p2p/{pid}",)
    assert public_addrs(listen, pid, "203.0.113.9")[0] == f"/ip4/203.0.113.9/tcp/4001/p2p/{pid}"


def test_announce_republishes_with_rising_sequence_on_a_fake_clock():
    published, reported = [], []

    async def publish(r):
        published.append((trio.current_time(), r))
        return 1

    async def main():
        def wall():
            return NOW + int(trio.current_time() * 1000)

        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: announce_relay(
                A, lambda: [addr(A)], publish, ttl_s=30.0, wall_ms=wall,
                on_published=lambda r, acks: reported.append((r.sequence, acks)), task_status=task_status))
            await trio.sleep(25)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [t for t, _ in published] == [0.0, 10.0, 20.0]
    seqs = [r.sequence for _, r in published]
    assert seqs == sorted(set(seqs))
    assert all(r.addrs == (addr(A),) for _, r in published)
    assert reported == [(s, 1) for s in seqs]


def test_a_relay_record_published_on_one_node_is_listed_by_the_others():
    idents = [ident(51), ident(52), ident(53)]

    def wall():
        return int(time.time() * 1000)


    async def main():
        with trio.fail_after(60):
            async with AsyncExitStack() as stack:
                nodes = []
                for i in idents:
                    host = await stack.enter_async_context(running_host(i, ["/ip4/127.0.0.1/tcp/0"]))
                    nodes.append(await stack.enter_async_context(DhtNode(host, wall).running()))
                boot = [str(nodes[0].host.get_addrs()[0])]
                for node in nodes[1:]:
                    await connect_bootstrap(node.host, boot, 10)
                for node in nodes:
                    await node.sync_peers()
                relay = idents[1]
                first = validate_relay(sign_relay([addr(relay)], relay.signing_key, peer_id=relay.peer_id,
                                                  sequence=5, now_ms=wall(), ttl_ms=TTL), wall())
                assert await nodes[1].publish_relay(first) > 0
                for node in nodes:
                    assert [(r.peer_id, r.sequence) for r in await node.fetch_relays()] == [(relay.peer_id, 5)]
                # a replay of an older sequence does not replace the newer one anywhere
                newer = validate_relay(sign_relay([addr(relay, 4002)], relay.signing_key, peer_id=relay.peer_id,
                                                  sequence=6, now_ms=wall(), ttl_ms=TTL), wall())
                await nodes[1].publish_relay(newer)
                await nodes[2].put_remote(K.relays_key(), encode_record_set([first]))
                for node in nodes:
                    got = await node.fetch_relays()
                    assert [(r.peer_id, r.sequence, r.addrs) for r in got] == \
                        [(relay.peer_id, 6, (addr(relay, 4002),))]

    trio.run(main)
