"""``meshd bench pool``: does a pool of nodes run a model on little more memory than one machine alone?

    meshd bench pool [--quick] [--json]

Per lane (llama.cpp on a seeded 1.15 B-parameter llama GGUF, F16; torch on the
same shape as fp32 safetensors; both built once and cached), in one run:

1. **whole**: the model in one bare process, no meshd (meshd/benchmarks/pool_whole.py:
   llama-cpp-python alone, or transformers), with the workers' context, KV
   type, flash-attention setting and one thread; the prompt then NEW_TOKENS
   tokens. ``whole_peak_rss_bytes`` is its VmHWM from the end of the load
   (reset there, as the workers' is; transformers keeps the safetensors map
   it copied the tensors out of, resident and never read again: those pages
   are left out, ``whole_stale_map_bytes``): what one machine running the
   model alone needs. ``whole_peak_with_load_bytes``: over its whole life.
   Its tokens are the reference.
2. **pools**: for N = 2, 3, 4 (``--quick``: 3) the smallest equal ``--memory`` M
   at which N ``meshd join --layers auto --memory M`` daemons, each (daemon and
   worker) in a memory cgroup capped at exactly M (meshd/testing/cgroup.py;
   the page cache its processes fault in or write is charged to it, as on a
   machine of its own), cover the model and pass: greedy tokens equal to the
   whole model's, decode at least DECODE_FLOOR of the same swarm uncapped (a
   cap that holds only by evicting and re-reading weights is thrashing, not
   pooling), no OOM kill. The search: a trial at the planner's own smallest
   covering M (``threshold``: the pure planner over the lane's footprint,
   exactly what the daemons plan with), then FAIL_STEP below it, which must
   not pass, raising the pass point by STEP_UP while a trial fails (bounded).
   ``pool_vs_whole_N`` = N x M / whole_peak_rss_bytes.
   Each trial starts fresh daemons in fresh data directories; after the
   swarm covers the model it runs ROUNDS rounds alternating capped (limit M)
   and uncapped (limit raised to the machine) generations of NEW_TOKENS on
   the same daemons: ``decode_vs_uncapped`` = median capped decode tok/s /
   median uncapped. Per node it reads its published figures (weights, KV,
   working memory, worker base, daemon base: ``parts_mb``), its cgroup's peak
   (``max_peak_vs_memory``: the largest, capped or not, over M), the bytes its
   daemon and worker wrote to storage over its range's tensor bytes
   (``disk_written_vs_range``: the slice, once) and ``coverage_s`` (first
   daemon started -> the entry sees every layer served).
3. ``projected_pool_vs_whole_40gb_4``: the same parts scaled to a 40 GB model
   (80 layers, hidden 8192, ffn 28672, 8 KV heads of 128, a 128,256-token
   vocabulary, the default KV budget) on 4 nodes: the measured working memory
   times the lane's estimate for the big dims over its estimate for the
   measured ones, the measured worker base, the measured daemon peak plus the
   tokenizer of the bigger vocabulary (meshd/plan/footprint.py
   TOKENIZER_PEAK_PER_TOKEN), weights and KV from the dims; 4 x the smallest
   M with which 4 joiners cover it (the planner), over the whole model's
   weights + KV + its measured non-weight parts scaled alike.

Reports, per lane: ``whole_peak_rss_bytes``, ``pool_vs_whole_2/3/4``,
``projected_pool_vs_whole_40gb_4``, ``tokens_equal``, ``max_peak_vs_memory``,
``oom_kills``, ``disk_written_vs_range``, ``coverage_s``, ``decode_vs_uncapped``
(the last three and ``parts_mb`` from N = 3's passing run), ``parts_mb`` (per
node of it), ``cgroup`` ("v1", "v2" or "none": without one nothing is
capped and the pool figures say only what the planner allowed), plus
``memory_bytes_N`` and every trial. Ratios are memory, not speed, except
``decode_vs_uncapped`` (same daemons, alternating). Runs long (many daemon
starts of a 1 B model); needs root for the cgroups.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from meshd.errors import ConfigError

MIB = 1 << 20
LANES = ("llama.cpp", "torch")
SPLITS = (2, 3, 4)
QUICK_SPLITS = (3,)
# The seeded model: the shape of the 1.15 B llama the pool issue measured (TinyLlama's widths, 26 layers).
SHAPE = {"hidden": 2048, "layers": 26, "heads": 32, "kv_heads": 4, "head_dim": 64, "ffn": 5632, "context": 4096}
SEED = 35
NEW_TOKENS = 32
PROMPT = "A shard is a contiguous range of transformer layers. " * 4
# Rounds of (capped, uncapped) generations per trial; the quick run does one.
ROUNDS = 2
QUICK_ROUNDS = 1
DECODE_FLOOR = 0.9
# The trial below the pass point, as a fraction of it: it must fail (else the search goes lower).
FAIL_STEP = 0.02
# A failing trial at the planner's threshold is retried this much higher, at most MAX_RAISES times.
STEP_UP = 0.03
MAX_RAISES = 4
# Daemons load and validate a 1 B model (and cut its slices) on 2 shared cores: minutes, not seconds.
COVER_TIMEOUT_S = 600.0
# A trial that cannot cover (every node serving or refused, a gap left) is given up after this long
# with no change: room for the tracker to confirm the gap and move a range (minutes of loading).
STALL_S = 150.0
THREADS = 1
# The 40 GB model of the projection (a 70 B llama's widths); its vocabulary is the measured model's
# for the headline figure (the issue lists the dims that change), a real 128,256 for the variant.
BIG = {"bytes": 40 * 10**9, "layers": 80, "hidden": 8192, "ffn": 28672, "kv_heads": 8, "head_dim": 128, "vocab": 128256,
       "heads": 64}
# An uncapped cgroup: far above the machine, so the kernel never reclaims for it.
UNCAPPED = 1 << 50
# What a trial's progress line shows.
TRIAL_SUMMARY = ("covered", "tokens_equal", "decode_vs_uncapped", "oom_kills", "max_peak_vs_memory", "error")


def _say(progress: TextIO | None, line: str) -> None:
    if progress is not None:
        print(f"pool bench: {line}", file=progress, flush=True)


# ---------------------------------------------------------------------------------------------- models
def gguf_model() -> Path:
    from meshd.testing.gguf_models import build_random_gguf

    return build_random_gguf("llama", seed=SEED, qtype="F16", **SHAPE)


def torch_model() -> Path:
    from meshd.testing.models import build_random_llama

    return build_random_llama(seed=SEED, hidden_size=SHAPE["hidden"], intermediate_size=SHAPE["ffn"],
                              num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"],
                              num_key_value_heads=SHAPE["kv_heads"], max_position_embeddings=SHAPE["context"],
                              initializer_range=0.02)


def _model_of(lane: str) -> Path:
    return gguf_model() if lane == "llama.cpp" else torch_model()


# ---------------------------------------------------------------------------------------------- whole
def measure_whole(lane: str, model: Path, prompt: list[int], stops: frozenset[int], vocab: int) -> dict:
    """The bare whole-model process (pool_whole.py) inside an uncapped cgroup: its JSON + the cgroup's peak."""
    from meshd.daemon.local_swarm import child_env
    from meshd.testing.cgroup import MemoryCgroup

    cmd = [sys.executable, "-m", "meshd.benchmarks.pool_whole", lane, str(model),
           "--prompt", ",".join(map(str, prompt)), "--stop", ",".join(map(str, sorted(stops))),
           "--tokens", str(NEW_TOKENS), "--threads", str(THREADS), "--vocab", str(vocab)]
    with MemoryCgroup.create(f"meshd-pool-bench-{os.getpid()}-whole", UNCAPPED) as group:
        done = subprocess.run(group.wrap(cmd), env=child_env(THREADS), capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise ConfigError(f"the whole-model process failed: {done.stderr[-2000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["cgroup_peak_bytes"] = group.peak()
    return result


# ---------------------------------------------------------------------------------------------- planning
def threshold(fp, nodes: int, kv_tokens: int) -> int:
    """The smallest equal memory (to the byte) with which ``nodes`` joiners cover the model, per the planner."""
    from meshd.plan.assignment import simulate_joins
    from meshd.plan.errors import NoFitError

    def covers(memory: int) -> bool:
        try:
            return simulate_joins(fp, nodes, memory, kv_tokens).fully_covered
        except NoFitError:
            return False

    lo, hi = 0, fp.range_bytes(0, fp.num_layers, kv_tokens)
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if covers(mid) else (mid, hi)
    return hi


# ---------------------------------------------------------------------------------------------- trials
def _io_written(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/io") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("write_bytes"))
    except (OSError, StopIteration, ValueError):
        return 0


def _settled(daemon) -> bool:
    """The daemon serves a range, or was told it gets none (the planner found no room for it)."""
    view = daemon.swarm() or {}
    text = daemon.text()[-4000:]
    return bool(view.get("serving")) or "cannot plan" in text or "refused:" in text


def _wait_covered(swarm, nodes: int, progress) -> float | None:
    """Seconds until the entry sees the model covered by ``nodes`` peers; None when the swarm settles
    with a gap (every daemon serving or refused, nothing changing for STALL_S) or a daemon dies."""
    start = last_change = time.monotonic()
    seen = None
    while time.monotonic() - start < COVER_TIMEOUT_S:
        view = swarm.daemons[0].swarm() or {}
        cov = view.get("coverage") or {}
        ads = view.get("ads") or ()
        if cov.get("fully_covered") and len(ads) >= nodes:
            return time.monotonic() - start
        state = tuple(sorted((a["start"], a["end"]) for a in ads))
        if state != seen:
            seen, last_change = state, time.monotonic()
        if time.monotonic() - last_change > STALL_S and all(_settled(d) for d in swarm.daemons):
            _say(progress, f"  no coverage: ranges {state} (settled, unchanged for {STALL_S:.0f} s)")
            return None
        if not all(d.alive() for d in swarm.daemons):
            return None
        time.sleep(1.0)
    return None


def trial(lane: str, model: Path, nodes: int, memory: int, expected: list[int], rounds: int, progress,
          range_bytes) -> dict:
    """N capped daemons at ``memory``: covered? tokens? decode capped vs uncapped? parts, peaks, disk."""
    from meshd.benchmarks import daemon_runs as R
    from meshd.daemon.local_swarm import LocalSwarm
    from meshd.testing.cgroup import MemoryCgroup

    root = Path(tempfile.mkdtemp(prefix=f"meshd-pool-{nodes}-"))
    groups = [MemoryCgroup.create(f"meshd-pool-bench-{os.getpid()}-{nodes}-{i}", memory) for i in range(nodes)]
    out: dict = {"nodes": nodes, "memory_bytes": memory, "passed": False}
    env = os.environ.pop("MESHD_SLICE_CACHE", None)   # each node's slice goes into its own data dir
    t0 = time.monotonic()
    try:
        with LocalSwarm(root, model, backend=lane, record_ttl_s=R.BENCH_RECORD_TTL_S, threads=THREADS) as swarm:
            for group in groups:
                swarm.add(memory=memory, wrap=group.wrap)
            covered = _wait_covered(swarm, nodes, progress)
            out["oom_kills"] = sum(g.oom_kills() for g in groups)
            if covered is None:
                out["covered"] = False
                return out
            out["covered"], out["coverage_s"] = True, round(time.monotonic() - t0, 1)
            startup = [g.peak() for g in groups]   # loading and cutting slices, capped
            entry = next(d for d in swarm.daemons if ((d.swarm() or {}).get("layers") or [1])[0] == 0)
            capped: list[float] = []
            uncapped: list[float] = []
            tokens_ok: list[bool] = []
            peaks = {"capped": [0] * nodes, "uncapped": [0] * nodes}
            R.generate(entry, PROMPT, 4)   # warm: routes opened, pages in
            for r in range(rounds):
                for phase in (("capped", "uncapped") if r % 2 == 0 else ("uncapped", "capped")):
                    for group in groups:
                        group.set_limit(memory if phase == "capped" else UNCAPPED)
                        group.reset_peak()
                    done = R.generate(entry, PROMPT, NEW_TOKENS)
                    (capped if phase == "capped" else uncapped).append(float(done.get("decode_tokens_per_s") or 0))
                    tokens_ok.append(list(done["tokens"]) == expected)
                    for i, group in enumerate(groups):
                        peaks[phase][i] = max(peaks[phase][i], group.peak())
            for group in groups:
                group.set_limit(memory)
            out["tokens_equal"] = all(tokens_ok)
            out["decode_capped_tok_s"] = round(statistics.median(capped), 3)
            out["decode_uncapped_tok_s"] = round(statistics.median(uncapped), 3)
            out["decode_vs_uncapped"] = round(out["decode_capped_tok_s"] / out["decode_uncapped_tok_s"], 3) \
                if out["decode_uncapped_tok_s"] else 0.0
            peaks["startup"] = startup
            out["peak_bytes"] = peaks
            (records,) = (entry.query("status") or {})["coverage"].values()
            parts, written = [], []
            for d in swarm.daemons:
                view = d.swarm() or {}
                layers = tuple(view.get("layers") or (0, 0))
                pid_list = [d.proc.pid, *d.worker_pids()]
                record = next((r for r in records if r["peer_id"] == view.get("peer_id")), None)
                mem = record["memory"] if record else {}
                parts.append({"layers": list(layers), "weights": mem.get("weight_bytes", 0) / MIB,
                              "kv": mem.get("kv_bytes", 0) / MIB, "working": mem.get("working_bytes", 0) / MIB,
                              "worker_base": mem.get("worker_base_bytes", 0) / MIB,
                              "daemon_base": mem.get("daemon_base_bytes", 0) / MIB})
                wrote = sum(_io_written(pid) for pid in pid_list)
                written.append(wrote / max(1, range_bytes(*layers)) if layers != (0, 0) else 0.0)
            out["parts_mb"] = [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in p.items()} for p in parts]
            out["disk_written_vs_range"] = round(max(written), 4)
            out["oom_kills"] = sum(g.oom_kills() for g in groups)
            out["max_peak_vs_memory"] = round(max(max(v) for v in peaks.values()) / memory, 4)
            out["alive"] = all(d.alive() for d in swarm.daemons)
            out["passed"] = bool(out["tokens_equal"] and out["decode_vs_uncapped"] >= DECODE_FLOOR
                                 and out["oom_kills"] == 0 and out["alive"])
            return out
    except Exception as exc:  # noqa: BLE001 - a trial that breaks is a failed trial, said why
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return out
    finally:
        out.setdefault("oom_kills", sum(g.oom_kills() for g in groups))
        for group in groups:
            group.close()
        shutil.rmtree(root, ignore_errors=True)
        if env is not None:
            os.environ["MESHD_SLICE_CACHE"] = env
        shown = {k: out[k] for k in TRIAL_SUMMARY if k in out}
        verdict = "PASS" if out["passed"] else "fail"
        _say(progress, f"  N={nodes} M={memory / MIB:.0f} MiB: {verdict} {json.dumps(shown)}")


def search(lane: str, model: Path, nodes: int, start: int, expected, rounds, progress, range_bytes) -> dict:
    """The smallest passing M near the planner's threshold (module docstring); every trial kept."""
    trials = []
    memory, passing = start, None
    for _ in range(MAX_RAISES + 1):
        t = trial(lane, model, nodes, memory, expected, rounds, progress, range_bytes)
        trials.append(t)
        if t["passed"]:
            passing = t
            break
        memory = int(memory * (1 + STEP_UP))
    if passing is None:
        return {"memory_bytes": None, "passing": None, "trials": trials}
    while True:   # below the pass point: must fail
        lower = int(passing["memory_bytes"] * (1 - FAIL_STEP))
        t = trial(lane, model, nodes, lower, expected, rounds, progress, range_bytes)
        trials.append(t)
        if not t["passed"]:
            break
        passing = t
    return {"memory_bytes": passing["memory_bytes"], "passing": passing, "trials": trials}


# ---------------------------------------------------------------------------------------------- projection
def _working_estimate(lane: str, dims: dict, kv_tokens: int, *, head: bool) -> int:
    """The lane's working-memory estimate (meshd/plan/footprint.py) for ``dims``; ``head``: with the
    logits rows a llama.cpp head keeps (every row is an output there), else without them."""
    from meshd.plan.assignment import ModelFootprint
    from meshd.plan.footprint import llama_working_estimate, scratch_fields

    if lane == "llama.cpp":
        return llama_working_estimate(hidden=dims["hidden"], intermediate=dims["ffn"], vocab=dims["vocab"],
                                      kv_budget_tokens=kv_tokens, head=head)
    probe = ModelFootprint.uniform("sha256:" + "0" * 64, 1, 1, **scratch_fields(
        hidden=dims["hidden"], intermediate=dims["ffn"], heads=dims["heads"], vocab=dims["vocab"]))
    return probe.scratch_bytes(kv_tokens, tail=head)


def even_split_memory(fp, nodes: int, kv_tokens: int) -> int:
    """The smallest equal memory with which ``nodes`` contiguous ranges cover the model at all (each
    as long as it fits, left to right: optimal for contiguous ranges): what a planner that covers
    whenever the nodes' memory adds up needs."""
    def covers(memory: int) -> bool:
        start = 0
        for _ in range(nodes):
            end = start
            while end < fp.num_layers and fp.range_bytes(start, end + 1, kv_tokens) <= memory:
                end += 1
            if end == start:
                return False
            start = end
            if start == fp.num_layers:
                return True
        return False

    lo, hi = 0, fp.range_bytes(0, fp.num_layers, kv_tokens)
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if covers(mid) else (mid, hi)
    return hi


def projection(lane: str, info: dict, passing: dict, whole: dict, kv_tokens: int, vocab: int) -> dict:
    """N = 3's measured parts scaled to the 40 GB model on 4 nodes (module docstring); ``vocab``: the
    big model's vocabulary (the measured model's for the headline figure: only the listed dims change)."""
    from meshd.plan.assignment import ModelFootprint
    from meshd.plan.footprint import TOKENIZER_PEAK_PER_TOKEN

    parts = passing["parts_mb"]
    big = {**BIG, "vocab": vocab}
    # working memory: what was measured, moved by what the lane's estimate says the dims change
    heads = [p for p in parts if p["layers"][0] == 0]
    others = [p for p in parts if p["layers"][0] != 0] or heads
    def moved(head: bool) -> int:
        return _working_estimate(lane, big, kv_tokens, head=head) - _working_estimate(lane, info, kv_tokens, head=head)

    delta = moved(False)
    working = max(max(p["working"] for p in others) * MIB + delta, max(p["working"] for p in heads) * MIB + moved(True))
    worker_base = max(p["worker_base"] for p in parts) * MIB
    daemon_base = max(p["daemon_base"] for p in parts) * MIB + TOKENIZER_PEAK_PER_TOKEN * (vocab - info["vocab"])
    kv_width = 2 if lane == "llama.cpp" else 4
    per_layer_params = (2 * big["hidden"] ** 2 + 2 * big["hidden"] * big["kv_heads"] * big["head_dim"]
                        + 3 * big["hidden"] * big["ffn"])
    params = big["layers"] * per_layer_params + 2 * vocab * big["hidden"]
    per_param = big["bytes"] / params            # ~0.57 B: a 70 B-parameter model quantized to 40 GB
    embed = int(vocab * big["hidden"] * per_param)
    layer = int((big["bytes"] - 2 * embed) / big["layers"])
    kv_per_token_layer = 2 * big["kv_heads"] * big["head_dim"] * kv_width
    fp = ModelFootprint.uniform("sha256:" + "0" * 64, big["layers"], layer, head_extra_bytes=embed,
                                tail_extra_bytes=embed, kv_bytes_per_token_layer=kv_per_token_layer,
                                working_bytes=int(working), base_bytes=int(daemon_base + worker_base))
    memory = even_split_memory(fp, 4, kv_tokens)
    kv_whole = kv_tokens * kv_per_token_layer * big["layers"]
    # the whole process: its measured working memory moved alike (it keeps only the last rows' logits)
    whole_working = max(0, whole["peak_bytes"] - whole["weight_bytes"] - whole["kv_resident_bytes"]
                        - whole["base_bytes"]) + delta
    whole_big = big["bytes"] + kv_whole + whole_working + whole["base_bytes"]
    return {"ratio": round(4 * memory / whole_big, 4), "memory_bytes": memory,
            "planner_memory_bytes": threshold(fp, 4, kv_tokens), "whole_bytes": int(whole_big),
            "parts_mb": {"weights_per_node": round(big["bytes"] / 4 / MIB), "kv_per_node": round(kv_whole / 4 / MIB),
                         "working": round(working / MIB), "worker_base": round(worker_base / MIB),
                         "daemon_base": round(daemon_base / MIB)},
            "whole_nonweight_mb": round((whole_working + whole["base_bytes"]) / MIB)}


# ---------------------------------------------------------------------------------------------- lanes
def run_lane(lane: str, quick: bool, progress) -> dict:
    from meshd.config import DEFAULT_KV_BUDGET_TOKENS
    from meshd.generate.tokenizer import EntryTokenizer
    from meshd.plan.footprint import model_footprint
    from meshd.plan.modelinfo import model_digest
    from meshd.testing.cgroup import cgroup_version

    model = _model_of(lane)
    _say(progress, f"[{lane}] model {model} ({_size(model) / 1e9:.2f} GB); digest once (as a user's first join does)")
    digest = model_digest(model)
    fp = model_footprint(model, digest, lane)
    tok = EntryTokenizer(model)
    prompt = tok.encode_prompt(PROMPT, raw=True)
    kv = DEFAULT_KV_BUDGET_TOKENS
    info = {"hidden": SHAPE["hidden"], "ffn": SHAPE["ffn"], "heads": SHAPE["heads"], "vocab": _vocab(model)}
    _say(progress, f"[{lane}] the whole model alone ({len(prompt)} prompt tokens + {NEW_TOKENS})")
    whole = measure_whole(lane, model, prompt, tok.stop_ids, info["vocab"])
    # llama.cpp zeroes its whole KV buffer at start (resident); transformers grows a cache per token
    whole["kv_resident_bytes"] = kv * fp.kv_bytes_per_token_layer * fp.num_layers if lane == "llama.cpp" \
        else (len(prompt) + NEW_TOKENS) * fp.kv_bytes_per_token_layer * fp.num_layers
    expected = whole["tokens"]
    _say(progress, f"[{lane}] whole: peak {whole['peak_bytes'] / MIB:.0f} MiB, "
                   f"{whole['decode_tokens_per_s']:.2f} tok/s")
    result: dict = {"whole_peak_rss_bytes": whole["peak_bytes"], "whole_base_bytes": whole["base_bytes"],
                    "whole_peak_with_load_bytes": whole["peak_with_load_bytes"],
                    "whole_stale_map_bytes": whole.get("stale_map_bytes", 0),
                    "whole_cgroup_peak_bytes": whole["cgroup_peak_bytes"],
                    "whole_decode_tokens_per_s": round(whole["decode_tokens_per_s"], 3), "cgroup": cgroup_version(),
                    "model_bytes": _size(model), "kv_budget_tokens": kv}
    rounds = QUICK_ROUNDS if quick else ROUNDS

    def range_bytes(start: int, end: int) -> int:
        return sum(fp.layer_weight_bytes[start:end]) + (fp.head_extra_bytes if start == 0 else 0) + \
            (fp.tail_extra_bytes if end == fp.num_layers else 0)

    searches = {}
    for nodes in (QUICK_SPLITS if quick else SPLITS):
        start = threshold(fp, nodes, kv)
        _say(progress, f"[{lane}] N={nodes}: the planner covers the model from M = {start / MIB:.0f} MiB")
        found = search(lane, model, nodes, start, expected, rounds, progress, range_bytes)
        searches[nodes] = found
        result[f"memory_bytes_{nodes}"] = found["memory_bytes"]
        result[f"planner_threshold_bytes_{nodes}"] = start
        result[f"pool_vs_whole_{nodes}"] = round(nodes * found["memory_bytes"] / whole["peak_bytes"], 4) \
            if found["memory_bytes"] else None
    passing = [s["passing"] for s in searches.values() if s["passing"]]
    trials = [t for s in searches.values() for t in s["trials"]]
    three = searches.get(3, {}).get("passing")
    result.update({
        "tokens_equal": bool(passing) and all(p["tokens_equal"] for p in passing),
        "max_peak_vs_memory": max((p["max_peak_vs_memory"] for p in passing), default=None),
        "oom_kills": sum(t.get("oom_kills", 0) for t in trials),
        "oom_kills_in_passing_runs": sum(p["oom_kills"] for p in passing),
        "disk_written_vs_range": three["disk_written_vs_range"] if three else None,
        "coverage_s": three["coverage_s"] if three else None,
        "decode_vs_uncapped": three["decode_vs_uncapped"] if three else None,
        "parts_mb": three["parts_mb"] if three else None,
        "trials": trials,
    })
    if three:
        headline = projection(lane, info, three, whole, kv, int(info["vocab"]))
        real_vocab = projection(lane, info, three, whole, kv, BIG["vocab"])
        result.update({"projected_pool_vs_whole_40gb_4": headline["ratio"], "projected_40gb_4": headline,
                       "projected_pool_vs_whole_40gb_4_vocab128k": real_vocab["ratio"],
                       "projected_40gb_4_vocab128k": real_vocab})
    for nodes in (2, 3, 4):
        result.setdefault(f"pool_vs_whole_{nodes}", None)
    result.setdefault("projected_pool_vs_whole_40gb_4", None)
    return result


def _size(model: Path) -> int:
    return model.stat().st_size if model.is_file() else sum(f.stat().st_size for f in model.glob("*.safetensors"))


def _vocab(model: Path) -> int:
    if model.is_file():
        from native.gguf_range import model_info, open_reader

        return model_info(open_reader(model)).vocab_size
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def run(quick: bool = False, progress: TextIO | None = None, options=None) -> dict:
    from meshd.testing.cgroup import cgroup_version

    if cgroup_version() == "none":
        _say(progress, "no writable memory cgroup (run as root): nothing is capped; pool figures are the planner's")
    return {"lanes": {lane: run_lane(lane, quick, progress) for lane in LANES}}
