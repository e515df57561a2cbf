"""Model execution and artifact identity: what one layer range computes, and which bytes it is.

Files and roles:

    backend.py        LayerRange; RangeBackend / BackendCache protocols (torch and llama.cpp)
    manifest.py       the model's identity: a manifest (metadata, tensor table, a hash per chunk) under one
                      Merkle root, ``merkle:<hex>``, the model id on the wire (sans-I/O)
    st_manifest.py    a safetensors directory's manifest (whole, or a partial directory of a fetched range)
    artifact.py       the files' SHA-256 digest (kept beside the root), recipe digest, pb.Fingerprint builder
    digests.py        digests and manifests computed once per file: on-disk cache keyed by (path, size,
                      mtime_ns, inode)
    sampling.py       greedy / temperature / top-k / top-p, a pure function of (seed, position); logprobs
    adapters.py       model families (Llama family, Gemma 3): build / load / forward pieces, and the
                      family registry (``adapter_for``); other rooms' families register themselves
    torch_backend.py  TorchRangeBackend: meta build + safe_open range loading, exact forward
    torch_batch.py    the torch lane's ragged batched forward (row-wise ops batched, attention per session)
    reference.py      the whole-model reference (transformers CausalLM in one process)

Public surface: the light pieces below (numpy and protobuf only). The torch
modules (adapters, torch_backend, torch_batch, reference) are imported by
their own path, so that importing this room never loads torch: the daemon
and a client-only node use the sampling, the fingerprints and LayerRange
without any weights.
"""
from shard.model.artifact import Recipe, artifact_digest, fingerprints_match, make_fingerprint, torch_recipe
from shard.model.backend import MAX_LAYERS, BackendCache, LayerRange, RangeBackend, ids_in_range
from shard.model.sampling import SamplingSpec, check_top_logprobs, sample_token, token_logprobs

__all__ = [
    "LayerRange", "RangeBackend", "BackendCache", "MAX_LAYERS", "ids_in_range",
    "Recipe", "artifact_digest", "fingerprints_match", "make_fingerprint", "torch_recipe",
    "SamplingSpec", "check_top_logprobs", "sample_token", "token_logprobs",
]
