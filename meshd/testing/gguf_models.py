"""Seeded random GGUF models written directly with ``gguf.GGUFWriter`` (tests and benchmarks only).

``build_random_gguf(arch, seed, qtype)`` writes a tiny model of one of the
architectures the llama.cpp lane runs (llama, qwen2, qwen3, gemma3) with the
tensor names and metadata keys llama.cpp's loader expects for it, the
byte-level BPE test tokenizer of ``models.build_tokenizer`` as gpt2 metadata,
and weights from a seeded numpy generator (matrices F16 or F32, norms and
biases F32). Gemma 3's norms are stored as 1 + w like the converter does,
with a sliding window of 8 so a 40-token test crosses it.

Cached like the other test models (``~/.cache/meshd/gguf``, keyed by what
they are built from, written to a temporary name and moved into place).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from meshd.testing.models import SPECIAL_TOKENS, build_tokenizer
from native.convert import gguf_cache_root
from native.packaged import key as _key

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
# Bump when the builder writes something else, so cached files are rebuilt.
BUILD_VERSION = 2
DEFAULTS: dict[str, Any] = {"hidden": 64, "layers": 6, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 160,
                            "context": 1024, "sliding_window": 8}
_QTYPES = {"F16": np.float16, "F32": np.float32}
_FILE_TYPE = {"F16": gguf.LlamaFileType.MOSTLY_F16, "F32": gguf.LlamaFileType.ALL_F32}


def _tokenizer(writer: gguf.GGUFWriter) -> int:
    data = json.loads(build_tokenizer().backend_tokenizer.to_str())
    vocab = dict(data["model"]["vocab"])
    special = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    vocab.update(special)
    size = max(vocab.values()) + 1
    tokens, types = [f"[PAD{i}]" for i in range(size)], [1] * size
    for text, index in vocab.items():
        tokens[index] = text
        if text in special:
            types[index] = 3
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")  # llama.cpp knows "default" (GPT-2 split), not "gpt2"
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
    writer.add_bos_token_id(vocab[SPECIAL_TOKENS[1]])
    writer.add_eos_token_id(vocab[SPECIAL_TOKENS[2]])
    writer.add_add_bos_token(False)
    return size


def _write(out: Path, arch: str, seed: int, qtype: str, p: dict[str, Any]) -> None:
    rng = np.random.default_rng(seed)
    hidden, n_layer, heads, kv, hd, ffn = (p[k] for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn"))
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(f"random-{arch}-{seed}")
    writer.add_block_count(n_layer)
    writer.add_context_length(p["context"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(_FILE_TYPE[qtype])
    if arch == "llama":
        writer.add_rope_dimension_count(hd)
        writer.add_rope_freq_base(10000.0)
    else:
        writer.add_key_length(hd)
        writer.add_value_length(hd)
        writer.add_rope_freq_base(1_000_000.0)
    if arch == "gemma3":
        writer.add_sliding_window(p["sliding_window"])
        writer.add_float32("gemma3.final_logit_softcapping", 30.0)
    vocab = _tokenizer(writer)
    writer.add_vocab_size(vocab)
    mat = _QTYPES[qtype]

    def matrix(name: str, rows: int, cols: int, scale: float = 0.1) -> None:
        writer.add_tensor(name, (rng.standard_normal((rows, cols)) * scale).astype(mat))

    def vector(name: str, size: int, around: float = 1.0, scale: float = 0.1) -> None:
        writer.add_tensor(name, (around + rng.standard_normal(size) * scale).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden, 0.5)
    for il in range(n_layer):
        b = f"blk.{il}."
        vector(b + "attn_norm.weight", hidden)
        matrix(b + "attn_q.weight", heads * hd, hidden)
        matrix(b + "attn_k.weight", kv * hd, hidden)
        matrix(b + "attn_v.weight", kv * hd, hidden)
        matrix(b + "attn_output.weight", hidden, heads * hd)
        if arch == "qwen2":
            for name, size in (("attn_q.bias", heads * hd), ("attn_k.bias", kv * hd), ("attn_v.bias", kv * hd)):
                vector(b + name, size, 0.0)
        if arch in ("qwen3", "gemma3"):
            vector(b + "attn_q_norm.weight", hd)
            vector(b + "attn_k_norm.weight", hd)
        if arch == "gemma3":
            vector(b + "post_attention_norm.weight", hidden)
            vector(b + "post_ffw_norm.weight", hidden)
        vector(b + "ffn_norm.weight", hidden)
        matrix(b + "ffn_gate.weight", ffn, hidden)
        matrix(b + "ffn_up.weight", ffn, hidden)
        matrix(b + "ffn_down.weight", hidden, ffn)
    vector("output_norm.weight", hidden)
    if arch in ("llama", "qwen2"):  # untied output; qwen3 and gemma3 tie it to the embedding
        matrix("output.weight", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def build_random_gguf(arch: str, seed: int = 0, qtype: str = "F16", **overrides: Any) -> Path:
    """A tiny seeded GGUF of ``arch`` (cached)."""
    if arch not in ARCHS or qtype not in _QTYPES:
        raise ValueError(f"arch must be one of {ARCHS}, qtype one of {sorted(_QTYPES)}")
    params = {**DEFAULTS, **overrides}
    info = {"arch": arch, "seed": seed, "qtype": qtype, "params": params, "version": BUILD_VERSION}
    target = gguf_cache_root() / f"random-{arch}-{qtype}-{_key(info)}.gguf"
    if target.is_file():
        return target
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        _write(Path(tmp), arch, seed, qtype, params)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
