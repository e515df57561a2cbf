"""Why a GGUF quality lane disagrees with the reference: a runtime control and near-ties.

Two measurements, both in-process after the timed runs:

* **Runtime control**: the same artifact converted to an F32 GGUF (lossless:
  the reference's own weights) and run whole in llama.cpp. If its greedy
  outputs match the transformers reference, llama.cpp and the GGUF path are
  numerically sound and any BF16 divergence comes from bf16 itself (weights
  rounded to 8 mantissa bits, activations rounded before every matmul).
* **First divergence**: for every prompt where a recipe's tokens leave the
  reference's, both runtimes score the common prefix (prompt + the reference
  tokens before the divergence); the report gives each side's top-2 tokens,
  the reference's top-1/top-2 logit margin, and the largest logit difference.
  A margin within the observed logit noise is a near-tie, not a broken runtime.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

CHUNK_TOKENS = 128


def _top2(logits: np.ndarray) -> tuple[int, int, float]:
    order = np.argsort(-logits, kind="stable")[:2]
    return int(order[0]), int(order[1]), float(logits[order[0]] - logits[order[1]])


def _llama_whole(path, max_tokens: int, threads: int):
    from native.gguf_range import model_info, open_reader
    from native.llama_backend import LlamaBackendConfig, LlamaRangeBackend
    from shard.model.backend import LayerRange

    layers = model_info(open_reader(path)).num_layers
    return LlamaRangeBackend(path, LayerRange(0, layers, layers),
                             LlamaBackendConfig(n_threads=threads, kv_budget_tokens=max_tokens, max_sessions=1),
                             progress=None)


def _llama_logits(backend, ids: Sequence[int]) -> np.ndarray:
    cache = backend.new_cache(len(ids) + 1)
    try:
        arr = np.asarray(ids, np.int64)
        for first in range(0, len(arr), CHUNK_TOKENS):
            logits = backend.forward(cache, arr[first:first + CHUNK_TOKENS], effective_start=0)
        return logits
    finally:
        cache.release()


def _llama_greedy(backend, ids: Sequence[int], n: int) -> list[int]:
    cache = backend.new_cache(len(ids) + n + 1)
    try:
        arr = np.asarray(ids, np.int64)
        for first in range(0, len(arr), CHUNK_TOKENS):
            logits = backend.forward(cache, arr[first:first + CHUNK_TOKENS], effective_start=0)
        tokens = [int(np.argmax(logits))]
        while len(tokens) < n:
            tokens.append(int(np.argmax(backend.forward(cache, np.asarray(tokens[-1:]), effective_start=0))))
        return tokens
    finally:
        cache.release()


def diagnose(artifact, ggufs: Mapping[str, Any], prompts: Mapping[str, list[int]],
             reference: Mapping[str, Sequence[int]], recipes: Mapping[str, Mapping[str, Sequence[int]]],
             n_tokens: int, threads: int = 2) -> dict[str, Any]:
    """``ggufs``: qtype -> path (needs "F32"); ``recipes``: recipe qtype -> prompt -> tokens."""
    import torch

    from shard.model.reference import WholeModel

    torch.set_num_threads(threads)
    longest = max(len(p) for p in prompts.values()) + n_tokens + 1
    control = _llama_whole(ggufs["F32"], longest, threads)
    report: dict[str, Any] = {"control_recipe": "llama.cpp-F32 (lossless GGUF of the reference weights)"}
    try:
        control_out = {pid: _llama_greedy(control, ids, n_tokens) for pid, ids in prompts.items()}
        report["control_exact_match"] = round(
            sum(tuple(control_out[p]) == tuple(reference[p]) for p in prompts) / len(prompts), 4)
        whole = WholeModel(artifact, "float32")
        divergences = []
        for qtype, outputs in recipes.items():
            backend = _llama_whole(ggufs[qtype], longest, threads)
            try:
                for pid, ids in prompts.items():
                    want, got = list(reference[pid]), list(outputs[pid])
                    k = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
                    if k is None:
                        continue
                    prefix = list(ids) + want[:k]
                    ref_logits = whole.generate(prefix, 1).logits[0]
                    got_logits = _llama_logits(backend, prefix)
                    ctl_logits = _llama_logits(control, prefix)
                    r1, r2, r_margin = _top2(ref_logits)
                    g1, g2, g_margin = _top2(got_logits)
                    divergences.append({
                        "recipe": qtype, "prompt_id": pid, "first_divergent_token": k,
                        "reference_top2": [r1, r2], "reference_margin": round(r_margin, 5),
                        "recipe_top2": [g1, g2], "recipe_margin": round(g_margin, 5),
                        "recipe_max_abs_logit_diff": round(float(np.abs(got_logits - ref_logits).max()), 5),
                        "control_max_abs_logit_diff": round(float(np.abs(ctl_logits - ref_logits).max()), 5),
                        "near_tie": bool(r_margin <= float(np.abs(got_logits - ref_logits).max())),
                    })
            finally:
                backend.close()
        report["divergences"] = divergences
    finally:
        control.close()
    return report
