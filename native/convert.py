"""Safetensors artifact -> GGUF (F32, F16, BF16, Q8_0 with gguf.GGUFWriter; Q4_K_M via llama.cpp).

Data flow: ``convert(artifact_dir, "Q8_0")`` reads ``config.json``, the
``*.safetensors`` weights and ``tokenizer.json`` of a Llama-family artifact
(``meshd.testing.models``), renames tensors to GGUF names, applies the HF->GGUF
Q/K row permutation (GGUF stores each head's rotary halves interleaved, the
layout llama.cpp's RoPE expects; ``unpermute_qk`` undoes it for torch),
writes hparams and tokenizer metadata (byte-level BPE vocab, merges, token
types, bos/eos) and the tensors. ``Q4_K_M`` first writes the F16 file and
then runs llama.cpp's own quantizer (``llama_model_quantize``), the same code
``llama-quantize`` runs; it falls back per tensor where rows are not a
multiple of 256.

State: a per-user cache (``~/.cache/meshd/gguf``, override
``MESHD_GGUF_CACHE``) keyed by the artifact digest, the type and
``CONVERT_VERSION``; files are built under a temporary name and moved into
place with ``os.replace``.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

import gguf
import numpy as np

from native.errors import ArtifactError
from shard.model.artifact import artifact_digest as directory_digest

__all__ = ["convert", "permute_qk", "unpermute_qk", "GGUF_TYPES", "gguf_cache_root"]

# Bump when convert() changes what it writes, so cached files are rebuilt.
CONVERT_VERSION = 1
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_K_M")
_MATRIX_QTYPE = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
                 "BF16": gguf.GGMLQuantizationType.BF16, "Q8_0": gguf.GGMLQuantizationType.Q8_0}
FILE_TYPES = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
              "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Token types of llama.cpp's vocab (llama_token_type): normal and control.
_TOKEN_NORMAL, _TOKEN_CONTROL = 1, 3


def gguf_cache_root() -> Path:
    root = Path(os.environ.get("MESHD_GGUF_CACHE", Path.home() / ".cache" / "meshd" / "gguf"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF [n_head*head_dim, in] -> GGUF row order (each head's rotary halves interleaved)."""
    rows = weight.shape[0]
    return (weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of ``permute_qk``: GGUF row order back to HF's rotate-half layout."""
    rows = weight.shape[0]
    return (weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def load_tensors(artifact: Path) -> dict[str, np.ndarray]:
    import torch
    from safetensors import safe_open

    tensors: dict[str, np.ndarray] = {}
    files = sorted(artifact.glob("*.safetensors"))
    if not files:
        raise ArtifactError(f"{artifact} has no *.safetensors files")
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name).to(torch.float32).numpy()
    return tensors


def add_tokenizer_metadata(writer: gguf.GGUFWriter, artifact: Path, config: dict[str, Any],
                        vocab_size: int, pre: str) -> None:
    data = json.loads((artifact / "tokenizer.json").read_text())
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise ArtifactError("only byte-level BPE tokenizers are converted")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    vocab.update(special)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [_TOKEN_NORMAL] * vocab_size
    for text, index in vocab.items():
        if 0 <= index < vocab_size:
            tokens[index] = text
            if text in special:
                types[index] = _TOKEN_CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id), ("unk_token_id", writer.add_unk_token_id)):
        value = config.get(key)
        if isinstance(value, int) and 0 <= value < vocab_size:
            add(value)
    writer.add_add_bos_token(False)  # meshd tokenizes with the HF tokenizer; mirror it


def add_matrix(writer: gguf.GGUFWriter, name: str, value: np.ndarray, qtype: str) -> None:
    if value.ndim == 1:
        writer.add_tensor(name, value.astype(np.float32))
        return
    kind = _MATRIX_QTYPE[qtype]
    if kind == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, value.astype(np.float32))
        return
    if kind == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, value.astype(np.float16))
        return
    try:
        writer.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)
    except gguf.quants.QuantError:  # rows not a multiple of the block: keep F16
        writer.add_tensor(name, value.astype(np.float16))


def _write_gguf(artifact: Path, out: Path, qtype: str, pre: str) -> None:
    config = json.loads((artifact / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ArtifactError(f"convert supports model_type 'llama', not {config.get('model_type')!r}")
    weights = load_tensors(artifact)
    n_head = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_head)
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // n_head)
    rope = config.get("rope_parameters") or {}
    rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope.get("rope_type", "default") != "default":
        raise ArtifactError("rope scaling is not converted (only rope_type 'default')")
    embed = weights["model.embed_tokens.weight"]
    vocab_size = int(embed.shape[0])

    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name(artifact.name)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer_metadata(writer, artifact, config, vocab_size, pre)

    add_matrix(writer, "token_embd.weight", embed, qtype)
    for layer in range(int(config["num_hidden_layers"])):
        for hf_suffix, gguf_suffix in _LAYER_NAMES.items():
            value = weights[f"model.layers.{layer}.{hf_suffix}"]
            if hf_suffix.startswith("self_attn.q_proj"):
                value = permute_qk(value, n_head)
            elif hf_suffix.startswith("self_attn.k_proj"):
                value = permute_qk(value, n_kv)
            add_matrix(writer, f"blk.{layer}.{gguf_suffix}", value, qtype)
    add_matrix(writer, "output_norm.weight", weights["model.norm.weight"], qtype)
    tied = bool(config.get("tie_word_embeddings", False)) or "lm_head.weight" not in weights
    if not tied:
        add_matrix(writer, "output.weight", weights["lm_head.weight"], qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def _quantize_q4_k_m(source: Path, out: Path, n_threads: int = 2) -> None:
    from native.llama_engine import load_llama_cpp

    llama_cpp = load_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = n_threads
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if rc != 0:
        raise ArtifactError(f"llama.cpp's quantizer failed with code {rc} on {source}")


def convert(artifact: str | os.PathLike[str], qtype: str, *, tokenizer_pre: str = "gpt2",
            progress: TextIO | None = sys.stderr) -> Path:
    """Return the cached GGUF of ``artifact`` in ``qtype`` (one of GGUF_TYPES), building it once."""
    if qtype not in GGUF_TYPES:
        raise ValueError(f"qtype must be one of {GGUF_TYPES}, got {qtype!r}")
    artifact = Path(artifact)
    digest = directory_digest(artifact).removeprefix("sha256:")[:20]
    target = gguf_cache_root() / f"{artifact.name}-{digest}-{qtype}-v{CONVERT_VERSION}.gguf"
    if target.is_file():
        return target
    source = convert(artifact, "F16", tokenizer_pre=tokenizer_pre, progress=progress) \
        if qtype == "Q4_K_M" else None
    if progress is not None:
        print(f"[meshd gguf] converting {artifact.name} to {qtype} GGUF", file=progress, flush=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        if source is not None:
            _quantize_q4_k_m(source, Path(tmp_name))
        else:
            _write_gguf(artifact, Path(tmp_name), qtype, tokenizer_pre)
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return target
