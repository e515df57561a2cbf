"""The test liar (meshd/testing/liar.py): it lies as told, keeps an honest identity, and no
product flag, config key or product module can reach it."""
from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from meshd import config
from meshd.cli import build_parser
from meshd.testing.liar import LyingBackend, Perturb, Skip, Substitute
from shard.model.torch_backend import TorchRangeBackend

ROOT = Path(__file__).resolve().parent.parent
LIAR_WORDS = ("liar", "lying", "lie")


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def _mentions_liar(value) -> bool:
    words = str(value).lower().replace("-", "_").split("_")
    return any(w in LIAR_WORDS for w in words) or "liar" in str(value).lower()


def test_no_cli_flag_choice_or_default_names_the_liar():
    seen = 0
    for parser in _parsers(build_parser()):
        for action in parser._actions:
            seen += 1
            values = [*action.option_strings, action.dest, action.default, *(action.choices or ())]
            assert not any(_mentions_liar(v) for v in values), (parser.prog, action.option_strings)
    assert seen > 100       # every subcommand's options were walked
    assert "liar" not in " ".join(config.WORKER_BACKENDS).lower()


def test_no_config_field_names_the_liar():
    classes = [v for v in vars(config).values() if dataclasses.is_dataclass(v) and isinstance(v, type)]
    assert classes
    for cls in classes:
        assert not any(_mentions_liar(f.name) for f in dataclasses.fields(cls)), cls


def test_no_product_module_imports_the_liar():
    offenders = []
    for path in (ROOT / "meshd").rglob("*.py"):
        if "testing" in path.relative_to(ROOT / "meshd").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
            if any(n.endswith("testing.liar") or n == "meshd.testing.liar" for n in names):
                offenders.append(str(path))
    assert offenders == []


@pytest.fixture(scope="module")
def middle(model):
    return TorchRangeBackend.load(model, 2, 5)


def _run(backend, rows, steps=4):
    cache = backend.new_cache(64)
    outs = [backend.forward(cache, rows[:8], effective_start=2)]
    outs += [backend.forward(cache, rows[8 + i:9 + i], effective_start=2) for i in range(steps)]
    return outs


def test_each_lie_differs_from_the_honest_answer_and_keeps_the_identity(model, middle):
    rows = np.random.default_rng(0).normal(0, 1, (12, middle.hidden_size)).astype(middle.boundary_dtype)
    honest = _run(middle, rows)
    assert all(np.array_equal(a, b) for a, b in zip(honest, _run(middle, rows)))   # the lane is exact
    bf16 = TorchRangeBackend.load(model, 2, 5, dtype="bfloat16")
    for lie in (Perturb(share=1.0), Skip(2), Substitute(bf16)):
        liar = LyingBackend(middle, lie)
        assert liar.fingerprint == middle.fingerprint and liar.layer_range == middle.layer_range
        got = _run(liar, rows)
        assert all(a.dtype == b.dtype and a.shape == b.shape for a, b in zip(got, honest))
        assert not any(np.array_equal(a, b) for a, b in zip(got, honest)), lie
        assert liar.lies == len(got)


def test_a_perturbing_liar_lies_on_its_seeded_share(middle):
    rows = np.random.default_rng(1).normal(0, 1, (40, middle.hidden_size)).astype(middle.boundary_dtype)
    honest = _run(middle, rows, steps=32)
    liar = LyingBackend(middle, Perturb(share=0.25, seed=3))
    got = _run(liar, rows, steps=32)
    lied = [not np.array_equal(a, b) for a, b in zip(got, honest)]
    assert sum(lied) == liar.lies and 0 < liar.lies < len(got)
    again = LyingBackend(middle, Perturb(share=0.25, seed=3))
    assert [not np.array_equal(a, b) for a, b in zip(_run(again, rows, steps=32), honest)] == lied


def test_a_skipping_liar_cannot_skip_everything_or_be_the_head(model, middle):
    with pytest.raises(ValueError):
        LyingBackend(middle, Skip(3))
    head = LyingBackend(TorchRangeBackend.load(model, 0, 3), Skip(1))
    with pytest.raises(ValueError, match="head"):
        head.forward(head.new_cache(8), np.arange(4, dtype=np.int64), effective_start=0)
