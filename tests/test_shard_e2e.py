"""Real worker processes on loopback: exact split generation and typed errors.

Two `meshd worker` subprocesses serve layers 0:3 and 3:6 of the seeded random
Llama; every test talks to them over real gRPC.
"""
from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch

from meshd.errors import HopFailure
from meshd.generate.driver import RouteFailed
from meshd.generate.routes import fixed_route
from meshd.testing.procs import spawn_workers
from proto import shard_runtime_pb2 as pb
from proto.limits import MAX_FRAME_BYTES
from proto.tensors import encode_tensor
from shard.edges.grpc_server import GRPC_OPTIONS, SERVICE_NAME
from shard.model.reference import WholeModel
from tests._shard_helpers import PROMPT, RawStream, StatusError, check_route_equals_whole, drive_fixed, fixed_source

torch.set_num_threads(1)
SPECS = ["0:3", "3:6"]
BUDGET = 512
MODEL_SEED = 0   # the shared ``model`` fixture's seed (tests/conftest.py)


@pytest.fixture(scope="module")
def workers(model):
    ws = spawn_workers(model, SPECS, threads=1,
                       extra=["--kv-budget-tokens", str(BUDGET), "--min-idle-evict", "600"])
    yield ws
    for w in ws:
        assert w.stop() == 0  # clean shutdown on SIGTERM


def unary(endpoint, name, request, response_cls):
    channel = grpc.insecure_channel(endpoint, options=GRPC_OPTIONS)
    try:
        return channel.unary_unary(f"/{SERVICE_NAME}/{name}", request_serializer=type(request).SerializeToString,
                                   response_deserializer=response_cls.FromString)(request, timeout=30)
    finally:
        channel.close()


def raw_stream(worker):
    return RawStream(worker.endpoint)


def open_raw(worker, fingerprint, session, *, epoch=0, max_tokens=64):
    s = raw_stream(worker)
    s.send(pb.SessionRequest(open=pb.SessionOpen(
        schema_version=1, route_session_id=session, route_epoch=epoch, fingerprint=fingerprint,
        shard_range=pb.ShardRange(start_layer=0, end_layer=3), max_tokens=max_tokens)).SerializeToString())
    return s


def decode_body(step, pos, expected=None):
    return pb.SessionRequest(decode=pb.DecodeStep(
        idempotency_step=step, position=pos, expected_past_len=pos if expected is None else expected,
        tensor=encode_tensor("token_ids", np.array([3], np.int64)))).SerializeToString()


def fingerprint_of(worker):
    report = unary(worker.endpoint, "GetCapability", pb.CapabilityRequest(schema_version=1), pb.CapabilityReport)
    assert report.validated and report.validated_at_unix_nanos > 0 and report.decode_ms_per_layer > 0
    return report.fingerprint


def test_two_workers_reproduce_the_whole_model_exactly(model, workers):
    diff = check_route_equals_whole(model, workers, SPECS, 6, label="random llama")
    assert diff == 0.0


def test_interleaved_sessions_do_not_touch_each_other(model, workers):
    prompts = [PROMPT, list(range(60, 90)), [7] * 20]
    refs = [WholeModel(model).generate(p, 12, chunk_tokens=16).tokens for p in prompts]
    results: dict[int, list[int]] = {}

    def run(i):
        results[i] = drive_fixed(fixed_source(workers, SPECS, 6), prompts[i], 12).tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results.get(i) for i in range(len(prompts))] == refs


def test_bad_frames_get_typed_errors_and_the_worker_keeps_serving(model, workers):
    fp = fingerprint_of(workers[0])
    good = open_raw(workers[0], fp, "alive")
    assert good.recv()[0].WhichOneof("kind") == "accepted"
    bad = raw_stream(workers[0])
    bad.send(b"\x0a\xff\xff\xff\xff\x0f")  # truncated garbage
    with pytest.raises(StatusError) as err:
        bad.recv()
    assert err.value.error.code == pb.ERROR_CODE_PAYLOAD_CORRUPT
    bad.close()
    oversized = raw_stream(workers[0])
    oversized.send(b"\x00" * (MAX_FRAME_BYTES + 1))
    with pytest.raises(StatusError) as err:
        oversized.recv()
    assert "RESOURCE_EXHAUSTED" in err.value.error.detail
    oversized.close()
    good.send(decode_body(1, 0))
    resp, tensors = good.recv()
    assert resp.decode.past_len == 1 and tensors["h"].shape == (1, 64)
    good.close()
    health = unary(workers[0].endpoint, "Health", pb.HealthRequest(), pb.HealthReport)
    assert health.state == pb.SERVING_STATE_SERVING and health.resident_bytes > 0
    assert health.kv_budget_tokens == BUDGET


def test_cache_miss_and_duplicate_over_the_wire(workers):
    fp = fingerprint_of(workers[0])
    s = open_raw(workers[0], fp, "miss")
    s.recv()
    s.send(decode_body(1, 5))
    with pytest.raises(StatusError) as err:
        s.recv()
    assert err.value.error.code == pb.ERROR_CODE_CACHE_MISS and err.value.error.actual_past_len == 0
    s.send(decode_body(2, 0))
    first = s.recv()[0].decode
    s.send(decode_body(2, 0))
    again = s.recv()[0].decode
    assert again.duplicate and again.past_len == first.past_len == 1 and again.bundle == first.bundle
    s.close()


def test_wrong_fingerprint_and_wrong_range(workers):
    """A refused open is a HopFailure with the worker's code; a fixed route has no replacement."""
    bad = pb.Fingerprint(model_artifact_digest="sha256:00", runtime_recipe_digest="sha256:00")
    with pytest.raises(RouteFailed) as err:
        drive_fixed(fixed_source(workers, SPECS, 6), PROMPT, 2, fingerprint=bad)
    failure = err.value.__cause__
    assert isinstance(failure, HopFailure) and failure.code == pb.ERROR_CODE_FINGERPRINT_MISMATCH
    wrong = fixed_route([(workers[0].endpoint, 0, 2), (workers[1].endpoint, 2, 6)], 6)
    with pytest.raises(RouteFailed) as err:
        drive_fixed(wrong, PROMPT, 2, fingerprint=fingerprint_of(workers[0]))
    assert err.value.__cause__.code == pb.ERROR_CODE_SHARD_RANGE_MISMATCH
    assert "SHARD_RANGE_MISMATCH" in str(err.value)        # the user sees why


def test_stale_epoch_release_and_cancel_rpcs(workers):
    fp = fingerprint_of(workers[0])
    new = open_raw(workers[0], fp, "route", epoch=2)
    new.recv()
    old = open_raw(workers[0], fp, "route", epoch=1)
    with pytest.raises(StatusError) as err:
        old.recv()
    assert err.value.error.code == pb.ERROR_CODE_EPOCH_STALE
    old.close()
    req = pb.ReleaseRequest(schema_version=1, route_session_id="route", route_epoch=2)
    assert unary(workers[0].endpoint, "Release", req, pb.ReleaseResponse).released
    assert not unary(workers[0].endpoint, "Release", req, pb.ReleaseResponse).released
    new.send(decode_body(1, 3))
    with pytest.raises(StatusError) as err:
        new.recv()
    assert err.value.error.code == pb.ERROR_CODE_CACHE_MISS  # released: nothing cached
    new.close()
    s = open_raw(workers[0], fp, "doomed")
    s.recv()
    cancel = pb.CancelRequest(schema_version=1, route_session_id="doomed", route_epoch=0, reason="test")
    assert unary(workers[0].endpoint, "Cancel", cancel, pb.CancelResponse).cancelled_work_items == 1
    s.send(decode_body(1, 0))
    with pytest.raises(StatusError) as err:
        s.recv()
    assert err.value.error.code == pb.ERROR_CODE_CANCELLED
    s.close()


def test_budget_refusal_with_retry_hint(workers):
    fp = fingerprint_of(workers[0])
    too_big = open_raw(workers[0], fp, "big", max_tokens=BUDGET + 1)
    with pytest.raises(StatusError) as err:
        too_big.recv()
    assert err.value.error.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED and not err.value.error.retryable
    too_big.close()
    used = unary(workers[0].endpoint, "Health", pb.HealthRequest(), pb.HealthReport).kv_tokens_used
    holder = open_raw(workers[0], fp, "hold", max_tokens=BUDGET - used)
    assert holder.recv()[0].WhichOneof("kind") == "accepted"
    late = open_raw(workers[0], fp, "late", max_tokens=1)
    with pytest.raises(StatusError) as err:
        late.recv()
    assert err.value.error.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED
    assert err.value.error.retryable and err.value.error.retry_after_ms > 0
    late.close()
    holder.send(pb.SessionRequest(release=pb.ReleaseSignal(route_session_id="hold")).SerializeToString(), work=False)
    assert holder.recv()[0].WhichOneof("kind") == "ack"
    holder.close()
    health = unary(workers[0].endpoint, "Health", pb.HealthRequest(), pb.HealthReport)
    assert health.kv_tokens_used == used  # released at once


def test_the_tail_draws_what_the_logits_say_and_sends_only_the_token(model, workers):
    """Token-only tails (the default) and tails that also return logits draw the same tokens,
    greedy and seeded; each drawn token is the pure function of (seed, position) of its logits."""
    from proto.limits import MAX_TAIL_BYTES_PER_DECODE_STEP
    from shard.model.sampling import SamplingSpec, sample_token

    source = fixed_source(workers, SPECS, 6)
    for sampling in (SamplingSpec(), SamplingSpec(temperature=0.8, top_k=20, seed=11)):
        by_tail = drive_fixed(source, PROMPT, 12, sampling=sampling)
        checked = drive_fixed(source, PROMPT, 12, sampling=sampling, return_logits=True)
        assert by_tail.tokens == checked.tokens, sampling
        assert by_tail.logits == [] and len(checked.logits) == 12
        assert [sample_token(row, sampling, len(PROMPT) + i) for i, row in enumerate(checked.logits)] \
            == checked.tokens
        assert by_tail.stats.tail_bytes_per_decode_step <= MAX_TAIL_BYTES_PER_DECODE_STEP
        assert min(checked.stats.step_tail_bytes) > 4 * 380          # a logits row per step when asked
        assert len(PROMPT) > 16  # several prefill chunks: only the final one samples
