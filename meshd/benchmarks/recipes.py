"""``meshd bench recipes``: safetensors versus GGUF under the seeds' DGR-001 v1 contract.

Recipes (model: SmolLM2-135M-Instruct, the safetensors artifact that
``meshd.testing.models.smollm2_artifact`` dequantizes from the shipped Q4_1 GGUF,
and GGUFs converted from that same artifact by ``native.convert``):

  transformers-safetensors-reference  quality lane, the reference (float32:
                                      the artifact's own precision)
  llama.cpp-BF16                      quality lane (near-lossless)
  llama.cpp-Q8_0, llama.cpp-Q4_K_M    performance-fit lane

Each runs whole (one child process per recipe, ``recipe_runner``) and as a
2-shard route of two local ``meshd worker`` processes (``recipe_routes``).
The contract (``recipe_plan.evaluate``) judges the whole-model recipes, as
DGR-001 did; the routes add ``gguf_split_decode_ratio`` (2-shard llama.cpp
Q4_K_M route over whole-model llama.cpp Q4_K_M, same run). Prompts are
tokenized once with the artifact's tokenizer and every recipe gets the same
ids, so prompt and output token counts agree by construction.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

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

REFERENCE = "transformers-safetensors-reference"
GGUF_RECIPES = (("llama.cpp-BF16", "BF16", QUALITY), ("llama.cpp-Q8_0", "Q8_0", PERFORMANCE_FIT),
                ("llama.cpp-Q4_K_M", "Q4_K_M", PERFORMANCE_FIT))
THREADS = 2  # the whole machine: every recipe gets the same CPU budget
SPLIT_LAYER = 15  # SmolLM2 has 30 layers: two equal shards
REPO_ROOT = Path(__file__).resolve().parents[2]


def _say(progress: TextIO | None, message: str) -> None:
    if progress is not None:
        print(f"[bench recipes] {message}", file=progress, flush=True)


def _bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _run_child(spec: dict[str, Any], progress: TextIO | None) -> dict[str, Any]:
    from meshd.testing.procs import child_env

    with tempfile.TemporaryDirectory(prefix="meshd-recipe-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, "-m", "meshd.benchmarks.recipe_runner", str(spec_path)],
                              env=child_env(THREADS), cwd=REPO_ROOT, capture_output=True, text=True, timeout=3600)
    if progress is not None and proc.stderr:
        tail = [line for line in proc.stderr.splitlines() if line.startswith("[recipe")]
        print("\n".join(tail), file=progress, flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"recipe {spec['id']} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _entry(outcomes: list[Outcome], walls: dict[str, float], *, lane: str, route: bool,
           peak_rss: int, artifact_bytes: int, artifact: Path) -> dict[str, Any]:
    cells = {level: cell_metrics([o for o in outcomes if str(o.concurrency) == level], wall)
             for level, wall in walls.items()}
    return {"lane": lane, "route": route, "concurrency": cells, "peak_rss_bytes": peak_rss,
            "artifact_bytes": artifact_bytes, "artifact": artifact.name,
            "outputs": {k: list(v) for k, v in outputs_by_prompt(outcomes).items()},
            "errors": sorted({o.error for o in outcomes if not o.ok})[:5]}


def run(quick: bool, progress: TextIO | None, options=None) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from meshd.benchmarks.recipe_routes import measure_route, vocab_projection_probe
    from native.convert import convert
    from native.llama_engine import runtime_version
    from native.packaged import smollm2_artifact

    plan = Plan(repeats=1, warmups=1) if quick else Plan()
    artifact = smollm2_artifact("float32")
    tokenizer = AutoTokenizer.from_pretrained(artifact)
    prompts = {pid: tokenizer(text).input_ids for pid, text in PROMPTS}
    ggufs = {q: convert(artifact, q, tokenizer_pre="smollm", progress=progress) for _, q, _ in GGUF_RECIPES}
    plan_json = {"output_tokens": plan.output_tokens, "repeats": plan.repeats, "warmups": plan.warmups,
                 "concurrency": list(plan.concurrency), "chunk_tokens": plan.chunk_tokens}
    recipes: dict[str, dict[str, Any]] = {}

    whole = [(REFERENCE, "transformers", artifact, QUALITY)]
    whole += [(rid, "llama.cpp", ggufs[q], lane) for rid, q, lane in GGUF_RECIPES]
    for recipe_id, kind, path, lane in whole:
        _say(progress, f"{recipe_id}: whole model ({path.name})")
        spec = {"id": recipe_id, "kind": kind, "path": str(path), "dtype": "float32", "threads": THREADS,
                "plan": plan_json, "prompts": prompts}
        raw = _run_child(spec, progress)
        outcomes = [Outcome(**{**o, "tokens": tuple(o["tokens"])}) for o in raw["outcomes"]]
        recipes[recipe_id] = _entry(outcomes, raw["walls"], lane=lane, route=False,
                                    peak_rss=raw["peak_rss_bytes"], artifact_bytes=_bytes(path), artifact=path)

    routes = [(REFERENCE, "torch", artifact, QUALITY)]
    routes += [(rid, "llama.cpp", ggufs[q], lane) for rid, q, lane in GGUF_RECIPES]
    for recipe_id, backend, path, lane in routes:
        route_id = f"{recipe_id}@2-shard-route"
        _say(progress, f"{route_id}: workers 0:{SPLIT_LAYER} + {SPLIT_LAYER}:30")
        outcomes, walls, rss = measure_route(path, backend, SPLIT_LAYER, 30, plan, prompts, THREADS, progress)
        recipes[route_id] = _entry(outcomes, walls, lane=lane, route=True, peak_rss=rss,
                                   artifact_bytes=_bytes(path), artifact=path)

    def decode_text(tokens) -> str:
        return str(tokenizer.decode(list(tokens), skip_special_tokens=False))

    reference_outputs = {k: tuple(v) for k, v in recipes[REFERENCE]["outputs"].items()}
    for recipe_id, entry in recipes.items():
        if recipe_id != REFERENCE:
            entry["drift"] = drift({k: tuple(v) for k, v in entry["outputs"].items()}, reference_outputs,
                                   decode_text)
            entry["drift"]["advisory"] = entry["lane"] == PERFORMANCE_FIT
    _say(progress, "quality diagnosis: llama.cpp F32 control and first divergences of the BF16 lane")
    from meshd.benchmarks.recipe_diagnose import diagnose

    f32 = convert(artifact, "F32", tokenizer_pre="smollm", progress=progress)
    bf16_outputs = {k: tuple(v) for k, v in recipes["llama.cpp-BF16"]["outputs"].items()}
    diagnosis = diagnose(artifact, {**ggufs, "F32": f32}, prompts, reference_outputs, {"BF16": bf16_outputs},
                         plan.output_tokens, THREADS)
    _say(progress, "vocabulary projection probe (head 0:15, Q4_K_M)")
    probe = vocab_projection_probe(ggufs["Q4_K_M"], SPLIT_LAYER, 30, prompts["long-summary"], threads=THREADS)
    contract = evaluate(recipes, REFERENCE, Thresholds())

    def c1(recipe_id: str, key: str = "decode_tokens_per_sec") -> float:
        return recipes[recipe_id]["concurrency"]["1"][key]

    q4 = "llama.cpp-Q4_K_M"
    split_ratio = round(c1(f"{q4}@2-shard-route") / c1(q4), 4) if c1(q4) else 0.0
    bf16_drift = recipes["llama.cpp-BF16"]["drift"]
    return {
        "verdict": contract["verdict"],
        "quality_exact_match": bf16_drift["exact_match_rate"],
        "quality_similarity": bf16_drift["mean_similarity"],
        "gguf_split_decode_ratio": split_ratio,
        "gguf_split_decode_ratio_pass": split_ratio >= Thresholds().min_gguf_split_decode_ratio,
        "q4_decode_speedup": round(c1(q4) / c1(REFERENCE), 4) if c1(REFERENCE) else 0.0,
        "contract": contract,
        "vocab_projection_probe": probe,
        "quality_diagnosis": diagnosis,
        "recipes": recipes,
        "plan": {**plan_json, "prompts": {k: len(v) for k, v in prompts.items()}, "quick": quick,
                 "model": "SmolLM2-135M-Instruct (dequantized from Q4_1)", "reference_dtype": "float32",
                 "threads_per_process": THREADS, "split_layer": SPLIT_LAYER},
        "host": {"platform": platform.platform(), "python": platform.python_version(),
                 "cpu_count": __import__("os").cpu_count(), "runtime": runtime_version()},
    }
