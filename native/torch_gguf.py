"""A GGUF layer range executed in torch: the exactness reference for GGUF.

Data flow: ``load_torch_gguf(path, layer_range, dtype)`` reads the GGUF
metadata into a transformers config (the architecture adapter's, ``gguf_arch``),
selects the range's tensors (``gguf_range.read_range``: memory-mapped, nothing
else touched), dequantizes each with ``gguf.quants.dequantize`` (the same
function transformers' ``gguf_file=`` loader uses), undoes what the converter
did (Llama's Q/K row permutation, Gemma's 1 + w norms), renames them to HF keys and hands the state dict
to shard's adapter, producing a ``shard.model.torch_backend.TorchRangeBackend``.
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

from native.errors import ArtifactError
from native.gguf_file import GGUFFile, GGUFTensor
from native.gguf_range import GGUFModelInfo, gguf_recipe, model_digest, open_reader, read_range
from shard.model.artifact import TORCH_LAYOUT, make_fingerprint
from shard.model.backend import LayerRange

__all__ = ["load_torch_gguf", "hf_config", "range_state_dict"]

def hf_config(info: GGUFModelInfo, reader=None):
    """The transformers config equivalent of the GGUF hparams (the architecture adapter's)."""
    return info.adapter.hf_config(info, (lambda key, default=None: reader.value(key, default)) if reader
                                  else (lambda key, default=None: default))


def _dequant(tensor: GGUFTensor) -> np.ndarray:
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ArtifactError(f"{tensor.name}: tensor type {tensor.tensor_type.name} cannot be dequantized") from exc
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF [ne0, ne1] -> numpy [ne1, ne0]
    return np.array(values.reshape(shape), dtype=np.float32, copy=True)  # writable, off the mmap


def range_state_dict(reader: GGUFFile, layer_range: LayerRange,
                     say=lambda message: None) -> tuple[GGUFModelInfo, dict[str, np.ndarray]]:
    """HF-named float32 arrays for exactly the tensors ``layer_range`` needs."""
    tensors = read_range(reader, layer_range)
    info = tensors.info
    adapter = info.adapter
    state: dict[str, np.ndarray] = {}
    for offset, block in enumerate(tensors.blocks):
        layer = layer_range.start + offset
        for suffix, hf_suffix in adapter.hf_names().items():
            if suffix not in block:
                raise ArtifactError(f"GGUF block {layer} lacks {suffix}")
            value = adapter.to_hf(suffix, _dequant(block[suffix]), info)
            state[f"model.layers.{layer}.{hf_suffix}"] = value
        say(f"dequantized layer {layer} ({offset + 1}/{layer_range.count})")
    if tensors.token_embd is not None:
        state["model.embed_tokens.weight"] = _dequant(tensors.token_embd)
    if tensors.output_norm is not None:
        state["model.norm.weight"] = adapter.to_hf("output_norm.weight", _dequant(tensors.output_norm), info)
    if tensors.output is not None:
        state["lm_head.weight"] = _dequant(tensors.output)
    return info, state


def load_torch_gguf(path: str | Path, layer_range: LayerRange, *, dtype: str = "float32",
                    progress: TextIO | None = sys.stderr):
    """Load ``layer_range`` of a GGUF file as a shard ``TorchRangeBackend``."""
    import gguf as gguf_module
    import torch
    import transformers

    from shard.model.adapters import adapter_for, range_config
    from shard.model.torch_backend import DTYPES, TorchRangeBackend

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = Path(path)
    t0 = time.monotonic()

    def say(message: str) -> None:
        if progress is not None:
            print(f"[meshd torch-gguf {layer_range}] {message}", file=progress, flush=True)

    reader = open_reader(path)
    info, arrays = range_state_dict(reader, layer_range, say)
    config = hf_config(info, reader)
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
    state.clear()   # the modules hold the tensors now: each layout swap frees what it copies
    arrays.clear()
    adapter.finish_modules(modules)
    modules.eval().requires_grad_(False)
    libraries = (("gguf", getattr(gguf_module, "__version__", "0.19.0")), TORCH_LAYOUT, ("torch", torch.__version__),
                 ("transformers", transformers.__version__))
    recipe = gguf_recipe(backend="torch", info=info, compute_dtype=dtype, libraries=libraries)
    fingerprint = make_fingerprint(model_digest(path, progress, reader), recipe)
    backend = TorchRangeBackend(config=config, adapter=adapter, modules=modules, layer_range=layer_range,
                                dtype=dtype, fingerprint=fingerprint, model_path=path)
    say(f"loaded {backend.weight_bytes / 1e6:.1f} MB in {time.monotonic() - t0:.1f}s")
    return backend
