"""The recipe benchmark's pure parts: cell metrics, drift and the locked DGR-001 verdict."""
from __future__ import annotations

import pytest

from meshd.benchmarks.recipe_plan import (
    PERFORMANCE_FIT,
    PROMPTS,
    QUALITY,
    Outcome,
    Plan,
    Thresholds,
    cell_metrics,
    drift,
    evaluate,
    outputs_by_prompt,
)


def test_cell_metrics_follow_the_conventions():
    outcomes = [Outcome("a", 1, 0, True, 10, tuple(range(32)), ttft_s=0.1, decode_s=0.31),
                Outcome("b", 1, 0, True, 20, tuple(range(32)), ttft_s=0.3, decode_s=0.62),
                Outcome("c", 1, 0, False, 5, error="boom")]
    cell = cell_metrics(outcomes, wall_s=2.0)
    assert cell["requests"] == 3 and cell["failures"] == 1
    assert cell["decode_tokens_per_sec"] == pytest.approx((100 + 50) / 2)  # 31 tokens after the first
    assert cell["prefill_tokens_per_sec"] == pytest.approx((100 + 66.6667) / 2, rel=1e-4)
    assert cell["aggregate_tokens_per_sec"] == 32.0
    assert cell["ttft_p50_ms"] in (100.0, 300.0) and cell["ttft_p95_ms"] == 300.0


def test_drift_counts_exact_and_similar_outputs():
    reference = {"a": (1, 2, 3), "b": (4, 5, 6)}
    got = {"a": (1, 2, 3), "b": (4, 9, 6)}
    result = drift(got, reference, lambda toks: " ".join(map(str, toks)))
    assert result["compared_prompts"] == 2 and result["exact_match_rate"] == 0.5
    assert 0.5 < result["mean_similarity"] < 1.0
    assert result["per_prompt"][1]["first_divergent_token"] == 1


def test_outputs_by_prompt_prefers_single_requests():
    outcomes = [Outcome("a", 4, 0, True, 1, (9,)), Outcome("a", 1, 0, True, 1, (7,))]
    assert outputs_by_prompt(outcomes) == {"a": (7,)}


def _recipe(lane, decode, ttft, aggregate, rss, size, exact=1.0, sim=1.0, failures=0):
    cell = {"decode_tokens_per_sec": decode, "ttft_p50_ms": ttft, "aggregate_tokens_per_sec": aggregate,
            "failures": failures}
    return {"lane": lane, "route": False, "concurrency": {"1": cell, "4": cell}, "peak_rss_bytes": rss,
            "artifact_bytes": size,
            "drift": {"compared_prompts": len(PROMPTS), "exact_match_rate": exact, "mean_similarity": sim}}


@pytest.mark.parametrize("quality,fast,small,verdict", [
    ((1.0, 1.0), True, True, "promote"),
    ((1.0, 1.0), True, False, "optimize"),
    ((1.0, 1.0), False, False, "stop"),
    ((0.67, 0.99), True, True, "stop"),  # a failed quality lane is never redeemed by speed
    ((1.0, 0.96), True, True, "stop"),
])
def test_verdict_rules(quality, fast, small, verdict):
    recipes = {
        "ref": _recipe(QUALITY, 10, 100, 10, 1000, 1000),
        "bf16": _recipe(QUALITY, 20, 100, 20, 900, 500, *quality),
        "q4": _recipe(PERFORMANCE_FIT, 30 if fast else 11, 90, 30 if fast else 11, 500 if small else 900, 300),
    }
    result = evaluate(recipes, "ref", Thresholds())
    assert result["verdict"] == verdict
    assert result["recipes"]["q4"]["measurements"]["decode_speedup"] == (3.0 if fast else 1.1)


def test_failures_cancel_benefits():
    recipes = {"ref": _recipe(QUALITY, 10, 100, 10, 1000, 1000),
               "bf16": _recipe(QUALITY, 20, 100, 20, 900, 500),
               "q4": _recipe(PERFORMANCE_FIT, 30, 90, 30, 500, 300, failures=1)}
    assert evaluate(recipes, "ref")["verdict"] == "stop"


def test_plan_is_validated():
    with pytest.raises(ValueError):
        Plan(output_tokens=1)
    assert Plan().output_tokens == 32 and Plan().concurrency == (1, 4)
