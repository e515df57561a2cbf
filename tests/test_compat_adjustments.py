"""py-libp2p adjustments (dht/compat/): applied by the host builder, gated on the version, reported.

What a fresh process does is checked in a fresh process (the patches are process-wide):
importing ``dht.compat`` or ``relay`` changes nothing, another version string leaves the
library alone, MESHD_LIBP2P_FASTPATH=0 and a user's PY_YAMUX_RELEASE_ON_READ are honoured."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import trio
from libp2p.stream_muxer.yamux.yamux import YamuxStream

from dht.compat import inbound_limits, lean_datapath, no_auto_connect, peer_record_gc, release_on_read, yamux_window
from dht.compat import registry as A
from dht.compat.gate import TESTED_LIBP2P_VERSION, gate
from meshd.cli.status_view import render_status
from meshd.daemon.relay_mode import render_relay_status
from meshd.reach.direct_upgrade import DCUTR_POLICY, DirectUpgrader, apply_dcutr_policy, dcutr_policy_check
from tests._relay_helpers import LOOPBACK, REPO_ROOT, info, new_host

CHILD_TIMEOUT_S = 120
DATA_PATH = {"yamux_release_on_read", "yamux_window_batching", "libp2p_fastpath", "inbound_limits", "dial_head_start",
             "no_auto_connect", "peer_record_gc"}

# Run in a child: ``report()`` prints what the library looks like and what the registry says.
PROBE = r"""
import json, os, sys

def report():
    from libp2p.io.trio import TrioTCPStream
    from libp2p.stream_muxer.yamux import yamux as Y
    from libp2p.network.auto_connector import AutoConnector
    from libp2p.network.swarm import Swarm
    from libp2p.peer.peerstore import PeerStore
    from dht.compat import registry as A
    print(json.dumps({{
        "registry": A.snapshot(),
        "yamux_patched": Y.YamuxStream._auto_tune_and_send_window_update.__module__ != Y.__name__,
        "tcp_read_patched": TrioTCPStream.read.__module__ != "libp2p.io.trio",
        "write_patched": Y.YamuxStream.write.__module__ != Y.__name__,
        "inbound_patched": Swarm._handle_inbound_connection.__module__ != "libp2p.network.swarm",
        "auto_connect_patched": AutoConnector.maybe_connect.__module__ != "libp2p.network.auto_connector",
        "peerstore_patched": PeerStore.maybe_delete_peer_record.__module__ != "libp2p.peer.peerstore",
        "release_env": os.environ.get("PY_YAMUX_RELEASE_ON_READ"),
    }}))

{setup}
report()
"""
BUILD_A_HOST = ("import os; from dht.host.build import build_host; from dht.identity import Identity; "
                "build_host(Identity.from_seed(os.urandom(32)))")


def _children(setup: str, **env_extra: str) -> list[dict]:
    """Every ``report()`` of a child running ``setup`` (and one more at its end)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MESHD_LIBP2P_FASTPATH", "MESHD_INBOUND_LIMITS",
                                                      no_auto_connect.DISABLE_ENV, peer_record_gc.DISABLE_ENV,
                                                      release_on_read.ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup)], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.strip().splitlines() if line.startswith("{")]


def _child(setup: str, **env_extra: str) -> dict:
    return _children(setup, **env_extra)[-1]


def _by_name(rows: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in rows}


def test_building_a_host_turns_every_data_path_adjustment_on_for_the_tested_version():
    new_host()
    rows = _by_name(A.snapshot())
    assert DATA_PATH <= set(rows)
    for name in DATA_PATH:
        assert rows[name]["applied"], rows[name]
        assert rows[name]["library_version"] == TESTED_LIBP2P_VERSION == "0.8.1"
        assert rows[name]["reason"].startswith("on: libp2p 0.8.1")
    assert yamux_window.APPLIED and lean_datapath.APPLIED and release_on_read.APPLIED
    assert YamuxStream._auto_tune_and_send_window_update is yamux_window._batched_window_update
    assert os.environ[release_on_read.ENV] == "0"
    # a second build (another host in the same process) keeps them on and changes nothing
    new_host()
    assert _by_name(A.snapshot()) == rows


def test_the_gates_refuse_any_other_version_and_say_which():
    assert gate("0.8.1") is None
    for other in ("0.8.2", "0.9.0", "0.8.1rc1"):
        for reason in (gate(other), yamux_window.check(other), lean_datapath.check(other),
                       inbound_limits.check(other), release_on_read.check(other), dcutr_policy_check(other)):
            assert reason is not None and reason.startswith("off:") and other in reason and "0.8.1" in reason
    assert gate("") == "off: py-libp2p is not installed"
    assert dcutr_policy_check("0.8.1") is None and yamux_window.check("0.8.1") is None


def test_one_tested_version_and_the_package_pin_name_the_same_release():
    import tomllib

    pins = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"libp2p=={TESTED_LIBP2P_VERSION}" in pins


def test_a_dht_node_records_its_own_adjustments():
    from dht.node import DhtNode

    DhtNode(new_host(), lambda: 0)
    rows = _by_name(A.snapshot())
    for name in ("dht_inbound_handlers", "dht_maintenance"):
        assert rows[name]["applied"] and rows[name]["reason"].startswith("on: libp2p 0.8.1"), rows[name]
    assert rows["dht_inbound_handlers"]["reason"].endswith("(64 streams)")


def test_importing_compat_or_relay_applies_nothing_and_building_a_host_applies_them():
    imported, built = _children("import relay, relay.transport, dht.host, dht.host.build, dht.compat, "
                                "dht.compat.registry, "
                                "dht.compat.lean_datapath, dht.compat.yamux_window, dht.node, "
                                "meshd.reach.direct_upgrade, meshd.daemon.node; report(); " + BUILD_A_HOST)
    assert imported == {"registry": [], "yamux_patched": False, "tcp_read_patched": False,
                        "write_patched": False, "inbound_patched": False, "auto_connect_patched": False,
                        "peerstore_patched": False, "release_env": None}
    assert built["yamux_patched"] and built["tcp_read_patched"] and built["write_patched"]
    assert built["inbound_patched"] and built["auto_connect_patched"] and built["peerstore_patched"]
    assert built["release_env"] == "0"
    assert {r["name"]: r["applied"] for r in built["registry"]} == dict.fromkeys(DATA_PATH, True)


def test_another_version_leaves_the_library_untouched_and_the_registry_says_why():
    got = _child("from dht.compat.registry import apply_libp2p_adjustments as go; go('0.9.3'); "
                 "from meshd.reach.direct_upgrade import apply_dcutr_policy; apply_dcutr_policy('0.9.3')")
    assert not (got["yamux_patched"] or got["tcp_read_patched"] or got["write_patched"] or got["inbound_patched"]
                or got["auto_connect_patched"] or got["peerstore_patched"])
    assert got["release_env"] is None
    rows = _by_name(got["registry"])
    assert set(rows) == DATA_PATH | {DCUTR_POLICY}
    for row in rows.values():
        assert not row["applied"] and row["library_version"] == "0.9.3"
        assert "off: libp2p 0.9.3 is installed, written for 0.8.1 only" in row["reason"]
    assert "direct upgrades disabled" in rows[DCUTR_POLICY]["reason"]


def test_the_lean_data_path_switch_and_a_users_yamux_knob_are_honoured():
    got = _child(BUILD_A_HOST, MESHD_LIBP2P_FASTPATH="0", PY_YAMUX_RELEASE_ON_READ="1")
    rows = _by_name(got["registry"])
    assert not got["tcp_read_patched"] and not got["write_patched"] and got["yamux_patched"]
    assert rows["libp2p_fastpath"] == {"name": "libp2p_fastpath", "applied": False,
                                       "reason": "off: MESHD_LIBP2P_FASTPATH=0", "library_version": "0.8.1"}
    assert got["release_env"] == "1" and not rows["yamux_release_on_read"]["applied"]
    assert "PY_YAMUX_RELEASE_ON_READ=1 set by the user" in rows["yamux_release_on_read"]["reason"]
    assert rows["yamux_window_batching"]["applied"]
    inherited = _by_name(_child(BUILD_A_HOST, PY_YAMUX_RELEASE_ON_READ="0")["registry"])["yamux_release_on_read"]
    assert inherited["applied"] and "already in the environment" in inherited["reason"]   # e.g. from a meshd parent


def test_the_upgrader_records_the_dcutr_policy_and_off_means_no_dcutr_service():
    async def main():
        host = new_host()
        async with host.run(LOOPBACK):
            upgrader = DirectUpgrader(host)
            async with trio.open_nursery() as nursery:
                await nursery.start(upgrader.run)
                assert upgrader.adjustment.applied and upgrader.snapshot()["enabled"]
                assert "/libp2p/dcutr" in [str(p) for p in host.get_mux().get_protocols()]
                nursery.cancel_scope.cancel()
            off = DirectUpgrader(host, libp2p_version="0.9.0")
            async with trio.open_nursery() as nursery:
                await nursery.start(off.run)
                assert not off.adjustment.applied and not off.snapshot()["enabled"]
                assert off.request(host.get_id().to_base58()) is False      # nothing is queued
                nursery.cancel_scope.cancel()

    trio.run(main)
    row = _by_name(A.snapshot())[DCUTR_POLICY]
    assert row["applied"] and row["reason"] == "on: libp2p 0.8.1, the version it was written for"
    assert not apply_dcutr_policy("0.9.0").applied
    assert _by_name(A.snapshot())[DCUTR_POLICY] == row    # once on in this process, the registry says on


def test_status_views_show_each_adjustment_and_why():
    new_host()
    status = A.library_status()
    lines = A.render_library(status)
    assert lines[0].startswith("libp2p     0.8.1 (") and "adjustments on)" in lines[0]
    assert any(line.split()[:2] == ["on", "libp2p_fastpath"] for line in lines[1:])
    off = {"version": "0.9.0", "adjustments": [{"name": "libp2p_fastpath", "applied": False,
                                                "reason": "off: libp2p 0.9.0 is installed, written for 0.8.1 only",
                                                "library_version": "0.9.0"}]}
    assert A.render_library(off) == ["libp2p     0.9.0 (0 of 1 adjustments on)",
                                     "  off  libp2p_fastpath  off: libp2p 0.9.0 is installed, written for 0.8.1 only"]
    daemon = {"peer_id": "p", "addresses": [], "peers": [], "routing_table": 0, "coverage": {},
              "own": {"layers": None}, "worker": {"state": "none"}, "libp2p": off}
    assert "off  libp2p_fastpath  off: libp2p 0.9.0" in render_status(daemon)
    relay = {"peer_id": "r", "addrs": [], "dht_routing_table": 0, "announced": None, "libp2p": off,
             "relay": {"circuits_refused": {}, "peers_connected": 0, "reservations_active": 0,
                       "circuits_active": 0, "circuits_opened": 0, "bytes_forwarded": 0,
                       "limits": {"reservations_total": 1, "circuits_total": 1}}}
    assert "off  libp2p_fastpath  off: libp2p 0.9.0" in render_relay_status(relay)


def test_the_inbound_limits_switch_is_honoured():
    got = _child(BUILD_A_HOST, MESHD_INBOUND_LIMITS="0")
    rows = _by_name(got["registry"])
    assert not got["inbound_patched"] and got["yamux_patched"]
    assert rows["inbound_limits"] == {"name": "inbound_limits", "applied": False,
                                      "reason": "off: MESHD_INBOUND_LIMITS=0", "library_version": "0.8.1"}



def test_dial_head_start_is_off_after_the_adjustments_and_back_on_restore():
    """py-libp2p 0.8.1 waits 250 ms after starting even a successful dial (dht/compat/dial_head_start.py)."""
    from libp2p.network import swarm as S

    from dht.compat import dial_head_start

    assert dial_head_start.check("0.7.0").startswith("off:")
    A.apply_libp2p_adjustments()
    assert dial_head_start.APPLIED and S._HAPPY_EYEBALLS_DELAY == 0.0
    assert {r["name"]: r for r in A.snapshot()}["dial_head_start"]["applied"]
    dial_head_start.restore()
    try:
        assert S._HAPPY_EYEBALLS_DELAY == dial_head_start.LIBRARY_DELAY_S
    finally:
        assert dial_head_start.apply()


def test_no_auto_connect_stops_the_library_dialing_its_peerstore_and_restore_brings_it_back():
    """py-libp2p 0.8.1's AutoConnector dials peers it merely heard of (dht/compat/no_auto_connect.py).

    Two real hosts: ``a`` knows ``b``'s address (as a DHT answer leaves it in the
    peerstore). With the adjustment ``a``'s auto-connect pass dials nobody; with the
    library's methods restored the same pass connects to ``b`` -- what is switched off."""
    from libp2p.network.auto_connector import AutoConnector

    for other in ("0.7.0", "0.8.2", ""):
        assert no_auto_connect.check(other).startswith("off:")
    A.apply_libp2p_adjustments()
    assert no_auto_connect.APPLIED and _by_name(A.snapshot())["no_auto_connect"]["applied"]
    assert AutoConnector.maybe_connect is no_auto_connect._no_connect

    async def main() -> tuple[bool, bool]:
        a, b = new_host(), new_host()
        async with a.run(LOOPBACK), b.run(LOOPBACK):
            a.get_peerstore().add_addrs(b.get_id(), info(b).addrs, 600)
            connector = a.get_network().auto_connector
            await connector.maybe_connect()
            quiet = b.get_id() not in a.get_network().connections
            no_auto_connect.restore()
            try:
                with trio.move_on_after(CHILD_TIMEOUT_S):
                    await connector.maybe_connect()
                dialed = b.get_id() in a.get_network().connections
            finally:
                assert no_auto_connect.apply()
            return quiet, dialed

    quiet, dialed = trio.run(main)
    assert quiet and dialed
    assert AutoConnector.maybe_connect is no_auto_connect._no_connect


def test_the_no_auto_connect_switch_is_honoured():
    got = _child(BUILD_A_HOST, MESHD_NO_AUTO_CONNECT="0")
    rows = _by_name(got["registry"])
    assert not got["auto_connect_patched"] and got["inbound_patched"]
    assert rows["no_auto_connect"] == {"name": "no_auto_connect", "applied": False,
                                       "reason": "off: MESHD_NO_AUTO_CONNECT=0", "library_version": "0.8.1"}


def test_the_peer_record_gc_gate_and_switch_are_honoured():
    for other in ("0.7.0", "0.8.2", ""):
        assert peer_record_gc.check(other).startswith("off:")
    got = _child(BUILD_A_HOST, MESHD_PEER_RECORD_GC="0")
    rows = _by_name(got["registry"])
    assert not got["peerstore_patched"] and got["auto_connect_patched"]
    assert rows["peer_record_gc"] == {"name": "peer_record_gc", "applied": False,
                                      "reason": "off: MESHD_PEER_RECORD_GC=0", "library_version": "0.8.1"}


def test_the_shared_library_gate_names_what_keeps_an_adjustment_off(monkeypatch):
    swarm = {"module": "libp2p.network.swarm", "what": "swarm", "owner": "Swarm"}
    assert gate(TESTED_LIBP2P_VERSION, **swarm, needs=("upgrade_inbound_raw_conn",)) is None
    assert gate(TESTED_LIBP2P_VERSION, **swarm, needs=("no_such_method",)) == \
        "off: the library's Swarm has no no_such_method"
    assert gate(TESTED_LIBP2P_VERSION, module="libp2p.network.swarm", what="swarm", owner="NoSuchClass") == \
        "off: libp2p's swarm has no NoSuchClass"
    assert gate(TESTED_LIBP2P_VERSION, module="libp2p.no_such_module", what="nothing").startswith(
        "off: cannot import libp2p's nothing")
    assert gate("", **swarm) == "off: py-libp2p is not installed"
    monkeypatch.setenv("MESHD_SOME_ADJUSTMENT", "0")
    assert gate(TESTED_LIBP2P_VERSION, **swarm, disable_env="MESHD_SOME_ADJUSTMENT") == "off: MESHD_SOME_ADJUSTMENT=0"
    monkeypatch.setenv("MESHD_SOME_ADJUSTMENT", "1")
    assert gate(TESTED_LIBP2P_VERSION, **swarm, disable_env="MESHD_SOME_ADJUSTMENT") is None
