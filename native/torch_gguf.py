"""A GGUF layer range executed in torch: the exactness reference for GGUF.

Data flow: ``load_torch_gguf(path, layer_range, dtype)`` reads the GGUF
metadata into a transformers ``LlamaConfig``, selects the range's tensors
(``gguf_range.read_range``: memory-mapped, nothing else touched), dequantizes
each with ``gguf.quants.dequantize`` (the same function transformers'
``gguf_file=`` loader uses), undoes the converter's Q/K row permutation
(``convert.unpermute_qk``), renames them to HF keys and hands the state dict
to shard's adapter, producing a ``shard.torch_backend.TorchRangeBackend``.
Everything downstream (sessions, worker, route driver) is shard's torch path
unchanged.

The fingerprint pairs the GGUF file digest with a *torch* recipe naming the
GGUF quantization, so a torch-GGUF hop and a llama.cpp hop of the same file
never mix in one route (their numbers differ).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

import gguf
import numpy as np

from native.convert import unpermute_qk
from native.errors import ArtifactError
from native.gguf_range import GGUFModelInfo, artifact_digest, gguf_recipe, open_reader, read_range
from shard.artifact import make_fingerprint
from shard.backend import LayerRange

__all__ = ["load_torch_gguf", "hf_config", "range_state_dict"]

_HF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_config(info: GGUFModelInfo):
    """The transformers LlamaConfig equivalent of the GGUF hparams."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=info.vocab_size, hidden_size=info.hidden_size,
        intermediate_size=info.intermediate_size, num_hidden_layers=info.num_layers,
        num_attention_heads=info.num_heads, num_key_value_heads=info.num_kv_heads,
        head_dim=info.head_dim, max_position_embeddings=info.context_length,
        rms_norm_eps=info.rms_norm_eps, tie_word_embeddings=info.tied_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": info.rope_theta},
    )


def _dequant(tensor: gguf.ReaderTensor) -> np.ndarray:
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ArtifactError(f"{tensor.name}: tensor type {tensor.tensor_type.name} cannot be dequantized") from exc
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF [ne0, ne1] -> numpy [ne1, ne0]
    return np.array(values.reshape(shape), dtype=np.float32, copy=True)  # writable, off the mmap


def range_state_dict(reader: gguf.GGUFReader, layer_range: LayerRange,
                     say=lambda message: None) -> tuple[GGUFModelInfo, dict[str, np.ndarray]]:
    """HF-named float32 arrays for exactly the tensors ``layer_range`` needs."""
    tensors = read_range(reader, layer_range)
    info = tensors.info
    state: dict[str, np.ndarray] = {}
    for offset, block in enumerate(tensors.blocks):
        layer = layer_range.start + offset
        for suffix, hf_suffix in _HF_LAYER.items():
            if suffix not in block:
                raise ArtifactError(f"GGUF block {layer} lacks {suffix}")
            value = _dequant(block[suffix])
            if suffix == "attn_q.weight":
                value = unpermute_qk(value, info.num_heads)
            elif suffix == "attn_k.weight":
                value = unpermute_qk(value, info.num_kv_heads)
            state[f"model.layers.{layer}.{hf_suffix}"] = value
        say(f"dequantized layer {layer} ({offset + 1}/{layer_range.count})")
    if tensors.token_embd is not None:
        state["model.embed_tokens.weight"] = _dequant(tensors.token_embd)
    if tensors.output_norm is not None:
        state["model.norm.weight"] = _dequant(tensors.output_norm)
    if tensors.output is not None:
        state["lm_head.weight"] = _dequant(tensors.output)
    return info, state


def load_torch_gguf(path: str | Path, layer_range: LayerRange, *, dtype: str = "float32",
                    progress: TextIO | None = sys.stderr):
    """Load ``layer_range`` of a GGUF file as a shard ``TorchRangeBackend``."""
    import gguf as gguf_module
    import torch
    import transformers

    from shard.adapters import adapter_for, range_config
    from shard.torch_backend import DTYPES, TorchRangeBackend

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = Path(path)
    t0 = time.monotonic()

    def say(message: str) -> None:
        if progress is not None:
            print(f"[meshd torch-gguf {layer_range}] {message}", file=progress, flush=True)

    reader = open_reader(path)
    info, arrays = range_state_dict(reader, layer_range, say)
    config = hf_config(info)
    adapter = adapter_for(config)
    sub = range_config(config, layer_range)
    modules = adapter.build(sub, layer_range)
    torch_dtype = DTYPES[dtype][0]
    state = {}
    for key, value in arrays.items():
        tensor = torch.from_numpy(value).to(torch_dtype)
        for target in adapter.local_names(key, layer_range):
            state[target] = tensor
    missing = set(modules.state_dict()) - state.keys()
    if missing:
        raise ArtifactError(f"{path.name} lacks tensors for {layer_range}: {sorted(missing)[:5]}")
    modules.load_state_dict(state, strict=True, assign=True)
    if modules.embed is not None:
        adapter.finish_embedding(modules.embed)
    modules.eval().requires_grad_(False)
    libraries = (("gguf", getattr(gguf_module, "__version__", "0.19.0")), ("torch", torch.__version__),
                 ("transformers", transformers.__version__))
    recipe = gguf_recipe(backend="torch", info=info, compute_dtype=dtype, libraries=libraries)
    fingerprint = make_fingerprint(artifact_digest(path, progress), recipe)
    backend = TorchRangeBackend(config=config, adapter=adapter, modules=modules, layer_range=layer_range,
                                dtype=dtype, fingerprint=fingerprint, model_path=path)
    say(f"loaded {backend.weight_bytes / 1e6:.1f} MB in {time.monotonic() - t0:.1f}s")
    return backend
