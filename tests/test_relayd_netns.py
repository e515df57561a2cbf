"""REAL daemons under real NAT: `meshd relay` + `meshd join` in network namespaces.

Topology (tests/_netns.py): "public" runs `meshd relay` and a public daemon
(the bootstrap peer, serving the tail layers [4, 6)); home1 runs a daemon for
the middle layers [2, 4) with `--reachability auto`; home2 runs the entry
daemon for [0, 2). Both homes drop new inbound connections (nftables,
conntrack lets replies through). Checks:
  * the NAT is real: new TCP connections to home1's daemon port fail from
    home2 and from public, while home2 reaches the relay;
  * home1's dial-back probe concludes "private"; it finds the relay (DHT),
    reserves, and advertises only its relayed address;
  * generation through the entry daemon's control API equals the whole
    model's greedy tokens, and the route's middle hop is home1;
  * what the public namespace carried does not contain the middle hop's
    activation bytes; the probe bytes are checked to be inside the frame the
    head worker's own serializer makes for this prompt (the daemon's hops
    accept no compression), so in clear they would show. (The entry reaches
    its own worker over a Unix socket, so no loopback capture sees them.)
  * the entry's background DCUtR upgrade to home1 ends (hole punching through
    both firewalls may or may not work: the outcome is printed), and a second
    generation equals the whole model either way, on the same route.
If namespaces cannot be created the test FAILS and says why.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshd.benchmarks import relay_harness as H
from meshd.daemon.control import request as control_request
from meshd.daemon.local_swarm import REPO_ROOT, LocalDaemon, child_env, wait_for
from tests._netns import NetnsUnavailable, new_topology, start_capture, stop_capture, tcp_connects

pytestmark = pytest.mark.netns

START_TIMEOUT_S = 300
RECORD_TTL_S = 20.0
PROMPT = "behind the home router the middle layers still answer"
NEW_TOKENS = 16
PROBE_BYTES = 32


class NsDaemon(LocalDaemon):
    """``meshd join`` inside a namespace, listening on one given address."""

    def __init__(self, root: Path, name: str, model: Path, *, prefix: list[str], listen: str, layers: str,
                 bootstrap: list[str], extra: tuple[str, ...] = ()) -> None:
        self.name = name
        self.data_dir = root / name
        self.log = root / f"{name}.log"
        args = [*prefix, sys.executable, "-m", "meshd", "join", "--model", str(model), "--layers", layers,
                "--listen", listen, "--data-dir", str(self.data_dir), "--record-ttl", str(RECORD_TTL_S),
                "--reachability", "auto", *(["--bootstrap", *bootstrap] if bootstrap else []),
                "--no-mdns", *extra]   # the homes sit behind NAT, on no LAN with the public side
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(args, cwd=REPO_ROOT, env=child_env(), stdout=self._log_file,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _head_activation_probes(model: Path, ids: list[int]) -> tuple[list[bytes], bytes]:
    """Byte slices from inside the hidden states layers [0, 2) hand to the middle hop, and the
    response frame the head worker's own serializer makes of them (the daemon's hops accept
    COMPRESSION_NONE only, so these bytes cross the wire as they are, unless encrypted)."""
    from proto import shard_runtime_pb2 as pb
    from proto import wire
    from shard.model.torch_backend import TorchRangeBackend
    from shard.session.stream import HIDDEN

    backend = TorchRangeBackend.load(model, 0, 2)
    hidden = backend.forward(backend.new_cache(len(ids) + 8), np.asarray(ids, dtype=np.int64), effective_start=0)
    raw = np.ascontiguousarray(hidden, dtype=np.float32).tobytes()
    frame = wire.response_chunk(pb.Envelope(), {HIDDEN: hidden})
    return [raw[int(len(raw) * f):int(len(raw) * f) + PROBE_BYTES] for f in (0.3, 0.5, 0.7)], frame


def test_real_daemons_generate_through_a_home_node_behind_nat(tmp_path):
    import torch

    from meshd.generate.tokenizer import EntryTokenizer
    from meshd.testing.models import build_random_llama
    from shard.model.reference import WholeModel

    torch.set_num_threads(1)
    model = build_random_llama(seed=0)
    tok = EntryTokenizer(model)
    ids = tok.encode_prompt(PROMPT, raw=True)
    expected = WholeModel(model).generate(ids, NEW_TOKENS).tokens
    cut = next((i for i, t in enumerate(expected) if t in tok.stop_ids), None)
    expected = expected if cut is None else expected[:cut + 1]
    probes, head_frame = _head_activation_probes(model, ids)
    # the probes are bytes the head worker puts on the wire for this prompt
    assert all(p in head_frame for p in probes)

    topo = new_topology()
    relay = None
    daemons: list[LocalDaemon] = []
    captures: dict[str, subprocess.Popen] = {}
    try:
        try:
            topo.up()
        except NetnsUnavailable as exc:
            pytest.fail(f"cannot build the NAT topology: {exc}")
        home1, home2 = topo.homes
        pub_ip = topo.public_ip(1)
        relay = H.spawn_relay(tmp_path, f"/ip4/{pub_ip}/tcp/4001", prefix=topo.prefix(topo.public))
        relay_addr = relay.ready["addrs"][0]
        boot = NsDaemon(tmp_path, "public", model, prefix=topo.prefix(topo.public), listen=f"/ip4/{pub_ip}/tcp/4003",
                        layers="4:6", bootstrap=[relay_addr])
        daemons.append(boot)
        boot_addr = boot.address()
        middle = NsDaemon(tmp_path, "home1", model, prefix=topo.prefix(home1),
                          listen=f"/ip4/{topo.home_ip(1)}/tcp/4002", layers="2:4", bootstrap=[relay_addr, boot_addr])
        entry = NsDaemon(tmp_path, "home2", model, prefix=topo.prefix(home2),
                         listen=f"/ip4/{topo.home_ip(2)}/tcp/4004", layers="0:2", bootstrap=[relay_addr, boot_addr])
        daemons += [middle, entry]

        def reach_of(d: LocalDaemon) -> dict | None:
            s = d.query("status")
            return s["reachability"] if s and s["reachability"]["verdict"] != "probing" else None

        # The NAT is real: nobody outside home1 opens a connection to its daemon...
        middle.address()
        assert not tcp_connects(topo.prefix(home2), topo.home_ip(1), 4002), "home2 reached home1 directly"
        assert not tcp_connects(topo.prefix(topo.public), topo.home_ip(1), 4002), "public reached home1"
        # ...while the route to it exists and home2 reaches the relay.
        assert tcp_connects(topo.prefix(home2), pub_ip, 4001), "home2 cannot reach the relay"

        assert wait_for(lambda: reach_of(boot), "the public daemon's verdict", START_TIMEOUT_S, boot)["verdict"] \
            == "public"
        home_reach = wait_for(lambda: (r := reach_of(middle)) and r["relayed_addrs"] and r,
                              "home1 to hold a relay reservation", START_TIMEOUT_S, middle)
        assert home_reach["verdict"] == "private" and home_reach["mode"] == "auto", home_reach
        assert all(f"/p2p/{relay.ready['peer_id']}/p2p-circuit/" in a for a in home_reach["relayed_addrs"])

        def covered():
            v = entry.swarm()
            return v if v and v.get("coverage") and v["coverage"]["fully_covered"] and len(v["ads"]) >= 3 else None
        wait_for(covered, "the entry to see all three ranges", START_TIMEOUT_S, entry)

        def relay_forwarded() -> int:     # the relay's own count of circuit bytes (its control socket)
            return control_request(tmp_path / "relay" / "control.sock", "status",
                                   timeout_s=30.0)["relay"]["bytes_forwarded"]

        captures = {"public": start_capture(topo.prefix(topo.public), tmp_path / "public.cap")}
        forwarded_before = relay_forwarded()
        done = None
        for event in entry.generate(PROMPT, max_tokens=NEW_TOKENS, raw=True):
            if event.get("done"):
                done = event
        carried = {name: stop_capture(proc, tmp_path / f"{name}.cap") for name, proc in captures.items()}
        first_forwarded = relay_forwarded() - forwarded_before
        captures = {}
        assert done is not None
        middle_id = middle.query("status")["peer_id"]
        print("route:", done["route"], "tokens:", done["tokens"], "expected:", expected)
        assert [h.split(":")[0] for h in done["route"]][1] == middle_id
        assert done["tokens"] == expected
        assert not done["failovers"]

        assert len(carried["public"]) > 10_000, "the public capture saw no relayed traffic"
        assert not any(p in carried["public"] for p in probes), "activation bytes crossed the relay in clear"

        def upgrade_ended():
            u = (entry.query("status") or {}).get("direct_upgrades") or {}
            return u if u.get("attempts") and not u.get("in_flight") else None
        upgrades = wait_for(upgrade_ended, "the entry's DCUtR attempt to end", START_TIMEOUT_S, entry)
        print("DCUtR hole punch home2 -> home1:", "direct" if upgrades["direct_now"] else "failed, relayed", upgrades)
        again = None
        captures = {"public": start_capture(topo.prefix(topo.public), tmp_path / "public2.cap")}
        forwarded_before = relay_forwarded()
        for event in entry.generate(PROMPT, max_tokens=NEW_TOKENS, raw=True):
            if event.get("done"):
                again = event
        public_again = stop_capture(captures.pop("public"), tmp_path / "public2.cap")
        second_forwarded = relay_forwarded() - forwarded_before
        print(f"public namespace carried {len(carried['public'])} bytes in the first generation, "
              f"{len(public_again)} in the second; the relay forwarded {first_forwarded} and {second_forwarded}")
        assert again is not None and again["tokens"] == expected
        if upgrades["direct_now"]:
            # Hole punched: the entry opened the middle hop's session on the direct connection, and the
            # relay forwarded (almost) none of it: its count, not the public capture, which also holds
            # the tail hop, DHT and reservation traffic that vary from run to run.
            assert entry.query("status")["direct_upgrades"]["sessions_direct"] >= 1
            assert first_forwarded > 10_000, first_forwarded
            assert second_forwarded < first_forwarded // 4, "the upgraded hop still went through the relay"
        assert again["route"] == done["route"] and not again["failovers"]
        assert entry.query("status")["direct_upgrades"]["attempts"] == 1
    finally:
        for proc in captures.values():
            proc.kill()
        for d in reversed(daemons):
            d.stop()
        if relay is not None:
            relay.stop()
        topo.down()
