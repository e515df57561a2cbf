"""Connection limits that keep the door open, with REAL daemons in namespaces.

Topology (tests/_netns.py): the public namespace runs the bootstrap daemon (layers [0, 3)) on
10.213.1.1; home1 (10.213.1.2, one address) holds 500 idle TCP connections open to its libp2p
port -- never a byte sent, each re-opened (after 1 s) when the daemon closes it. While the flood
runs, a NEW daemon (layers [3, 6), listening on 10.213.1.1:4005) bootstraps through the flooded
daemon and joins: the bootstrap answers, both see the model fully covered, and a generation
through the bootstrap daemon crosses the newcomer and equals the whole model's greedy tokens.
py-libp2p 0.8.1 alone (inbound cap 250, no per-address limit) closes every new connection while
such a flood lasts (tests/test_relay_inbound_limits.py shows it on loopback).
If namespaces cannot be created the test FAILS and says why.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from meshd.daemon.local_swarm import LocalDaemon, wait_for
from tests._netns import NetnsUnavailable, new_topology
from tests.test_relayd_netns import START_TIMEOUT_S, NsDaemon

pytestmark = pytest.mark.netns

FLOOD = 500
PROMPT = "the door stays open while one address holds five hundred sockets"
NEW_TOKENS = 8

# Run inside home1: hold FLOOD idle connections to IP:PORT; print the count open once all were
# opened, then keep re-opening closed ones (1 s apart each) until SIGTERM; print totals at exit.
HOLDER = r"""
import signal, sys, trio
ip, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
opened = closed = 0
async def one():
    global opened, closed
    while True:
        try:
            conn = await trio.open_tcp_stream(ip, port)
        except OSError:
            await trio.sleep(1.0)
            continue
        opened += 1
        try:
            while await conn.receive_some(4096):
                pass
        except trio.BrokenResourceError:
            pass
        closed += 1
        await conn.aclose()
        await trio.sleep(1.0)
async def main():
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            for _ in range(count):
                nursery.start_soon(one)
            while opened < count:
                await trio.sleep(0.05)
            print(f"holding {count}", flush=True)
            async for _ in signals:
                break
        print(f"opened {opened} closed-by-node {closed}", flush=True)
        nursery.cancel_scope.cancel()
trio.run(main)
"""


def test_a_new_node_joins_through_a_node_flooded_by_one_address(tmp_path):
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

    topo = new_topology()
    daemons: list[LocalDaemon] = []
    holder = None
    try:
        try:
            topo.up()
        except NetnsUnavailable as exc:
            pytest.fail(f"cannot build the NAT topology: {exc}")
        pub = topo.prefix(topo.public)
        boot_ip = topo.public_ip(1)
        boot = NsDaemon(tmp_path, "boot", model, prefix=pub, listen=f"/ip4/{boot_ip}/tcp/4003", layers="0:3",
                        bootstrap=[])
        daemons.append(boot)
        boot_addr = boot.address()
        rows = {r["name"]: r for r in boot.query("status")["libp2p"]["adjustments"]}
        assert rows["inbound_limits"]["applied"], rows.get("inbound_limits")

        holder = subprocess.Popen([*topo.prefix(topo.homes[0]), sys.executable, "-c", HOLDER, boot_ip, "4003",
                                   str(FLOOD)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = holder.stdout.readline()
        assert first.startswith(f"holding {FLOOD}"), (first, holder.stderr.read() if holder.poll() else "")
        flood_since = time.monotonic()

        # the newcomer listens beside the flooded daemon (its dial-back probe sees the address it
        # dials from), never on the flooder's address
        newcomer = NsDaemon(tmp_path, "newcomer", model, prefix=pub, listen=f"/ip4/{boot_ip}/tcp/4005",
                            layers="3:6", bootstrap=[boot_addr])
        daemons.append(newcomer)
        newcomer.address()
        wait_for(lambda: "bootstrap: connected to 1 of 1 peers" in newcomer.text() or None,
                 "the newcomer to bootstrap through the flooded daemon", START_TIMEOUT_S, newcomer)

        def covered(d: LocalDaemon):
            v = d.swarm()
            return v if v and v.get("coverage") and v["coverage"]["fully_covered"] and len(v["ads"]) >= 2 else None
        wait_for(lambda: covered(boot), "the flooded daemon to see the newcomer's layers", START_TIMEOUT_S, boot)
        wait_for(lambda: covered(newcomer), "the newcomer to see the whole model", START_TIMEOUT_S, newcomer)

        done = None
        for event in boot.generate(PROMPT, max_tokens=NEW_TOKENS, raw=True):
            if event.get("done"):
                done = event
        assert done is not None and done["tokens"] == expected, done
        newcomer_id = newcomer.query("status")["peer_id"]
        assert [h.split(":")[0] for h in done["route"]][-1] == newcomer_id
        assert holder.poll() is None, "the flood ended early"
        print(f"joined and generated {len(done['tokens'])} tokens while the flood ran "
              f"({time.monotonic() - flood_since:.1f} s)")
    finally:
        if holder is not None and holder.poll() is None:
            holder.terminate()
            try:
                out, _ = holder.communicate(timeout=30)
                print("holder:", out.strip())
            except subprocess.TimeoutExpired:
                holder.kill()
        for d in reversed(daemons):
            d.stop()
        topo.down()
