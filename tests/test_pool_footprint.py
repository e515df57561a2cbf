"""The pool's memory arithmetic: measured working memory and process bases in the planner's footprint."""
from __future__ import annotations

import pytest

from meshd.plan.adverts import ShardAd
from meshd.plan.assignment import ModelFootprint
from meshd.plan.errors import AdvertRejected, PlanInputError
from proto import shard_runtime_pb2 as pb
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
