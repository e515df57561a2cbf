"""Model artifacts for tests and benchmarks, built locally (no model hub).

An artifact is a directory with ``config.json``, ``*.safetensors`` weights and
a tokenizer (``tokenizer.json`` + ``tokenizer_config.json``), exactly what
``shard.model.torch_backend`` and ``transformers.AutoModelForCausalLM`` load.

* ``build_random_llama(seed, **overrides)``: a tiny LlamaForCausalLM with
  seeded random weights and a byte-level BPE tokenizer trained on a fixed
  text (``build_tokenizer``); ``vocab_size`` may exceed the tokenizer's
  (``LLAMA_58M``: the 58M-parameter speed target).
* ``build_random_gemma3(seed, **overrides)``: the second family, a tiny
  Gemma 3 text model (scaled embeddings, (1 + w) RMSNorm, sliding/full
  attention layers with two rotary bases, tied embeddings, logit softcap).
* ``build_random_qwen3_moe(seed, **overrides)``: a tiny Qwen3-MoE (router,
  top-2 of 8 experts with normalized top-k weights, Q/K norm), saved with the
  per-expert keys real checkpoints use (``mlp.experts.E.gate_proj.weight``).
* ``build_random_qwen2_moe(seed, **overrides)``: a tiny Qwen2-MoE (adds the
  shared expert behind its sigmoid gate, un-normalized top-k weights).
* ``smollm2_artifact`` / ``smollm2_gguf_path``: re-exported from
  ``native.packaged`` (product code: the demo runs them too).

Only tests and benchmarks import this package (the import-direction test
enforces it). Artifacts are cached like the packaged ones
(``native.packaged.cached_build``: keyed by what they were built from,
moved into place atomically).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from native.packaged import MARKER_NAME, cache_root, gemma3_gguf_path, smollm2_artifact, smollm2_gguf_path  # noqa: F401 - re-exported for tests
from native.packaged import cached_build as _cached_build
from native.packaged import key as _key

# Fixed text the test tokenizer is trained on: small, varied, deterministic.
_TOKENIZER_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "A shard is a contiguous range of transformer layers; each node serves one range. "
    "Activations travel from node to node, and the tail samples the next token. "
    "Hello world! 0123456789 = + - * / ( ) [ ] { } < > , . ; : ' \" ? ! "
    "meshd pools home machines to run language models too big for one machine."
)
TOKENIZER_VOCAB_SIZE = 384
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")


def build_tokenizer():
    """A byte-level BPE tokenizer trained on a fixed text, as PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TOKENIZER_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def _save_random(model_cls, config, seed: int, out: Path) -> None:
    import torch

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _special_ids(tokenizer, params: dict[str, Any]) -> dict[str, int]:
    """The tokenizer's ids; the vocabulary is the tokenizer's unless ``vocab_size`` asks for more
    (e.g. a 32000-row embedding and head, as in real models, for timing)."""
    vocab = params.get("vocab_size", len(tokenizer))
    if vocab < len(tokenizer):
        raise ValueError(f"vocab_size {vocab} is smaller than the test tokenizer's {len(tokenizer)} ids")
    return {
        "vocab_size": vocab,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}


def build_random_llama(seed: int = 0, **overrides: Any) -> Path:
    """A tiny seeded LlamaForCausalLM artifact (safetensors + tokenizer)."""
    params = {**LLAMA_DEFAULTS, **overrides}

    def build(out: Path) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**{**params, **_special_ids(build_tokenizer(), params)})
        _save_random(LlamaForCausalLM, config, seed, out)

    info = {"family": "llama", "seed": seed, "params": params}
    return _cached_build(f"random-llama-{_key(info)}", build, info)


# The speed target of the "one product path" issue: a 58M-parameter Llama (hidden 512, 8 layers,
# 8 heads, vocabulary 32000, fp32), e.g. `meshd bench swarm --model DIR --layers 0:4,4:8`.
LLAMA_58M: dict[str, Any] = {
    "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 8, "vocab_size": 32000,
}


GEMMA3_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    # Small window so a 40-token test exercises the sliding layers' cache.
    "sliding_window": 8,
    "layer_types": [
        "sliding_attention", "sliding_attention", "full_attention",
        "sliding_attention", "sliding_attention", "full_attention",
    ],
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 1024,
    "initializer_range": 0.1,
    "tie_word_embeddings": True,
}


def build_random_gemma3(seed: int = 0, **overrides: Any) -> Path:
    """A tiny seeded Gemma 3 (text) artifact: the second architecture family."""
    params = {**GEMMA3_DEFAULTS, **overrides}

    def build(out: Path) -> None:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(**{**params, **_special_ids(build_tokenizer(), params)})
        _save_random(Gemma3ForCausalLM, config, seed, out)

    info = {"family": "gemma3_text", "seed": seed, "params": params}
    return _cached_build(f"random-gemma3-{_key(info)}", build, info)


QWEN3_MOE_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,      # dense layers (mlp_only_layers) only
    "moe_intermediate_size": 32,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    # Router logits spread widely enough that routing differs row to row.
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}


def build_random_qwen3_moe(seed: int = 0, **overrides: Any) -> Path:
    """A tiny seeded Qwen3-MoE artifact: 6 layers, 8 experts, top-2, normalized top-k weights."""
    params = {**QWEN3_MOE_DEFAULTS, **overrides}

    def build(out: Path) -> None:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(**{**params, **_special_ids(build_tokenizer(), params)})
        _save_random(Qwen3MoeForCausalLM, config, seed, out)

    info = {"family": "qwen3_moe", "seed": seed, "params": params}
    return _cached_build(f"random-qwen3-moe-{_key(info)}", build, info)


QWEN2_MOE_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.2,   # at 0.1 seed 0 repeats one token; 0.2 gives varied greedy text
    "tie_word_embeddings": False,
}


def build_random_qwen2_moe(seed: int = 0, **overrides: Any) -> Path:
    """A tiny seeded Qwen2-MoE artifact: 4 layers, 8 experts, top-2, a gated shared expert."""
    params = {**QWEN2_MOE_DEFAULTS, **overrides}

    def build(out: Path) -> None:
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        config = Qwen2MoeConfig(**{**params, **_special_ids(build_tokenizer(), params)})
        _save_random(Qwen2MoeForCausalLM, config, seed, out)

    info = {"family": "qwen2_moe", "seed": seed, "params": params}
    return _cached_build(f"random-qwen2-moe-{_key(info)}", build, info)


def main() -> int:
    """``python -m meshd.testing.models``: build every test artifact and print the paths."""
    for path in (build_random_llama(), build_random_gemma3(), build_random_qwen3_moe(), build_random_qwen2_moe(),
                 smollm2_artifact(), build_random_llama(**LLAMA_58M)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
