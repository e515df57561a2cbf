"""`meshd relay` as a real subprocess: peers reserve, relay frames through it, `meshd status` counts."""
from __future__ import annotations

import json
import subprocess
import sys

import multiaddr
import trio
from libp2p.peer.peerinfo import info_from_p2p_addr

from relay.client import dial_relayed, relayed_addrs, reserve, stop_service
from relay.transport import RelayedSessionServer, open_session_channel
from tests._relay_helpers import ECHO_PREFIX, LOOPBACK, echo_worker, new_host, relay_process, subprocess_env
from tests.conftest import wait_until


def status(data_dir) -> dict:
    out = subprocess.run([sys.executable, "-m", "meshd", "status", "--json", "--data-dir", str(data_dir)],
                         env=subprocess_env(), capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_meshd_relay_relays_and_counts(tmp_path):
    with echo_worker() as target, relay_process(tmp_path / "relay") as ready:
        relay_info = info_from_p2p_addr(multiaddr.Multiaddr(ready["addrs"][0]))

        async def main():
            home, dialer = new_host(), new_host()
            async with home.run(LOOPBACK), dialer.run(LOOPBACK), stop_service(home):
                reservation = await reserve(home, relay_info)
                addrs = relayed_addrs(reservation, home.get_id().to_base58())
                assert addrs == (f"{ready['addrs'][0]}/p2p-circuit/p2p/{home.get_id()}",)
                server = RelayedSessionServer(target)
                server.attach(home)
                try:
                    await dial_relayed(dialer, relay_info, home.get_id())
                    channel = await open_session_channel(dialer, home.get_id())
                    for body in (b"one", b"two" * 1000):
                        await channel.send(body)
                        assert await channel.receive() == ECHO_PREFIX + body
                    s = await trio.to_thread.run_sync(status, tmp_path / "relay")
                    assert s["mode"] == "relay" and s["peer_id"] == ready["peer_id"]
                    r = s["relay"]
                    assert r["reservations_active"] == 1 and r["circuits_active"] == 1
                    assert r["circuits_opened"] == 1 and r["bytes_forwarded"] > 6000
                    # relay mode builds its host through the host builder: the data-path patches are on
                    on = {a["name"]: a["applied"] for a in s["libp2p"]["adjustments"]}
                    assert on == {"libp2p_fastpath": True, "yamux_release_on_read": True, "inbound_limits": True,
                                  "yamux_window_batching": True, "dial_head_start": True,
                                  "no_auto_connect": True, "peer_record_gc": True,
                                  "dht_inbound_handlers": True, "dht_maintenance": True}, s["libp2p"]
                finally:
                    server.close()
                for host in (dialer, home):     # host.run leaves connections open (dht/host/build.py)
                    await host.get_network().close()
            # both ends stopped: the relay's circuit ends with them and status says so
            def released() -> bool:
                r = status(tmp_path / "relay")["relay"]
                return r["circuits_active"] == 0 and r["circuits_closed"] == 1

            await wait_until(lambda: trio.to_thread.run_sync(released), 30, "the relay releasing the circuit")
            text = await trio.to_thread.run_sync(lambda: subprocess.run(
                [sys.executable, "-m", "meshd", "status", "--data-dir", str(tmp_path / "relay")],
                env=subprocess_env(), capture_output=True, text=True, timeout=60).stdout)
            assert "0 active" in text and "1 opened, 1 closed (" in text, text

        trio.run(main)
    human = subprocess.run([sys.executable, "-m", "meshd", "status", "--data-dir", str(tmp_path / "relay")],
                           env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert human.returncode != 0   # the relay stopped: one clear error line
