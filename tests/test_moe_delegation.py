"""Expert delegation, in one process: a holder's experts on TLS expert peers (threads).

Must show: f32 delegation is exact (tokens and logits, with and without the
shared expert delegated); the q8 drift gate (<= 1 argmax mismatch in 64
teacher-forced positions, < 1/3 of f32's bytes); rows once (copies per item
>= 0.9 x top-k x rows once); failover when an expert peer dies mid-decode.
"""
from __future__ import annotations

import pytest
from _shard_helpers import PROMPT

import shard.experts.adapters  # noqa: F401 - the MoE families register themselves
from meshd.testing.experts import ExpertPeer, generate, teacher_forced, tls_files
from meshd.testing.models import build_random_qwen2_moe, build_random_qwen3_moe
from proto import moe as W
from shard.experts.dispatch import ExpertsUnavailable
from shard.experts.pool import ExpertRouter, Placement
from shard.experts.spec import ExpertSpec
from shard.model.reference import WholeModel
from shard.model.torch_backend import TorchRangeBackend

NEW_TOKENS = 12
# The drift gate's fixed prompt set: 4 sequences x 16 positions = 64 positions.
DRIFT_SEQUENCES = [list(range(5 + 7 * i, 21 + 7 * i)) for i in range(4)]
Q8_MAX_MISMATCHES = 1


@pytest.fixture(scope="module", autouse=True)
def one_compute_thread():
    """Holder and expert peers share this process here: with two torch threads each, their OpenMP
    teams spin against each other on two cores (index_add_ measured at 51 ms a call under load).
    One thread, like every meshd worker, and the numerics of holder and peer stay the same."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def qwen3():
    path = build_random_qwen3_moe()
    return path, WholeModel(path).generate(PROMPT, NEW_TOKENS, chunk_tokens=16)


@pytest.fixture(scope="module")
def qwen3_wide():
    """The seed's hidden size (D = 256): at D = 64 the per-request headers and indices weigh as much
    as the rows, which is not the regime the byte ratios are about."""
    return build_random_qwen3_moe(hidden_size=256, head_dim=64)


@pytest.fixture(scope="module")
def qwen2():
    path = build_random_qwen2_moe()
    return path, WholeModel(path).generate(PROMPT, NEW_TOKENS, chunk_tokens=16)


def _router(store, **kw) -> ExpertRouter:
    fp = store.fingerprint
    return ExpertRouter(artifact=fp.model_artifact_digest, recipe=fp.runtime_recipe_digest, **kw)


def _holder(path, n, held, router):
    return TorchRangeBackend.load(path, 0, n, progress=None, experts=ExpertSpec.parse(held) if held else None,
                                  exchange=router)


def _exact(got, ref):
    tokens, logits = got
    diff = max(float(abs(a - b).max()) for a, b in zip(logits, ref.logits))
    return tokens == ref.tokens, diff


@pytest.mark.parametrize("family,held,served", [
    ("qwen3", "0-5:E0-E3", "0-5:E4-E7"),
    ("qwen3", "0-5:E1+E3+E5+E7", "0-5:E0+E2+E4+E6"),
    ("qwen2", "0-3:E0-E3+shared", "0-3:E4-E7"),           # shared expert held
    ("qwen2", "0-3:E0-E3", "0-3:E4-E7+shared"),           # shared expert delegated as one more item
])
def test_f32_delegation_is_exact(request, tls, family, held, served):
    path, ref = request.getfixturevalue(family)
    n = 6 if family == "qwen3" else 4
    peer = ExpertPeer.start(path, served, tls)
    try:
        router = _router(peer.store)
        router.set_placements([peer.placement])
        same, diff = _exact(generate(_holder(path, n, held, router), PROMPT, NEW_TOKENS), ref)
        stats = router.stats()
    finally:
        peer.stop()
    print(f"\n[{family} held {held} / peer {served}] tokens equal: {same}; max abs logit diff {diff}; "
          f"{stats['bytes_sent'] / stats['positions']:.0f} B/position sent, "
          f"{stats['bytes_received'] / stats['positions']:.0f} received")
    assert same and diff == 0.0
    assert stats["requests"] > 0 and stats["failovers"] == 0


def test_every_expert_offloaded_is_exact(qwen2, tls):
    path, ref = qwen2
    peer = ExpertPeer.start(path, "0-3:E0-E7+shared", tls)
    try:
        router = _router(peer.store, prefer_remote=True)
        router.set_placements([peer.placement])
        same, diff = _exact(generate(_holder(path, 4, None, router), PROMPT, NEW_TOKENS), ref)
    finally:
        peer.stop()
    assert same and diff == 0.0 and router.stats()["requests"] > 0


def _drift(path, tls, served, act):
    peer = ExpertPeer.start(path, served, tls)
    try:
        router = _router(peer.store, act=act, prefer_remote=True)
        router.set_placements([peer.placement])
        holder = _holder(path, 6, None, router)
        runs = [teacher_forced(holder, seq) for seq in DRIFT_SEQUENCES]
        stats = router.stats()
    finally:
        peer.stop()
    return [t for argmax, _ in runs for t in argmax], [row for _, logits in runs for row in logits], stats


def test_q8_drift_gate(qwen3_wide, tls):
    path = qwen3_wide
    local = TorchRangeBackend.load(path, 0, 6, progress=None)
    want = [t for seq in DRIFT_SEQUENCES for t in teacher_forced(local, seq)[0]]
    f32_tokens, f32_logits, f32_stats = _drift(path, tls, "0-5:E0-E7", W.ACT_F32)
    q8_tokens, q8_logits, q8_stats = _drift(path, tls, "0-5:E0-E7", W.ACT_Q8)
    assert len(want) == 64
    mismatches = sum(a != b for a, b in zip(q8_tokens, want))
    f32_bytes = f32_stats["bytes_sent"] + f32_stats["bytes_received"]
    q8_bytes = q8_stats["bytes_sent"] + q8_stats["bytes_received"]
    q8_diff = max(float(abs(a - b).max()) for a, b in zip(q8_logits, f32_logits))
    print(f"\n[q8 drift] {mismatches} argmax mismatches in {len(want)} positions; q8 max abs logit diff "
          f"{q8_diff:.4f}; bytes/position f32 {f32_bytes / 64:.0f}, q8 {q8_bytes / 64:.0f} "
          f"({q8_bytes / f32_bytes:.3f} of f32)")
    assert f32_tokens == want                     # the f32 delegation stays exact on the same positions
    assert mismatches <= Q8_MAX_MISMATCHES
    assert q8_bytes < f32_bytes / 3


def test_rows_once_moves_top_k_times_fewer_row_bytes(qwen3_wide, tls):
    path = qwen3_wide
    peer = ExpertPeer.start(path, "0-5:E0-E7", tls)
    sent = {}
    try:
        for version in (W.VERSION_COPIES, W.VERSION_ROWS_ONCE):
            router = _router(peer.store, version=version, prefer_remote=True)
            router.set_placements([peer.placement])
            generate(_holder(path, 6, None, router), PROMPT, NEW_TOKENS)
            stats = router.stats()
            sent[version] = stats["bytes_sent"] / stats["positions"]
    finally:
        peer.stop()
    top_k = 2
    print(f"\n[rows once, top-{top_k}, D=256] sent B/position: copies {sent[1]:.0f}, rows once {sent[2]:.0f} "
          f"({sent[1] / sent[2]:.2f}x)")
    assert sent[W.VERSION_COPIES] >= 0.9 * top_k * sent[W.VERSION_ROWS_ONCE]


def test_a_peer_dying_mid_decode_fails_over_to_another_with_the_same_tokens(qwen3, tls):
    path, ref = qwen3
    a = ExpertPeer.start(path, "0-5:E4-E7", tls, peer_id="peerA")
    b = ExpertPeer.start(path, "0-5:E4-E7", tls, peer_id="peerB")
    try:
        router = _router(a.store)
        router.set_placements([a.placement, b.placement])
        holder = _holder(path, 6, "0-5:E0-E3", router)

        def kill(step):
            if step == 4:
                a.stop()          # peerA sorts first: it served every request so far
        same, diff = _exact(generate(holder, PROMPT, NEW_TOKENS, before_step=kill), ref)
        stats = router.stats()
    finally:
        a.stop()
        b.stop()
    assert same and diff == 0.0
    assert stats["failovers"] >= 1 and "peerA" in stats["last_failure"]


def test_the_holder_computes_held_experts_itself_when_the_peer_dies(qwen3, tls):
    path, ref = qwen3
    peer = ExpertPeer.start(path, "0-5:E0-E7", tls)
    try:
        router = _router(peer.store, prefer_remote=True)
        router.set_placements([peer.placement])
        holder = _holder(path, 6, None, router)
        same, diff = _exact(generate(holder, PROMPT, NEW_TOKENS,
                                     before_step=lambda step: step == 3 and peer.stop()), ref)
    finally:
        peer.stop()
    assert same and diff == 0.0 and router.stats()["failovers"] >= 1


def test_no_peer_left_and_not_held_is_a_clear_error(qwen3, tls):
    path, _ = qwen3
    peer = ExpertPeer.start(path, "0-5:E4-E7", tls)
    router = _router(peer.store)
    router.set_placements([peer.placement])
    holder = _holder(path, 6, "0-5:E0-E3", router)
    peer.stop()
    with pytest.raises(ExpertsUnavailable, match="expert 4|expert 5|expert 6|expert 7"):
        generate(holder, PROMPT, 2)
    assert "cannot connect" in router.stats()["last_failure"]


def test_a_peer_with_another_certificate_is_refused(qwen3, tls, tmp_path):
    path, _ = qwen3
    other = tls_files(tmp_path, "other")
    peer = ExpertPeer.start(path, "0-5:E4-E7", other)
    try:
        router = _router(peer.store)
        p = peer.placement
        router.set_placements([Placement(p.peer_id, p.host, p.port, tls.pin, p.experts)])   # the record's pin
        with pytest.raises(ExpertsUnavailable):
            generate(_holder(path, 6, "0-5:E0-E3", router), PROMPT, 2)
        assert "does not match the pin" in router.stats()["last_failure"]
    finally:
        peer.stop()


def test_a_peer_of_another_recipe_refuses_the_hello(qwen3, tls):
    path, _ = qwen3
    peer = ExpertPeer.start(path, "0-5:E4-E7", tls)
    try:
        fp = peer.store.fingerprint
        router = ExpertRouter(artifact=fp.model_artifact_digest, recipe="sha256:" + "0" * 64)
        router.set_placements([peer.placement])
        with pytest.raises(ExpertsUnavailable):
            generate(_holder(path, 6, "0-5:E0-E3", router), PROMPT, 2)
        assert "refused our v2 f32 hello" in router.stats()["last_failure"]
    finally:
        peer.stop()


def test_the_expert_store_reads_only_its_experts(qwen3):
    from shard.experts.store import ExpertStore

    path, _ = qwen3
    store = ExpertStore.load(path, ExpertSpec.parse("1:E2+E5"))
    per_expert = (2 * 32 * 64 + 64 * 32) * 4
    assert store.weight_bytes == 2 * per_expert
    check = store.validate()
    assert check.ok and check.experts == 2
    with pytest.raises(KeyError):
        store.compute(1, 3, __import__("numpy").zeros((1, 64), "float32"))


def test_a_validated_holder_reports_the_experts_it_needs(qwen2, tls):
    from shard.session.service import ShardService
    from shard.session.sessions import SessionPolicy

    path, _ = qwen2
    peer = ExpertPeer.start(path, "0-3:E4-E7+shared", tls)
    try:
        router = _router(peer.store)
        router.set_placements([peer.placement])
        service = ShardService(_holder(path, 4, "0-3:E0-E3", router), SessionPolicy(kv_budget_tokens=256))
        report = service.validate()
    finally:
        peer.stop()
    assert report.validated
    assert ExpertSpec.from_runs(report.delegated_experts) == ExpertSpec.parse("0-3:E4-E7+shared")
    assert service.health().expert_positions > 0 and service.health().expert_bytes_sent > 0


def test_bf16_delegation_is_exact(tls):
    """bfloat16 holders: rows cross as float32 (exact for bf16 values), peers compute in bfloat16."""
    path = build_random_qwen3_moe()
    ref = WholeModel(path, "bfloat16").generate(PROMPT, 8, chunk_tokens=16)
    from shard.experts.server import ExpertServer
    from shard.experts.store import ExpertStore as Store

    store = Store.load(path, ExpertSpec.parse("0-5:E4-E7"), dtype="bfloat16")
    fp = store.fingerprint
    server = ExpertServer(store, artifact=fp.model_artifact_digest, recipe=fp.runtime_recipe_digest,
                          listen="127.0.0.1:0", tls_cert=str(tls.cert), tls_key=str(tls.key), threads=1).start()
    try:
        router = _router(store)
        router.set_placements([Placement("peer", "127.0.0.1", server.port, tls.pin, store.spec)])
        holder = TorchRangeBackend.load(path, 0, 6, dtype="bfloat16", progress=None,
                                        experts=ExpertSpec.parse("0-5:E0-E3"), exchange=router)
        same, diff = _exact(generate(holder, PROMPT, 8), ref)
    finally:
        server.close()
    assert same and diff == 0.0
