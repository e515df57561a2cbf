"""A client-only node (`meshd join --layers none`) generates through a real swarm.

Three `meshd join --layers A:B` daemons split a seeded tiny Llama (0:2, 2:4,
4:6); a fourth joins with `--layers none`: no worker, no capability record,
never the tracker. It serves generate on every edge -- the control socket
(star and push), `meshd generate` and the HTTP API -- and every hop of its
route is a remote peer: the push route counts hops + 1 legs per token and
the star 2 x hops, and the greedy tokens equal the whole model's. A
directive sent to it over the real /meshd/directive/1 path is refused. Last,
with a spare 2:4 daemon, the pushed route's middle hop is SIGKILLed mid-decode:
the same tokens, one failover, the spare in its place.
"""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import trio

from meshd.daemon.local_swarm import REPO_ROOT, LocalSwarm, child_env, wait_for

# Long enough that a kill right after the first token reaches us lands mid-decode.
FAILOVER_TOKENS = 300

pytestmark = pytest.mark.slow

SPANS = ("0:2", "2:4", "4:6")
START_TIMEOUT_S = 300
PROMPT = "the swarm answers"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def swarm(model, tmp_path_factory):
    s = LocalSwarm(tmp_path_factory.mktemp("client"), model, kv_budget_tokens=1024, record_ttl_s=8.0)
    try:
        for spec in SPANS:
            s.add(layers=spec)
        for d in s.daemons:
            s.wait_serving(d, START_TIMEOUT_S)
        s.wait_covered(START_TIMEOUT_S, peers=len(SPANS))
        s.add(layers="none", name="client")
        yield s
    finally:
        s.close()
        for d in s.daemons:
            assert not d.alive()


@pytest.fixture(scope="module")
def client(swarm):
    c = swarm.daemons[-1]
    wait_for(lambda: (v := c.swarm()) and v.get("coverage") and v["coverage"]["fully_covered"]
             and len(v["ads"]) == len(SPANS) and v, "the client's view of the covered model", 120, c)
    return c


@pytest.fixture(scope="module")
def expected(model):
    import torch

    from meshd.generate.tokenizer import EntryTokenizer
    from shard.model.reference import WholeModel

    torch.set_num_threads(1)
    tok = EntryTokenizer(model)
    tokens = WholeModel(model).generate(tok.encode_prompt(PROMPT, raw=True), NEW_TOKENS).tokens
    cut = next((i for i, t in enumerate(tokens) if t in tok.stop_ids), None)
    return tokens if cut is None else tokens[:cut + 1]


def _done(daemon, **params) -> dict:
    events = list(daemon.generate(PROMPT, max_tokens=NEW_TOKENS, raw=True, **params))
    errors = [e for e in events if "error" in e]
    assert not errors, errors
    return events[-1]


def test_client_only_node_holds_nothing_and_is_never_the_tracker(swarm, client):
    status = client.query("status")
    assert status["own"]["role"] == "client" and status["own"]["layers"] is None
    assert not status["own"]["advertising"] and status["worker"] == {"state": "none"}
    assert client.worker_pids() == []                      # no worker process at all
    (entries,) = status["coverage"].values()
    assert status["peer_id"] not in {e["peer_id"] for e in entries}
    view = client.swarm()
    assert view["role"] == "client" and not view["serving"] and view["layers"] is None
    assert view["tracker"] and not view["on_duty"]
    assert all((d.swarm() or {}).get("tracker") != status["peer_id"] for d in swarm.daemons[:-1])
    text = subprocess.run([sys.executable, "-m", "meshd", "status", "--data-dir", str(client.data_dir)],
                          cwd=REPO_ROOT, env=child_env(1), capture_output=True, text=True, timeout=60).stdout
    print(text)
    assert "role       client" in text and "client-only node" in text


@pytest.mark.parametrize("topology, legs", [("push", 4), ("star", 6)])
def test_client_only_generates_the_whole_models_tokens(client, expected, topology, legs):
    done = _done(client, topology=topology)
    me = client.query("ping")["peer_id"]
    print(topology, done["route"], done["tokens"], done["step_legs"][:3])
    assert done["tokens"] == expected
    assert done["topology"] == topology and not done["failovers"]
    assert len(done["route"]) == 3 and all(not hop.startswith(me) for hop in done["route"])
    assert done["step_legs"] and set(done["step_legs"]) == {legs}   # hops + 1 pushed, 2 x hops star


def test_meshd_generate_and_the_http_api_on_a_client_only_node(client, expected, model):
    from meshd.generate.tokenizer import EntryTokenizer

    r = subprocess.run([sys.executable, "-m", "meshd", "generate", PROMPT, "--raw", "--json", "--max-tokens",
                        str(NEW_TOKENS), "--data-dir", str(client.data_dir)], cwd=REPO_ROOT, env=child_env(1),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    done = json.loads(r.stdout.splitlines()[-1])
    assert done["tokens"] == expected
    url = client.api_url()
    models = httpx.get(f"{url}/v1/models", timeout=30).json()
    model_id = models["data"][0]["id"]
    out = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": model_id, "prompt": PROMPT, "max_tokens": NEW_TOKENS}).json()
    assert out["choices"][0]["text"] == EntryTokenizer(model).decode(expected)
    status = httpx.get(f"{url}/meshd/status", timeout=60).json()
    assert status["node"]["role"] == "client" and status["model"]["role"] == "client"


def test_a_directive_to_a_client_only_node_is_refused(client):
    """A well-formed signed LOAD directive over /meshd/directive/1 is refused for what the node is
    (before any tracker check): nothing starts."""
    import random
    import time

    import multiaddr
    from libp2p.peer.peerinfo import info_from_p2p_addr

    from dht.host.build import running_host
    from dht.identity import Identity
    from meshd.plan.adverts import Span
    from meshd.plan.assignment import DirectiveIntent
    from meshd.plan.directives import build_directive
    from meshd.plan.tracker import epoch_at
    from meshd.swarm.wire import DIRECTIVE_PROTOCOL, exchange, sign_directive
    from proto import shard_runtime_pb2 as pb

    signer = Identity.from_seed(bytes([77]) * 32)
    me = client.query("status")
    now = int(time.time() * 1000)
    intent = DirectiveIntent(pb.DIRECTIVE_ACTION_LOAD_SHARD, me["peer_id"], Span(0, 2))
    record = sign_directive(build_directive(intent, tracker_peer_id=signer.peer_id,
                                            model_digest=me["own"]["model_digest"], epoch=epoch_at(now),
                                            now_ms=now, rng=random.Random(1)), signer.signing_key)
    got: list = []

    async def main():
        with trio.fail_after(60):
            async with running_host(signer, ["/ip4/127.0.0.1/tcp/0"]) as host:
                addr = me["addresses"][0]
                await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
                raw = await exchange(host, me["peer_id"], (addr,), DIRECTIVE_PROTOCOL, record)
                got.append(pb.DirectiveAck.FromString(raw))

    trio.run(main)
    assert not got[0].accepted and got[0].reason == "client_only", got[0]
    assert client.worker_pids() == [] and client.query("status")["own"]["layers"] is None


def test_killing_the_middle_hop_mid_decode_keeps_the_tokens(swarm, client, model):
    import torch

    from meshd.generate.tokenizer import EntryTokenizer
    from shard.model.reference import WholeModel

    spare = swarm.add(layers="2:4", name="spare")
    swarm.wait_serving(spare, START_TIMEOUT_S)
    wait_for(lambda: len((client.swarm() or {}).get("ads", [])) == len(SPANS) + 1, "the spare in the client's view",
             120, client)
    torch.set_num_threads(1)
    tok = EntryTokenizer(model)
    expected = WholeModel(model).generate(tok.encode_prompt(PROMPT, raw=True), FAILOVER_TOKENS).tokens
    cut = next((i for i, t in enumerate(expected) if t in tok.stop_ids), None)
    expected = expected if cut is None else expected[:cut + 1]
    assert len(expected) > 10, "the reference stopped too early to test a failure mid-decode"
    first = _done(client, topology="push")
    middle = first["route"][1].split(":")[0]
    victim = next(d for d in swarm.daemons if d is not client and (d.query("ping") or {}).get("peer_id") == middle)
    events, prompt_tokens = [], None
    for event in client.generate(PROMPT, max_tokens=FAILOVER_TOKENS, raw=True, topology="push"):
        if event.get("event") == "start":
            prompt_tokens = event["prompt_tokens"]
        if "token" in event and not any("token" in e for e in events):
            victim.kill_node()
        events.append(event)
    done = events[-1]
    print("failovers:", done["failovers"], "route:", done["route"])
    assert done["tokens"] == expected and done["topology"] == "push"
    assert len(done["failovers"]) == 1 and done["failovers"][0]["failed_peer"] == middle
    assert done["failovers"][0]["position"] > prompt_tokens          # after the prefill: during decode
    assert middle not in " ".join(done["route"]) and len(done["route"]) == 3
