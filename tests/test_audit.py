"""Audits at the entry (meshd/generate/audit.py) over shards in memory, with a lying middle hop.

A serves [0,2), T [4,6); L (the liar, cheap) and H (honest, dearer) both
serve [2,4), so routes go A -> L -> T and H audits L. Everything is seeded:
the liar's lies, the audit sampler; no timing.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from meshd.generate.audit import (
    DEFAULT_VERIFY_RATE,
    AuditBook,
    AuditSampler,
    VerifyPolicy,
    answers_agree,
)
from meshd.generate.driver import collect
from meshd.generate.hop_link import TailOut
from meshd.testing.liar import LyingBackend, Perturb, Skip
from proto import shard_runtime_pb2 as pb
from proto.errors import LocalError
from shard.model.sampling import SamplingSpec
from shard.model.torch_backend import TorchRangeBackend
from shard.session.service import ShardService
from shard.session.sessions import SessionPolicy
from tests._swarm_helpers import KV_BUDGET_TOKENS, PROMPT, MemoryShard, MemorySwarm, whole_tokens
from tests._swarm_helpers import request as make_request

NEW_TOKENS = 12
TRIALS = 40


def start_liar(swarm: MemorySwarm, peer_id: str, start: int, end: int, lie, *, cost: float = 0.5) -> LyingBackend:
    backend = LyingBackend(TorchRangeBackend.load(swarm.model, start, end), lie)
    service = ShardService(backend, SessionPolicy(kv_budget_tokens=KV_BUDGET_TOKENS))
    endpoint = f"mem-liar:{peer_id}"
    hop = swarm.network.add(endpoint, service)
    swarm.shards[peer_id] = MemoryShard(peer_id, start, end, service, hop, endpoint)
    swarm.costs[peer_id] = cost
    return backend


def swarm_with(lie) -> tuple[MemorySwarm, LyingBackend | None]:
    swarm = MemorySwarm()
    swarm.start("peer-a", 0, 2)
    liar = start_liar(swarm, "peer-l", 2, 4, lie) if lie is not None else None
    if liar is None:
        swarm.start("peer-l", 2, 4, cost=0.5)
    swarm.start("peer-h", 2, 4, cost=5.0)
    swarm.start("peer-t", 4, 6)
    return swarm, liar


@pytest.fixture(scope="module")
def reference():
    return whole_tokens(NEW_TOKENS)


# -- the pure parts ---------------------------------------------------------------------------
def test_verify_policy_parses_rates_percentages_and_all():
    assert VerifyPolicy.parse("all").rate == 1.0
    assert VerifyPolicy.parse("0.03").rate == VerifyPolicy().rate == DEFAULT_VERIFY_RATE
    assert VerifyPolicy.parse("5%").rate == pytest.approx(0.05)
    assert not VerifyPolicy.parse("0").enabled
    for bad in ("1.5", "-0.1", "often", "nan"):
        with pytest.raises(LocalError):
            VerifyPolicy.parse(bad)
    with pytest.raises(LocalError):
        VerifyPolicy(0.1, tolerance=2.0)


@pytest.mark.parametrize("rate", [1.0, 0.5, 0.1, DEFAULT_VERIFY_RATE])
def test_the_sampler_picks_one_step_per_window_at_a_seeded_offset(rate):
    window = math.ceil(1 / rate)
    sampler = AuditSampler(rate, seed=7)
    picks = [sampler.pick("hop") for _ in range(window * 50)]
    for w in range(50):
        assert sum(picks[w * window:(w + 1) * window]) == 1
    again = AuditSampler(rate, seed=7)
    assert [again.pick("hop") for _ in range(window * 50)] == picks
    if rate < 1:
        offsets = {picks[w * window:(w + 1) * window].index(True) for w in range(50)}
        assert len(offsets) > 1      # not a fixed stride a liar could dodge
    assert not any(AuditSampler(0.0, seed=1).pick("hop") for _ in range(100))


def test_answers_agree_exactly_or_within_the_tolerance():
    rows = np.linspace(-2, 2, 32, dtype=np.float32).reshape(4, 8)
    assert answers_agree(rows, rows.copy(), 0.0) == ""
    nudged = rows.copy()
    nudged[1, 1] = np.nextafter(nudged[1, 1], np.float32(9))
    assert answers_agree(rows, nudged, 0.0)
    assert answers_agree(rows, nudged, 1e-5) == ""
    assert answers_agree(rows, rows + 0.1, 1e-5)
    assert answers_agree(rows, rows[:2], 0.5)
    a = TailOut(pb.TailSample(token_id=3), None)
    assert answers_agree(a, TailOut(pb.TailSample(token_id=3), None), 0.0) == ""
    assert "token" in answers_agree(a, TailOut(pb.TailSample(token_id=4), None), 0.0)
    assert answers_agree(a, rows, 0.0)


# -- over the swarm -----------------------------------------------------------------------------
def test_an_honest_swarm_audited_on_every_step_has_no_accusation(reference):
    swarm, _ = swarm_with(None)
    book = AuditBook()
    driver = swarm.driver(verify=VerifyPolicy.parse("all", seed=1), audit_book=book)
    assert collect(driver, make_request(NEW_TOKENS)) == reference
    assert not driver.stats.failovers and book.mismatches == 0 and not book.excluded
    # every step of peer-l is audited by peer-h; peer-a and peer-t have no replica
    assert driver.auditor is not None and driver.auditor.audited_steps == NEW_TOKENS
    assert book.unaudited == 2 * NEW_TOKENS and book.audits == NEW_TOKENS
    assert swarm.idle()      # audit sessions are released too


@pytest.mark.parametrize("lie", [Perturb(share=1.0, seed=5), Perturb(share=0.2, seed=5), Skip(1)],
                         ids=["every-step", "a-fifth", "skips-a-layer"])
def test_with_verify_all_a_liar_never_changes_a_token_and_is_excluded_after_its_first_lie(reference, lie):
    swarm, liar = swarm_with(lie)
    assert liar is not None
    book = AuditBook()
    driver = swarm.driver(verify=VerifyPolicy.parse("all", seed=2), audit_book=book)
    assert collect(driver, make_request(NEW_TOKENS)) == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-l" and "audit" in event.detail
    assert list(book.excluded) == ["peer-l"] and book.mismatches == 1
    assert driver.stats.routes[-1].peers == ("peer-a", "peer-h", "peer-t")
    # detected at its first lying step: every forward before it was honest
    assert liar.lies >= 1
    assert swarm.idle()
    # the entry's next generation never routes through the excluded peer
    again = swarm.driver(verify=VerifyPolicy.parse("all", seed=3), audit_book=book)
    assert collect(again, make_request(NEW_TOKENS)) == reference
    assert "peer-l" not in again.stats.routes[0].peers and not again.stats.failovers


def test_seeded_sampling_through_a_liar_with_verify_all_equals_the_honest_run():
    sampling = SamplingSpec(temperature=0.9, seed=11)
    honest_swarm, _ = swarm_with(None)
    honest = collect(honest_swarm.driver(), make_request(NEW_TOKENS, sampling=sampling))
    swarm, _ = swarm_with(Perturb(share=1.0, seed=1))
    driver = swarm.driver(verify=VerifyPolicy.parse("all", seed=4), audit_book=AuditBook())
    assert collect(driver, make_request(NEW_TOKENS, sampling=sampling)) == honest
    assert len(driver.stats.failovers) == 1


@pytest.mark.parametrize("lie", [Perturb(share=1.0), Skip(1)], ids=["corrupts-every-step", "skips-a-layer"])
def test_at_the_default_rate_a_liar_is_caught_within_3_over_rate_of_its_steps(lie):
    """40 seeded trials: the step of the liar's at which the audit caught it (1: its prefill)."""
    bound = math.ceil(3 / DEFAULT_VERIFY_RATE)
    caught_at = []
    swarm, _ = swarm_with(lie)          # one swarm: each trial is a fresh entry (its own book)
    for trial in range(TRIALS):
        driver = swarm.driver(verify=VerifyPolicy(DEFAULT_VERIFY_RATE, seed=1000 + trial), audit_book=AuditBook())
        tokens = driver.generate(make_request(bound + 5))
        for _ in tokens:
            if driver.stats.failovers:
                break
        tokens.close()
        if driver.stats.failovers:
            (event,) = driver.stats.failovers
            assert event.failed_peer == "peer-l"
            caught_at.append(event.position - len(PROMPT) + 1)
        assert swarm.idle()
    within = [n for n in caught_at if n <= bound]
    assert len(within) >= math.ceil(0.95 * TRIALS), caught_at
    assert len(set(caught_at)) > 5        # the steps audited differ from seed to seed


def test_the_verify_setting_reaches_the_config_from_the_flag_and_the_file(tmp_path):
    import argparse

    from meshd.cli import join
    from meshd.config import DaemonConfig, load_config
    from meshd.errors import ConfigError

    parser = argparse.ArgumentParser()
    join.add_arguments(parser)
    assert parser.parse_args([]).verify_rate is None
    assert DaemonConfig().verify_rate == DEFAULT_VERIFY_RATE
    assert load_config(None, {"verify_rate": parser.parse_args(["--verify", "all"]).verify_rate}).verify_rate == 1.0
    assert load_config(None, {"verify_rate": "2%"}).verify_rate == pytest.approx(0.02)
    file = tmp_path / "meshd.toml"
    file.write_text('verify_rate = 0\n')
    assert load_config(file, {}).verify_rate == 0.0
    for bad in ("sometimes", 1.5, True, "nan"):
        with pytest.raises(ConfigError, match="verify"):
            DaemonConfig(verify_rate=bad)


def test_metrics_and_status_show_audits_mismatches_and_excluded_peers():
    from meshd.api.metrics import ApiMetrics
    from meshd.cli.status_view import render_audits

    book = AuditBook()
    book.count(audits=7, unaudited=2)
    book.exclude("peer-l", "rows differ")
    book.exclude("peer-l", "again")                 # one peer, two mismatches
    metrics = ApiMetrics(probe=lambda: {"audits": book.snapshot()})
    text = metrics.render().decode()
    for line in ("meshd_audits_total 7.0", "meshd_audit_mismatches_total 2.0", "meshd_audits_skipped_total 2.0",
                 "meshd_excluded_peers 1.0"):
        assert line in text
    assert "meshd_audits_total 0.0" in ApiMetrics(probe=lambda: {}).render().decode()
    lines = render_audits({"verify_rate": 0.03, **book.snapshot()})
    assert lines[0] == "audits     3.0% of each hop's steps: 7 run, 2 mismatches, 2 skipped (no replica)"
    assert lines[1:] == ["  excluded peer-l"]
    assert render_audits({"verify_rate": 1.0})[0].startswith("audits     every step")
    assert render_audits({"verify_rate": 0.0})[0].startswith("audits     off")


# -- the torch lane with batching on: a bound measured from its own drift ---------------------------
def _batch_drift(backend, start: int, sessions: int = 8, steps: int = 24) -> float:
    """The largest relative difference between a decode row computed in a batch of ``sessions``
    and the same row computed alone, over ``steps`` decode steps (the KV drifts along)."""
    rng = np.random.default_rng(start)
    prompts = [rng.integers(0, backend.vocab_size, 12 + steps) if start == 0 else
               rng.normal(0, 1, (12 + steps, backend.hidden_size)).astype(backend.boundary_dtype)
               for _ in range(sessions)]
    alone, batched = [backend.new_cache(64) for _ in prompts], [backend.new_cache(64) for _ in prompts]
    for p, a, b in zip(prompts, alone, batched):
        backend.forward(a, p[:12], effective_start=start)
        backend.forward(b, p[:12], effective_start=start)
    worst = 0.0
    for step in range(steps):
        rows = [p[12 + step:13 + step] for p in prompts]
        together = backend.forward_batch(batched, rows, effective_start=start)
        for cache, row, got in zip(alone, rows, together):
            assert isinstance(got, np.ndarray)
            one = backend.forward(cache, row, effective_start=start)
            worst = max(worst, float(np.abs(one.astype(np.float64) - got).max() / np.abs(one).max()))
    return worst


def test_the_torch_batch_drift_is_far_inside_the_tolerance_and_a_lie_far_outside(model):
    from meshd.generate.audit import TORCH_BATCH_TOLERANCE

    drifts = {}
    for start, end in ((0, 2), (2, 4), (4, 6)):
        drifts[(start, end)] = _batch_drift(TorchRangeBackend.load(model, start, end), start)
    print("torch batch drift (relative, worst row of 8 sessions x 24 steps):", drifts)
    assert 0 < max(drifts.values()) < TORCH_BATCH_TOLERANCE / 10
    # the mildest lie the test liar tells is orders of magnitude above the bound
    middle = TorchRangeBackend.load(model, 2, 4)
    rows = np.random.default_rng(3).normal(0, 1, (4, middle.hidden_size)).astype(np.float32)
    honest = middle.forward(middle.new_cache(8), rows, effective_start=2)
    liar = LyingBackend(middle, Perturb(share=1.0, scale=1e-3))
    lied = liar.forward(liar.new_cache(8), rows, effective_start=2)
    assert answers_agree(lied, honest, TORCH_BATCH_TOLERANCE)
    assert answers_agree(honest + np.float32(0), honest, TORCH_BATCH_TOLERANCE) == ""


def test_eight_concurrent_audited_generations_on_batching_workers_accuse_no_one(reference):
    """c=8 through the same batching workers, every step audited within the torch bound."""
    import threading

    from meshd.generate.audit import TORCH_BATCH_TOLERANCE

    swarm, _ = swarm_with(None)
    book = AuditBook()
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            driver = swarm.driver(verify=VerifyPolicy(1.0, seed=i, tolerance=TORCH_BATCH_TOLERANCE),
                                  audit_book=book)
            results[i] = collect(driver, make_request(NEW_TOKENS))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=110)
    assert not errors and len(results) == 8
    print("rows batched with others:", {p: s.service.batcher.batched_rows for p, s in swarm.shards.items()})
    assert book.mismatches == 0 and not book.excluded
    assert book.audits == 8 * NEW_TOKENS
    assert swarm.idle()
