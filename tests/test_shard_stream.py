"""The sans-I/O Session stream core: typed errors for every bad frame, no transport."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.testing import models as testmodels
from proto import shard_runtime_pb2 as pb
from proto.tensors import encode_bundle, encode_tensor
from shard.model.torch_backend import TorchRangeBackend
from shard.session.service import ShardService
from shard.session.sessions import SessionPolicy
from shard.session.stream import SessionStream

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def service():
    backend = TorchRangeBackend.load(testmodels.build_random_llama(), 0, 6, progress=None)
    svc = ShardService(backend, SessionPolicy(kv_budget_tokens=4096))
    assert svc.validate().validated
    return svc


def parse(body):
    return pb.SessionResponse.FromString(body)


def open_req(svc, session="s", epoch=0, **kw):
    fp = kw.pop("fingerprint", svc.backend.fingerprint)
    rng = kw.pop("shard_range", pb.ShardRange(start_layer=0, end_layer=6, effective_start_layer=0))
    return pb.SessionRequest(open=pb.SessionOpen(
        schema_version=pb.SCHEMA_VERSION_1, route_session_id=session, route_epoch=epoch, fingerprint=fp,
        shard_range=rng, tail=pb.TailOptions(return_logits=True), max_tokens=64, **kw)).SerializeToString()


def decode_req(step, pos, token=5, expected=None):
    return pb.SessionRequest(decode=pb.DecodeStep(
        idempotency_step=step, position=pos, expected_past_len=pos if expected is None else expected,
        tensor=encode_tensor("token_ids", np.array([token], np.int64)))).SerializeToString()


def opened(svc, **kw):
    s = SessionStream(svc)
    out = [parse(b) for b in s.receive(open_req(svc, **kw))]
    assert out[0].WhichOneof("kind") == "accepted", out
    return s, out[0].accepted


def error_of(bodies):
    statuses = [parse(b).status for b in bodies if parse(b).WhichOneof("kind") == "status"]
    assert statuses, [parse(b) for b in bodies]
    return statuses[0]


def test_open_prefill_decode_and_duplicate(service):
    s, acc = opened(service, session="ok")
    assert acc.flow_control.credits_granted > 0 and acc.past_len == 0
    env = pb.Envelope(schema_version=1, route_session_id="ok", route_epoch=0, phase=pb.PHASE_PREFILL,
                      position=pb.PositionSpan(first_position=0, token_count=3), idempotency_step=1,
                      cache_expectation=pb.CacheExpectation(mode=pb.CACHE_MODE_PREFILL, expected_past_len=0))
    req = pb.SessionRequest(chunk=pb.ActivationChunk(
        envelope=env, bundle=encode_bundle({"token_ids": np.array([1, 2, 3], np.int64)}))).SerializeToString()
    out = parse(s.receive(req)[0])
    assert out.WhichOneof("kind") == "chunk" and out.chunk.bundle.tensors[0].name == "logits"
    first = parse(s.receive(decode_req(2, 3))[0]).decode
    assert first.past_len == 4 and not first.duplicate
    again = parse(s.receive(decode_req(2, 3))[0]).decode
    assert again.duplicate and again.past_len == 4 and again.bundle == first.bundle
    # A second open of the same (session, epoch) re-attaches and reports the cached length.
    _, acc2 = opened(service, session="ok")
    assert acc2.past_len == 4


def test_cache_miss_is_not_terminal(service):
    s, _ = opened(service, session="miss")
    st_ = error_of(s.receive(decode_req(1, 7)))
    assert st_.error.code == pb.ERROR_CODE_CACHE_MISS and st_.error.actual_past_len == 0 and not st_.terminal
    assert parse(s.receive(decode_req(2, 0))[0]).decode.past_len == 1


@pytest.mark.parametrize("body, code", [
    (b"\xff\xff\xff", pb.ERROR_CODE_PAYLOAD_CORRUPT),
    (b"", pb.ERROR_CODE_PROTOCOL_VIOLATION),
    (decode_req(1, 0), pb.ERROR_CODE_PROTOCOL_VIOLATION),  # work before open
])
def test_bad_first_frames(service, body, code):
    s = SessionStream(service)
    st_ = error_of(s.receive(body))
    assert st_.error.code == code and st_.terminal and s.closed
    assert s.receive(open_req(service)) == []  # a closed stream stays closed


def test_wrong_fingerprint_range_and_schema(service):
    bad_fp = pb.Fingerprint(model_artifact_digest="sha256:00", runtime_recipe_digest="sha256:00")
    cases = [
        (open_req(service, fingerprint=bad_fp), pb.ERROR_CODE_FINGERPRINT_MISMATCH),
        (open_req(service, shard_range=pb.ShardRange(start_layer=0, end_layer=3)), pb.ERROR_CODE_SHARD_RANGE_MISMATCH),
        (open_req(service, shard_range=pb.ShardRange(start_layer=0, end_layer=6, effective_start_layer=6)),
         pb.ERROR_CODE_SHARD_RANGE_MISMATCH),
        (pb.SessionRequest(open=pb.SessionOpen(schema_version=9)).SerializeToString(),
         pb.ERROR_CODE_SCHEMA_UNSUPPORTED),
    ]
    for body, code in cases:
        st_ = error_of(SessionStream(service).receive(body))
        assert st_.error.code == code and st_.terminal


def test_stale_epoch(service):
    opened(service, session="ep", epoch=5)
    st_ = error_of(SessionStream(service).receive(open_req(service, session="ep", epoch=4)))
    assert st_.error.code == pb.ERROR_CODE_EPOCH_STALE
    s_old, _ = opened(service, session="ep2", epoch=1)
    opened(service, session="ep2", epoch=2)
    st_ = error_of(s_old.receive(decode_req(1, 0)))
    assert st_.error.code == pb.ERROR_CODE_EPOCH_STALE and not st_.terminal


def test_bad_tensor_payloads(service):
    s, _ = opened(service, session="badt")
    wrong_name = pb.SessionRequest(decode=pb.DecodeStep(
        idempotency_step=1, tensor=encode_tensor("h", np.zeros((1, 64), np.float32)))).SerializeToString()
    st_ = error_of(s.receive(wrong_name))
    assert st_.error.code == pb.ERROR_CODE_PAYLOAD_CORRUPT and not st_.terminal
    out_of_vocab = decode_req(2, 0, token=10_000)
    assert error_of(s.receive(out_of_vocab)).error.code == pb.ERROR_CODE_PROTOCOL_VIOLATION
    assert parse(s.receive(decode_req(5, 0))[0]).decode.past_len == 1  # work-level errors: still serving
    # Tensor bytes that fail to decode make the frame bad: that stream ends, typed; others go on.
    t = encode_tensor("token_ids", np.array([1], np.int64))
    t.checksum.value = b"\x00\x00\x00\x00"
    huge = encode_tensor("token_ids", np.array([1], np.int64))
    del huge.shape[:]
    huge.shape.extend([1 << 40])
    for tensor, code in ((t, pb.ERROR_CODE_PAYLOAD_CORRUPT), (huge, pb.ERROR_CODE_LIMIT_EXCEEDED)):
        other, _ = opened(service, session="badt-" + str(code))
        st_ = error_of(other.receive(pb.SessionRequest(decode=pb.DecodeStep(
            idempotency_step=9, tensor=tensor)).SerializeToString()))
        assert st_.error.code == code and st_.terminal and other.closed
    assert parse(s.receive(decode_req(6, 1))[0]).decode.past_len == 2


def test_flow_control_violation(service):
    s, acc = opened(service, session="fc", proposed_flow_control=pb.FlowControl(max_inflight_chunks=1))
    assert acc.flow_control.credits_granted == 1
    # One credit: the grant comes back with the first answer; a burst beyond it is refused.
    s.ledger.outstanding = 0
    st_ = error_of(s.receive(decode_req(1, 0)))
    assert st_.error.code == pb.ERROR_CODE_FLOW_CONTROL_VIOLATION and st_.terminal


def test_release_and_cancel(service):
    s, _ = opened(service, session="rel")
    s.receive(decode_req(1, 0))
    out = parse(s.receive(pb.SessionRequest(release=pb.ReleaseSignal(route_session_id="rel")).SerializeToString())[0])
    assert out.WhichOneof("kind") == "ack" and s.closed
    s2, acc = opened(service, session="rel")
    assert acc.past_len == 0  # released: a fresh session
    cancel = pb.SessionRequest(cancel=pb.CancelSignal(route_session_id="rel", reason="user"))
    st_ = error_of(s2.receive(cancel.SerializeToString()))
    assert st_.error.code == pb.ERROR_CODE_CANCELLED and st_.terminal
    st_ = error_of(SessionStream(service).receive(open_req(service, session="rel")))
    assert st_.error.code == pb.ERROR_CODE_CANCELLED


def test_deadline(service):
    s = SessionStream(service, wall_ns=lambda: 2_000)
    s.receive(open_req(service, session="dl"))
    body = pb.SessionRequest(decode=pb.DecodeStep(
        idempotency_step=1, deadline_unix_nanos=1_000,
        tensor=encode_tensor("token_ids", np.array([1], np.int64)))).SerializeToString()
    st_ = error_of(s.receive(body))
    assert st_.error.code == pb.ERROR_CODE_DEADLINE_EXCEEDED and not st_.terminal


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(max_size=200), max_size=4))
def test_fuzz_any_bytes_give_responses_never_exceptions(service, frames):
    s = SessionStream(service)
    s.receive(open_req(service, session="fuzz"))
    for frame in frames:
        for body in s.receive(frame):
            pb.SessionResponse.FromString(body)


def _prefill(s, session, ids, step=1):
    env = pb.Envelope(schema_version=1, route_session_id=session, route_epoch=0, phase=pb.PHASE_PREFILL,
                      position=pb.PositionSpan(first_position=0, token_count=len(ids)), idempotency_step=step,
                      cache_expectation=pb.CacheExpectation(mode=pb.CACHE_MODE_PREFILL, expected_past_len=0),
                      chunk=pb.ChunkInfo(chunk_index=0, chunk_count=1, final_chunk=True))
    return s.receive(pb.SessionRequest(chunk=pb.ActivationChunk(
        envelope=env, bundle=encode_bundle({"token_ids": np.array(ids, np.int64)}))).SerializeToString())


def sampling_tail(svc, session, *, logits=False, **tail):
    s = SessionStream(svc)
    body = pb.SessionRequest(open=pb.SessionOpen(
        schema_version=1, route_session_id=session, route_epoch=0, fingerprint=svc.backend.fingerprint,
        shard_range=pb.ShardRange(start_layer=0, end_layer=6, effective_start_layer=0), max_tokens=64,
        tail=pb.TailOptions(sample=True, return_logits=logits, **tail))).SerializeToString()
    return s, [parse(b) for b in s.receive(body)]


def test_a_sampling_tail_answers_with_the_token_only(service):
    from proto.zerocopy import read_response
    from shard.model.sampling import SamplingSpec, sample_token, token_logprobs

    spec = SamplingSpec(temperature=0.9, top_k=40, seed=77)
    s, out = sampling_tail(service, "tok", sampling=spec.to_pb())
    assert out[0].WhichOneof("kind") == "accepted"
    twin, _ = sampling_tail(service, "tok-logits", logits=True, logprobs=True, top_logprobs=5, sampling=spec.to_pb())
    first = parse(_prefill(s, "tok", [1, 2, 3])[0]).chunk
    checked = parse(_prefill(twin, "tok-logits", [1, 2, 3])[0]).chunk
    assert first.HasField("sample") and not first.HasField("bundle")        # no tensor at all
    assert first.sample.token_id == checked.sample.token_id
    token = first.sample.token_id
    for step, pos in enumerate(range(3, 8), start=2):
        bodies = s.receive(decode_req(step, pos, token))
        body = next(b for b in bodies if parse(b).WhichOneof("kind") == "decode")
        assert len(body) <= 64, len(body)                                     # MAX_TAIL_BYTES_PER_DECODE_STEP
        resp, tensors = read_response(body)
        assert tensors == {} and not resp.decode.sample.top and resp.decode.sample.logprob == 0.0
        big = next(b for b in twin.receive(decode_req(step, pos, token)) if parse(b).WhichOneof("kind") == "decode")
        resp2, tensors2 = read_response(big)
        logits = tensors2["logits"]
        # the draw for position pos + 1 is a pure function of (seed, pos + 1) and the logits
        assert resp.decode.sample.token_id == resp2.decode.sample.token_id == sample_token(logits, spec, pos + 1)
        lp, top = token_logprobs(logits, resp2.decode.sample.token_id, 5)
        assert resp2.decode.sample.logprob == pytest.approx(lp, rel=1e-6)
        assert [(t.token_id, pytest.approx(t.logprob, rel=1e-6)) for t in resp2.decode.sample.top] == list(top)
        token = resp.decode.sample.token_id
    again = parse(next(b for b in s.receive(decode_req(6, 7, 9)) if parse(b).WhichOneof("kind") == "decode")).decode
    assert again.duplicate and again.sample.token_id == token               # the replay carries the sample


def test_top_logprobs_beyond_the_bound_are_refused(service):
    s, out = sampling_tail(service, "greedy-top", top_logprobs=21)
    assert out[0].status.terminal and out[0].status.error.code == pb.ERROR_CODE_LIMIT_EXCEEDED
    assert "top_logprobs" in out[0].status.error.detail
