"""Artifact and recipe digests."""
from __future__ import annotations

import hashlib

import pytest

from shard.model.artifact import (
    Recipe,
    artifact_digest,
    fingerprints_match,
    make_fingerprint,
    torch_recipe,
)


def _tree(root, files):
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def test_digest_depends_on_every_path_size_and_byte(tmp_path):
    base = {"config.json": b"{}", "w/model.safetensors": b"abc", "tokenizer.json": b"t"}
    a = artifact_digest(_tree(tmp_path / "a", base))
    assert a.startswith("sha256:")
    assert artifact_digest(_tree(tmp_path / "b", base)) == a  # location does not matter
    assert artifact_digest(_tree(tmp_path / "c", {**base, "w/model.safetensors": b"abd"})) != a
    assert artifact_digest(_tree(tmp_path / "d", {**base, "extra": b""})) != a
    renamed = dict(base)
    renamed["w/model2.safetensors"] = renamed.pop("w/model.safetensors")
    assert artifact_digest(_tree(tmp_path / "e", renamed)) != a
    # Moving bytes across the file boundary changes it (sizes are hashed).
    assert artifact_digest(_tree(tmp_path / "f", {"a": b"xy", "b": b"z"})) != artifact_digest(
        _tree(tmp_path / "g", {"a": b"x", "b": b"yz"})
    )


def test_digest_of_one_file_and_missing(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert artifact_digest(f).startswith("sha256:")
    with pytest.raises(FileNotFoundError):
        artifact_digest(tmp_path / "missing")


def test_digest_tracks_rewrites(tmp_path):
    root = _tree(tmp_path / "a", {"x": b"1"})
    first = artifact_digest(root)
    (root / "x").write_bytes(b"22")
    assert artifact_digest(root) != first


def test_recipe_digest_covers_every_field():
    base = Recipe("torch", "float32", "llama", (("torch", "2"), ("transformers", "5")))
    variants = [
        Recipe("llama.cpp", "float32", "llama", base.libraries),
        Recipe("torch", "bfloat16", "llama", base.libraries),
        Recipe("torch", "float32", "gemma3", base.libraries),
        Recipe("torch", "float32", "llama", (("torch", "3"), ("transformers", "5"))),
    ]
    assert len({base.digest(), *(v.digest() for v in variants)}) == 5
    with pytest.raises(ValueError):
        Recipe("", "float32", "llama")
    with pytest.raises(ValueError):
        Recipe("torch", "float32", "llama", (("z", "1"), ("a", "1")))


def test_fingerprint():
    recipe = torch_recipe("float32", "llama")
    fp = make_fingerprint("sha256:" + hashlib.sha256(b"x").hexdigest(), recipe)
    assert fp.runtime_recipe_digest == recipe.digest() and fp.recipe_id == "torch/llama/float32"
    # the weight layout is part of the recipe: another layout computes other last bits
    assert ("meshd.torch_layout", "input-major-2") in recipe.libraries
    assert Recipe(recipe.backend, recipe.dtype, recipe.adapter,
                  tuple(lib for lib in recipe.libraries if lib[0] != "meshd.torch_layout")).digest() != recipe.digest()
    other = make_fingerprint(fp.model_artifact_digest, recipe)
    other.recipe_id = "label only"
    assert fingerprints_match(fp, other)
    other.runtime_recipe_digest = "sha256:0"
    assert not fingerprints_match(fp, other)
