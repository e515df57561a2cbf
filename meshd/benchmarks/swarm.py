"""``meshd bench swarm``: a real 3-daemon SmolLM2 swarm against the whole model, same run.

Steps (progress lines on the given stream):
1. route planning micro-benchmark (meshd/benchmarks/route_plan.py): ``route_plan_ms``;
2. three ``meshd join --layers auto`` daemons on loopback (memory sized as in
   ``meshd demo``): ``join_to_routable_s`` = from starting the last joiners
   to the entry seeing every layer covered;
3. greedy decode through the swarm (entry: node0) and through the whole
   model in this process (transformers, 1 thread like each worker), twice
   each, alternating; ``decode_ratio`` = best swarm tok/s / best whole tok/s;
   ``tokens_equal``: swarm tokens == whole-model tokens;
4. a fourth daemon serving the middle hop's range (fixed ``--layers``) makes
   that span redundant; the middle hop's daemon is SIGKILLed right after the
   first token: ``tokens_equal_with_failure`` and ``recovery_s`` (kill ->
   next token, monotonic clock shared by the processes on this host; it
   includes the worker's 1 s shutdown grace) and ``failover_to_token_s``
   (failure seen by the driver -> next token).
Every daemon is stopped at the end.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import TextIO

PROMPT = "The history of the Roman Empire begins"


def _say(progress: TextIO | None, line: str) -> None:
    if progress is not None:
        print(f"swarm bench: {line}", file=progress, flush=True)


def _generate(daemon, n: int, on_token=None) -> dict:
    done, count = None, 0
    for event in daemon.generate(PROMPT, max_tokens=n, raw=True):
        if "token" in event:
            count += 1
            if on_token is not None:
                on_token(count)
        if event.get("done"):
            done = event
    return done


def run(quick: bool = False, progress: TextIO | None = None) -> dict:
    import torch

    from meshd.benchmarks import route_plan
    from meshd.benchmarks.local_swarm import DEMO_KV_TOKENS, DEMO_NODES as NODES
    from meshd.plan.assignment import even_memory_for as demo_memory
    from meshd.plan.footprint import artifact_footprint
    from meshd.benchmarks.local_swarm import LocalSwarm
    from meshd.generate.tokenizer import EntryTokenizer
    from shard.reference import WholeModel
    from native.packaged import smollm2_artifact

    new_tokens = 32 if quick else 64
    rounds = 1 if quick else 2
    result: dict = {"model": "SmolLM2-135M-Instruct (float32, torch)", "nodes": NODES, "new_tokens": new_tokens}
    plan = route_plan.run(quick=quick, progress=progress)
    result.update(route_plan_ms=plan["route_plan_ms"], replacement_plan_ms=plan["replacement_plan_ms"])

    _say(progress, "preparing SmolLM2")
    model = smollm2_artifact()
    memory = demo_memory(artifact_footprint(model, "bench"), NODES, DEMO_KV_TOKENS)
    tok = EntryTokenizer(model)
    stops = tok.stop_ids
    root = Path(tempfile.mkdtemp(prefix="meshd-bench-swarm-"))
    swarm = LocalSwarm(root, model, kv_budget_tokens=DEMO_KV_TOKENS)
    try:
        first = swarm.add(memory=memory)
        swarm.wait_serving(first, 300)
        t_join = time.monotonic()
        for _ in range(NODES - 1):
            swarm.add(memory=memory)
        view = swarm.wait_covered(600, peers=NODES)
        result["join_to_routable_s"] = round(time.monotonic() - t_join, 2)
        result["assigned"] = sorted([a["start"], a["end"]] for a in view["ads"])
        _say(progress, f"covered: {result['assigned']} after {result['join_to_routable_s']} s")

        torch.set_num_threads(1)
        whole = WholeModel(model)
        ids = tok.encode_prompt(PROMPT, raw=True)
        swarm_rates, whole_rates, swarm_tokens, whole_tokens = [], [], None, None
        for r in range(rounds):
            done = _generate(first, new_tokens)
            swarm_tokens = done["tokens"]
            swarm_rates.append(done["decode_tokens_per_s"] or 0.0)
            ref = whole.generate(ids, new_tokens)
            cut = next((i for i, t in enumerate(ref.tokens) if t in stops), None)
            whole_tokens = ref.tokens if cut is None else ref.tokens[:cut + 1]
            whole_rates.append((len(ref.tokens) - 1) / ref.decode_s if ref.decode_s else 0.0)
            _say(progress, f"round {r + 1}: swarm {swarm_rates[-1]:.2f} tok/s, whole {whole_rates[-1]:.2f} tok/s")
        result.update(tokens_equal=swarm_tokens == whole_tokens, route=done["route"],
                      swarm_decode_tok_s=round(max(swarm_rates), 3), whole_decode_tok_s=round(max(whole_rates), 3),
                      decode_ratio=round(max(swarm_rates) / max(whole_rates), 3) if max(whole_rates) else None)

        # the entry is the layer-0 node; a backup makes the middle span redundant
        by_peer = {(d.swarm() or {}).get("peer_id"): d for d in swarm.daemons}
        ads = {a["peer_id"]: a for a in first.swarm()["ads"]}
        entry = next(by_peer[p] for p, a in ads.items() if a["start"] == 0 and p in by_peer)
        middle = ads[done["route"][len(done["route"]) // 2].split(":")[0]]
        backup = swarm.add(layers=f"{middle['start']}:{middle['end']}", name="backup")
        swarm.wait_serving(backup, 300)
        swarm.wait_covered(120, peers=NODES + 1)
        probe = _generate(entry, 2)["route"]  # which of the two twins this entry's route uses
        victim_peer = probe[len(probe) // 2].split(":")[0]
        victim = by_peer.get(victim_peer) or backup
        _say(progress, f"backup serves {middle['start']}:{middle['end']}; entry {entry.name}; "
                       f"killing {victim.name} (middle hop) after the first token")
        killed: list[float] = []

        def kill(count: int) -> None:
            if count == 1 and not killed:
                victim.kill()
                killed.append(time.monotonic())

        failed = _generate(entry, max(new_tokens, 48), on_token=kill)
        ref = whole.generate(ids, max(new_tokens, 48)).tokens
        cut = next((i for i, t in enumerate(ref) if t in stops), None)
        ref = ref if cut is None else ref[:cut + 1]
        fo = failed["failovers"]
        result.update(tokens_equal_with_failure=failed["tokens"] == ref, failovers=len(fo))
        if fo and fo[0].get("next_token_at") and killed:
            result["recovery_s"] = round(fo[0]["next_token_at"] - killed[0], 3)
            result["failover_to_token_s"] = round(fo[0]["next_token_at"] - fo[0]["failed_at"], 3)
        _say(progress, f"failure run: {len(fo)} failover(s), recovery {result.get('recovery_s')} s")
    finally:
        _say(progress, "stopping the daemons")
        swarm.close()
        shutil.rmtree(root, ignore_errors=True)
    return result
