"""The whole-model reference: transformers' own CausalLM in one process.

What split runs are compared against: ``AutoModelForCausalLM`` with the same
attention implementation (sdpa), dtype, chunked prefill plan and a
``DynamicCache``; logits of the last position only (``logits_to_keep=1``, as
``generate`` does). One layout differs from a stock model, as in the ranges: the LM
head and the decoder layers' dense projections of a family whose ranges run them
input-major (``adapters.InputMajorLinear``, the same product with a faster CPU
kernel; within ~1e-6 relative of ``nn.Linear``) run input-major here too, so a
split run and this reference compute every op alike and their logits stay equal
bit for bit. Greedy ties break to the lowest token id; with a
``SamplingSpec`` each token is drawn as a sampling tail draws it
(shard/model/sampling.py: a pure function of the seed and the token's position).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from shard.model.adapters import ATTN_IMPLEMENTATION
from shard.model.sampling import SamplingSpec, sample_token
from shard.model.torch_backend import DTYPES

DEFAULT_CHUNK_TOKENS = 128


@dataclass(slots=True)
class ReferenceResult:
    tokens: list[int]
    logits: list[np.ndarray] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0


def greedy(logits: np.ndarray) -> int:
    """argmax with ties to the lowest id (np.argmax returns the first maximum)."""
    return int(np.argmax(logits))


class WholeModel:
    def __init__(self, path: str | os.PathLike, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM

        # Experts (MoE models) run the per-expert loop, as the range adapters do (shard/experts/adapters.py).
        self.model = AutoModelForCausalLM.from_pretrained(
            Path(path), dtype=DTYPES[dtype][0], attn_implementation=ATTN_IMPLEMENTATION,
            experts_implementation="eager",
        ).eval()
        from shard.model.adapters import adapter_for

        self.model.lm_head = adapter_for(self.model.config).apply_layout(self.model.model.layers,
                                                                         self.model.lm_head)

    def _step(self, ids: Sequence[int], cache) -> np.ndarray:
        out = self.model(input_ids=torch.tensor([list(ids)], dtype=torch.long), past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float().numpy()

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, sampling: SamplingSpec | None = None) -> ReferenceResult:
        import time

        from transformers import DynamicCache

        result = ReferenceResult(tokens=[])
        with torch.inference_mode():
            cache = DynamicCache(config=self.model.config)
            t0 = time.perf_counter()
            for first in range(0, len(prompt_ids), chunk_tokens):
                logits = self._step(prompt_ids[first:first + chunk_tokens], cache)
            result.prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(max_new_tokens):
                result.logits.append(logits)
                token = greedy(logits) if sampling is None else sample_token(logits, sampling, len(prompt_ids) + i)
                result.tokens.append(token)
                if i + 1 < max_new_tokens:
                    logits = self._step([token], cache)
            result.decode_s = time.perf_counter() - t0
        return result
