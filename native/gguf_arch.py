"""One small adapter per GGUF architecture: its tensors, its hparams, its layer-indexed metadata.

What differs between the architectures meshd runs, and nothing else:

    arch     block tensors (besides the common set)        converter transforms     layer-indexed hparams
    llama    --                                            Q/K rows permuted        --
    qwen2    attn_{q,k,v}.bias                             --                       --
    qwen3    attn_{q,k}_norm                               --                       --
    gemma3   attn_{q,k}_norm, post_attention_norm,         norms stored as 1 + w    sliding-window layers
             post_ffw_norm                                                          (every 6th is global)
    qwen3moe attn_{q,k}_norm, ffn_gate_inp, ffn_{gate,up,   (llama.cpp lane only)    --
             down}_exps instead of the dense FFN

Users: ``gguf_range.model_info`` (which hparams, head size), ``gguf_range.read_range``
(which block tensors must be present), ``slice.write_slice`` (the metadata a
renumbered slice needs so llama.cpp sees the same layer kinds) and
``torch_gguf`` (HF config, HF tensor names, undoing the converter).

Layer-indexed metadata: llama.cpp derives some per-layer facts from the
layer's *index*: Gemma 3 makes layer ``il`` sliding-window unless
``il % 6 == 5`` (and picks the rotary base by that). A slice renumbers its
blocks from 0, so the adapter writes the explicit per-layer flags
(``gemma3.attention.sliding_window_pattern``, a bool array llama.cpp reads in
preference to the period) for the slice's original layers (a slice of global
layers only gets window 0: llama.cpp refuses an SWA model without a sliding
layer, and window 0 builds exactly the global layers' graph). Any ``{arch}.*``
array with one entry per layer is cut to the slice's layers generically.

State: none; adapters are immutable singletons in ``ARCHITECTURES``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from native.errors import ArtifactError

__all__ = ["Architecture", "ARCHITECTURES", "architecture", "COMMON_BLOCK_TENSORS"]

# Every supported architecture's blocks hold these (GGUF suffix after "blk.N.").
COMMON_BLOCK_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                        "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                        "ffn_down.weight")
_HF_COMMON = {
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


def _unpermute(weight: np.ndarray, n_head: int) -> np.ndarray:
    rows = weight.shape[0]
    return (weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape))


@dataclass(frozen=True, slots=True)
class Architecture:
    """The llama family's shape; subclasses change only what their table row says."""

    name: str
    hf_model_type: str
    extra_block_tensors: tuple[str, ...] = ()
    hf_extra: tuple[tuple[str, str], ...] = ()

    @property
    def block_tensors(self) -> tuple[str, ...]:
        return COMMON_BLOCK_TENSORS + self.extra_block_tensors

    def key(self, suffix: str) -> str:
        return f"{self.name}.{suffix}"

    def head_dim(self, value, hidden: int, heads: int) -> int:
        """Head size: key_length, else the rotary dimension, else hidden / heads."""
        return int(value(self.key("attention.key_length"), 0) or value(self.key("rope.dimension_count"), 0)
                   or hidden // max(heads, 1))

    # -- slices ------------------------------------------------------------------------
    def slice_metadata(self, fields: dict[str, Any], start: int, end: int, num_layers: int) -> dict[str, Any]:
        """Extra ``{arch}.*`` pairs a slice of [start, end) needs: name -> (value, vtype, sub_type)."""
        return {}

    # -- torch lane --------------------------------------------------------------------
    def hf_names(self) -> dict[str, str]:
        return {**_HF_COMMON, **dict(self.hf_extra)}

    def to_hf(self, suffix: str, value: np.ndarray, info) -> np.ndarray:
        """Undo what the HF -> GGUF converter did to this tensor (nothing, by default)."""
        return value

    def hf_config(self, info, value):
        from transformers import AutoConfig

        return AutoConfig.for_model(self.hf_model_type, **self._hf_kwargs(info))

    def _hf_kwargs(self, info) -> dict[str, Any]:
        return dict(vocab_size=info.vocab_size, hidden_size=info.hidden_size,
                    intermediate_size=info.intermediate_size, num_hidden_layers=info.num_layers,
                    num_attention_heads=info.num_heads, num_key_value_heads=info.num_kv_heads,
                    head_dim=info.head_dim, max_position_embeddings=info.context_length,
                    rms_norm_eps=info.rms_norm_eps, tie_word_embeddings=info.tied_embeddings,
                    rope_parameters={"rope_type": "default", "rope_theta": info.rope_theta})


@dataclass(frozen=True, slots=True)
class _Llama(Architecture):
    def to_hf(self, suffix: str, value: np.ndarray, info) -> np.ndarray:
        # llama.cpp's converter interleaves each head's rotary halves (its RoPE layout).
        if suffix == "attn_q.weight":
            return _unpermute(value, info.num_heads)
        if suffix == "attn_k.weight":
            return _unpermute(value, info.num_kv_heads)
        return value


@dataclass(frozen=True, slots=True)
class _Qwen2(Architecture):
    def _hf_kwargs(self, info) -> dict[str, Any]:
        kwargs = Architecture._hf_kwargs(self, info)
        kwargs.pop("head_dim")  # Qwen2 derives it from hidden / heads
        return kwargs


# Gemma 3: a layer is global (full attention) every this many layers (llama.cpp's default period).
GEMMA3_SWA_PERIOD = 6


@dataclass(frozen=True, slots=True)
class _Gemma3(Architecture):
    def sliding_layers(self, fields: dict[str, Any], num_layers: int) -> list[bool]:
        period_or_flags = fields.get(self.key("attention.sliding_window_pattern"))
        if isinstance(period_or_flags, list):
            if len(period_or_flags) < num_layers:
                raise ArtifactError("gemma3.attention.sliding_window_pattern is shorter than the layer count")
            return [bool(x) for x in period_or_flags[:num_layers]]
        period = int(period_or_flags) if period_or_flags is not None else GEMMA3_SWA_PERIOD
        return [period == 0 or il % period < period - 1 for il in range(num_layers)]

    def slice_metadata(self, fields, start, end, num_layers):
        from gguf import GGUFValueType as V

        if not fields.get(self.key("attention.sliding_window")):
            return {}
        flags = self.sliding_layers(fields, num_layers)[start:end]
        if not any(flags):
            # Only global layers: llama.cpp asserts an SWA model has a sliding layer, and a
            # window of 0 gives exactly the global layers' graph (full attention, global rope base).
            return {self.key("attention.sliding_window"): (0, V.UINT32, None)}
        return {self.key("attention.sliding_window_pattern"): (flags, V.ARRAY, V.BOOL)}

    def to_hf(self, suffix: str, value: np.ndarray, info) -> np.ndarray:
        # The converter stores Gemma's (1 + w) RMSNorm weights as 1 + w (llama.cpp's norm is x * w).
        return value - 1.0 if suffix.endswith("norm.weight") else value

    def hf_config(self, info, value):
        from transformers import Gemma3TextConfig

        window = int(value(self.key("attention.sliding_window"), 0) or 0)
        flags = self.sliding_layers({self.key("attention.sliding_window_pattern"):
                                     value(self.key("attention.sliding_window_pattern"), None),
                                     self.key("attention.sliding_window"): window}, info.num_layers)
        kwargs = self._hf_kwargs(info)
        kwargs.pop("rope_parameters")
        return Gemma3TextConfig(
            **kwargs, query_pre_attn_scalar=info.head_dim, sliding_window=window or None,
            layer_types=["sliding_attention" if f and window else "full_attention" for f in flags],
            final_logit_softcapping=value(self.key("final_logit_softcapping"), None),
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": info.rope_theta},
                             "sliding_attention": {"rope_type": "default", "rope_theta":
                                                   float(value(self.key("rope.freq_base_swa"), 10000.0))}})


# Qwen3-MoE: the dense FFN is replaced by a router and the experts stacked per block,
# so a layer range (and a slice) carries exactly its layers' experts.
MOE_BLOCK_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                     "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight",
                     "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


@dataclass(frozen=True, slots=True)
class _Qwen3Moe(Architecture):
    @property
    def block_tensors(self) -> tuple[str, ...]:
        return MOE_BLOCK_TENSORS

    def hf_config(self, info, value):
        raise ArtifactError("the torch lane over GGUF does not dequantize qwen3moe experts; run it with "
                            "--backend llama.cpp (or its safetensors artifact with the torch lane)")


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    _Llama("llama", "llama"),
    _Qwen2("qwen2", "qwen2", ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
           (("attn_q.bias", "self_attn.q_proj.bias"), ("attn_k.bias", "self_attn.k_proj.bias"),
            ("attn_v.bias", "self_attn.v_proj.bias"))),
    Architecture("qwen3", "qwen3", ("attn_q_norm.weight", "attn_k_norm.weight"),
                 (("attn_q_norm.weight", "self_attn.q_norm.weight"),
                  ("attn_k_norm.weight", "self_attn.k_norm.weight"))),
    _Gemma3("gemma3", "gemma3_text",
            ("attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight", "post_ffw_norm.weight"),
            (("attn_q_norm.weight", "self_attn.q_norm.weight"), ("attn_k_norm.weight", "self_attn.k_norm.weight"),
             ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
             ("post_attention_norm.weight", "post_attention_layernorm.weight"),
             ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"))),
    _Qwen3Moe("qwen3moe", "qwen3_moe"),
)}


def architecture(name: str) -> Architecture:
    """The adapter of ``general.architecture``; ArtifactError for one meshd cannot run exactly."""
    adapter = ARCHITECTURES.get(name)
    if adapter is None:
        raise ArtifactError(f"GGUF architecture {name!r} is not supported by meshd's GGUF path "
                            f"(supported: {sorted(ARCHITECTURES)})")
    return adapter
