"""Qwen3-MoE safetensors artifact -> a ``qwen3moe`` GGUF (gguf.GGUFWriter), for the llama.cpp lane.

``convert_qwen3_moe(artifact_dir, "F16")`` writes what llama.cpp's
``LLM_ARCH_QWEN3MOE`` loads: per block ``attn_norm``, ``attn_q/k/v``,
``attn_q_norm`` / ``attn_k_norm`` (per-head Q/K RMSNorm), ``attn_output``,
``ffn_norm``, the router ``ffn_gate_inp`` [n_expert, n_embd] and the experts
stacked into three 3-D tensors ``ffn_gate_exps`` / ``ffn_up_exps``
[n_expert, n_ff_exp, n_embd] and ``ffn_down_exps`` [n_expert, n_embd,
n_ff_exp] (numpy order; GGUF's ne is the reverse). The experts of a block
are tensors *of that block*, so a layer-range slice (native/slice.py)
carries exactly its layers' experts. No Q/K row permutation: llama.cpp runs
Qwen's rotary in NEOX order, which is the HF layout.

Hparams: ``qwen3moe.expert_count`` / ``expert_used_count`` /
``expert_feed_forward_length``, ``attention.key_length`` / ``value_length``
(head_dim). llama.cpp's qwen3moe graph always renormalizes the top-k
weights, so only ``norm_topk_prob = true`` artifacts convert (refused
otherwise), and dense layers (``mlp_only_layers``) are refused too: the
architecture expects every block sparse.

State: the GGUF cache of native/convert.py, keyed by the artifact digest,
the type and ``MOE_CONVERT_VERSION``; written under a temporary name and
moved into place.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TextIO

import gguf
import numpy as np

from native.convert import FILE_TYPES, add_matrix, add_tokenizer_metadata, gguf_cache_root, load_tensors
from native.errors import ArtifactError
from shard.model.artifact import artifact_digest as directory_digest

__all__ = ["convert_qwen3_moe", "MOE_GGUF_TYPES"]

MOE_CONVERT_VERSION = 1
MOE_GGUF_TYPES = ("F32", "F16", "Q8_0")
ARCH = "qwen3moe"
_ATTN = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}


def _write(artifact: Path, out: Path, qtype: str) -> None:
    config = json.loads((artifact / "config.json").read_text())
    if config.get("model_type") != "qwen3_moe":
        raise ArtifactError(f"convert_qwen3_moe converts model_type 'qwen3_moe', not {config.get('model_type')!r}")
    if not config.get("norm_topk_prob", False):
        raise ArtifactError("llama.cpp's qwen3moe renormalizes the top-k weights: norm_topk_prob must be true")
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
        raise ArtifactError("llama.cpp's qwen3moe expects every layer sparse (no mlp_only_layers)")
    weights = load_tensors(artifact)
    n_head, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // n_head)
    n_layers = int(config["num_hidden_layers"])
    n_expert = int(config.get("num_experts") or config["num_local_experts"])   # saved as num_local_experts
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ArtifactError("rope scaling is not converted (only rope_type 'default')")
    embed = weights["model.embed_tokens.weight"]
    vocab = int(embed.shape[0])
    writer = gguf.GGUFWriter(out, ARCH)
    writer.add_name(artifact.name)
    writer.add_block_count(n_layers)
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or n_head))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    writer.add_vocab_size(vocab)
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer_metadata(writer, artifact, config, vocab, "qwen2")
    add_matrix(writer, "token_embd.weight", embed, qtype)
    for layer in range(n_layers):
        prefix = f"model.layers.{layer}."
        for hf, name in _ATTN.items():
            value = weights[prefix + hf]
            # the router stays float32: its top-k picks must not move with the weight type
            kind = "F32" if hf == "mlp.gate.weight" else qtype
            add_matrix(writer, f"blk.{layer}.{name}", value, kind)
        for proj in ("gate", "up", "down"):
            stacked = np.stack([weights[f"{prefix}mlp.experts.{e}.{proj}_proj.weight"] for e in range(n_expert)])
            add_matrix(writer, f"blk.{layer}.ffn_{proj}_exps.weight", stacked, qtype)
    add_matrix(writer, "output_norm.weight", weights["model.norm.weight"], qtype)
    if not config.get("tie_word_embeddings", False) and "lm_head.weight" in weights:
        add_matrix(writer, "output.weight", weights["lm_head.weight"], qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def convert_qwen3_moe(artifact: str | os.PathLike[str], qtype: str = "F16", *,
                      progress: TextIO | None = sys.stderr) -> Path:
    """The cached qwen3moe GGUF of a Qwen3-MoE artifact, built once."""
    if qtype not in MOE_GGUF_TYPES:
        raise ValueError(f"qtype must be one of {MOE_GGUF_TYPES}, got {qtype!r}")
    artifact = Path(artifact)
    digest = directory_digest(artifact).removeprefix("sha256:")[:20]
    target = gguf_cache_root() / f"{artifact.name}-{digest}-{ARCH}-{qtype}-v{MOE_CONVERT_VERSION}.gguf"
    if target.is_file():
        return target
    if progress is not None:
        print(f"[meshd gguf] converting {artifact.name} to a {qtype} qwen3moe GGUF", file=progress, flush=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        _write(artifact, Path(tmp_name), qtype)
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return target
