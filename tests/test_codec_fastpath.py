"""proto.fastpath: decode-step frames by hand are protobuf's own bytes, and its reader is a strict
subset of the general bounded reader (it never accepts what that refuses, and reads the same values).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.generate.hop_link import read_answer
from proto import fastpath, wire
from proto import shard_runtime_pb2 as pb
from proto.errors import ProtocolError
from proto.frames import parse_request
from proto.tensors import decode_tensor, encode_bundle, encode_tensor
from shard.session.stream import read_small_or_large

U63 = st.integers(0, (1 << 63) - 1)
U32 = st.integers(0, (1 << 32) - 1)
ARRAYS = st.one_of(
    st.builds(lambda n, s: np.random.default_rng(s).standard_normal((1, n)).astype(np.float32),
              st.integers(1, 700), st.integers(0, 9)),
    st.builds(lambda t: np.array([t], np.int64), st.integers(0, 1 << 40)),
    st.builds(lambda n: np.arange(n, dtype=np.float16).reshape(n, 1), st.integers(1, 40)),
)


def _general_request(data: bytes):
    req = parse_request(data)
    return req, {req.decode.tensor.name: decode_tensor(req.decode.tensor)}


def _step_fields(d) -> tuple:
    return (d.idempotency_step, d.position, d.expected_past_len, d.work_id, d.deadline_unix_nanos, d.legs,
            d.route_execution_nanos)


@settings(max_examples=300, deadline=None)
@given(step=U63, position=U63, work=st.text(max_size=20), deadline=U63, legs=U32, execution=U63,
       name=st.sampled_from(["h", "token_ids", "x" * 64]), array=ARRAYS)
def test_decode_requests_are_protobufs_bytes_and_read_back(step, position, work, deadline, legs, execution, name,
                                                           array):
    msg = pb.DecodeStep(idempotency_step=step, position=position, expected_past_len=position, work_id=work,
                        deadline_unix_nanos=deadline, legs=legs, route_execution_nanos=execution)
    msg.tensor.CopyFrom(encode_tensor(name, array))
    canonical = pb.SessionRequest(decode=msg).SerializeToString()
    fast = fastpath.decode_request_bytes(step, position, position, name, array, work_id=work,
                                         deadline_unix_nanos=deadline, legs=legs, route_execution_nanos=execution)
    assert fast == canonical
    assert wire.request_decode(msg, name, array) == canonical        # wire takes the same way
    view, tensors = fastpath.read_decode_request(fast)
    req, general = _general_request(fast)
    assert _step_fields(view) == _step_fields(req.decode)
    assert view.WhichOneof("kind") == "decode" and view.decode is view
    assert list(tensors) == [name] and np.array_equal(tensors[name], general[name])
    assert tensors[name].dtype == general[name].dtype and tensors[name].shape == general[name].shape


@settings(max_examples=200, deadline=None)
@given(step=U63, past=U63, dup=st.booleans(), execution=U63, legs=U32,
       token=st.one_of(st.none(), U32), with_tensor=st.booleans(), array=ARRAYS)
def test_decode_answers_are_protobufs_bytes_and_read_back(step, past, dup, execution, legs, token, with_tensor,
                                                          array):
    tensors = {"logits": array} if with_tensor else {}
    res = pb.DecodeResult(idempotency_step=step, past_len=past, duplicate=dup, execution_nanos=execution, legs=legs)
    if token is not None:
        res.sample.CopyFrom(pb.TailSample(token_id=token))
    if tensors or token is None:
        res.bundle.CopyFrom(encode_bundle(tensors))
    canonical = pb.SessionResponse(decode=res).SerializeToString()
    fast = fastpath.decode_response_bytes(step, past, dup, execution, tensors=tensors, token_id=token, legs=legs)
    assert fast == canonical
    view, got = fastpath.read_decode_response(fast)
    resp = pb.SessionResponse.FromString(fast).decode
    assert (view.idempotency_step, view.past_len, view.duplicate, view.execution_nanos, view.legs) == \
        (resp.idempotency_step, resp.past_len, resp.duplicate, resp.execution_nanos, resp.legs)
    for field in ("sample", "bundle"):
        assert view.HasField(field) == resp.HasField(field)
    if token is not None:
        assert view.sample.token_id == resp.sample.token_id
    assert list(got) == list(tensors) and all(np.array_equal(got[k], tensors[k]) for k in tensors)
    assert read_answer(fast)[0] is not None


def _frame() -> bytes:
    row = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    return fastpath.decode_request_bytes(7, 100, 100, "h", row, legs=2, route_execution_nanos=5)


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.one_of(st.integers(0, 15), st.integers(0, 399)), st.integers(0, 255)),
                     min_size=1, max_size=4),
       cut=st.integers(0, 400))
def test_a_mutated_frame_is_read_as_the_general_path_reads_it_or_left_to_it(edits, cut):
    """Edits land in the step's scalar fields (the first bytes) half the time, so many mutants
    are still frames the fast reader takes: each must then read exactly as the general path."""
    data = bytearray(_frame())
    for at, value in edits:
        data[at % len(data)] = value
    data = bytes(data[:max(1, len(data) - cut % 8)]) if cut % 3 == 0 else bytes(data)
    fast = fastpath.read_decode_request(data)
    if fast is None:
        return                                 # the general path decides (and may refuse)
    try:
        req, general = _general_request(data)
    except ProtocolError as exc:               # the fast reader accepted what the general one refuses
        pytest.fail(f"fast read accepted a frame the general path refuses: {exc}")
    view, tensors = fast
    assert _step_fields(view) == _step_fields(req.decode)
    (name,) = tensors
    assert np.array_equal(tensors[name], general[name]) and tensors[name].dtype == general[name].dtype


def test_frames_the_fast_reader_leaves_to_the_general_path():
    row = np.ones((1, 8), np.float32)
    step = pb.DecodeStep(idempotency_step=3, position=4, expected_past_len=4)
    # zstd, q8 and several fragments: the general encoder's options
    for kw in ({"compression": pb.COMPRESSION_ZSTD}, {"encoding": pb.TENSOR_ENCODING_Q8_BLOCK32},
               {"max_fragment_bytes": 8}):
        body = wire.request_decode(step, "h", row, **kw)
        assert fastpath.read_decode_request(body) is None
        assert read_small_or_large(body)[0].decode.position == 4       # read the general way
    # fields out of the canonical order (legs before the tensor) are valid protobuf
    reordered = pb.SessionRequest(decode=pb.DecodeStep(legs=5)).SerializeToString()[2:]
    body = fastpath.decode_request_bytes(3, 4, 4, "h", row)
    inner = body[2:]
    mixed = b"\x1a" + bytes([len(inner) + len(reordered)]) + reordered + inner
    assert fastpath.read_decode_request(mixed) is None
    assert read_small_or_large(mixed)[0].decode.legs == 5
    # a corrupt checksum is the general path's PayloadCorrupt, not the fast reader's business
    bad = bytearray(body)
    bad[-3] ^= 0xFF
    assert fastpath.read_decode_request(bytes(bad)) is None
    with pytest.raises(ProtocolError):
        read_small_or_large(bytes(bad))
    # a sample with logprobs is read by protobuf
    res = pb.DecodeResult(past_len=4, sample=pb.TailSample(token_id=9, logprob=-0.5))
    answer = pb.SessionResponse(decode=res).SerializeToString()
    assert fastpath.read_decode_response(answer) is None
    assert read_answer(answer)[0].decode.sample.logprob == -0.5
