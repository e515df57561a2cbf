"""The recipe benchmark's plan, metrics and locked contract (pure functions, no I/O).

The plan and the thresholds are the seeds' DGR-001 v1 contract: three fixed
prompts (short, medium, long), greedy, 32 output tokens, repeats and
warm-ups, concurrency 1 and 4; a GGUF recipe earns a *speed* benefit with
decode >= 1.25x the reference at TTFT <= 1.25x, or aggregate throughput at
concurrency 4 >= 1.25x; a *fit* benefit with peak resident memory <= 0.75x;
the near-lossless quality lane must reach exact match >= 0.90 and mean text
similarity >= 0.97; failures must be 0. Verdict: ``stop`` when the quality
lane fails or no performance-fit recipe has any benefit, ``promote`` when a
performance-fit recipe has both, else ``optimize``. Only performance-fit
recipes can earn benefits; quantized drift is advisory.

Conventions: TTFT is prefill plus the first token's logits; decode tokens/s
counts the tokens after the first (llama.cpp's predicted_n - 1 convention,
which matches transformers' inter-token rate); aggregate tokens/s is every
generated token of a concurrency level over that level's wall time.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from difflib import SequenceMatcher
from typing import Any

PROMPTS: tuple[tuple[str, str], ...] = (
    ("short-fact", "The capital of France is"),
    ("medium-code", "Complete this Python function without commentary:\n\ndef fibonacci(n):\n"
                    "    \"\"\"Return the nth Fibonacci number for n >= 0.\"\"\"\n"),
    ("long-summary",
     "A distributed inference service divides a transformer across consumer machines. The tracker owns "
     "admission, routing, cancellation, accounting, and telemetry, while workers own only model execution. "
     "Every request carries an immutable model identity and revision. Workers must reject incompatible "
     "protocol versions and resource demands before allocating large buffers. Activation tensors are "
     "chunked, checksummed, bounded by negotiated limits, and propagated with explicit flow-control credits. "
     "A caller may disconnect at any time, so cancellation must release queued work, in-flight transfers, "
     "and cache reservations without double billing. Retries can occur after network failures, requiring "
     "idempotent request identifiers and deterministic completion accounting. The system keeps the existing "
     "safetensors path as a correctness reference while a native GGUF path is measured. Benchmarks compare "
     "the same prompts, output lengths, sampling policy, device, and concurrency, and they separate "
     "near-lossless quality checks from quantized speed and fit claims. Summarize the design priorities in "
     "three concise bullet points."),
)
QUALITY, PERFORMANCE_FIT = "quality", "performance-fit"


@dataclass(frozen=True, slots=True)
class Thresholds:
    """DGR-001 v1, locked before measuring; never tuned after a run."""

    min_decode_speedup: float = 1.25
    max_ttft_ratio: float = 1.25
    min_aggregate_throughput_speedup: float = 1.25
    max_resident_memory_ratio: float = 0.75
    max_artifact_size_ratio: float = 0.60
    min_quality_exact_match_rate: float = 0.90
    min_quality_mean_similarity: float = 0.97
    max_failure_rate: float = 0.0
    # The 2-shard llama.cpp route must keep this share of whole-model decode speed.
    min_gguf_split_decode_ratio: float = 0.85


@dataclass(frozen=True, slots=True)
class Plan:
    output_tokens: int = 32
    repeats: int = 3
    warmups: int = 2
    concurrency: tuple[int, ...] = (1, 4)
    chunk_tokens: int = 128

    def __post_init__(self) -> None:
        if self.output_tokens < 2 or self.repeats < 1 or self.warmups < 0 or not self.concurrency:
            raise ValueError("output_tokens >= 2, repeats >= 1, warmups >= 0, some concurrency")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request: who, which cell, what came out and how long each part took."""

    prompt_id: str
    concurrency: int
    repeat: int
    ok: bool
    prompt_tokens: int = 0
    tokens: tuple[int, ...] = ()
    ttft_s: float = 0.0
    decode_s: float = 0.0
    error: str = ""

    @property
    def decode_tokens(self) -> int:
        return max(0, len(self.tokens) - 1)


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def cell_metrics(outcomes: Sequence[Outcome], wall_s: float) -> dict[str, Any]:
    """Aggregate the requests of one (recipe, concurrency) cell."""
    good = [o for o in outcomes if o.ok]
    ttft = [o.ttft_s * 1000 for o in good]
    decode_rates = [o.decode_tokens / o.decode_s for o in good if o.decode_s > 0]
    prefill_rates = [o.prompt_tokens / o.ttft_s for o in good if o.ttft_s > 0]
    generated = sum(len(o.tokens) for o in good)
    return {
        "requests": len(outcomes),
        "failures": len(outcomes) - len(good),
        "ttft_p50_ms": round(_pct(ttft, 0.5), 3),
        "ttft_p95_ms": round(_pct(ttft, 0.95), 3),
        "prefill_tokens_per_sec": round(statistics.fmean(prefill_rates), 2) if prefill_rates else 0.0,
        "decode_tokens_per_sec": round(statistics.fmean(decode_rates), 2) if decode_rates else 0.0,
        "aggregate_tokens_per_sec": round(generated / wall_s, 2) if wall_s > 0 else 0.0,
        "wall_s": round(wall_s, 3),
    }


def outputs_by_prompt(outcomes: Sequence[Outcome]) -> dict[str, tuple[int, ...]]:
    """The first successful single-request output of each prompt (greedy: repeats agree)."""
    found: dict[str, tuple[int, ...]] = {}
    for o in sorted(outcomes, key=lambda o: (o.concurrency, o.repeat)):
        if o.ok and o.prompt_id not in found:
            found[o.prompt_id] = o.tokens
    return found


def drift(recipe: Mapping[str, tuple[int, ...]], reference: Mapping[str, tuple[int, ...]],
          decode_text) -> dict[str, Any]:
    """Exact-match rate (token sequences) and mean text similarity (difflib ratio)."""
    shared = sorted(set(recipe) & set(reference))
    per_prompt, exact, sims = [], 0, []
    for prompt_id in shared:
        want, got = reference[prompt_id], recipe[prompt_id]
        same = want == got
        exact += same
        want_text, got_text = decode_text(want), decode_text(got)
        sim = round(SequenceMatcher(None, want_text, got_text).ratio(), 4)
        sims.append(sim)
        first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b),
                     None if len(want) == len(got) else min(len(want), len(got)))
        per_prompt.append({"prompt_id": prompt_id, "exact_match": same, "similarity": sim,
                           "first_divergent_token": first, "reference_text": want_text, "recipe_text": got_text})
    return {
        "compared_prompts": len(shared),
        "exact_match_rate": round(exact / len(shared), 4) if shared else 0.0,
        "mean_similarity": round(statistics.fmean(sims), 4) if sims else 0.0,
        "per_prompt": per_prompt,
    }


def _ratio(value: float, reference: float) -> float:
    return round(value / reference, 4) if reference > 0 else 0.0


def evaluate(recipes: Mapping[str, Mapping[str, Any]], reference_id: str,
             thresholds: Thresholds = Thresholds()) -> dict[str, Any]:
    """Judge every whole-model GGUF recipe against the reference (rules in the docstring)."""
    t = thresholds
    ref = recipes[reference_id]
    evaluations: dict[str, Any] = {}
    quality_pass_all, any_speed, any_fit, quality_seen = True, False, False, False
    for recipe_id, entry in recipes.items():
        if recipe_id == reference_id or entry.get("route"):
            continue
        cells, ref_cells = entry["concurrency"], ref["concurrency"]
        c1, r1 = cells.get("1"), ref_cells.get("1")
        top = str(max(int(k) for k in cells))
        m: dict[str, Any] = {
            "decode_speedup": _ratio(c1["decode_tokens_per_sec"], r1["decode_tokens_per_sec"]),
            "ttft_ratio": _ratio(c1["ttft_p50_ms"], r1["ttft_p50_ms"]),
            "aggregate_throughput_speedup": _ratio(cells[top]["aggregate_tokens_per_sec"],
                                                   ref_cells[top]["aggregate_tokens_per_sec"]),
            "resident_memory_ratio": _ratio(entry["peak_rss_bytes"], ref["peak_rss_bytes"]),
            "artifact_size_ratio": _ratio(entry["artifact_bytes"], ref["artifact_bytes"]),
        }
        failures = sum(c["failures"] for c in cells.values())
        m["failures"] = failures
        speed = failures == 0 and (
            (m["decode_speedup"] >= t.min_decode_speedup and 0 < m["ttft_ratio"] <= t.max_ttft_ratio)
            or m["aggregate_throughput_speedup"] >= t.min_aggregate_throughput_speedup)
        fit = failures == 0 and 0 < m["resident_memory_ratio"] <= t.max_resident_memory_ratio
        m["artifact_size_win"] = 0 < m["artifact_size_ratio"] <= t.max_artifact_size_ratio
        quality = None
        if entry["lane"] == QUALITY:
            quality_seen = True
            d = entry["drift"]
            quality = (failures == 0 and d["compared_prompts"] == len(PROMPTS)
                       and d["exact_match_rate"] >= t.min_quality_exact_match_rate
                       and d["mean_similarity"] >= t.min_quality_mean_similarity)
            quality_pass_all = quality_pass_all and quality
        else:
            any_speed, any_fit = any_speed or speed, any_fit or fit
        evaluations[recipe_id] = {"lane": entry["lane"], "speed_benefit": speed, "fit_benefit": fit,
                                  "quality_pass": quality, "measurements": m}
    quality_lane_pass = quality_seen and quality_pass_all
    if not quality_lane_pass or not (any_speed or any_fit):
        verdict = "stop"
    elif any_speed and any_fit:
        verdict = "promote"
    else:
        verdict = "optimize"
    return {"verdict": verdict, "quality_lane_pass": quality_lane_pass, "speed_benefit": any_speed,
            "fit_benefit": any_fit, "recipes": evaluations, "thresholds": asdict(t)}
