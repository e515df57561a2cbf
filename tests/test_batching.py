"""Continuous batching on the torch lane (shard/session/batching.py, shard/model/torch_batch.py).

Several sessions' steps through one ShardService from several threads share
forwards; every session's greedy tokens equal the same request run alone,
whole model and split, with the prefill in one piece and chunked. The logit
differences are measured (a GEMM over R rows may round differently from one
row) and printed.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from meshd.testing.models import build_random_gemma3, build_random_llama
from proto.errors import ProtocolViolation
from shard.model.torch_backend import TorchRangeBackend
from shard.session.sessions import SessionKey
from tests._batching_helpers import Gate, concurrent, generate, hold_batches, max_diff, services, step

PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11], [300, 301, 302, 303]]
N_NEW = 8


@pytest.fixture(scope="module")
def llama():
    return build_random_llama(seed=11)


def _alone(chain, chunk=0):
    return [generate(chain, f"alone{i}", p, N_NEW, chunk) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize(("cuts", "chunk"), [([], 0), ([2], 2)], ids=["whole-prefill", "split-chunked"])
def test_batched_greedy_equals_alone(llama, cuts, chunk):
    bounds = [0, *cuts, None]
    backends = [TorchRangeBackend.load(llama, a, b, progress=None) for a, b in zip(bounds, bounds[1:])]
    alone = _alone(services(backends, batching=False), chunk)
    chain = services(backends)
    gate = Gate(chain[0], len(PROMPTS) - 1)
    together = concurrent(chain, PROMPTS, N_NEW, chunk)
    assert gate.opened and chain[0].batcher.batched_rows >= len(PROMPTS) - 1   # rows really merged
    diffs = [max_diff(a, b) for a, b in zip(alone, together)]
    print(f"torch batched vs alone ({cuts=}, {chunk=}): max logit diff {max(diffs):.3g}, "
          f"batches {chain[0].batcher.batches}, merged rows {chain[0].batcher.batched_rows}")
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert max(diffs) < 1e-3


def test_forward_batch_refuses_one_row_and_runs_the_others(llama):
    backend = TorchRangeBackend.load(llama, 0, None, progress=None)
    caches = [backend.new_cache(64) for _ in range(3)]
    bad = np.asarray([backend.vocab_size + 5], np.int64)
    results = backend.forward_batch(caches, [np.asarray([1, 2], np.int64), bad, np.asarray([3], np.int64)],
                                    effective_start=0)
    assert isinstance(results[1], ValueError) and caches[1].past_len == 0
    alone = backend.new_cache(64)
    np.testing.assert_allclose(results[0], backend.forward(alone, np.asarray([1, 2], np.int64), effective_start=0),
                               atol=1e-4)
    assert caches[0].past_len == 2 and caches[2].past_len == 1


def test_gemma_rows_take_the_one_session_path_and_stay_exact():
    backend = TorchRangeBackend.load(build_random_gemma3(seed=2), 0, None, progress=None)
    alone = [generate(services([backend], batching=False), f"a{i}", p, 4) for i, p in enumerate(PROMPTS[:3])]
    together = concurrent(services([backend]), PROMPTS[:3], 4)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert max(max_diff(a, b) for a, b in zip(alone, together)) == 0.0   # same kernels: bit for bit


def test_release_during_a_running_forward_waits_for_it(llama):
    backend = TorchRangeBackend.load(llama, 0, None, progress=None)
    (service,) = services([backend])
    key = SessionKey("victim", 0)
    with service.lock:
        service.manager.open(key, 64)
        outer = service.manager._sessions[key].cache
        inner = outer.inner
    started, proceed = hold_batches(service)
    out: list = []
    worker = threading.Thread(target=lambda: out.append(step(service, key, 0, 0, np.asarray([1, 2, 3], np.int64))))
    worker.start()
    assert started.wait(30)
    with service.lock:                     # the lock is free while the batch runs
        assert service.manager.release(key)
        assert outer._release_pending      # not released under the running forward
        second = SessionKey("other", 0)
        service.manager.open(second, 64)
    proceed.set()
    worker.join(30)
    assert out and out[0].shape == (backend.vocab_size,)
    assert not outer._release_pending and inner.past_len == 3 and inner.dynamic is None   # released after it
    with service.lock:
        assert service.manager.past_len(key) is None


def test_a_second_step_of_a_queued_cache_is_refused(llama):
    backend = TorchRangeBackend.load(llama, 0, None, progress=None)
    (service,) = services([backend])
    cache = service.batcher.new_cache(64)
    service.batcher._busy.add(id(cache))
    with service.lock, pytest.raises(ProtocolViolation, match="still running"):
        service.batcher.forward(cache, np.asarray([1], np.int64), effective_start=0)


def test_batching_off_calls_the_backend_directly(llama):
    backend = TorchRangeBackend.load(llama, 0, None, progress=None)
    (service,) = services([backend], batching=False)
    generate([service], "x", PROMPTS[0], 2)
    assert service.batcher.batches == 0


def test_worker_batching_knob_reaches_the_worker_command(tmp_path):
    from meshd.config import load_config
    from meshd.daemon.worker_process import WorkerSpec
    from meshd.errors import ConfigError
    from meshd.reach.tls import TlsMaterial

    toml = tmp_path / "meshd.toml"
    toml.write_text("[worker]\nbatching = false\n")
    assert load_config(toml).worker.batching is False
    assert load_config(None).worker.batching is True
    toml.write_text("[worker]\nbatching = \"no\"\n")
    with pytest.raises(ConfigError, match="batching"):
        load_config(toml)
    tls = TlsMaterial(tmp_path / "c.pem", tmp_path / "k.pem", b"", bytes(32))
    spec = WorkerSpec(model=tmp_path, layers=(0, 2), run_dir=tmp_path, tls=tls)
    assert "--no-batching" not in spec.command(tmp_path / "ready")
    off = WorkerSpec(model=tmp_path, layers=(0, 2), run_dir=tmp_path, tls=tls, batching=False)
    assert "--no-batching" in off.command(tmp_path / "ready")


def test_llama_kv_streams_knob_reaches_the_worker_command(tmp_path):
    """Per-session KV streams are the default ("auto": the worker picks N from its budget); an
    explicit N, or 0 for the shared pool (opt-in), is passed on; bad values are refused."""
    import argparse

    from meshd.cli.worker import add_arguments
    from meshd.config import load_config
    from meshd.daemon.worker_process import WorkerSpec
    from meshd.errors import ConfigError
    from meshd.reach.tls import TlsMaterial

    toml = tmp_path / "meshd.toml"
    assert load_config(None).worker.llama_kv_streams == "auto"
    for value, parsed in (("4", 4), ("0", 0), ("\"auto\"", "auto")):
        toml.write_text(f"[worker]\nllama_kv_streams = {value}\n")
        assert load_config(toml).worker.llama_kv_streams == parsed
    for bad in ("-1", "true", "\"4\"", "100000"):
        toml.write_text(f"[worker]\nllama_kv_streams = {bad}\n")
        with pytest.raises(ConfigError, match="llama_kv_streams"):
            load_config(toml)
    tls = TlsMaterial(tmp_path / "c.pem", tmp_path / "k.pem", b"", bytes(32))
    auto = WorkerSpec(model=tmp_path, layers=(0, 2), run_dir=tmp_path, tls=tls).command(tmp_path / "ready")
    assert "--llama-kv-streams" not in auto
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--model", "m", "--layers", "0:2"]).llama_kv_streams == "auto"
    for streams in (4, 0):
        cmd = WorkerSpec(model=tmp_path, layers=(0, 2), run_dir=tmp_path, tls=tls, llama_kv_streams=streams).command(
            tmp_path / "ready")
        assert cmd[cmd.index("--llama-kv-streams") + 1] == str(streams)
        args = parser.parse_args(["--model", "m", "--layers", "0:2", "--llama-kv-streams", str(streams)])
        assert args.llama_kv_streams == streams


def test_auto_kv_streams_follow_the_budget():
    from native.factory import AUTO_MAX_STREAMS, AUTO_STREAM_TOKENS, auto_kv_streams

    assert auto_kv_streams(4096, 64) == 2                           # the default budget: 2 x 2048
    assert auto_kv_streams(16384, 64) == 8 == AUTO_MAX_STREAMS
    assert auto_kv_streams(100, 64) == 1                            # a tiny budget: one session, exact
    assert auto_kv_streams(1 << 20, 64) == AUTO_MAX_STREAMS
    assert auto_kv_streams(16384, 2) == 2                           # never more than the worker's sessions
    assert AUTO_STREAM_TOKENS == 2048


def test_a_deep_batch_queue_refuses_new_sessions_with_a_retry_hint_then_admits(llama):
    """Admission by queue depth: while max_queued_steps steps wait behind a running forward,
    a new session gets ResourceExhausted (retryable, with a hint); Health shows the depth;
    once the queue drains the same open succeeds and every queued step got its answer."""
    from shard.errors import ResourceExhausted
    from shard.session.service import ShardService
    from shard.session.sessions import SessionPolicy

    backend = TorchRangeBackend.load(llama, 0, None, progress=None)
    service = ShardService(backend, SessionPolicy(kv_budget_tokens=4096, max_queued_steps=2))
    keys = [SessionKey(f"s{i}", 0) for i in range(3)]
    with service.lock:
        for key in keys:
            service.manager.open(key, 64)
    started, proceed = hold_batches(service)
    outs: list = []
    threads = [threading.Thread(target=lambda k=k: outs.append(step(service, k, 0, 0, np.asarray([1, 2], np.int64))))
               for k in keys]
    threads[0].start()
    assert started.wait(30)                          # s0's forward runs (held); s1, s2 queue behind it
    for t in threads[1:]:
        t.start()
    for _ in range(3000):
        if service.batcher.queue_depth == 2:
            break
        threading.Event().wait(0.01)
    assert service.batcher.queue_depth == 2
    assert service.health().queued_chunks == 2
    newcomer = SessionKey("late", 0)
    with service.lock, pytest.raises(ResourceExhausted, match="wait for this worker's next forward") as refused:
        service.manager.open(newcomer, 64)
    assert refused.value.retryable and refused.value.retry_after_ms >= 100
    with service.lock:
        assert service.manager.open(keys[1], 64) == 0   # re-attaching to one's own session is not refused
    proceed.set()
    for t in threads:
        t.join(30)
    assert len(outs) == 3 and all(o.shape == (backend.vocab_size,) for o in outs)
    with service.lock:
        assert service.manager.open(newcomer, 64) == 0
    assert service.health().queued_chunks == 0 and service.health().batch_occupancy == 2


def test_a_step_takes_every_decode_row_and_prefill_within_the_prefill_budget(llama):
    """Decode rows always ride in the next forward; prefill chunks join only within
    PREFILL_TOKENS_PER_FORWARD (whole chunks, first come first served; the first item always
    goes), with or without decode rows: a burst of prompts goes to the next hop in short forwards."""
    from shard.session.batching import PREFILL_TOKENS_PER_FORWARD, _Item

    backend = TorchRangeBackend.load(llama, 0, None, progress=None)
    (service,) = services([backend])
    batcher = service.batcher

    def queue(*sizes):
        batcher._queue.extend(_Item(batcher.new_cache(512), np.zeros(n, np.int64), 0) for n in sizes)

    chunk = PREFILL_TOKENS_PER_FORWARD // 2 + 1
    queue(chunk, 1, chunk, 1, 1)
    assert [i.tokens for i in batcher._take()] == [chunk, 1, 1, 1]
    assert [i.tokens for i in batcher._queue] == [chunk]
    batcher._queue.clear()
    queue(chunk, chunk, chunk)                     # no decode row: the same budget
    assert [i.tokens for i in batcher._take()] == [chunk]
    assert [i.tokens for i in batcher._take()] == [chunk]
    batcher._queue.clear()
    small = PREFILL_TOKENS_PER_FORWARD // 4
    queue(small, small, small, small, small)
    assert [i.tokens for i in batcher._take()] == [small] * 4
    batcher._queue.clear()
    queue(1, 300, 1)                               # a chunk over the budget waits ...
    assert [i.tokens for i in batcher._take()] == [1, 1]
    assert [i.tokens for i in batcher._take()] == [300]   # ... and goes once it is first


def test_with_other_sessions_active_rows_sent_back_to_back_run_as_one_forward(llama, monkeypatch):
    """The gather: a lone session's row runs at once; with another session active, the row that
    would start a forward alone waits while rows keep arriving, so two rows that come one after
    the other share one forward (the quiet period is widened here: a loaded CI machine must not
    turn this into a race)."""
    import shard.session.batching as batching

    monkeypatch.setattr(batching, "GATHER_QUIET_MIN_S", 0.5)
    monkeypatch.setattr(batching, "GATHER_QUIET_MAX_S", 0.5)
    monkeypatch.setattr(batching, "ACTIVE_S", 60.0)
    backend = TorchRangeBackend.load(llama, 0, None, progress=None)
    (service,) = services([backend])
    batcher = service.batcher
    lone, a, b = (batcher.new_cache(64) for _ in range(3))
    one = np.asarray([1, 2, 3], np.int64)
    with service.lock:                     # one session: no gather, a forward of its own at once
        batcher.forward(lone, one, effective_start=0)
        lone.release()                     # released: no longer active
        batcher.forward(a, one, effective_start=0)
        assert batcher.last_batch_rows == 1 and batcher.batched_rows == 0
        batcher.forward(b, one, effective_start=0)   # a was active: b gathered, nothing came
        assert batcher.last_batch_rows == 1 and batcher.batched_rows == 0
    outs: list = []
    first = threading.Thread(target=lambda: outs.append(_locked_forward(service, a)))
    second = threading.Thread(target=lambda: outs.append(_locked_forward(service, b)))
    first.start()
    second.start()
    first.join(60)
    second.join(60)
    assert len(outs) == 2 and batcher.last_batch_rows == 2 and batcher.batched_rows == 2


def _locked_forward(service, cache):
    with service.lock:
        return service.batcher.forward(cache, np.asarray([4], np.int64), effective_start=0)


def test_a_tail_forward_of_three_sessions_equals_each_alone(llama):
    """Three sessions' rows through the (input-major) LM head at once: each one's logits match alone."""
    import numpy as np

    backend = TorchRangeBackend.load(llama, 0, None, progress=None)
    prompts = [np.asarray(p, np.int64) for p in PROMPTS[:3]]
    alone = [backend.forward(backend.new_cache(64), p, effective_start=0) for p in prompts]
    caches = [backend.new_cache(64) for _ in prompts]
    together = backend.forward_batch(caches, prompts, effective_start=0)
    diffs = [float(np.abs(a - b).max()) for a, b in zip(alone, together)]
    print(f"3-session tail forward vs alone: max logit diff {max(diffs):.3g}")
    assert [int(np.argmax(a)) for a in alone] == [int(np.argmax(b)) for b in together]
    assert max(diffs) < 1e-3
