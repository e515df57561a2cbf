"""``meshd bench swarm``: real ``meshd join`` daemons (the product path) against the whole model, one run.

    meshd bench swarm [--quick] [--json]                     three daemons on SmolLM2, --layers auto
    meshd bench swarm --model DIR [--layers 0:4,4:8] [--backend torch]
    meshd bench swarm --backend llama.cpp [--model FILE.gguf]      2 and 3 daemons (swarm_llama.py)

Steps (progress lines on the given stream):
1. route planning micro-benchmark (meshd/benchmarks/route_plan.py): ``route_plan_ms``;
2. the daemons: by default three ``meshd join --layers auto`` (memory sized as in
   ``meshd demo``; ``join_to_routable_s`` = from starting the last joiners to the
   entry seeing every layer covered), or with ``--layers`` one ``meshd join
   --layers A:B`` per range; one compute thread per worker (meshd/daemon/local_swarm.py THREADS),
   records living as long as a user's (daemon_runs.BENCH_RECORD_TTL_S);
3. generation through the entry daemon's control socket (the generate op, what
   ``meshd generate`` does; the entry is the layer-0 daemon) and through the
   whole model in this process (shard/model/reference.py, same thread count), in
   alternating rounds after a warm-up of each: ``decode_ratio`` = best swarm
   decode tok/s / best whole tok/s (``decode_ratio_median``: the medians),
   ``prefill_ratio`` = whole prefill time / the swarm's time to its first token
   (which includes planning and opening the route), ``tokens_equal`` (greedy),
   ``tail_bytes_per_decode_step`` (response bytes from the tail per decode step,
   as the driver counted them) and ``per_hop_overhead_median_ms`` (median decode
   step wall time minus the hops' own compute, per hop); in the same rounds the
   route's ranges also run in bare processes on a ring of pipes (torch_floor.py:
   no meshd at all): ``bare_split_ratio`` = best bare-split tok/s / best whole tok/s is
   what splitting alone costs on this machine, ``decode_ratio_vs_bare_split``
   what meshd adds on top;
4. one more daemon serving the middle hop's range makes that span redundant; the
   middle hop's node (daemon and worker) is SIGKILLed right after the first token:
   ``tokens_equal_with_failure`` and ``recovery_s`` (kill -> next token,
   monotonic clock shared by the processes on this host) and
   ``failover_to_token_s`` (failure seen by the driver -> next token).
``path: "daemon"`` says what was timed. Every daemon is stopped at the end.

``--rtt-ms N``: instead, the daemons run in network namespaces N ms apart and
star is compared with push in the same run, plus the same on loopback
(meshd/benchmarks/wan.py: ``push_vs_star_decode_ratio``, ``legs_per_token``,
``hops``).
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import TextIO


def _say(progress: TextIO | None, line: str) -> None:
    if progress is not None:
        print(f"swarm bench: {line}", file=progress, flush=True)


def _start(root: Path, model: Path, options, progress, result: dict):
    from meshd.benchmarks import daemon_runs as R
    from meshd.daemon.local_swarm import DEMO_KV_TOKENS, DEMO_NODES, LocalSwarm
    from meshd.plan.assignment import even_memory_for
    from meshd.plan.footprint import artifact_footprint
    from meshd.plan.modelinfo import model_num_layers

    backend = getattr(options, "backend", None)
    layers = getattr(options, "layers", None)
    if layers:
        specs = R.parse_splits(layers, model_num_layers(model))
        _say(progress, f"starting {len(specs)} daemons with fixed layers {', '.join(specs)}")
        t0 = time.monotonic()
        swarm = R.start_split(root, model, specs, backend=backend, kv_budget_tokens=DEMO_KV_TOKENS)
        result.update(nodes=len(specs), layers=specs, join_to_routable_s=round(time.monotonic() - t0, 2))
        return swarm
    memory = even_memory_for(artifact_footprint(model, "bench"), DEMO_NODES, DEMO_KV_TOKENS)
    swarm = LocalSwarm(root, model, kv_budget_tokens=DEMO_KV_TOKENS, backend=backend,
                       record_ttl_s=R.BENCH_RECORD_TTL_S)
    try:
        first = swarm.add(memory=memory)
        swarm.wait_serving(first, R.START_TIMEOUT_S)
        t_join = time.monotonic()
        for _ in range(DEMO_NODES - 1):
            swarm.add(memory=memory)
        view = swarm.wait_covered(R.START_TIMEOUT_S, peers=DEMO_NODES)
    except BaseException:
        swarm.close()
        raise
    result.update(nodes=DEMO_NODES, layers="auto", join_to_routable_s=round(time.monotonic() - t_join, 2),
                  assigned=sorted([a["start"], a["end"]] for a in view["ads"]))
    return swarm


def run(quick: bool = False, progress: TextIO | None = None, options=None) -> dict:
    if (getattr(options, "backend", None) or "torch") == "llama.cpp":
        from meshd.benchmarks.swarm_llama import run as run_llama  # whole-model llama.cpp as the reference

        return run_llama(quick, progress, options)
    if getattr(options, "rtt_ms", None) is not None:   # star vs push across a delayed network
        from meshd.benchmarks import wan

        return wan.run(options.rtt_ms, quick=quick, progress=progress, options=options)
    from meshd.benchmarks import daemon_runs as R
    from meshd.benchmarks import route_plan
    from meshd.benchmarks.torch_floor import TorchFloor
    from meshd.daemon.local_swarm import THREADS
    from native.packaged import smollm2_artifact

    model = R.bench_model(options, smollm2_artifact)
    new_tokens = R.QUICK_NEW_TOKENS if quick else R.NEW_TOKENS
    rounds = 1 if quick else 3
    prompt = R.PROMPT_TEXT
    result: dict = {"path": "daemon", "model": str(model), "backend": "torch", "threads": THREADS,
                    "new_tokens": new_tokens, "rounds": rounds}
    plan = route_plan.run(quick=quick, progress=progress)
    result.update(route_plan_ms=plan["route_plan_ms"], replacement_plan_ms=plan["replacement_plan_ms"])

    root = Path(tempfile.mkdtemp(prefix="meshd-bench-swarm-"))
    swarm = None
    try:
        swarm = _start(root, model, options, progress, result)
        _say(progress, f"covered by {result['nodes']} daemons after {result['join_to_routable_s']} s")
        entry = R.entry_of(swarm)
        reference = R.Reference(model, THREADS)
        result["prompt_tokens"] = len(reference.ids(prompt))
        _say(progress, "warm-up: one short generation each")
        route = R.generate(entry, prompt, 4)["route"]
        reference.generate(prompt, 4)
        floor = TorchFloor(model, [":".join(hop.split(":")[1:]) for hop in route], THREADS)
        try:
            runs, wholes, bares = [], [], []
            for r in range(rounds):
                runs.append(R.RunFigures.of(R.generate(entry, prompt, new_tokens)))
                wholes.append(reference.generate(prompt, new_tokens))
                bare = floor.generate(reference.ids(prompt), new_tokens)
                bares.append((bare.decode_tok_s, bare.tokens))
                _say(progress, f"round {r + 1}/{rounds}: swarm {runs[-1].decode_tok_s:.2f} tok/s, "
                               f"whole {wholes[-1][1]:.2f} tok/s, bare split {bares[-1][0]:.2f} tok/s")
        finally:
            floor.close()
        whole_tokens = wholes[-1][0]
        swarm_rates, whole_rates = [x.decode_tok_s for x in runs], [w[1] for w in wholes]
        whole_prefill = min(w[2] for w in wholes)
        swarm_prefill = min(x.prefill_s for x in runs)
        tail_bytes = [x.tail_bytes for x in runs if x.tail_bytes is not None]
        result.update(
            tokens_equal=all(x.tokens == whole_tokens for x in runs) and all(w[0] == whole_tokens for w in wholes),
            route=runs[-1].route, looped=all(x.looped for x in runs),
            swarm_decode_tok_s=round(max(swarm_rates), 3), whole_decode_tok_s=round(max(whole_rates), 3),
            decode_ratio=round(max(swarm_rates) / max(whole_rates), 3) if max(whole_rates) else None,
            decode_ratio_median=round(statistics.median(swarm_rates) / statistics.median(whole_rates), 3)
            if statistics.median(whole_rates) else None,
            swarm_prefill_tok_s=round(result["prompt_tokens"] / swarm_prefill, 3),
            whole_prefill_tok_s=round(result["prompt_tokens"] / whole_prefill, 3),
            prefill_ratio=round(whole_prefill / swarm_prefill, 3),
            tail_bytes_per_decode_step=round(max(tail_bytes), 2) if tail_bytes else None,
            per_hop_overhead_median_ms=round(statistics.median(x.overhead_per_hop_median_ms for x in runs), 3),
            bare_split_decode_tok_s=round(max(b[0] for b in bares), 3),
            bare_split_ratio=round(max(b[0] for b in bares) / max(whole_rates), 3) if max(whole_rates) else None,
            decode_ratio_vs_bare_split=round(max(swarm_rates) / max(b[0] for b in bares), 3),
            bare_split_tokens_equal=all(b[1][:len(whole_tokens)] == whole_tokens for b in bares),
        )
        R.measure_failover(swarm, entry, reference, prompt, new_tokens, result, lambda line: _say(progress, line))
    finally:
        _say(progress, "stopping the daemons")
        if swarm is not None:
            swarm.close()
        shutil.rmtree(root, ignore_errors=True)
    return result

