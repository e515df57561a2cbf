"""A verify chunk on one shard: the tail's verdict, the rollback rule, the refusals (no transport).

The tail of a whole seeded Llama (layers 0..6) behind the sans-I/O stream
core, and its session manager directly: the verdict must be the draws of
plain decoding, position by position; the next step may drop the drafted
positions only right after the verify and never below its first position + 1.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from meshd.testing import models as testmodels
from proto import shard_runtime_pb2 as pb
from proto.limits import MAX_DRAFT_TOKENS
from proto.tensors import encode_bundle
from shard.errors import CacheMiss
from shard.model.sampling import SamplingSpec, sample_token
from shard.model.torch_backend import TorchRangeBackend
from shard.session.service import ShardService
from shard.session.sessions import SessionKey, SessionManager, SessionPolicy
from shard.session.stream import SessionStream

torch.set_num_threads(1)
PROMPT = tuple(range(5, 45))
SAMPLING = SamplingSpec(temperature=0.9, top_p=0.95, seed=99)


@pytest.fixture(scope="module")
def backend():
    return TorchRangeBackend.load(testmodels.build_random_llama(), 0, 6, progress=None)


def parse(body: bytes) -> pb.SessionResponse:
    return pb.SessionResponse.FromString(body)


def open_stream(backend, session: str, tail: pb.TailOptions) -> SessionStream:
    stream = SessionStream(ShardService(backend, SessionPolicy(kv_budget_tokens=4096)))
    (accepted,) = stream.receive(pb.SessionRequest(open=pb.SessionOpen(
        schema_version=pb.SCHEMA_VERSION_1, route_session_id=session, route_epoch=0,
        fingerprint=backend.fingerprint, shard_range=pb.ShardRange(start_layer=0, end_layer=6),
        tail=tail, max_tokens=128)).SerializeToString())
    assert parse(accepted).WhichOneof("kind") == "accepted"
    return stream


def chunk(session: str, step: int, first: int, ids, *, expected: int | None = None, drafts=None) -> bytes:
    env = pb.Envelope(schema_version=1, route_session_id=session, route_epoch=0, idempotency_step=step,
                      phase=pb.PHASE_PREFILL if drafts is None else pb.PHASE_DECODE,
                      position=pb.PositionSpan(first_position=first, token_count=len(ids)),
                      cache_expectation=pb.CacheExpectation(expected_past_len=first if expected is None else expected))
    if drafts is not None:
        env.verify.CopyFrom(pb.VerifyDrafts(draft_token_ids=drafts))
    return pb.SessionRequest(chunk=pb.ActivationChunk(
        envelope=env, bundle=encode_bundle({"token_ids": np.asarray(ids, np.int64)}))).SerializeToString()


def answers(stream: SessionStream, body: bytes) -> list[pb.SessionResponse]:
    return [r for r in map(parse, stream.receive(body)) if r.WhichOneof("kind") != "flow_control"]


@pytest.mark.parametrize("sampling", [SamplingSpec(), SAMPLING])
def test_the_tail_accepts_exactly_the_drafts_it_would_have_drawn(backend, sampling):
    # the draws of plain decoding, one position at a time, from a reference cache
    cache = backend.new_cache(128)
    logits = backend.forward(cache, np.asarray(PROMPT, np.int64), effective_start=0)
    plain = [sample_token(logits, sampling, len(PROMPT))]
    for p in range(len(PROMPT), len(PROMPT) + 6):
        logits = backend.forward(cache, np.asarray([plain[-1]], np.int64), effective_start=0)
        plain.append(sample_token(logits, sampling, p + 1))
    tail = pb.TailOptions(sample=True, sampling=sampling.to_pb())
    for right in range(5):      # drafts right for `right` tokens, then wrong
        session = f"v{right}"
        stream = open_stream(backend, session, tail)
        (first,) = answers(stream, chunk(session, 1, 0, PROMPT))
        assert first.chunk.sample.token_id == plain[0]
        drafts = [t if i < right else (t + 1) % backend.vocab_size for i, t in enumerate(plain[1:5])]
        (verdict,) = answers(stream, chunk(session, 2, len(PROMPT), [plain[0], *drafts], drafts=drafts))
        assert verdict.chunk.verify.accepted == right
        assert verdict.chunk.sample.token_id == plain[right + 1]
        # the next step names the kept length: the hop rolls back and continues
        kept = len(PROMPT) + 1 + right
        (after,) = answers(stream, chunk(session, 3, kept, [plain[right + 1]]))
        assert after.WhichOneof("kind") == "chunk"


def test_verify_refusals_keep_the_stream(backend):
    stream = open_stream(backend, "r", pb.TailOptions(sample=True, logprobs=True))
    answers(stream, chunk("r", 1, 0, PROMPT))
    (refused,) = answers(stream, chunk("r", 2, len(PROMPT), [1, 2], drafts=[2]))
    assert refused.status.error.code == pb.ERROR_CODE_PROTOCOL_VIOLATION and not refused.status.terminal
    stream = open_stream(backend, "q", pb.TailOptions(sample=True))
    answers(stream, chunk("q", 1, 0, PROMPT))
    (wrong,) = answers(stream, chunk("q", 2, len(PROMPT), [1, 2, 3], drafts=[2]))       # 1 + drafts rows
    assert wrong.status.error.code == pb.ERROR_CODE_PROTOCOL_VIOLATION and not wrong.status.terminal
    many = list(range(1, MAX_DRAFT_TOKENS + 2))
    (deep,) = answers(stream, chunk("q", 3, len(PROMPT), [1, *many], drafts=many))
    assert deep.status.error.code == pb.ERROR_CODE_PROTOCOL_VIOLATION and not deep.status.terminal
    (ok,) = answers(stream, chunk("q", 4, len(PROMPT), [1, 2], drafts=[2]))
    assert ok.chunk.HasField("verify")


def test_rollback_only_right_after_a_verify_and_not_below_its_first_token(backend):
    manager = SessionManager(backend, SessionPolicy(kv_budget_tokens=4096))
    key = SessionKey("s", 0)
    manager.open(key, 256)
    ids = np.asarray(PROMPT, dtype=np.int64)
    manager.step(key, step=1, position=0, expected_past_len=0, inputs=ids[:20], effective_start=0)
    with pytest.raises(CacheMiss):      # no verify ran: a shorter expectation is a miss
        manager.step(key, step=2, position=19, expected_past_len=19, inputs=ids[19:20], effective_start=0)
    out = manager.step(key, step=3, position=20, expected_past_len=20, inputs=ids[20:25], effective_start=0,
                       verify=True).payload
    assert out.shape == (5, backend.vocab_size)       # every position's logits
    with pytest.raises(CacheMiss):      # below the verify's first position + 1
        manager.step(key, step=4, position=20, expected_past_len=20, inputs=ids[20:21], effective_start=0)
    rolled = manager.step(key, step=5, position=22, expected_past_len=22, inputs=ids[22:23], effective_start=0)
    assert rolled.past_len == 23
    with pytest.raises(CacheMiss):      # the floor is gone after one step
        manager.step(key, step=6, position=21, expected_past_len=21, inputs=ids[21:22], effective_start=0)
    # positions 22..24 are gone: the logits equal a session that never saw them (up to the rounding
    # of a 5-row against a 2-row batch for positions 20 and 21)
    fresh = SessionKey("t", 0)
    manager.open(fresh, 256)
    manager.step(fresh, step=1, position=0, expected_past_len=0, inputs=ids[:20], effective_start=0)
    manager.step(fresh, step=2, position=20, expected_past_len=20, inputs=ids[20:22], effective_start=0)
    alone = manager.step(fresh, step=3, position=22, expected_past_len=22, inputs=ids[22:23], effective_start=0)
    np.testing.assert_allclose(rolled.payload, alone.payload, atol=1e-4)
