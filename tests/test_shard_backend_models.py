"""LayerRange validation and the locally built test artifacts."""
from __future__ import annotations

import json

import pytest

from meshd.testing import models as testmodels
from shard.model.backend import LayerRange


def test_layer_range_properties():
    r = LayerRange(0, 3, 6)
    assert r.is_head and not r.is_tail and r.count == 3
    assert LayerRange(3, 6, 6).is_tail
    assert LayerRange(0, 6, 6).is_head and LayerRange(0, 6, 6).is_tail


@pytest.mark.parametrize("args", [(3, 3, 6), (4, 3, 6), (-1, 2, 6), (0, 7, 6), (0, 1, 0)])
def test_layer_range_rejects_bad_bounds(args):
    with pytest.raises(ValueError):
        LayerRange(*args)


def test_layer_range_rejects_non_int():
    with pytest.raises(TypeError):
        LayerRange(0, 2.0, 6)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        LayerRange(False, 2, 6)  # type: ignore[arg-type]


def test_layer_range_parse():
    assert LayerRange.parse("2:4", 6) == LayerRange(2, 4, 6)
    assert LayerRange.parse("3:", 6) == LayerRange(3, 6, 6)
    with pytest.raises(ValueError):
        LayerRange.parse("3", 6)


def test_layer_range_frozen():
    r = LayerRange(0, 1, 2)
    with pytest.raises(AttributeError):
        r.start = 1  # type: ignore[misc]


@pytest.mark.parametrize("builder", [testmodels.build_random_llama, testmodels.build_random_gemma3])
def test_random_artifact_is_complete_and_cached(builder):
    path = builder()
    assert (path / "config.json").is_file()
    assert list(path.glob("*.safetensors"))
    assert (path / "tokenizer.json").is_file()
    assert (path / testmodels.MARKER_NAME).is_file()
    assert builder() == path  # cached: same directory, no rebuild
    config = json.loads((path / "config.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    assert config["vocab_size"] == len(tok)
    ids = tok("Hello world, a shard of layers.")["input_ids"]
    assert ids and max(ids) < config["vocab_size"]


def test_overrides_give_a_distinct_artifact():
    a = testmodels.build_random_llama()
    b = testmodels.build_random_llama(seed=1)
    assert a != b


def test_atomic_build_survives_existing_target(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHD_MODEL_CACHE", str(tmp_path))
    calls = []

    def build(out):
        calls.append(out)
        (out / "x").write_text("1")

    first = testmodels._cached_build("thing", build, {"k": 1})
    again = testmodels._cached_build("thing", build, {"k": 1})
    assert again == first and len(calls) == 1

    # A concurrent builder that finishes first: ours is discarded, theirs kept.
    def racing_build(out):
        (out / "x").write_text("mine")
        winner = tmp_path / "race"
        winner.mkdir()
        (winner / "x").write_text("theirs")
        (winner / testmodels.MARKER_NAME).write_text("{}")

    won = testmodels._cached_build("race", racing_build, {})
    assert (won / "x").read_text() == "theirs"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".build-")]
