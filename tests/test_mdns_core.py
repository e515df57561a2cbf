"""mDNS discovery's sans-I/O core and the swarm scope (dht/host/mdns_core.py, swarm_scope.py,
interfaces.py): which announcements are ours, what they may say, whom to dial when; a fuzz of
the TXT parser and of the event sequence. No network."""
from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.compat import mdns_broadcaster
from dht.compat.gate import TESTED_LIBP2P_VERSION
from dht.host import mdns_core as C
from dht.host.errors import SwarmNameInvalid
from dht.host.interfaces import IfaceAddr, default_route_iface, mdns_interfaces, pick_advertise_host
from dht.host.mdns import SERVICE_TYPE, announced_addrs
from dht.host.mdns_core import Announcement, MdnsPeers, Rejected, classify_name, parse_announcement, valid_peer_id
from dht.host.swarm_scope import DEFAULT_SCOPE, SwarmScope
from tests._daemon_helpers import identity

LAN = [ipaddress.IPv4Network("192.168.1.0/24")]
ME, PEER, OTHER = (identity(i).peer_id for i in (1, 2, 3))
BLUE, RED = SwarmScope("blue"), SwarmScope("red")


def name(scope: SwarmScope, suffix: str = "x" * 24) -> str:
    return f"{scope.mdns_prefix}{suffix}.{SERVICE_TYPE}"


def txt(*addrs: str) -> dict[bytes, bytes]:
    """TXT properties as libp2p's PeerBroadcaster writes them: dnsaddr, dnsaddr2, ..."""
    return {(b"dnsaddr" if i == 0 else f"dnsaddr{i + 1}".encode()): a.encode() for i, a in enumerate(addrs)}


# ------------------------------------------------------------------ the swarm scope

def test_a_swarm_name_scopes_the_mdns_names_and_the_dht_protocol():
    assert DEFAULT_SCOPE.name == "default"
    # the tag is a pure function of the (lower-cased) name: golden values keep nodes of one
    # release and the next in one swarm
    # sha256(b"meshd-swarm-v1\x00default")[:8]
    assert SwarmScope("default").tag == DEFAULT_SCOPE.tag == "1482f9062c080a9e"
    assert SwarmScope("Smith-House").tag == SwarmScope("smith-house").tag
    assert SwarmScope("Smith-House").name == "smith-house"
    assert BLUE.tag != RED.tag and len(BLUE.tag) == 16
    assert BLUE.dht_protocol == f"/meshd/kad/{BLUE.tag}/1.0.0" != RED.dht_protocol
    assert BLUE.dht_protocol != "/ipfs/kad/1.0.0"
    assert BLUE.mdns_prefix == f"meshd-{BLUE.tag}-"
    # an instance name of the longest random part still fits one DNS label (63 bytes)
    assert len(BLUE.mdns_prefix) + 24 <= 63


@pytest.mark.parametrize("bad", ["", " ", "two words", "-lead", "x" * 65, "ünï", "a/b", "a:b"])
def test_a_swarm_name_we_cannot_use_is_refused_with_what_to_type(bad):
    with pytest.raises(SwarmNameInvalid, match="letters, digits"):
        SwarmScope(bad)


def test_the_config_takes_the_swarm_name_and_the_mdns_switch(tmp_path):
    from meshd.config import load_config
    from meshd.errors import ConfigError

    path = tmp_path / "c.toml"
    path.write_text('swarm = "Blue"\nmdns = false\n')
    config = load_config(path)
    assert config.swarm == "blue" and config.scope == BLUE and config.mdns is False
    assert load_config(None).swarm == "default" and load_config(None).mdns is True
    assert load_config(path, {"swarm": "red", "mdns": True}).scope == RED    # flags win
    with pytest.raises(ConfigError, match="swarm name"):
        load_config(None, {"swarm": "no spaces please"})
    path.write_text('mdns = "yes"\n')
    with pytest.raises(ConfigError, match="mdns must be true or false"):
        load_config(path)


# ------------------------------------------------------------------ names

def test_only_our_swarms_instances_are_resolved():
    assert classify_name(name(BLUE), SERVICE_TYPE, BLUE.mdns_prefix) == C.OURS
    assert classify_name(name(RED), SERVICE_TYPE, BLUE.mdns_prefix) == C.OTHER_SWARM
    assert classify_name("abcdef0123." + SERVICE_TYPE, SERVICE_TYPE, BLUE.mdns_prefix) == C.NOT_MESHD  # kubo
    assert classify_name(BLUE.mdns_prefix + "." + SERVICE_TYPE, SERVICE_TYPE, BLUE.mdns_prefix) == C.OTHER_SWARM
    assert classify_name(name(BLUE).replace("_p2p", "_http"), SERVICE_TYPE, BLUE.mdns_prefix) == C.BAD_NAME
    table = MdnsPeers(ME, BLUE.mdns_prefix, SERVICE_TYPE)
    assert table.seen(name(BLUE)) and not table.seen(name(RED)) and not table.seen("kubo1." + SERVICE_TYPE)
    assert table.snapshot()["ignored"] == {"not_meshd": 1, "other_swarm": 1}
    table.removed(name(RED))                    # its goodbye
    assert table.snapshot()["ignored"] == {"not_meshd": 1}


# ------------------------------------------------------------------ announcements

def test_a_good_announcement_names_one_peer_and_its_lan_addresses():
    got = parse_announcement(txt(f"/ip4/192.168.1.7/tcp/4001/p2p/{PEER}", f"/ip4/10.9.9.9/tcp/4001/p2p/{PEER}",
                                 f"/ip4/192.168.1.7/udp/4001/quic-v1/p2p/{PEER}"), networks=LAN, me=ME)
    # the address outside our LAN and the transport we do not dial are left out
    assert got == Announcement(PEER, ("/ip4/192.168.1.7/tcp/4001",))


@pytest.mark.parametrize("props, reason", [
    (txt(f"/ip4/192.168.1.7/tcp/4001/p2p/{PEER}", f"/ip4/192.168.1.8/tcp/4001/p2p/{OTHER}"), "bad_record"),
    (txt(f"/ip4/8.8.8.8/tcp/4001/p2p/{PEER}"), "off_lan"),        # a LAN announcement cannot point outside
    (txt(f"/ip4/192.168.1.7/tcp/4001/p2p/{ME}"), "self"),
    (txt(f"/ip4/192.168.1.7/tcp/4001/p2p/{PEER[:-4]}"), "bad_record"),    # its length byte disagrees
    (txt("/ip4/192.168.1.7/tcp/4001/p2p/0OIl"), "bad_record"),   # not base58
    (txt(f"/ip4/192.168.1.7/tcp/0/p2p/{PEER}"), "bad_record"),
    (txt(f"/ip4/192.168.1.7/tcp/99999/p2p/{PEER}"), "bad_record"),
    (txt(f"/ip4/0.0.0.0/tcp/4001/p2p/{PEER}"), "bad_record"),   # a wildcard is not an address to dial
    (txt(f"/ip4/192.168.1.7/tcp/4001/p2p/{PEER}" + "/x" * 200), "bad_record"),
    ({b"dnsaddr": None}, "bad_record"),
    ({b"id": PEER.encode()}, "bad_record"),                       # the legacy form: no address
    ({}, "bad_record"),
])
def test_an_announcement_that_is_not_a_peer_to_dial_says_why(props, reason):
    assert parse_announcement(props, networks=LAN, me=ME) == Rejected(reason)


def test_an_announcement_is_read_within_its_bounds():
    many = txt(*(f"/ip4/192.168.1.{i}/tcp/4001/p2p/{PEER}" for i in range(1, 100)))
    got = parse_announcement(many, networks=LAN, me=ME)
    assert isinstance(got, Announcement) and len(got.addrs) == C.MAX_PEER_ADDRS
    # entries past MAX_TXT_ENTRIES are not read at all
    late = {**{f"k{i}".encode(): b"v" for i in range(C.MAX_TXT_ENTRIES)}, **txt(f"/ip4/192.168.1.7/tcp/1/p2p/{PEER}")}
    assert parse_announcement(late, networks=LAN, me=ME) == Rejected("bad_record")


def test_real_peer_ids_pass_the_shape_check():
    from libp2p.crypto.secp256k1 import create_new_key_pair
    from libp2p.peer.id import ID

    assert valid_peer_id(PEER)                                                       # Ed25519: identity multihash
    assert valid_peer_id(ID.from_pubkey(create_new_key_pair().public_key).to_base58())  # secp256k1: identity too
    assert valid_peer_id("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")          # sha2-256 (RSA-era ids)
    assert not valid_peer_id("") and not valid_peer_id("1" * 200)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.one_of(st.binary(max_size=12), st.sampled_from([b"dnsaddr", b"dnsaddr2", b"dnsaddr3"]),
                                 st.text(max_size=4)),
                       st.one_of(st.none(), st.binary(max_size=300), st.text(max_size=40),
                                 st.builds(lambda ip, port, pid: f"/ip4/{ip}/tcp/{port}/p2p/{pid}".encode(),
                                           st.ip_addresses(v=4), st.integers(-5, 70000),
                                           st.sampled_from([PEER, OTHER, ME, "x", ""]))),
                       max_size=40))
def test_any_txt_record_gives_a_peer_or_a_reason_never_an_exception(props):
    got = parse_announcement(props, networks=LAN, me=ME)
    assert isinstance(got, (Announcement, Rejected))
    if isinstance(got, Announcement):
        assert got.peer_id != ME and 0 < len(got.addrs) <= C.MAX_PEER_ADDRS
        assert all(ipaddress.IPv4Address(a.split("/")[2]) in LAN[0] for a in got.addrs)


# ------------------------------------------------------------------ whom to dial when

def _found(table: MdnsPeers, peer: str, now: float, suffix: str = "a" * 24):
    got = table.resolved(name(BLUE, suffix), txt(f"/ip4/192.168.1.7/tcp/4001/p2p/{peer}"), LAN, now)
    assert not isinstance(got, Rejected)
    return got


def test_the_smaller_peer_id_dials_at_once_the_larger_waits_for_it():
    lo, hi = sorted([ME, PEER])
    first = MdnsPeers(lo, BLUE.mdns_prefix, SERVICE_TYPE)
    _found(first, hi, now=100.0)
    assert [p.peer_id for p in first.due(100.0, connected=set())] == [hi]
    second = MdnsPeers(hi, BLUE.mdns_prefix, SERVICE_TYPE)
    _found(second, lo, now=100.0)
    assert second.due(100.0, set()) == [] and second.next_due() == 100.0 + C.DIAL_DEFER_S
    # the smaller one dialed meanwhile: nothing to do
    assert second.due(100.0 + C.DIAL_DEFER_S, connected={lo}) == []
    assert second.peers[lo].state == "connected"


def test_a_failed_dial_backs_off_and_a_fresh_announcement_retries_at_once():
    table = MdnsPeers("1", BLUE.mdns_prefix, SERVICE_TYPE)      # "1" sorts before every peer id
    _found(table, PEER, now=0.0)
    now = 0.0
    for wait in C.DIAL_BACKOFF_S + (C.DIAL_BACKOFF_S[-1],):
        (peer,) = table.due(now, set())
        assert peer.state == "dialing" and table.due(now, set()) == []      # one dial at a time
        table.dialed(PEER, False, now, "ConnectionRefused")
        assert table.peers[PEER].next_dial == now + wait and table.due(now + wait - 0.01, set()) == []
        now += wait
    table.peers[PEER].state = "failed"
    _found(table, PEER, now=now + 0.5, suffix="b" * 24)     # it restarted: a new instance, same peer
    assert table.peers[PEER].attempts == 0 and [p.peer_id for p in table.due(now + 0.5, set())] == [PEER]


def test_a_lost_connection_is_redialed_and_a_goodbye_forgets_the_peer():
    table = MdnsPeers("1", BLUE.mdns_prefix, SERVICE_TYPE)
    _found(table, PEER, now=0.0)
    (peer,) = table.due(0.0, set())
    table.dialed(PEER, True, 0.1)
    assert table.due(1.0, {PEER}) == [] and table.peers[PEER].state == "connected"
    assert table.due(2.0, set()) == []                           # gone: redialed after a pause
    assert [p.peer_id for p in table.due(2.0 + C.REDIAL_AFTER_DROP_S, set())] == [PEER]
    table.removed(name(BLUE, "a" * 24))
    assert table.peers == {} and table.due(100.0, set()) == []
    table.dialed(PEER, True, 101.0)                              # a dial that ends after the goodbye


def test_the_peer_table_is_bounded():
    table = MdnsPeers("1", BLUE.mdns_prefix, SERVICE_TYPE, max_peers=2)
    for i in range(4, 8):
        table.resolved(name(BLUE, f"{i:024d}"), txt(f"/ip4/192.168.1.{i}/tcp/1/p2p/{identity(i).peer_id}"), LAN, 0.0)
    assert len(table.peers) == 2 and table.snapshot()["ignored"] == {"table_full": 2}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["seen", "resolved", "removed", "due", "ok", "fail"]),
                          st.integers(0, 5), st.floats(0, 50)), max_size=60))
def test_any_sequence_of_events_keeps_the_table_consistent(events):
    ids = [identity(i).peer_id for i in range(10, 16)]
    table = MdnsPeers(ME, BLUE.mdns_prefix, SERVICE_TYPE, max_peers=4)
    now = 0.0
    for kind, i, dt in events:
        now += dt
        n = name(BLUE, f"{i:024d}")
        if kind == "seen":
            table.seen(n)
        elif kind == "resolved":
            table.resolved(n, txt(f"/ip4/192.168.1.9/tcp/4001/p2p/{ids[i]}"), LAN, now)
        elif kind == "removed":
            table.removed(n)
        elif kind == "due":
            for peer in table.due(now, set(ids[:i])):
                assert peer.state == "dialing"
        else:
            table.dialed(ids[i], kind == "ok", now, "x")
        assert len(table.peers) <= 4 and len(table.ignored) <= C.MAX_IGNORED
        assert all(p.state in ("found", "dialing", "connected", "failed") for p in table.peers.values())
        assert all(p.next_dial >= 0 for p in table.peers.values())
    table.snapshot()


# ------------------------------------------------------------------ interfaces and announced addresses

ETH = IfaceAddr("eth0", "192.168.1.5", 24)
DOCKER = IfaceAddr("docker0", "172.17.0.1", 16)
LO = IfaceAddr("lo", "127.0.0.1", 8)
PUBLIC = IfaceAddr("wan0", "81.2.69.160", 24)


def test_mdns_runs_only_on_the_interfaces_we_listen_on():
    assert mdns_interfaces(["0.0.0.0"], [LO, ETH, DOCKER]) == [ETH, DOCKER]
    assert mdns_interfaces(["192.168.1.5"], [LO, ETH, DOCKER]) == [ETH]
    assert mdns_interfaces(["127.0.0.1"], [LO, ETH]) == []          # loopback: no LAN, no mDNS
    assert mdns_interfaces(["10.0.0.1"], [LO, ETH]) == []
    listen = ["/ip4/0.0.0.0/tcp/4001/p2p/X", "/ip6/::/tcp/4001", "/ip4/127.0.0.1/tcp/9"]
    assert announced_addrs(listen, [ETH, DOCKER]) == ["/ip4/192.168.1.5/tcp/4001", "/ip4/172.17.0.1/tcp/4001"]
    assert announced_addrs(["/ip4/192.168.1.5/tcp/5000"], [ETH]) == ["/ip4/192.168.1.5/tcp/5000"]
    assert announced_addrs(["/ip4/127.0.0.1/tcp/5000"], [ETH]) == []


def test_a_wildcard_listener_offers_its_lan_address():
    routes = ("Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
              "docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n"
              "eth0\t00000000\t0101A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n")
    assert default_route_iface(routes) == "eth0" and default_route_iface("") is None
    assert pick_advertise_host([LO, DOCKER, ETH], "eth0") == "192.168.1.5"          # the default route's
    assert pick_advertise_host([LO, PUBLIC, DOCKER], None) == "172.17.0.1"            # else a private one
    assert pick_advertise_host([LO, PUBLIC], None) == "81.2.69.160"
    assert pick_advertise_host([LO], None) is None
    with pytest.raises(ValueError):
        IfaceAddr("x", "not-an-ip", 24)


# ------------------------------------------------------------------ the library's broadcaster, adjusted

def test_the_adjusted_broadcaster_announces_the_spec_txt_and_our_interfaces():
    kwargs = dict(zeroconf=None, service_type=SERVICE_TYPE, service_name=name(BLUE), peer_id=PEER, port=4001,
                  listen_addrs=["/ip4/192.168.1.5/tcp/4001", "/ip4/172.17.0.1/tcp/4001"], host=None)
    adjusted, off = mdns_broadcaster.broadcaster(TESTED_LIBP2P_VERSION, ["192.168.1.5", "172.17.0.1"], **kwargs)
    assert off is None and type(adjusted).__name__ == "MeshdBroadcaster"
    info = adjusted.service_info
    assert info.properties == {b"dnsaddr": f"/ip4/192.168.1.5/tcp/4001/p2p/{PEER}".encode(),
                               b"dnsaddr2": f"/ip4/172.17.0.1/tcp/4001/p2p/{PEER}".encode()}
    assert sorted(info.parsed_addresses()) == ["172.17.0.1", "192.168.1.5"]
    # our own parser reads what the library writes
    assert parse_announcement(info.properties, networks=[ETH.network, DOCKER.network], me=ME) == Announcement(
        PEER, ("/ip4/192.168.1.5/tcp/4001", "/ip4/172.17.0.1/tcp/4001"))
    library, off = mdns_broadcaster.broadcaster("0.9.0", ["192.168.1.5"], **kwargs)
    assert off.startswith("off: libp2p 0.9.0 is installed") and type(library).__name__ == "PeerBroadcaster"
    assert library.service_info.properties == info.properties      # the TXT entries libp2p peers read


# ------------------------------------------------------------------ the edge, where no LAN is; the status lines

def test_a_node_on_loopback_runs_no_mdns_and_says_why():
    import trio

    from dht.host.build import build_host
    from dht.host.mdns import MdnsDiscovery

    async def main():
        with trio.fail_after(30):
            mdns = MdnsDiscovery(build_host(identity(9)), BLUE, listen_addrs=["/ip4/127.0.0.1/tcp/4001/p2p/X"],
                                 ifaces=[LO, ETH])
            async with trio.open_nursery() as nursery:
                await nursery.start(mdns.run)          # returns at once: nothing was opened
            return mdns.status()

    got = trio.run(main)
    assert got["state"] == "off" and "loopback only" in got["reason"] and got["announced"] == []


def test_the_status_shows_the_swarm_its_mdns_and_foreign_peers():
    from meshd.cli.status_view import render_discovery

    lines = render_discovery({
        "swarm": BLUE.status(),
        "mdns": {"state": "on", "interfaces": ["eth0 192.168.1.5/24"], "instance": "meshd-x-y",
                 "peers": [{"peer_id": PEER, "addrs": ["/ip4/192.168.1.7/tcp/4001"], "state": "connected",
                            "attempts": 0, "last_error": ""}],
                 "ignored": {"not_meshd": 3, "other_swarm": 1}},
        "foreign_peers": [OTHER]})
    text = "\n".join(lines)
    assert f"swarm      blue (tag {BLUE.tag}, DHT {BLUE.dht_protocol})" in text
    assert "mdns       on eth0 192.168.1.5/24 as meshd-x-y: 1 peers of this swarm found (1 connected)" in text
    assert "3 not meshd, 1 other swarm" in text and "1 connected peers of other swarms" in text
    off = render_discovery({"swarm": BLUE.status(), "mdns": {"state": "off", "reason": "off: --no-mdns"},
                            "foreign_peers": []})
    assert off[1] == "mdns       off: --no-mdns"
