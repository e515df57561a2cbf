"""The torch lane's batched forward: rows of several sessions through one range at once.

Ragged, not padded: the rows of every session in the batch (a decode step is
one row, a prefill chunk T rows) are concatenated into one [1, R, hidden]
tensor. Everything that is row-wise -- the norms, the q/k/v and output
projections, the MLP, the final norm and the LM head -- runs once over all R
rows, so each weight matrix is read once per batch instead of once per
session (decode on a CPU is bound by reading the weights). Only attention is
per session: each session's rows get their own rotary positions, are appended
to that session's own ``DynamicCache`` and attend over it alone with the mask
the single-session path builds (``adapter._masks`` on that session's cache),
through the same attention function (sdpa). No padding, no copy of any cache,
and a cache never sees another session's rows.

The layer step mirrors ``LlamaDecoderLayer.forward`` / ``LlamaAttention.forward``
(and Qwen3's q/k norms, Mistral/Qwen2's sliding window argument) of
transformers 5.23 op for op; ``supports_batch`` admits only the plain
Llama-family adapter (Gemma 3's extra norms and softcap and the MoE families'
expert dispatch keep the one-session path: the scheduler runs their rows one
after another).

The LM head runs on one row per session (the last position of each). It and the
layers' projections run input-major (``adapters.InputMajorLinear``: with one thread
their 1- to 3-row products are 15-50% cheaper than ``nn.Linear``'s, which goes row by
row below 4 rows).

Exactness: the ops per row are the single-session ones, but a matrix product
over R rows may take another kernel than over one row, so batched logits may
differ from the alone run in the last bits; tests/test_batching.py measures the
difference and checks greedy tokens stay equal.
"""
from __future__ import annotations

import importlib

import numpy as np
import torch

from shard.model.adapters import ATTN_IMPLEMENTATION, LlamaFamily


def supports_batch(backend) -> bool:
    return type(backend.adapter) is LlamaFamily and backend.exchange is None


def _attention_parts(adapter):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    module = importlib.import_module(f"transformers.models.{adapter.config.model_type}."
                                     f"modeling_{adapter.config.model_type}")
    return module.apply_rotary_pos_emb, ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]


def forward_rows(backend, caches, inputs_list, effective_start: int, to_torch, to_numpy) -> list:
    """One forward over every session's rows; returns one output (or exception) per session."""
    from transformers import DynamicCache

    results: list = [None] * len(caches)
    live: list[int] = []
    for index, (cache, inputs) in enumerate(zip(caches, inputs_list)):
        try:
            backend._check(cache, inputs, effective_start)
            if cache.dynamic is None:
                if cache.past_len:
                    raise ValueError("cache was released")
                cache.dynamic = DynamicCache(config=backend.sub_config)
                cache.effective_start = effective_start
            live.append(index)
        except Exception as exc:   # noqa: BLE001 - this session's refusal; the others run
            results[index] = exc
    if not live:
        return results
    adapter, sub, modules = backend.adapter, backend.sub_config, backend.modules
    skip = effective_start - backend.layer_range.start
    apply_rotary, attention = _attention_parts(adapter)
    counts = [int(inputs_list[i].shape[0]) for i in live]
    bounds = np.cumsum([0, *counts]).tolist()
    with torch.inference_mode():
        x = torch.cat([to_torch(inputs_list[i]) for i in live]).unsqueeze(0)
        hidden = adapter.embed(modules, x) if effective_start == 0 else x
        position_ids = torch.cat([torch.arange(n) + caches[i].past_len
                                  for i, n in zip(live, counts)]).unsqueeze(0)
        masks = []
        for j, i in enumerate(live):   # each session's masks, from its own cache before this step
            rows = hidden[:, bounds[j]:bounds[j + 1]]
            masks.append(adapter._masks(sub, rows, caches[i].dynamic, position_ids[:, bounds[j]:bounds[j + 1]], skip))
        cos, sin = modules.rotary(hidden, position_ids=position_ids)
        types = adapter._layer_types(sub)
        for layer, layer_type in zip(modules.layers[skip:], types[skip:]):
            attn = layer.self_attn
            residual = hidden
            h = layer.input_layernorm(hidden)
            shape = (1, h.shape[1], -1, attn.head_dim)
            q, k, v = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape), attn.v_proj(h).view(shape)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            extra = {"sliding_window": attn.sliding_window} if hasattr(attn, "sliding_window") else {}
            outs = []
            for j, i in enumerate(live):
                lo, hi = bounds[j], bounds[j + 1]
                qi, ki = apply_rotary(q[:, :, lo:hi], k[:, :, lo:hi], cos[:, lo:hi], sin[:, lo:hi])
                ki, vi = caches[i].dynamic.update(ki, v[:, :, lo:hi], attn.layer_idx)
                out, _ = attention(attn, qi, ki, vi, masks[j][layer_type], dropout=0.0,
                                   scaling=attn.scaling, **extra)
                outs.append(out.reshape(1, hi - lo, -1))
            hidden = residual + attn.o_proj(torch.cat(outs, dim=1).contiguous())
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        for i, n in zip(live, counts):
            caches[i].past_len += n
        if backend.layer_range.is_tail:
            normed = modules.norm(hidden)
            last = torch.stack([normed[0, bounds[j + 1] - 1] for j in range(len(live))]).unsqueeze(0)
            logits = modules.lm_head(last)[0].float()
            for j, i in enumerate(live):
                hidden_rows = getattr(caches[i], "hidden_out", False)   # embeddings: normed rows, not logits
                if getattr(caches[i], "logits_rows", False):   # a verify step: every position's logits
                    rows = normed[:, bounds[j]:bounds[j + 1]]
                    results[i] = modules.lm_head(rows)[0].float().numpy().copy()
                    continue
                results[i] = (normed[0, bounds[j]:bounds[j + 1]].float().numpy().copy() if hidden_rows
                              else logits[j].numpy().copy())
        else:
            for j, i in enumerate(live):
                results[i] = to_numpy(hidden[0, bounds[j]:bounds[j + 1]]).copy()
    return results
