"""Route-planning micro-benchmark: ``run(quick, progress) -> dict``.

Builds a synthetic swarm from a seeded RNG (default 200 peers x 32 layers,
random ranges of 1..8 layers, measured-looking decode times, 10% relayed
peers, a partial RTT map) and times ``plan_route`` and ``replacement_route``
over it in the same run. Reported: ``route_plan_ms`` (median full plan),
``replacement_plan_ms`` (median re-plan after the middle hop fails) and
their ratio. Not registered in meshd/cli/bench.py: the integrator folds
``route_plan_ms`` into ``meshd bench swarm``.
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Any, TextIO

from meshd.plan.adverts import ShardAd
from meshd.plan.routing import plan_route, replacement_route

MODEL = "sha256:" + "ab" * 32
# Ranges are 1..MAX_SPAN layers: home nodes hold a handful of layers each.
MAX_SPAN = 8


def synthetic_swarm(peers: int, layers: int, rng: random.Random) -> tuple[list[ShardAd], dict]:
    """Random ads covering every layer, plus RTTs for about a third of the pairs."""
    ads: list[ShardAd] = []
    ids = [f"12D3KooW{rng.getrandbits(160):040x}" for _ in range(peers)]
    for i, peer in enumerate(ids):
        if i * MAX_SPAN < layers:  # a backbone so the model is always covered
            start, end = i * MAX_SPAN, min(layers, (i + 1) * MAX_SPAN)
        else:
            length = rng.randint(1, min(MAX_SPAN, layers))
            start = rng.randrange(0, layers - length + 1)
            end = start + length
        ads.append(ShardAd(peer_id=peer, model_digest=MODEL, start=start, end=end, num_layers=layers,
                           decode_ms_per_layer=rng.uniform(0.5, 5.0),
                           prefill_tokens_per_s=rng.uniform(100.0, 2000.0),
                           free_kv_tokens=rng.choice([0, 2048, 8192]),
                           memory_budget_bytes=8 << 30, relayed=rng.random() < 0.1,
                           expires_at_ms=10**12))
    rtt = {(a, b): rng.uniform(0.2, 40.0) for a in ids for b in ids if a < b and rng.random() < 0.33}
    return ads, rtt


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def run(quick: bool = False, progress: TextIO | None = None, *, peers: int = 200,
        layers: int = 32, seed: int = 0) -> dict:
    repeats = 5 if quick else 30
    ads, rtt = synthetic_swarm(peers, layers, random.Random(seed))
    entry = next(a.peer_id for a in ads if a.start == 0)
    kwargs: dict[str, Any] = dict(now_ms=0, entry_peer_id=entry, rtt=rtt, needed_tokens=4096)
    if progress is not None:
        print(f"route_plan: {peers} peers x {layers} layers, {len(rtt)} RTTs, "
              f"{repeats} repeats", file=progress)
    route = plan_route(ads, model_digest=MODEL, num_layers=layers, **kwargs)
    failed = route.hops[len(route.hops) // 2].peer_id
    plan_ms = _median_ms(lambda: plan_route(ads, model_digest=MODEL, num_layers=layers, **kwargs),
                         repeats)
    replan_ms = _median_ms(lambda: replacement_route(route, failed, ads, **kwargs), repeats)
    return {
        "peers": peers,
        "layers": layers,
        "repeats": repeats,
        "hops": len(route.hops),
        "route_cost_ms": round(route.cost_ms, 3),
        "route_plan_ms": round(plan_ms, 3),
        "replacement_plan_ms": round(replan_ms, 3),
        "replacement_over_plan": round(replan_ms / plan_ms, 3) if plan_ms else None,
    }


if __name__ == "__main__":  # pragma: no cover - manual use: python -m meshd.benchmarks.route_plan
    import json
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv, progress=sys.stderr), sort_keys=True))
