"""Self-describing GGUF slices (``meshd slice``), their identity and sizes, and the slice metadata
the architecture adapters write (default suite: no llama.cpp needed)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from meshd.errors import LayerRangeInvalid
from meshd.plan.footprint import gguf_footprint
from meshd.plan.modelinfo import check_layers, held_layers, model_digest
from meshd.testing.gguf_models import build_random_gguf
from meshd.testing.models import build_random_llama, smollm2_gguf_path
from meshd.testing.procs import child_env
from native.convert import convert
from native.errors import RangeUnavailable
from native.gguf_range import artifact_digest, held_range, model_info, open_reader, read_range, size_table
from native.slice import slice_path, write_user_slice
from shard.model.backend import LayerRange
from shard.model.manifest import is_root


@pytest.fixture(scope="module")
def source():
    return convert(build_random_llama(), "F16", progress=None)


@pytest.fixture()
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHD_SLICE_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_user_slice_is_the_source_restricted_to_its_layers(source, isolated):
    out = write_user_slice(source, 2, 5, isolated / "mid.gguf", progress=None)
    whole, part = open_reader(source), open_reader(out)
    assert held_range(part) == LayerRange(2, 5, 6) and held_layers(out) == (2, 5) and held_layers(source) is None
    # one model id: the slice proves its bytes against its source's root; the file's SHA-256 stays a field
    assert is_root(model_digest(out)) and model_digest(out) == model_digest(source)
    assert part.value("meshd.slice.source_digest") == artifact_digest(source)
    blocks = {t.name.split(".")[1] for t in part.tensors if t.name.startswith("blk.")}
    assert blocks == {"2", "3", "4"} and "token_embd.weight" not in {t.name for t in part.tensors}
    src = {t.name: t for t in whole.tensors}
    for tensor in part.tensors:
        assert np.array_equal(tensor.data, src[tensor.name].data)
    assert part.value("tokenizer.ggml.tokens") == whole.value("tokenizer.ggml.tokens")
    assert model_info(part) == model_info(whole)
    assert size_table(part) == size_table(whole)
    for bad in (LayerRange(1, 3, 6), LayerRange(4, 6, 6), LayerRange(0, 6, 6)):
        with pytest.raises(RangeUnavailable, match="inside"):
            read_range(part, bad)
    read_range(part, LayerRange(3, 5, 6))


def test_slices_of_slices_and_head_tail(source, isolated):
    mid = write_user_slice(source, 1, 5, isolated / "a.gguf", progress=None)
    inner = write_user_slice(mid, 2, 4, isolated / "b.gguf", progress=None)
    assert held_range(open_reader(inner)) == LayerRange(2, 4, 6) and model_digest(inner) == model_digest(source)
    with pytest.raises(RangeUnavailable):
        write_user_slice(mid, 0, 2, isolated / "c.gguf", progress=None)
    head = {t.name for t in open_reader(write_user_slice(source, 0, 2, isolated / "h.gguf", progress=None)).tensors}
    assert "token_embd.weight" in head and "output.weight" not in head
    tail = open_reader(write_user_slice(smollm2_gguf_path(), 20, 30, isolated / "t.gguf", progress=None))
    assert {"token_embd.weight", "output_norm.weight"} <= {t.name for t in tail.tensors}  # tied: the embedding
    assert model_info(tail).tied_embeddings and model_info(tail).vocab_size == 49152


def test_internal_slices_of_a_slice_equal_those_of_the_source(source, isolated, monkeypatch):
    part = write_user_slice(source, 2, 6, isolated / "p.gguf", progress=None)
    rng = LayerRange(3, 6, 6)
    monkeypatch.setenv("MESHD_SLICE_CACHE", str(isolated / "from-source"))
    a = slice_path(source, rng, progress=None).read_bytes()
    monkeypatch.setenv("MESHD_SLICE_CACHE", str(isolated / "from-slice"))
    b = slice_path(part, rng, progress=None).read_bytes()
    assert a == b


def test_footprint_of_a_slice_is_the_models(source, isolated):
    part = write_user_slice(source, 2, 4, isolated / "p.gguf", progress=None)
    digest = artifact_digest(source)
    for backend, dtype in (("llama.cpp", "float32"), ("torch", "float32"), ("torch", "bfloat16")):
        assert gguf_footprint(part, digest, backend, dtype) == gguf_footprint(source, digest, backend, dtype)
    fp = gguf_footprint(source, digest, "llama.cpp")
    reader = open_reader(source)
    per_layer = sum(t.n_bytes for t in reader.tensors if t.name.startswith("blk.0."))
    assert fp.layer_weight_bytes == (per_layer,) * 6
    assert fp.kv_bytes_per_token_layer == 2 * 2 * 16 * 2  # K+V x 2 kv heads x head 16 x F16
    assert fp.head_extra_bytes == next(t.n_bytes for t in reader.tensors if t.name == "token_embd.weight")
    torch_fp = gguf_footprint(source, digest, "torch", "float32")
    assert torch_fp.layer_weight_bytes[0] == 2 * per_layer - 2 * 64 * 4  # F16 matrices doubled, two F32 norms kept
    smol = gguf_footprint(smollm2_gguf_path(), "d", "llama.cpp")
    assert sum(smol.layer_weight_bytes) + smol.head_extra_bytes + smol.tail_extra_bytes \
        - smol.head_extra_bytes < smollm2_gguf_path().stat().st_size  # quantized bytes, tied output counted once


def test_fixed_layers_of_a_slice_must_lie_inside_it(source, isolated):
    part = write_user_slice(source, 2, 4, isolated / "p.gguf", progress=None)
    assert check_layers(part, (2, 4)) == 6 and check_layers(part, (3, 4)) == 6
    with pytest.raises(LayerRangeInvalid, match="slice holding layers 2:4"):
        check_layers(part, (0, 4))


def test_gemma3_slices_name_their_sliding_layers(isolated):
    path = build_random_gguf("gemma3")
    pattern = "gemma3.attention.sliding_window_pattern"
    mid = open_reader(slice_path(path, LayerRange(1, 5, 6), progress=None))
    assert mid.value(pattern) == [True, True, True, True] and mid.value("gemma3.attention.sliding_window") == 8
    mixed = open_reader(slice_path(path, LayerRange(3, 6, 6), progress=None))
    assert mixed.value(pattern) == [True, True, False]  # layer 5 is the global one (period 6)
    glob = open_reader(slice_path(path, LayerRange(5, 6, 6), progress=None))
    assert glob.value("gemma3.attention.sliding_window") == 0 and glob.value(pattern) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_random_architectures_read_as_their_adapter_says(arch):
    reader = open_reader(build_random_gguf(arch))
    info = model_info(reader)
    assert (info.architecture, info.num_layers, info.hidden_size, info.head_dim) == (arch, 6, 64, 16)
    tensors = read_range(reader, LayerRange(0, 6, 6))
    assert set(tensors.blocks[0]) == set(info.adapter.block_tensors)
    assert info.tied_embeddings == (arch in ("qwen3", "gemma3"))


def test_slice_cli(source, isolated):
    out = isolated / "cli.gguf"
    proc = subprocess.run([sys.executable, "-m", "meshd", "slice", str(source), "--layers", "1:3", "-o", str(out)],
                          env=child_env(1), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert held_layers(out) == (1, 3) and "layers 1:3" in proc.stdout
    for args, message in ((["--layers", "4:9"], "outside the model"), (["--layers", "x"], "A:B")):
        proc = subprocess.run([sys.executable, "-m", "meshd", "slice", str(source), *args, "-o", str(out)],
                              env=child_env(1), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr
