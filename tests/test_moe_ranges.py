"""MoE layer ranges in the torch lane: Qwen3-MoE and Qwen2-MoE split == whole, bit for bit."""
from __future__ import annotations

import pytest
import torch
from _shard_helpers import PROMPT, max_diff, run_split
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.testing.models import build_random_llama, build_random_qwen2_moe, build_random_qwen3_moe
from shard.experts.adapters import moe_layers
from shard.experts.dispatch import MoeDispatch
from shard.experts.spec import SHARED, ExpertSpec, ExpertSpecError
from shard.model.reference import WholeModel
from shard.model.torch_backend import TorchRangeBackend

FAMILIES = {"qwen3_moe": (build_random_qwen3_moe, 6), "qwen2_moe": (build_random_qwen2_moe, 4)}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def references():
    out = {}
    for name, (builder, _) in FAMILIES.items():
        path = builder()
        out[name] = (path, WholeModel(path).generate(PROMPT, NEW_TOKENS, chunk_tokens=16))
    return out


@pytest.mark.parametrize("family,cuts", [("qwen3_moe", (2, 4)), ("qwen2_moe", (2,)),
                                         ("qwen2_moe", (1, 3))])
def test_split_equals_whole(references, family, cuts):
    path, ref = references[family]
    n = FAMILIES[family][1]
    bounds = (0, *cuts, n)
    parts = [TorchRangeBackend.load(path, a, b, progress=None) for a, b in zip(bounds, bounds[1:])]
    tokens, logits = run_split(parts, PROMPT, NEW_TOKENS)
    print(f"\n[{family} split {bounds}] tokens equal: {tokens == ref.tokens}; "
          f"max abs logit diff {max_diff(logits, ref.logits)}")
    assert tokens == ref.tokens
    assert max_diff(logits, ref.logits) == 0.0


def test_models_route_rows_to_different_experts(references):
    """The seeded models are not degenerate: rows pick varied experts (else delegation tests prove little)."""
    for family, (path, ref) in references.items():
        backend = TorchRangeBackend.load(path, 0, FAMILIES[family][1], progress=None)
        block = backend.modules.layers[0].mlp
        hidden = torch.randn(40, backend.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            _, _, selected = block.gate(hidden)
        assert len(set(selected.flatten().tolist())) >= 6, family
        assert len(set(ref.tokens)) >= 2, family


def test_a_range_reads_only_its_experts(references):
    path, _ = references["qwen3_moe"]
    whole = TorchRangeBackend.load(path, 0, 3, progress=None)
    half = TorchRangeBackend.load(path, 0, 3, progress=None, experts=ExpertSpec.parse("0-2:E0-E3"))
    mlp = half.modules.layers[1].mlp
    assert isinstance(mlp, MoeDispatch) and mlp.experts.held == (0, 1, 2, 3)
    assert mlp.experts.gate_up_proj.shape[0] == 4
    full = whole.modules.layers[1].mlp.experts
    assert torch.equal(mlp.experts.gate_up_proj, full.gate_up_proj[:4])
    assert torch.equal(mlp.experts.down_proj, full.down_proj[:4])
    expert_bytes = sum(t.numel() * 4 for t in (full.gate_up_proj, full.down_proj)) * 3
    assert whole.weight_bytes - half.weight_bytes == expert_bytes // 2


def test_dispatch_holding_every_expert_equals_the_transformers_block(references):
    """MoeDispatch's own composition (router, local experts, index_add in expert order) is transformers'."""
    for family, (path, ref) in references.items():
        n = FAMILIES[family][1]

        class Offload:   # prefer peers, but no peer: every expert falls back to local compute
            prefer_remote = True

            def can_serve(self, layer, expert):
                return False

            def note_positions(self, count):
                pass

            def run(self, layer, rows, items):
                raise AssertionError("no expert should be sent anywhere")

        backend = TorchRangeBackend.load(path, 0, n, progress=None, exchange=Offload())
        assert isinstance(backend.modules.layers[0].mlp, MoeDispatch)
        tokens, logits = run_split([backend], PROMPT, NEW_TOKENS)
        assert tokens == ref.tokens and max_diff(logits, ref.logits) == 0.0, family


def test_missing_experts_without_peers_fail_clearly(references):
    from shard.experts.dispatch import ExpertsUnavailable

    path, _ = references["qwen3_moe"]
    backend = TorchRangeBackend.load(path, 0, 6, progress=None, experts=ExpertSpec.parse("0-5:E0-E6"))
    with pytest.raises(ExpertsUnavailable, match="meshd join --experts"):
        run_split([backend], PROMPT, 2)


def test_qwen2_shared_expert_can_be_left_out(references):
    path, _ = references["qwen2_moe"]
    backend = TorchRangeBackend.load(path, 0, 4, progress=None, experts=ExpertSpec.parse("0-3:E0-E7"))
    mlp = backend.modules.layers[0].mlp
    assert isinstance(mlp, MoeDispatch) and mlp.shared_expert is None and mlp.shared_expert_gate is not None
    assert backend.adapter.delegated(backend.layer_range) == ExpertSpec.parse("0-3:shared")


def test_experts_on_a_dense_model_are_refused():
    with pytest.raises(ValueError, match="no experts"):
        TorchRangeBackend.load(build_random_llama(), 0, 2, progress=None, experts=ExpertSpec.parse("0:E0"))


def test_spec_is_checked_against_the_model(references):
    path, _ = references["qwen3_moe"]
    with pytest.raises(ExpertSpecError, match="8 experts"):
        TorchRangeBackend.load(path, 0, 2, progress=None, experts=ExpertSpec.parse("0:E8"))
    with pytest.raises(ExpertSpecError, match="no shared expert"):
        TorchRangeBackend.load(path, 0, 2, progress=None, experts=ExpertSpec.parse("0:shared"))


def test_dense_layers_stay_dense():
    path = build_random_qwen3_moe(mlp_only_layers=[1], num_hidden_layers=4)
    from transformers import AutoConfig

    assert moe_layers(AutoConfig.from_pretrained(path)) == [0, 2, 3]
    ref = WholeModel(path).generate(PROMPT, 8, chunk_tokens=16)
    parts = [TorchRangeBackend.load(path, 0, 2, progress=None, experts=ExpertSpec.parse("0:E0-E7")),
             TorchRangeBackend.load(path, 2, 4, progress=None)]
    tokens, logits = run_split(parts, PROMPT, 8)
    assert tokens == ref.tokens and max_diff(logits, ref.logits) == 0.0
    with pytest.raises(ExpertSpecError, match="dense layer"):
        TorchRangeBackend.load(path, 0, 2, progress=None, experts=ExpertSpec.parse("1:E0"))


# --------------------------------------------------------------------------- the spec text


@pytest.mark.parametrize("text,pairs", [
    ("0:E0-E2", {(0, 0), (0, 1), (0, 2)}),
    ("1-2:E4-5", {(1, 4), (1, 5), (2, 4), (2, 5)}),
    ("3:E1+E7+shared", {(3, 1), (3, 7), (3, SHARED)}),
    ("0:E0, 0:E3", {(0, 0), (0, 3)}),
])
def test_spec_parses(text, pairs):
    spec = ExpertSpec.parse(text)
    assert spec.pairs == frozenset(pairs)
    assert ExpertSpec.parse(str(spec)) == spec


def test_spec_canonical_text():
    assert str(ExpertSpec.parse("2:E4-E7,0:E4-E7,1:E4-E7+shared")) == "0:E4-E7,1:E4-E7+shared,2:E4-E7"
    assert str(ExpertSpec.parse("0-3:E0+E1+E2+E5")) == "0-3:E0-E2+E5"


@pytest.mark.parametrize("text", ["", "E0", "0:", "0:F1", "3-1:E0", "0:E5-E2", "0:E512", "4096:E0", "0:E0;1:E1",
                                  "x" * 9000])
def test_spec_refuses(text):
    with pytest.raises(ExpertSpecError):
        ExpertSpec.parse(text)


def test_spec_pair_bound():
    with pytest.raises(ExpertSpecError, match="pairs"):
        ExpertSpec.parse("0-4095:E0-E511")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789E-:,+ shared", max_size=60))
def test_spec_parser_fuzz(text):
    try:
        spec = ExpertSpec.parse(text)
    except ExpertSpecError:
        return
    assert ExpertSpec.parse(str(spec)) == spec
