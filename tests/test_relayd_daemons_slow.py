"""Real daemons on loopback: a `--reachability private` node reached only through relays.

Two `meshd relay` processes (DHT servers too); the entry daemon serves layers
[0, 2) of a 4-layer model, the home daemon [2, 4) with --reachability
private: it finds both relays in the DHT, reserves on both, advertises only
relayed addresses. The first generation through the entry's control API
opens the hop on a circuit; the relay carrying it is SIGKILLed mid-generation
and the generation completes with the whole model's greedy tokens, the route
unchanged (the same home peer, through the other relay or through the direct
connection a DCUtR upgrade found meanwhile). On loopback the home node is
dialable, so the entry's background upgrade succeeds: the second generation
runs on the direct connection with the same tokens.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from meshd.benchmarks import relay_harness as H
from meshd.daemon.local_swarm import LocalDaemon, wait_for
from relay.client import parse_relayed_addr

pytestmark = pytest.mark.slow

LAYERS = 4
RECORD_TTL_S = 12.0
START_TIMEOUT_S = 300
PROMPT = "relays carry the middle of the model"
NEW_TOKENS = 24


def spawn_relay(tmp_path: Path, name: str, bootstrap: str | None = None) -> H.Child:
    d = tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    args = ["meshd", "relay", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(d),
            "--ready-file", str(d / "ready.json")]
    if bootstrap:
        args += ["--bootstrap", bootstrap]
    return H.spawn_ready(name, args, d / "ready.json")


def status(daemon: LocalDaemon) -> dict | None:
    return daemon.query("status")


def run_generation(daemon: LocalDaemon, on_token=None) -> dict:
    done, count = None, 0
    for event in daemon.generate(PROMPT, max_tokens=NEW_TOKENS, raw=True):
        if "token" in event:
            count += 1
            if on_token is not None:
                on_token(count)
        if event.get("done"):
            done = event
    assert done is not None
    return done


def test_private_home_node_through_two_relays_survives_a_relay_death(tmp_path):
    import torch

    from meshd.generate.tokenizer import EntryTokenizer
    from meshd.testing.models import build_random_llama
    from shard.model.reference import WholeModel

    torch.set_num_threads(1)
    model = build_random_llama(seed=5, num_hidden_layers=LAYERS)
    ids = EntryTokenizer(model).encode_prompt(PROMPT, raw=True)
    expected = WholeModel(model).generate(ids, NEW_TOKENS).tokens
    stops = EntryTokenizer(model).stop_ids
    cut = next((i for i, t in enumerate(expected) if t in stops), None)
    expected = expected if cut is None else expected[:cut + 1]

    relays: list[H.Child] = []
    daemons: list[LocalDaemon] = []
    try:
        relays.append(spawn_relay(tmp_path, "relay0"))
        relays.append(spawn_relay(tmp_path, "relay1", bootstrap=relays[0].ready["addrs"][0]))
        boot = relays[0].ready["addrs"][0] + " " + relays[1].ready["addrs"][0]
        entry = LocalDaemon(tmp_path, "entry", model, layers="0:2", record_ttl_s=RECORD_TTL_S,
                            extra=("--bootstrap", *boot.split(), "--reachability", "public"))
        home = LocalDaemon(tmp_path, "home", model, layers="2:4", record_ttl_s=RECORD_TTL_S,
                           extra=("--bootstrap", *boot.split(), "--reachability", "private"))
        daemons += [entry, home]

        def home_relayed():
            s = status(home)
            r = (s or {}).get("reachability") or {}
            return r if len(r.get("relayed_addrs", [])) == 2 and (s["own"]["advertising"]) else None
        reach = wait_for(home_relayed, "the home node to advertise two relayed addrs", START_TIMEOUT_S, home)
        assert reach["verdict"] == "private" and reach["mode"] == "private"
        held = {parse_relayed_addr(a)[0].peer_id.to_base58() for a in reach["relayed_addrs"]}
        assert held == {r.ready["peer_id"] for r in relays}

        def covered():
            v = entry.swarm()
            if not v or not v.get("coverage") or not v["coverage"]["fully_covered"]:
                return None
            return v
        view = wait_for(covered, "the entry to see the whole model covered", START_TIMEOUT_S, entry)
        home_id = status(home)["peer_id"]
        home_ad = next(a for a in view["ads"] if a["peer_id"] == home_id)
        print("home ad:", json.dumps(home_ad))

        # The relay listed first in the home's record carries the entry's circuit: kill it mid-decode.
        carrier_id = parse_relayed_addr(reach["relayed_addrs"][0])[0].peer_id.to_base58()
        carrier = next(r for r in relays if r.ready["peer_id"] == carrier_id)

        def kill_at(count: int) -> None:
            if count == 6:
                carrier.proc.kill()
                carrier.proc.wait(30)

        first = run_generation(entry, kill_at)
        print("route:", first["route"], "tokens:", first["tokens"])
        print("after killing relay", carrier_id[:16], "failovers:", json.dumps(first["failovers"])[:1500])
        assert carrier.proc.poll() is not None
        assert first["tokens"] == expected
        assert any(h.startswith(home_id) for h in first["route"])
        assert first["failovers"], "the relay died mid-generation but nothing failed over"
        assert all(f["failed_peer"] == home_id for f in first["failovers"])

        # DCUtR: the entry tried one upgrade when the first circuit opened; on loopback it succeeds.
        upgrades = wait_for(lambda: (status(entry) or {}).get("direct_upgrades", {}).get("direct_now") or None,
                            "the entry's direct upgrade to the home node", START_TIMEOUT_S, entry)
        print("entry direct upgrades:", status(entry)["direct_upgrades"], upgrades)
        second = run_generation(entry)
        assert second["tokens"] == expected
        assert second["route"] == first["route"] and not second["failovers"]
        assert status(entry)["direct_upgrades"]["attempts"] == 1     # once per peer per window
    finally:
        for d in daemons:
            d.stop()
        for r in relays:
            r.stop()
        keep = Path(tempfile.gettempdir()) / "meshd-relayd-logs"
        shutil.rmtree(keep, ignore_errors=True)
        keep.mkdir()
        for d in daemons:
            shutil.copy(d.log, keep / d.log.name)
