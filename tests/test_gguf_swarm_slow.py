"""llama.cpp swarms of real ``meshd join --backend llama.cpp`` daemons on loopback, on GGUF files.

For each model (SmolLM2 Q4_1 as shipped, SmolLM2 F16 converted, the real
Gemma-3-270m Q4_K_M, a seeded random qwen3), in order:

1. two daemons ``[0, c1) + [c1, n)``: the greedy tokens through the entry equal
   whole-model llama.cpp in one process (native/llama_reference.py) on the
   same file;
2. the second leaves; three hops ``[0, c1) + [c1, c2) x2 + [c2, n)``: equal again;
3. the middle hop's daemon is SIGKILLed right after the first token: the
   route fails over to its twin, re-prefills, and the tokens are equal again.

Then: daemons holding only ``meshd slice`` files join with ``--layers auto``,
are assigned only layers inside their slice, route together with a whole-file
daemon (one recipe, the source's digest) that joined before the low slice and
was moved by the tracker to close the gap between the slices, and refuse a
directive outside the slice; and a route never mixes recipes (a torch-backend daemon of the same
file is not used by a llama.cpp entry).
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from meshd.daemon.local_swarm import LocalSwarm, wait_for
from meshd.generate.tokenizer import EntryTokenizer
from native.llama_reference import reference_generate
from proto.errors import MeshdError

pytestmark = [pytest.mark.slow, pytest.mark.native]

# Two llama.cpp sequences per worker (one per 2048 tokens of budget): at the kill the re-prefilled
# route opens its session on a surviving hop while that hop may still hold the old route's.
KV_TOKENS = 4096
RECORD_TTL_S = 12.0
START_TIMEOUT_S = 300
PROMPT = "Once upon a time, in a small village by the sea,"
N_TOKENS = 48
N_KILL = 96
LLAMA = ("--backend", "llama.cpp")


def _model(name: str):
    from meshd.testing.gguf_models import build_random_gguf
    from meshd.testing.models import gemma3_gguf_path, smollm2_artifact, smollm2_gguf_path
    from native.convert import convert

    if name == "smollm2-q4_1":
        return smollm2_gguf_path(), 30, (10, 20)
    if name == "smollm2-f16":
        return convert(smollm2_artifact("float32"), "F16", tokenizer_pre="smollm", progress=None), 30, (10, 20)
    if name == "gemma3-270m":
        return gemma3_gguf_path(), 18, (6, 12)
    return build_random_gguf("qwen3"), 6, (2, 4)


def _reference(path, n: int) -> list[int]:
    tok = EntryTokenizer(path)
    return list(reference_generate(path, tok.encode_prompt(PROMPT, raw=True), n, n_threads=2,
                                   stop_ids=tok.stop_ids).tokens)


def _generate(daemon, n: int, on_token=None) -> dict:
    done, count, prompt_tokens = None, 0, None
    for event in daemon.generate(PROMPT, max_tokens=n, raw=True):
        if event.get("event") == "start":
            prompt_tokens = event["prompt_tokens"]
        if "token" in event:
            count += 1
            if on_token is not None:
                on_token(count)
        if event.get("done"):
            done = event
    assert done is not None
    return {**done, "prompt_tokens": prompt_tokens}


def _wait_route(swarm, daemons) -> None:
    for d in daemons:
        swarm.wait_serving(d, START_TIMEOUT_S)
    swarm.wait_covered(60, peers=len([d for d in swarm.daemons if d.alive()]))


@pytest.mark.parametrize("name", ["smollm2-q4_1", "smollm2-f16", "gemma3-270m", "qwen3-random"])
def test_llama_cpp_swarm_equals_whole_model_and_survives_a_kill(name, tmp_path):
    path, n, (c1, c2) = _model(name)
    expected = _reference(path, N_KILL)
    assert len(expected) > 12, f"{name}: the reference stopped after {len(expected)} tokens; pick another prompt"
    with LocalSwarm(tmp_path, path, kv_budget_tokens=KV_TOKENS, record_ttl_s=RECORD_TTL_S, extra=LLAMA) as swarm:
        entry = swarm.add(layers=f"0:{c1}")
        second = swarm.add(layers=f"{c1}:{n}")
        _wait_route(swarm, [entry, second])
        two = _generate(entry, N_TOKENS)
        print(f"\n{name} 2 daemons: route {two['route']} {two['decode_tokens_per_s']} tok/s")
        assert len(two["route"]) == 2 and two["tokens"] == expected[:len(two["tokens"])]
        assert len(two["tokens"]) == min(N_TOKENS, len(expected))

        second.stop()  # graceful: withdraws its records
        middles = [swarm.add(layers=f"{c1}:{c2}") for _ in range(2)]
        tail = swarm.add(layers=f"{c2}:{n}")
        _wait_route(swarm, [*middles, tail])
        wait_for(lambda: (len((entry.swarm() or {}).get("ads", [])) == 4) or None, "the leaver's records gone", 60)
        three = _generate(entry, N_TOKENS)
        print(f"{name} 3 daemons: route {three['route']} {three['decode_tokens_per_s']} tok/s")
        assert len(three["route"]) == 3 and three["tokens"] == two["tokens"]

        middle_peer = three["route"][1].split(":")[0]
        victim = next(d for d in middles if (d.swarm() or {}).get("peer_id") == middle_peer)
        worker_pid = victim.query("status")["worker"]["pid"]
        killed = []

        def kill_at(count: int) -> None:
            # The hop is the worker process: SIGKILL it and its daemon (no drain, no withdrawal).
            if count == 1 and not killed:
                os.kill(worker_pid, signal.SIGKILL)
                victim.kill()
                killed.append(time.monotonic())

        done = _generate(entry, N_KILL, on_token=kill_at)
        print(f"{name} after SIGKILL of {middle_peer[-6:]}: failovers {done['failovers']}")
        assert done["tokens"] == expected
        assert killed and len(done["failovers"]) == 1 and done["failovers"][0]["failed_peer"] == middle_peer
        assert done["failovers"][0]["position"] > done["prompt_tokens"]  # during decode
        assert middle_peer not in " ".join(done["route"])


def test_slice_holders_join_serve_and_stay_inside_their_slices(tmp_path):
    from meshd.plan.footprint import gguf_footprint
    from meshd.testing.models import smollm2_gguf_path
    from native.slice import write_user_slice

    path = smollm2_gguf_path()
    low = write_user_slice(path, 0, 12, tmp_path / "low.gguf", progress=None)
    high = write_user_slice(path, 18, 30, tmp_path / "high.gguf", progress=None)
    fp = gguf_footprint(path, "x", "llama.cpp")
    roomy = fp.range_bytes(0, 30, KV_TOKENS)  # enough for the whole model: only the slice limits them
    whole_node = fp.range_bytes(10, 20, KV_TOKENS)
    expected = _reference(path, N_TOKENS)
    (tmp_path / "swarm").mkdir()
    with LocalSwarm(tmp_path / "swarm", path, kv_budget_tokens=KV_TOKENS, record_ttl_s=RECORD_TTL_S,
                    extra=LLAMA) as swarm:
        a = swarm.add(memory=roomy, model=high)
        view = swarm.wait_serving(a, START_TIMEOUT_S)
        assert 18 <= view["layers"][0] < view["layers"][1] <= 30, view["layers"]
        assert "is a slice holding layers 18:30" in a.text()
        # The order that once left 12:18 uncovered: the whole file joins before the low slice exists and
        # is placed inside 0:18; the low slice then takes 0:12, and the tracker moves the whole-file node.
        c = swarm.add(memory=whole_node)
        placed = tuple(swarm.wait_serving(c, START_TIMEOUT_S)["layers"])
        assert 0 <= placed[0] < placed[1] <= 18, placed
        b = swarm.add(memory=roomy, model=low)
        assert 0 <= swarm.wait_serving(b, START_TIMEOUT_S)["layers"][0] < 12
        cover = swarm.wait_covered(180, peers=3)
        print("\nslice swarm:", [(x["start"], x["end"]) for x in cover["ads"]], "digest", cover["model_digest"][:20],
              "whole-file node first at", placed)
        spans = {d.name: tuple(d.swarm()["layers"]) for d in (b, c)}
        for d, held in ((b, (0, 12)), (c, (0, 30))):
            assert held[0] <= spans[d.name][0] < spans[d.name][1] <= held[1], (d.name, spans[d.name])
        assert len({v["model_digest"] for v in (a.swarm(), b.swarm(), c.swarm())}) == 1  # the source's
        entry = b if spans[b.name][0] == 0 else c
        done = _generate(entry, N_TOKENS)
        print("route:", done["route"])
        assert done["tokens"] == expected
        held = {a.swarm()["peer_id"]: (18, 30), b.swarm()["peer_id"]: (0, 12), c.swarm()["peer_id"]: (0, 30)}
        for hop in done["route"]:
            peer, start, end = hop.split(":")
            assert held[peer][0] <= int(start) < int(end) <= held[peer][1], hop
        ack = _deliver_from_tracker(swarm, a, (0, 12))  # a valid tracker directive outside a's slice
        print("outside-the-slice directive:", ack.accepted, ack.reason, ack.detail)
        assert not ack.accepted and ack.reason == "not_held"
        assert tuple(a.swarm()["layers"]) == tuple(view["layers"])


def _deliver_from_tracker(swarm, target, span):
    """Sign a LOAD of ``span`` for ``target`` with the current tracker's key and deliver it."""
    import random

    import trio

    from dht.host.build import running_host
    from dht.identity import Identity, load_or_create_identity
    from meshd.plan.adverts import Span
    from meshd.plan.assignment import DirectiveIntent
    from meshd.plan.directives import build_directive
    from meshd.plan.tracker import epoch_at
    from meshd.swarm.wire import DIRECTIVE_PROTOCOL, exchange, sign_directive
    from proto import shard_runtime_pb2 as pb

    view = target.swarm()
    tracker_id = view["tracker"]
    tracker = next(d for d in swarm.daemons if d.alive() and (d.swarm() or {}).get("peer_id") == tracker_id)
    now = int(time.time() * 1000)
    directive = build_directive(DirectiveIntent(pb.DIRECTIVE_ACTION_LOAD_SHARD, view["peer_id"], Span(*span)),
                                tracker_peer_id=tracker_id, model_digest=view["model_digest"],
                                epoch=epoch_at(now), now_ms=now, rng=random.Random(7))
    record = sign_directive(directive, load_or_create_identity(tracker.data_dir).signing_key)
    addr = target.address()

    async def main():
        async with running_host(Identity.from_seed(random.randbytes(32)), ["/ip4/127.0.0.1/tcp/0"]) as host:
            return await exchange(host, addr.split("/p2p/")[1], [addr], DIRECTIVE_PROTOCOL, record)

    return pb.DirectiveAck.FromString(trio.run(main))


def test_a_route_never_mixes_recipes(tmp_path):
    from meshd.testing.gguf_models import build_random_gguf

    path = build_random_gguf("qwen3")
    with LocalSwarm(tmp_path, path, kv_budget_tokens=KV_TOKENS, record_ttl_s=RECORD_TTL_S, extra=LLAMA) as swarm:
        head = swarm.add(layers="0:3", name="llama-head")
        swarm.extra = ("--backend", "torch")
        torch_tail = swarm.add(layers="3:6", name="torch-tail")
        _wait_route(swarm, [head, torch_tail])
        with pytest.raises(MeshdError, match="(?i)missing|layers"):
            _generate(head, 4)
        swarm.extra = LLAMA
        cpp_tail = swarm.add(layers="3:6", name="llama-tail")
        swarm.wait_serving(cpp_tail, START_TIMEOUT_S)
        wait_for(lambda: len((head.swarm() or {}).get("ads", [])) == 3 or None, "three ads", 60)
        done = _generate(head, 8)
        assert torch_tail.swarm()["peer_id"] not in " ".join(done["route"])
        assert done["tokens"] == _reference(path, 8)


def test_relayed_llama_cpp_hop(tmp_path):
    """A --reachability private llama.cpp daemon reached only through a relay circuit: same tokens."""
    from meshd.benchmarks import relay_harness as H
    from meshd.daemon.local_swarm import LocalDaemon
    from meshd.testing.gguf_models import build_random_gguf

    path = build_random_gguf("qwen3")
    expected = _reference(path, N_TOKENS)
    relay_dir = tmp_path / "relay"
    relay_dir.mkdir()
    relay = H.spawn_ready("relay", ["meshd", "relay", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir",
                                    str(relay_dir), "--ready-file", str(relay_dir / "ready.json")],
                          relay_dir / "ready.json")
    daemons = []
    try:
        boot = relay.ready["addrs"][0]
        entry = LocalDaemon(tmp_path, "entry", path, layers="0:3", record_ttl_s=RECORD_TTL_S,
                            extra=(*LLAMA, "--bootstrap", boot, "--reachability", "public"))
        home = LocalDaemon(tmp_path, "home", path, layers="3:6", record_ttl_s=RECORD_TTL_S,
                           extra=(*LLAMA, "--bootstrap", boot, "--reachability", "private"))
        daemons += [entry, home]

        def covered():
            v = entry.swarm()
            return v if v and (v.get("coverage") or {}).get("fully_covered") else None
        wait_for(lambda: ((home.query("status") or {}).get("reachability") or {}).get("relayed_addrs") or None,
                 "the home node's relayed addrs", START_TIMEOUT_S, home)
        wait_for(covered, "coverage through the relayed home node", START_TIMEOUT_S, entry)
        done = _generate(entry, N_TOKENS)
        home_id = home.query("status")["peer_id"]
        print("\nrelayed route:", done["route"])
        assert done["tokens"] == expected and any(h.startswith(home_id) for h in done["route"])
    finally:
        for d in daemons:
            d.stop()
        relay.stop()
