"""``meshd bench relay``: the same route with its last hop direct (gRPC) and relayed (libp2p circuit).

Setup (real processes on loopback): a seeded random Llama with hidden 1024 and
2 layers; worker A serves layer 0:1 (the head, always direct), worker B serves
1:2 (the tail). B is reached either directly over gRPC, or through
``meshd relay`` via a bare home node (meshd/benchmarks/relay_home.py) that forwards the
relayed session to B over its Unix frame socket. The entry node is this process:
the route driver (SwarmDriver over a fixed route) with a libp2p host in a
LoopThread (relay/portal.py; meshd/benchmarks/relay_harness.py).

Measured side by side in one run (medians over repeats, alternating order):
* ``*_step_ms``: one decode step through the route (the hidden row crosses
  the measured hop and the tail's token id comes back), the median over every decode
  step of every repeat; the difference is the cost of relaying that one hop
  (``relayed_step_overhead_ms``). ``*_step_mean_ms`` and
  ``relayed_step_overhead_mean_ms``: the same from each repeat's mean step
  (the median of those), which a stray slow step (GC, a noisy neighbour) moves.
* ``*_chunk_mb_s``: prefill with 256-token chunks, i.e. 1 MiB fp32 hidden
  frames into the measured hop, MiB per second of prefill (compute included
  on both sides, identical for both transports).
* ``tokens_equal``: direct, relayed and the whole model in one process give
  the same greedy tokens; ``max_logit_diff`` is relayed vs whole model, from
  one more relayed run that asks the tail for its logits rows.
* ``bare_libp2p_relayed_rtt_ms``: the floor under the overhead, measured in
  the same run: an ``ECHO_FRAME_BYTES`` frame to the same home node through the same
  relay and back, timed inside a trio loop (libp2p + framing, none of our
  thread bridges, no gRPC, no compute).
* ``relayed_step_breakdown_ms``: one extra relayed decode run with
  relay.trace enabled in the entry and the home node; the median time of each
  segment of a decode step's path (cross-process CLOCK_MONOTONIC marks).
"""
from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

MIB = 1024 * 1024
# The reference point: a bare py-libp2p relayed round trip of an 8 KiB frame.
ECHO_FRAME_BYTES = 8 * 1024
HIDDEN = 1024
CHUNK_TOKENS = MIB // (HIDDEN * 4)          # one chunk of fp32 hidden rows = 1 MiB
MODEL = dict(hidden_size=HIDDEN, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=2048)


def _say(progress, line: str) -> None:
    if progress is not None:
        print(f"[bench relay] {line}", file=progress, flush=True)


def run(quick: bool, progress=None, options=None) -> dict:
    import numpy as np

    from meshd.benchmarks import relay_harness as H
    from meshd.testing.models import build_random_llama
    from relay import trace
    from shard.model.reference import WholeModel

    repeats = 1 if quick else 3
    decode_tokens = 16 if quick else 48
    chunks = 2 if quick else 4
    model = build_random_llama(seed=0, **MODEL)
    workdir = Path(tempfile.mkdtemp(prefix="meshd-bench-relay-"))
    trace_dir = workdir / "trace"
    trace_dir.mkdir()
    kids = []
    try:
        _say(progress, "starting the relay, two workers and the home node")
        relay = H.spawn_relay(workdir, "/ip4/127.0.0.1/tcp/0")
        kids.append(relay)
        head, tail = H.spawn_worker(workdir, model, "0:1"), H.spawn_worker(workdir, model, "1:2")
        kids += [head, tail]
        # The home node records trace marks from the start (a list append per frame);
        # the entry only during the extra traced run below.
        os.environ[trace.TRACE_ENV] = str(trace_dir)
        try:
            home = H.spawn_home_node(workdir, "home", "/ip4/127.0.0.1/tcp/0", relay.ready["addrs"][0],
                                     tail.ready["unix"], bench_echo=True)
        finally:
            os.environ.pop(trace.TRACE_ENV, None)
        kids.append(home)
        peer = home.ready["peer_id"]

        def hop(endpoint, start, end):
            return {"endpoint": endpoint, "start": start, "end": end, "num_layers": 2}

        routes: dict[str, dict] = {
            "direct": {"hops": [hop(head.ready["listen"], 0, 1), hop(tail.ready["listen"], 1, 2)]},
            "relayed": {"hops": [hop(head.ready["listen"], 0, 1), hop("p2p:" + peer, 1, 2)],
                        "relayed": {peer: home.ready["relayed_addrs"][0]}},
        }
        rng = np.random.default_rng(0)
        short = [int(t) for t in rng.integers(3, 380, size=16)]
        long = [int(t) for t in rng.integers(3, 380, size=chunks * CHUNK_TOKENS)]
        steps: dict[str, list[float]] = {"direct": [], "relayed": []}          # per repeat: mean step
        each_step: dict[str, list[float]] = {"direct": [], "relayed": []}      # every decode step
        rates: dict[str, list[float]] = {"direct": [], "relayed": []}
        tokens: dict[str, list] = {"direct": [], "relayed": []}
        for rep in range(repeats):
            for name in (("direct", "relayed") if rep % 2 == 0 else ("relayed", "direct")):
                _say(progress, f"repeat {rep + 1}/{repeats}: {name} decode of {decode_tokens} tokens")
                out = H.drive({**routes[name], "prompt": short, "max_new_tokens": decode_tokens})
                steps[name].append(out["decode_s"] / (decode_tokens - 1) * 1e3)
                each_step[name] += [ns / 1e6 for ns in out["step_wall_ns"]]
                tokens[name].append(out["tokens"])
                _say(progress, f"repeat {rep + 1}/{repeats}: {name} prefill of {chunks} x 1 MiB chunks")
                out = H.drive({**routes[name], "prompt": long, "max_new_tokens": 1,
                               "chunk_tokens": CHUNK_TOKENS})
                rates[name].append(chunks / out["prefill_s"])
                tokens[name].append(out["tokens"])
        _say(progress, "relayed pass with the tail's logits rows (for max_logit_diff)")
        checked = H.drive({**routes["relayed"], "prompt": short, "max_new_tokens": decode_tokens,
                           "return_logits": True})
        logits = checked["logits"]
        tokens["relayed"].append(checked["tokens"])
        _say(progress, f"bare libp2p relayed round trips of {ECHO_FRAME_BYTES} B")
        echo = H.relayed_echo_rtts(routes["relayed"]["relayed"][peer], frame_bytes=ECHO_FRAME_BYTES,
                                   count=decode_tokens * repeats)
        _say(progress, "traced relayed decode (breakdown)")
        trace.enable(trace_dir)
        try:
            traced = H.drive({**routes["relayed"], "prompt": short, "max_new_tokens": decode_tokens})
        finally:
            trace.disable()
        home.stop()                 # writes its marks at exit
        breakdown = trace.breakdown(trace_dir, last=decode_tokens - 1)
        if breakdown:
            # Inside h.iter_yield->h.pump_got: the worker's own compute, as it reports it.
            breakdown["worker_execution_mean"] = round(traced["hop_execution_ns"][-1] / decode_tokens / 1e6, 3)
        _say(progress, "whole-model reference")
        whole = WholeModel(model).generate(short, decode_tokens)
        max_diff = max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(logits, whole.logits))
        direct_ms, relayed_ms = statistics.median(each_step["direct"]), statistics.median(each_step["relayed"])
        direct_mean, relayed_mean = statistics.median(steps["direct"]), statistics.median(steps["relayed"])
        equal = (all(t == tokens["direct"][0] for t in tokens["direct"][::2] + tokens["relayed"][::2])
                 and all(t == tokens["direct"][1] for t in tokens["direct"][1::2] + tokens["relayed"][1::2])
                 and tokens["direct"][0] == whole.tokens)
        return {
            "direct_step_ms": round(direct_ms, 3),
            "relayed_step_ms": round(relayed_ms, 3),
            "relayed_step_overhead_ms": round(relayed_ms - direct_ms, 3),
            "direct_step_mean_ms": round(direct_mean, 3),
            "relayed_step_mean_ms": round(relayed_mean, 3),
            "relayed_step_overhead_mean_ms": round(relayed_mean - direct_mean, 3),
            "direct_chunk_mb_s": round(statistics.median(rates["direct"]), 3),
            "relayed_chunk_mb_s": round(statistics.median(rates["relayed"]), 3),
            "tokens_equal": bool(equal),
            "bare_libp2p_relayed_rtt_ms": round(statistics.median(echo), 3),
            "relayed_step_breakdown_ms": breakdown,
            "max_logit_diff": max_diff,
            "decode_tokens": decode_tokens, "prefill_chunks": chunks, "chunk_bytes": MIB,
            "repeats": repeats, "route": "head 0:1 direct + tail 1:2 (measured hop)",
        }
    finally:
        for kid in reversed(kids):
            kid.stop()
