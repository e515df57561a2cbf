"""The pool's memory arithmetic: measured working memory and process bases in the planner's footprint."""
from __future__ import annotations

import pytest

from meshd.plan.adverts import ShardAd
from meshd.plan.assignment import ModelFootprint
from meshd.plan.errors import AdvertRejected, PlanInputError
from proto import shard_runtime_pb2 as pb
from shard.model.memory import process_memory
from tests._planner_helpers import MODEL

MIB = 1 << 20


def _payload(memory: pb.MemoryFigures | None = None) -> pb.CapabilityPayload:
    p = pb.CapabilityPayload(
        schema_version=pb.SCHEMA_VERSION_1, peer_id="12D3KooWpeer", model_artifact_digest=MODEL,
        shard_range=pb.ShardRange(start_layer=0, end_layer=4), num_layers=8, backend=pb.BACKEND_LLAMA_CPP,
        throughput=pb.Throughput(decode_ms_per_layer=1.0, prefill_tokens_per_s=10.0),
        issued_at_unix_ms=1_000, expires_at_unix_ms=61_000, sequence=1)
    if memory is not None:
        p.memory.CopyFrom(memory)
    return p


def test_range_bytes_counts_working_memory_and_base_once():
    fp = ModelFootprint.uniform(MODEL, 4, 100 * MIB, kv_bytes_per_token_layer=1024,
                                scratch_row_bytes=4096, score_bytes_per_kv_token=128)
    measured = ModelFootprint.uniform(MODEL, 4, 100 * MIB, kv_bytes_per_token_layer=1024,
                                      scratch_row_bytes=4096, score_bytes_per_kv_token=128,
                                      working_bytes=40 * MIB, base_bytes=150 * MIB)
    kv = 4096
    for start, end in ((0, 1), (1, 3), (0, 4)):
        plain = fp.range_bytes(start, end, kv)
        scratch = fp.scratch_bytes(kv, tail=end == 4)
        # the measured working memory replaces the scratch estimate; the base is added once
        assert measured.range_bytes(start, end, kv) == plain - scratch + 40 * MIB + 150 * MIB
    assert measured.scratch_bytes(kv, tail=True) == measured.scratch_bytes(kv, tail=False) == 40 * MIB


@pytest.mark.parametrize("field", ["working_bytes", "base_bytes"])
@pytest.mark.parametrize("value", [-1, True, 1.5, 1 << 41])
def test_footprint_refuses_bad_memory_figures(field, value):
    with pytest.raises(PlanInputError):
        ModelFootprint.uniform(MODEL, 4, MIB, **{field: value})


def test_advert_reads_the_measured_memory():
    figures = pb.MemoryFigures(weight_bytes=800 * MIB, kv_bytes=36 * MIB, working_bytes=40 * MIB,
                               worker_base_bytes=70 * MIB, daemon_base_bytes=110 * MIB)
    ad = ShardAd.from_payload(_payload(figures))
    assert ad.backend == pb.BACKEND_LLAMA_CPP
    assert (ad.measured_working_bytes, ad.measured_base_bytes) == (40 * MIB, 180 * MIB)
    bare = ShardAd.from_payload(_payload())
    assert (bare.measured_working_bytes, bare.measured_base_bytes) == (0, 0)


def test_advert_with_absurd_memory_figures_is_the_peers_fault():
    with pytest.raises(AdvertRejected, match="measured_base_bytes"):
        ShardAd.from_payload(_payload(pb.MemoryFigures(worker_base_bytes=1 << 60)))


def test_a_real_models_llama_footprint_has_working_memory_not_score_scratch():
    """SmolLM2 (GGUF, llama.cpp, flash attention): no 512 x 9 heads x 4096 tokens of scores; the
    compute buffer of one 128-row ubatch, the mask, the engine's buffers and the tail's logits."""
    from pathlib import Path

    from meshd.plan.footprint import base_estimate, model_footprint
    from native.packaged import smollm2_gguf_path

    fp = model_footprint(Path(smollm2_gguf_path()), MODEL, "llama.cpp")
    assert (fp.scratch_row_bytes, fp.score_bytes_per_kv_token, fp.logit_row_bytes) == (
        (6 * 576 + 3 * 1536) * 4, 9 * 4, 49152 * 4)   # the torch lane's estimate stays available
    compute = 128 * 4 * (3 * 1536 + 4 * 576)
    head_logits = 128 * 49152 * 4
    assert fp.working_bytes == compute + 128 * 4096 * 2 + 3 * 128 * 576 * 4 + head_logits + 20 * MIB
    assert fp.scratch_bytes(4096, tail=True) == fp.scratch_bytes(4096, tail=False) == fp.working_bytes
    assert fp.working_bytes < 512 * 9 * 4096 * 4                # far below the old score scratch
    # measured here: a head range's worker 47 MiB, a middle's 22, a tail's 24: the estimate bounds them
    assert 47 * MIB <= fp.working_bytes <= 60 * MIB
    assert fp.base_bytes == base_estimate("llama.cpp", 49152) == 150 * MIB + 1400 * 49152 + 80 * MIB
    torch_fp = model_footprint(Path(smollm2_gguf_path()), MODEL, "torch")
    assert torch_fp.working_bytes == 0 and torch_fp.base_bytes == base_estimate("torch", 49152)


def _ad(peer: str, backend: int, working: int, base: int, model: str = MODEL) -> ShardAd:
    return ShardAd(peer_id=peer, model_digest=model, start=0, end=2, num_layers=4, decode_ms_per_layer=1.0,
                   prefill_tokens_per_s=1.0, free_kv_tokens=0, memory_budget_bytes=0, relayed=False,
                   expires_at_ms=10, backend=backend, measured_working_bytes=working, measured_base_bytes=base)


def test_measured_figures_of_the_same_backend_raise_the_estimates():
    from meshd.plan.footprint import measured_footprint

    fp = ModelFootprint.uniform(MODEL, 4, MIB, working_bytes=25 * MIB, base_bytes=185 * MIB)
    assert measured_footprint(fp, [], "llama.cpp") is fp
    ads = [_ad("a", pb.BACKEND_LLAMA_CPP, 30 * MIB, 180 * MIB), _ad("b", pb.BACKEND_LLAMA_CPP, 28 * MIB, 190 * MIB),
           _ad("c", pb.BACKEND_TORCH, 90 * MIB, 500 * MIB),                    # another lane: not ours
           _ad("d", pb.BACKEND_LLAMA_CPP, 99 * MIB, 999 * MIB, model="sha256:" + "ab" * 32),  # another model
           _ad("e", pb.BACKEND_LLAMA_CPP, 0, 0)]                              # measured nothing
    got = measured_footprint(fp, ads, "llama.cpp")
    assert (got.working_bytes, got.base_bytes) == (30 * MIB, 190 * MIB)   # the largest of each
    assert got.layer_weight_bytes == fp.layer_weight_bytes
    torch_view = measured_footprint(fp, ads, "torch")
    assert (torch_view.working_bytes, torch_view.base_bytes) == (90 * MIB, 500 * MIB)
    # figures below the estimates change nothing: plans made before they arrived stay the plans
    quiet = [_ad("a", pb.BACKEND_LLAMA_CPP, 20 * MIB, 150 * MIB)]
    assert measured_footprint(fp, quiet, "llama.cpp") is fp
    # a lane without a measured working memory (torch's scratch estimate) is raised from that estimate
    scratchy = ModelFootprint.uniform(MODEL, 4, MIB, scratch_row_bytes=1000, base_bytes=185 * MIB)
    raised = measured_footprint(scratchy, [_ad("t", pb.BACKEND_TORCH, 90 * MIB, 0)], "torch")
    assert raised.working_bytes == 90 * MIB and raised.base_bytes == 185 * MIB


def _written_bytes() -> int:
    """Bytes this process has caused to be written to storage (``/proc/self/io`` write_bytes)."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("write_bytes"))


# Metadata, tensor table and the placeholder embedding/norm of a slice of these small models.
SLICE_HEADER_ALLOWANCE = 1 << 20


def test_a_slice_writes_its_range_once_and_replaces_the_nodes_other_slices(tmp_path):
    from meshd.testing.models import smollm2_gguf_path
    from native.gguf_range import open_reader, read_range
    from native.slice import range_file
    from shard.model.backend import LayerRange

    source = smollm2_gguf_path()
    node = tmp_path / "node-slices"
    reader = open_reader(source)
    whole = LayerRange(0, 30, 30)
    before = _written_bytes()
    assert range_file(source, whole, None, directory=node, replace=True) == source   # the file is the range
    assert _written_bytes() == before and not any(node.glob("*"))                    # nothing written

    first = LayerRange(0, 12, 30)
    rss = process_memory()
    before = _written_bytes()
    path = range_file(source, first, None, directory=node, replace=True)
    written = _written_bytes() - before
    grown = process_memory().file - rss.file
    range_bytes = read_range(reader, first).touched_bytes()
    print(f"\nslice 0:12: {written / 1e6:.1f} MB written for {range_bytes / 1e6:.1f} MB of tensors; "
          f"file pages +{grown / 1e6:.1f} MB")
    assert range_bytes <= path.stat().st_size <= written <= range_bytes + SLICE_HEADER_ALLOWANCE
    assert grown < range_bytes // 4     # the source was read, not mapped into this process
    before = _written_bytes()
    assert range_file(source, first, None, directory=node, replace=True) == path and _written_bytes() == before

    second = LayerRange(12, 30, 30)   # the tracker moved the node: the new slice replaces the old one
    moved = range_file(source, second, None, directory=node, replace=True)
    assert sorted(node.iterdir()) == [moved] and not path.exists()
    assert moved.stat().st_size <= read_range(reader, second).touched_bytes() + SLICE_HEADER_ALLOWANCE


def test_entering_a_llama_cpp_range_mid_way_costs_its_whole_range():
    """llama.cpp enters a range mid-way by running the layers before the entry too (one copy of the
    weights, injection): a route through it pays for them, so an exact-fitting peer wins."""
    from meshd.plan.routing import DEFAULT_RTT_MS, plan_route
    from tests._planner_helpers import make_ad

    llama = {"backend": pb.BACKEND_LLAMA_CPP}

    def route(ads):
        return plan_route(ads, model_digest=MODEL, num_layers=8, now_ms=0, entry_peer_id="e")

    overlap = route([make_ad("a", 0, 5, **llama), make_ad("b", 3, 8, **llama)])
    assert [(h.peer_id, h.effective_start) for h in overlap.hops] == [("a", 0), ("b", 5)]
    assert overlap.cost_ms == 5.0 + 5.0 + 3 * DEFAULT_RTT_MS          # b runs 3..8, not 5..8
    torch = route([make_ad("a", 0, 5), make_ad("b", 3, 8)])
    assert torch.cost_ms == 5.0 + 3.0 + 3 * DEFAULT_RTT_MS             # torch skips the layers
    exact = route([make_ad("a", 0, 5, **llama), make_ad("b", 3, 8, decode_ms_per_layer=0.9, **llama),
                   make_ad("c", 5, 8, **llama)])
    assert [h.peer_id for h in exact.hops] == ["a", "c"]               # b is faster per layer, not here


# A torch model whose range weights dwarf a worker's real working memory (measured 25-56 MiB here),
# with few heads so that the planner's estimate of it is small too (~100 MiB): 6 layers of 58 MiB.
TORCH_POOL_DIMS = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 6,
                   "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 384}


def test_a_torch_workers_measured_figures_leave_the_next_node_its_share():
    """The torch lane end to end through the planner: a worker loads 0:3 and measures its figures
    as ``meshd worker`` does (base after the imports, peak reset after the load, the validation
    forward); its record raises the footprint (measured_footprint); a second node with the same
    --memory must then still cover 3:6. The load once left safetensors' map of the file alive, so
    the range's weights were resident twice and the second copy counted as working memory: the
    second node got 3:4."""
    import argparse

    from meshd.cli.worker import import_backend_libraries
    from meshd.config import DEFAULT_KV_BUDGET_TOKENS as KV
    from meshd.plan.adverts import CoverageMap, Span
    from meshd.plan.assignment import JoinRequest, plan_join
    from meshd.plan.footprint import WORKER_BASE_ESTIMATE, measured_footprint, model_footprint
    from meshd.testing.models import build_random_llama
    from shard.model.memory import memory_figures, reset_peak
    from shard.model.torch_backend import TorchRangeBackend
    from shard.session.service import ShardService
    from shard.session.sessions import SessionPolicy

    model = build_random_llama(seed=35, **TORCH_POOL_DIMS)
    import_backend_libraries(argparse.Namespace(model=str(model), threads=1, backend="torch"))
    base = process_memory().rss
    backend = TorchRangeBackend.load(model, 0, 3, progress=None)
    with open("/proc/self/maps") as fh:   # nothing maps the file: the tensors own their memory
        assert not [line for line in fh if str(model) in line]
    if not reset_peak():
        pytest.skip("this kernel does not let a process reset its VmHWM (clear_refs 5)")
    service = ShardService(backend, SessionPolicy(kv_budget_tokens=KV), model_id="pool")
    assert service.validate().validated
    figures = memory_figures(backend, base=base, peak=process_memory().peak, kv_budget_tokens=KV,
                             validation_tokens=service.validation_tokens)
    print(f"weights {figures.weight_bytes >> 20} MiB, working {figures.working_bytes >> 20} MiB")
    # the range's weights are resident once: its working memory is not a second copy of them
    assert figures.working_bytes < figures.weight_bytes // 2
    layer = figures.weight_bytes // 3

    fp = model_footprint(model, MODEL, "torch")
    memory = fp.range_bytes(0, 3, KV) + layer // 2   # 0:3 with half a layer to spare
    alone = CoverageMap.build([], model_digest=MODEL, num_layers=6)
    assert plan_join(alone, fp, JoinRequest("n0", memory)).span == Span(0, 3)
    # its record: the worker's figures, the process bases as estimated (this test process is no
    # worker; the base is not the figure under test)
    figures.worker_base_bytes = WORKER_BASE_ESTIMATE["torch"]
    figures.daemon_base_bytes = fp.base_bytes - WORKER_BASE_ESTIMATE["torch"]
    payload = pb.CapabilityPayload(
        schema_version=pb.SCHEMA_VERSION_1, peer_id="12D3KooWfirst", model_artifact_digest=MODEL,
        shard_range=pb.ShardRange(start_layer=0, end_layer=3), num_layers=6, backend=pb.BACKEND_TORCH,
        throughput=pb.Throughput(decode_ms_per_layer=1.0, prefill_tokens_per_s=10.0),
        issued_at_unix_ms=1_000, expires_at_unix_ms=61_000, sequence=1, memory=figures)
    ad = ShardAd.from_payload(payload)
    measured = measured_footprint(fp, [ad], "torch")
    served = CoverageMap.build([ad], model_digest=MODEL, num_layers=6)
    assert plan_join(served, measured, JoinRequest("n1", memory)).span == Span(3, 6)
