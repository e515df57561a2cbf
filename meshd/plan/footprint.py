"""Memory footprint of a model artifact, per layer, for coverage-first assignment.

``artifact_footprint(path, digest, dtype)`` reads only the safetensors
headers (tensor names, shapes -- no weights) and ``config.json``:

    layer l        every tensor named ``*.layers.<l>.*``
    head extra     everything else that is not the final norm / lm_head
                   (token embeddings), held by the node serving layer 0
    tail extra     ``*norm.weight`` outside the layers + ``lm_head.*``; with
                   tied embeddings the tail holds the embedding matrix too
    KV per token   2 (K and V) x kv heads x head dim, per layer
    scratch        one batched forward's working memory (``scratch_fields``):
                   per position ~6 hidden-wide and 3 intermediate-wide
                   activations, float32 attention scores per head and cached
                   token, and float32 logits at the tail

Sizes are in the *runtime* dtype the worker will compute in (float32 or
bfloat16), not the file's: the torch backend converts on load.

``gguf_footprint(path, digest, backend, dtype)`` sizes a ``.gguf`` from its
tensor infos (native/gguf_range.size_table; a slice carries its source's
table): for llama.cpp the *stored* bytes (it maps the quantized blocks as
they are), for torch the dequantized elements times the dtype width. KV per
token and layer: K and V heads times their head sizes, in F16 for llama.cpp
(its default cache type, which the engine keeps) or the torch dtype.

``--memory`` is the whole node's promise (daemon + worker peak, the page
cache of its weights included), so a footprint also carries what is not
weights or KV, per lane:

    working   llama.cpp (flash attention: no attention-score scratch): its
              compute buffer for one ubatch of LLAMA_UBATCH_ROWS rows, the
              KQ mask, the batch and capture buffers (``llama_working_estimate``;
              within a few MB of what workers measure); torch: the scratch above
    base      the daemon (its core and the entry tokenizer it builds, which
              grows with the vocabulary) and the worker before any weight
              (``base_estimate``)

The estimates are calibrated upper bounds of what nodes measure on the
reference machine. Workers measure their own working memory and base at
their validation forward (shard/model/memory.py) and publish them in their
records; ``measured_footprint(fp, ads, backend)`` raises the estimates to the
largest figures nodes of the same backend published. Raises, never lowers:
a plan made before any figure arrived (the first node plans alone) stays the
plan after (no range moves because a quiet node measured a few MB less), a
figure a node measured before its API served anything does not shrink the
margin of the others, and a machine whose processes are bigger than ours
(another Python, a fatter library build) is planned with its own figures, so
a cgroup capped at ``--memory`` is not exceeded.
"""
from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from meshd.config import DEFAULT_KV_BUDGET_TOKENS
from meshd.errors import ConfigError
from meshd.plan.adverts import ShardAd
from meshd.plan.assignment import ModelFootprint
from proto import shard_runtime_pb2 as pb
from proto.limits import DEFAULT_PREFILL_CHUNK_TOKENS

# A safetensors header is JSON; real ones are well under a few MiB.
MAX_HEADER_BYTES = 64 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# llama.cpp's KV cache type (type_k / type_v default F16; native/llama_engine.py keeps it).
LLAMA_CPP_KV_BYTES = 2
# Compute width of activations, scores and logits: the torch lane computes in
# its dtype but softmax and logits run in float32; llama.cpp computes in F32.
SCRATCH_WIDTH = 4
MIB = 1 << 20
# Rows llama.cpp computes at once (native/llama_engine.py DEFAULT_UBATCH_TOKENS: the prefill chunk);
# its compute buffer is sized for them, and a forward rarely carries more (one chunk, or decode rows
# with a short chunk: shard/session/batching.py).
LLAMA_UBATCH_ROWS = DEFAULT_PREFILL_CHUNK_TOKENS
# What llama.cpp's compute graph holds besides the buffers counted below (graph metadata, thread
# scratch, the model's tensor structs) and the worker's validation arrays: measured 11-19 MiB over
# them on SmolLM2 (hidden 576) and a 1.15 B llama (hidden 2048), head, middle and tail ranges.
LLAMA_WORKING_FIXED = 20 * MIB
# The daemon without a tokenizer (interpreter, libp2p, gRPC, the API, the DHT and the route driver):
# its peak was 143 MiB serving the 1.15 B llama, whose tokenizer is 384 tokens.
DAEMON_CORE_ESTIMATE = 150 * MIB
# The entry tokenizer the daemon builds from the model (meshd/generate/gguf_tokenizer.py): its peak
# while building grows with the vocabulary, measured +44 MiB for SmolLM2's 49,152 tokens and
# +331 MiB for Gemma 3's 262,144 (~0.9-1.3 KiB a token).
TOKENIZER_PEAK_PER_TOKEN = 1400
# The worker before it loads weights (interpreter, numpy, gRPC, and llama-cpp-python or torch with
# transformers' modeling modules), measured 75 MiB and 407 MiB.
WORKER_BASE_ESTIMATE = {"llama.cpp": 80 * MIB, "torch": 420 * MIB}
BACKENDS = {"llama.cpp": pb.BACKEND_LLAMA_CPP, "torch": pb.BACKEND_TORCH}


def llama_working_estimate(*, hidden: int, intermediate: int, vocab: int, kv_budget_tokens: int,
                           head: bool = True) -> int:
    """llama.cpp's working memory with flash attention, for the range that needs most (a head):
    per ubatch row the FFN's three intermediate-wide and ~4 hidden-wide F32 activations (the compute
    buffer: 12.75 MiB for hidden 2048 / ffn 5632 at 128 rows, as llama.cpp reports it), the F16 KQ
    mask over the context, the batch, capture and output-embedding rows (3 x hidden x F32 a row),
    a head's logits buffer (every row is an output there, so the residual keeps all rows, and
    llama.cpp fills a vocabulary-wide row for each; ``head`` False leaves it out: another range's),
    and LLAMA_WORKING_FIXED. No attention-score scratch: flash attention never materialises the scores."""
    rows = LLAMA_UBATCH_ROWS
    compute = rows * SCRATCH_WIDTH * (3 * intermediate + 4 * hidden)
    mask = rows * kv_budget_tokens * 2
    buffers = 3 * rows * hidden * SCRATCH_WIDTH
    outputs = rows * vocab * SCRATCH_WIDTH if head else 0
    return compute + mask + buffers + outputs + LLAMA_WORKING_FIXED


def base_estimate(backend: str, vocab: int = 0) -> int:
    """The daemon's (with a tokenizer of ``vocab`` tokens) and the worker's memory before any
    weight, for a lane (module docstring)."""
    daemon = DAEMON_CORE_ESTIMATE + TOKENIZER_PEAK_PER_TOKEN * vocab
    return daemon + WORKER_BASE_ESTIMATE.get(backend, WORKER_BASE_ESTIMATE["torch"])


def measured_footprint(fp: ModelFootprint, ads: Iterable[ShardAd], backend: str) -> ModelFootprint:
    """``fp`` with its working memory and base raised to the largest figures live nodes of
    ``backend`` measured and published (a node's figures: its worker's at its validation forward,
    its daemon's peak); ``fp`` itself when none exceeds them (module docstring: raise, never lower)."""
    want = BACKENDS.get(backend, pb.BACKEND_UNSPECIFIED)
    mine = [a for a in ads if a.model_digest == fp.model_digest and a.backend == want]
    estimated_working = fp.working_bytes or fp.scratch_bytes(DEFAULT_KV_BUDGET_TOKENS, tail=True)
    working = max((a.measured_working_bytes for a in mine), default=0)
    base = max((a.measured_base_bytes for a in mine), default=0)
    if working <= estimated_working and base <= fp.base_bytes:
        return fp
    return replace(fp, working_bytes=max(working, estimated_working), base_bytes=max(base, fp.base_bytes))


def scratch_fields(*, hidden: int, intermediate: int, heads: int, vocab: int) -> dict[str, int]:
    """The ModelFootprint scratch fields of a model of these widths (see the module docstring)."""
    return {"scratch_row_bytes": (6 * hidden + 3 * intermediate) * SCRATCH_WIDTH,
            "score_bytes_per_kv_token": heads * SCRATCH_WIDTH,
            "logit_row_bytes": vocab * SCRATCH_WIDTH}


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _headers(path: Path) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path} holds no .safetensors files")
    for file in files:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:
                raise ConfigError(f"{file} has an implausible header of {size} bytes")
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                shapes[name] = list(info["shape"])
    return shapes


def artifact_footprint(path: Path, model_digest: str, dtype: str = "float32") -> ModelFootprint:
    from shard.model.st_manifest import dir_manifest, is_partial

    config = json.loads((path / "config.json").read_text())
    if is_partial(path):   # a fetched range: the whole model's shapes are in the manifest it carries
        shapes = {e.name: list(e.shape) for e in dir_manifest(path).entries if e.dtype}
        return footprint_of_config(config, shapes, model_digest, dtype)
    return footprint_of_config(config, _headers(path), model_digest, dtype)


def footprint_of_config(config: dict, shapes: dict[str, list[int]], model_digest: str,
                        dtype: str = "float32") -> ModelFootprint:
    """The footprint of a safetensors model from its config.json and tensor shapes (a manifest's
    tensor table serves as well as the files' headers)."""
    text = config.get("text_config") or config
    num_layers = int(text["num_hidden_layers"])
    width = DTYPE_BYTES[dtype]
    layers = [0] * num_layers
    head = tail = 0
    embed = 0
    for name, shape in shapes.items():
        count = 1
        for dim in shape:
            count *= int(dim)
        nbytes = count * width
        m = _LAYER.search(name)
        if m:
            index = int(m.group(1))
            if index < num_layers:
                layers[index] += nbytes
        elif name.startswith("lm_head") or name.endswith("norm.weight"):
            tail += nbytes
        else:
            head += nbytes
            if "embed" in name:
                embed = nbytes
    if config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)):
        tail += embed
    heads = int(text.get("num_key_value_heads") or text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    scratch = scratch_fields(hidden=int(text["hidden_size"]), intermediate=int(text.get("intermediate_size") or 0),
                             heads=int(text["num_attention_heads"]), vocab=int(text.get("vocab_size") or 0))
    return ModelFootprint(model_digest, tuple(layers), head_extra_bytes=head, tail_extra_bytes=tail,
                          kv_bytes_per_token_layer=2 * heads * head_dim * width,
                          base_bytes=base_estimate("torch", int(text.get("vocab_size") or 0)),
                          **scratch)


def gguf_footprint(path: Path, model_digest: str, backend: str = "llama.cpp", dtype: str = "float32") -> ModelFootprint:
    """Per-layer memory of a GGUF model (or of the source of a GGUF slice) on ``backend``."""
    from native.errors import ArtifactError
    from native.gguf_range import open_reader

    try:
        reader = open_reader(path)
    except ArtifactError as exc:
        raise ConfigError(f"{path} is not a usable GGUF model: {exc}") from exc
    return gguf_footprint_of(reader, model_digest, backend, dtype, name=str(path))


def gguf_footprint_of(reader, model_digest: str, backend: str = "llama.cpp", dtype: str = "float32", *,
                      name: str = "the model") -> ModelFootprint:
    """``gguf_footprint`` of a parsed GGUF (a file, or a manifest's virtual reader)."""
    from native.errors import ArtifactError
    from native.gguf_range import SIZED_SINGLES, model_info, size_table

    try:
        info = model_info(reader)
        sizes = size_table(reader, info)
    except ArtifactError as exc:
        raise ConfigError(f"{name} is not a usable GGUF model: {exc}") from exc
    if backend == "llama.cpp":
        layers, singles, kv_width = sizes.layer_bytes, sizes.single_bytes, LLAMA_CPP_KV_BYTES
    else:
        width = DTYPE_BYTES[dtype]
        layers = tuple(e * width for e in sizes.layer_elements)
        singles = tuple(e * width for e in sizes.single_elements)
        kv_width = width
    single = dict(zip(SIZED_SINGLES, singles))
    tail = single["output_norm.weight"] + (single["output.weight"] if not info.tied_embeddings
                                           else single["token_embd.weight"])
    working = (llama_working_estimate(hidden=info.hidden_size, intermediate=info.intermediate_size,
                                      vocab=info.vocab_size, kv_budget_tokens=DEFAULT_KV_BUDGET_TOKENS)
               if backend == "llama.cpp" else 0)
    return ModelFootprint(model_digest, tuple(int(b) for b in layers),
                          head_extra_bytes=int(single["token_embd.weight"]), tail_extra_bytes=int(tail),
                          kv_bytes_per_token_layer=info.kv_elements_per_token_layer() * kv_width,
                          working_bytes=working, base_bytes=base_estimate(backend, info.vocab_size),
                          **scratch_fields(hidden=info.hidden_size, intermediate=info.intermediate_size,
                                           heads=info.num_heads, vocab=info.vocab_size))


def model_footprint(path: Path, model_digest: str, backend: str = "torch", dtype: str = "float32") -> ModelFootprint:
    """The footprint of either kind of model: a ``.gguf`` file or an artifact directory."""
    if path.is_file():
        return gguf_footprint(path, model_digest, backend, dtype)
    return artifact_footprint(path, model_digest, dtype)
