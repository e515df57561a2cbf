"""Seeds and strategies shared by the codec fuzz tests."""
from __future__ import annotations

import random

import ml_dtypes
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import strategies as st

from proto import golden, wire
from proto import shard_runtime_pb2 as pb
from proto.errors import ProtocolError
from proto.records import sign_record
from proto.tensors import encode_bundle, encode_tensor

DTYPES = [ml_dtypes.bfloat16, np.float16, np.float32, np.int32, np.int64, np.int8, np.uint8,
          np.bool_]
FLOATS = DTYPES[:3]
COMPRESSIONS = [pb.COMPRESSION_NONE, pb.COMPRESSION_ZSTD]
ENV = golden.golden_envelope()


def _arr(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 20).astype(dtype)


def request_seeds() -> list[bytes]:
    h = _arr((3, 40), ml_dtypes.bfloat16)
    out = [golden.build_all()["session_request_chunk.bin"], golden.build_all()["decode_step.bin"],
           wire.request_chunk(ENV, {"h": h}, compression=pb.COMPRESSION_ZSTD, max_fragment_bytes=50),
           wire.request_chunk(ENV, {"h": h.astype(np.float32)},
                              encoding=pb.TENSOR_ENCODING_Q8_BLOCK32, max_fragment_bytes=64),
           wire.request_chunk(ENV, {"m": np.array([True, False]), "e": np.zeros((0, 2), np.int32)})]
    for msg in [pb.SessionRequest(open=pb.SessionOpen(
                    schema_version=1, route_session_id="s", route_epoch=1,
                    proposed_flow_control=pb.FlowControl(credits_granted=4),
                    accepted_compression=[1, 2], max_tokens=512)),
                pb.SessionRequest(flow_control=pb.FlowControl(credits_granted=3)),
                pb.SessionRequest(release=pb.ReleaseSignal(route_session_id="s", route_epoch=1)),
                pb.SessionRequest(cancel=pb.CancelSignal(route_session_id="s", reason="x"))]:
        out.append(msg.SerializeToString())
    return out


def response_seeds() -> list[bytes]:
    h = _arr((2, 33), np.float32)
    out = [wire.response_chunk(ENV, {"h": h}, max_fragment_bytes=100),
           wire.response_decode(pb.DecodeResult(idempotency_step=4, past_len=5),
                                {"token_ids": np.array([7], np.int64), "logits": h[0]},
                                compression=pb.COMPRESSION_ZSTD),
           wire.response_decode(pb.DecodeResult(
               idempotency_step=6, past_len=7, execution_nanos=99, sample=pb.TailSample(
                   token_id=300, logprob=-0.5, top=[pb.TokenLogprob(token_id=300, logprob=-0.5)])), {}),
           wire.response_chunk(ENV, {}, sample=pb.TailSample(token_id=2))]
    for msg in [pb.SessionResponse(accepted=pb.SessionAccepted(schema_version=1, past_len=3,
                                                               accepted_compression=[1])),
                pb.SessionResponse(ack=pb.Ack(work_id="w", idempotency_step=2, duplicate=True)),
                pb.SessionResponse(status=pb.ShardStatus(error=pb.ShardError(code=5)))]:
        out.append(msg.SerializeToString())
    return out


def tensor_seeds() -> list[bytes]:
    return [encode_tensor("h", _arr((4, 9), d), compression=c, max_fragment_bytes=16)
            .SerializeToString() for d in DTYPES for c in COMPRESSIONS] + [
        encode_tensor("q", _arr((70,), d), encoding=pb.TENSOR_ENCODING_Q8_BLOCK32,
                      compression=c).SerializeToString() for d in FLOATS for c in COMPRESSIONS]


def bundle_seeds() -> list[bytes]:
    return [encode_bundle({"a": _arr((3, 3), np.float16), "b": np.arange(5, dtype=np.int64)},
                          max_fragment_bytes=8).SerializeToString(),
            encode_bundle({"c": _arr((33,), np.float32)}, encoding=pb.TENSOR_ENCODING_Q8_BLOCK32,
                          compression=pb.COMPRESSION_ZSTD).SerializeToString()]


def record_seeds() -> list[bytes]:
    key = Ed25519PrivateKey.from_private_bytes(bytes(32))
    directive = pb.RebalanceDirective(schema_version=1, directive_id="d", action=1, epoch=3)
    return [golden.build_all()["capability_record.bin"],
            sign_record(pb.RECORD_KIND_DIRECTIVE, directive.SerializeToString(), key)
            .SerializeToString()]


_OPS = ("flip", "set", "insert", "delete", "truncate", "dup")


def mutate(data: bytes, rnd: random.Random) -> bytes:
    """1-4 byte-level mutations: flip a bit, set a byte, insert, delete, truncate,
    duplicate a span."""
    data = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        if not data:
            break
        op, i = rnd.choice(_OPS), rnd.randrange(len(data))
        if op == "flip":
            data[i] ^= 1 << rnd.randrange(8)
        elif op == "set":
            data[i] = rnd.choice([0, 1, 0x7F, 0x80, 0xFF, rnd.randrange(256)])
        elif op == "insert":
            data[i:i] = rnd.randbytes(rnd.randint(1, 8))
        elif op == "delete":
            del data[i:i + rnd.randint(1, 8)]
        elif op == "truncate":
            del data[i:]
        else:
            j = min(len(data), i + rnd.randint(1, 64))
            data[j:j] = data[i:j]
    return bytes(data)


BATCH = 8    # decoder inputs per hypothesis example (hypothesis' own overhead is ~2 ms each)


def fuzz_inputs(seeds: list[bytes]) -> st.SearchStrategy[list[bytes]]:
    """Per example: one arbitrary byte string plus BATCH mutated valid encodings.

    Hypothesis draws the arbitrary bytes and one RNG seed; the mutations come from
    that RNG, so each example feeds BATCH + 1 inputs to the decoder under test.
    """
    def build(arbitrary: bytes, rng_seed: int) -> list[bytes]:
        rnd = random.Random(rng_seed)
        return [arbitrary] + [mutate(rnd.choice(seeds), rnd) for _ in range(BATCH)]
    return st.builds(build, st.binary(max_size=120), st.integers(0, 2**64 - 1))


def only_protocol_errors(fn, *args) -> object:
    """Call a decoder; any exception other than a ProtocolError fails the test."""
    try:
        return fn(*args)
    except ProtocolError as exc:
        assert type(exc).code, exc
        return exc
