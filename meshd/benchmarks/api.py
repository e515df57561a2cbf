"""``meshd bench api``: the streaming HTTP API against the control socket, same swarm, same run.

Three ``meshd join --layers auto`` daemons on SmolLM2-135M-Instruct (as in
``meshd demo``); the entry is node0. Rounds alternate between the two edges
of the same entry -- ``POST /v1/completions`` with ``stream: true`` (SSE,
read with httpx as a client would) and the control socket's ``generate``
(JSON lines, as ``meshd generate`` reads them) -- with the same raw prompt,
greedy, same token budget. Times are taken at the client, when each
token's chunk / line arrives:

    *_ttft_s                 request sent -> first token received (median)
    *_decode_tokens_per_s    (tokens - 1) / (last - first arrival) (median)
    api_vs_control_decode_ratio   api / control decode rate (>= 0.97 wanted)
    api_vs_control_ttft_ratio     api / control time to first token
    tokens_equal             both edges produced the same text every round
    *_at_entry               decode rate and first-token time as the entry itself saw them (its
                             status JSON: from the request entering the entry to each token
                             leaving the core), to tell the edge's and the client's cost apart

``load_average`` is the machine's 1-minute load when the run ended (other
work on the machine makes absolute numbers noisy; the ratios are side by side).
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import TextIO

from meshd.benchmarks.sse import choices

PROMPT = "The history of the Roman Empire begins"


def _say(progress: TextIO | None, line: str) -> None:
    if progress is not None:
        print(f"api bench: {line}", file=progress, flush=True)


def _rates(sent: float, arrivals: list[float]) -> tuple[float, float | None]:
    ttft = arrivals[0] - sent
    span = arrivals[-1] - arrivals[0]
    return ttft, (len(arrivals) - 1) / span if span > 0 else None


def _via_api(client, url: str, model_id: str, n: int) -> tuple[str, float, float | None, int]:
    """One streamed completion; ``client`` is one httpx.Client for every round, as an application keeps one."""
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": n, "stream": True}
    arrivals, text = [], []
    sent = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        for choice in choices(r):
            text.append(choice["text"])
            if choice["finish_reason"] is None:
                arrivals.append(time.perf_counter())
    ttft, rate = _rates(sent, arrivals)
    return "".join(text), ttft, rate, len(arrivals)


def _via_control(daemon, n: int) -> tuple[str, float, float | None, int]:
    arrivals, text = [], []
    sent = time.perf_counter()
    for event in daemon.generate(PROMPT, max_tokens=n, raw=True):
        if "token" in event:
            arrivals.append(time.perf_counter())
        text.append(event.get("text", ""))
    ttft, rate = _rates(sent, arrivals)
    return "".join(text), ttft, rate, len(arrivals)


def run(quick: bool = False, progress: TextIO | None = None, options=None) -> dict:
    import httpx

    from meshd.daemon.local_swarm import DEMO_KV_TOKENS, DEMO_NODES, LocalSwarm
    from meshd.plan.assignment import even_memory_for
    from meshd.plan.footprint import artifact_footprint
    from native.packaged import smollm2_artifact

    new_tokens = 32 if quick else 64
    rounds = 3 if quick else 6
    model = smollm2_artifact()
    memory = even_memory_for(artifact_footprint(model, "bench"), DEMO_NODES, DEMO_KV_TOKENS)
    root = Path(tempfile.mkdtemp(prefix="meshd-bench-api-"))
    swarm = LocalSwarm(root, model, kv_budget_tokens=DEMO_KV_TOKENS)
    try:
        entry = swarm.add(memory=memory)
        swarm.wait_serving(entry, 300)
        for _ in range(DEMO_NODES - 1):
            swarm.add(memory=memory)
        for d in swarm.daemons[1:]:
            swarm.wait_serving(d, 300)
        swarm.wait_covered(300, peers=DEMO_NODES)
        url = entry.api_url()
        model_id = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        _say(progress, f"swarm covered; entry API at {url}; {rounds} rounds of {new_tokens} tokens per edge")
        http = httpx.Client(timeout=600)
        _via_control(entry, 4)   # warm both edges (tokenizer, channels, relay-free routes)
        _via_api(http, url, model_id, 4)
        api, control, equal = [], [], True
        for i in range(rounds):
            order = (("api", lambda: _via_api(http, url, model_id, new_tokens)),
                     ("control", lambda: _via_control(entry, new_tokens)))
            texts = {}
            for name, fn in (order if i % 2 == 0 else order[::-1]):
                text, ttft, rate, count = fn()
                texts[name] = text
                (api if name == "api" else control).append((ttft, rate, count))
                _say(progress,
                     f"round {i + 1} {name}: ttft {ttft * 1000:.0f} ms, {rate or 0:.2f} tok/s, {count} tokens")
            equal = equal and texts["api"] == texts["control"]
        recent = httpx.get(f"{url}/meshd/status", timeout=60).json()["generations"]["recent"]
        http.close()
        mine = recent[:2 * rounds]
        at_entry = {edge: [g["decode_tokens_per_s"] for g in mine if g["edge"] == edge and g["decode_tokens_per_s"]]
                    for edge in ("http", "control")}
        ttft_at_entry = {edge: [g["ttft_s"] for g in mine if g["edge"] == edge and g["ttft_s"] is not None]
                         for edge in ("http", "control")}
        api_rate = statistics.median(r for _, r, _ in api if r)
        control_rate = statistics.median(r for _, r, _ in control if r)
        api_ttft = statistics.median(t for t, _, _ in api)
        control_ttft = statistics.median(t for t, _, _ in control)
        return {
            "new_tokens": new_tokens, "rounds": rounds, "nodes": DEMO_NODES, "model": model.name,
            "api_decode_tokens_per_s": round(api_rate, 3), "control_decode_tokens_per_s": round(control_rate, 3),
            "api_vs_control_decode_ratio": round(api_rate / control_rate, 4),
            "api_ttft_s": round(api_ttft, 4), "control_ttft_s": round(control_ttft, 4),
            "api_vs_control_ttft_ratio": round(api_ttft / control_ttft, 4),
            "api_decode_tokens_per_s_at_entry": round(statistics.median(at_entry["http"]), 3),
            "control_decode_tokens_per_s_at_entry": round(statistics.median(at_entry["control"]), 3),
            "api_ttft_s_at_entry": round(statistics.median(ttft_at_entry["http"]), 4),
            "control_ttft_s_at_entry": round(statistics.median(ttft_at_entry["control"]), 4),
            "tokens_equal": equal, "load_average": round(os.getloadavg()[0], 2),
        }
    finally:
        swarm.close()
        shutil.rmtree(root, ignore_errors=True)
