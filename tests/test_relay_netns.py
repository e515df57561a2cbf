"""Relayed hops under real NAT: Linux network namespaces, veth pairs and an nftables firewall.

Topology (tests/_netns.py): the relay runs in "public"; home1 runs the worker
for the middle layers and a home node that reserves a slot on the relay;
home2 is the entry node with the head and tail workers. Both homes drop new
inbound connections. Checks, in order:
  * the NAT is real: a new TCP connection from home2 (and from public) to the
    home node's libp2p port fails, while home2 -> relay succeeds;
  * the home node's dial-back probe through the relay says "private";
  * generation through head (home2) -> middle (home1, relayed) -> tail
    (home2) equals the whole model's greedy tokens;
  * everything the public namespace carried (captured with an AF_PACKET
    socket there) does not contain the activation bytes sent to the middle hop.
If namespaces cannot be created the test FAILS and says why.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from meshd.benchmarks import relay_harness as H
from tests._netns import NetnsUnavailable, new_topology, start_capture, stop_capture, tcp_connects

pytestmark = pytest.mark.netns

LAYERS = 6
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 380, size=40)]
NEW_TOKENS = 12


def test_generation_through_a_home_node_behind_nat(tmp_path):
    from meshd.testing.models import build_random_llama
    from shard.model.reference import WholeModel

    model = build_random_llama(seed=0)
    topo = new_topology()
    kids: list[H.Child] = []
    capture = None
    try:
        try:
            topo.up()
        except NetnsUnavailable as exc:
            pytest.fail(f"cannot build the NAT topology: {exc}")
        home1, home2 = topo.homes
        capture = start_capture(topo.prefix(topo.public), tmp_path / "public.cap")
        relay = H.spawn_relay(tmp_path, f"/ip4/{topo.public_ip(1)}/tcp/4001", prefix=topo.prefix(topo.public))
        kids.append(relay)
        workers = [H.spawn_worker(tmp_path, model, "2:4", prefix=topo.prefix(home1), wait=False),
                   H.spawn_worker(tmp_path, model, "0:2", prefix=topo.prefix(home2), wait=False),
                   H.spawn_worker(tmp_path, model, "4:6", prefix=topo.prefix(home2), wait=False)]
        kids += workers
        middle, head, tail = (H.wait_ready(w) for w in workers)
        node = H.spawn_home_node(tmp_path, "home1", f"/ip4/{topo.home_ip(1)}/tcp/4002", relay.ready["addrs"][0],
                                 middle.ready["unix"], prefix=topo.prefix(home1))
        kids.append(node)

        # The NAT is real: nobody outside home1 can open a connection to it...
        assert not tcp_connects(topo.prefix(home2), topo.home_ip(1), 4002), "home2 reached home1 directly"
        assert not tcp_connects(topo.prefix(topo.public), topo.home_ip(1), 4002), "public reached home1"
        # ...while the route to it exists and home2 reaches the relay.
        assert tcp_connects(topo.prefix(home2), topo.public_ip(1), 4001), "home2 cannot reach the relay"
        assert node.ready["verdict"] == "private", node.ready
        relayed_addr = node.ready["relayed_addrs"][0]
        assert "/p2p-circuit/p2p/" in relayed_addr

        peer = node.ready["peer_id"]

        def hop(endpoint, a, b):
            return {"endpoint": endpoint, "start": a, "end": b, "num_layers": LAYERS}

        spec = {"hops": [hop(head.ready["listen"], 0, 2), hop("p2p:" + peer, 2, 4), hop(tail.ready["listen"], 4, 6)],
                "relayed": {peer: relayed_addr}, "prompt": PROMPT, "max_new_tokens": NEW_TOKENS,
                "chunk_tokens": 16, "return_logits": True}
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        entry = subprocess.run([*topo.prefix(home2), sys.executable, "-m", "meshd.benchmarks.relay_harness", "drive",
                                str(tmp_path / "spec.json"), str(tmp_path / "out.json")],
                               env=H.child_env(), capture_output=True, text=True, timeout=600)
        assert entry.returncode == 0, entry.stderr[-3000:]
        out = json.loads((tmp_path / "out.json").read_text())
        carried = stop_capture(capture, tmp_path / "public.cap")
        capture = None

        whole = WholeModel(model).generate(PROMPT, NEW_TOKENS, chunk_tokens=16)
        diff = max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(out["logits"], whole.logits))
        print(f"relayed route tokens {out['tokens']}; max logit diff vs whole model {diff:.3g}")
        assert out["tokens"] == whole.tokens

        bodies = [bytes.fromhex(h) for h in out["sent_bodies_hex"]]
        assert bodies, "the entry node sent nothing over the relayed hop"
        biggest = max(bodies, key=len)
        probe = biggest[len(biggest) // 2: len(biggest) // 2 + 48]   # inside the hidden-state tensor bytes
        assert len(carried) > sum(map(len, bodies)), "the capture did not see the relayed traffic"
        assert probe not in carried, "activation bytes crossed the relay in clear"
    finally:
        if capture is not None:
            capture.kill()
        for kid in reversed(kids):
            kid.stop()
        topo.down()
