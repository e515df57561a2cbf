"""Golden vectors: committed frames rebuilt byte for byte, and a (message, bytes) table
checked in both directions (serialize -> bytes, bytes -> parse -> message)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from proto import golden
from proto import shard_runtime_pb2 as pb
from proto.frames import FrameReader, encode_frame, parse_request
from proto.records import parse_capability, parse_signed_record, verify_record_signature
from proto.tensors import decode_bundle, decode_tensor
from proto.zerocopy import read_request

H = bytes.fromhex


@pytest.mark.parametrize("name", sorted(golden.build_all()))
def test_committed_golden_frames_rebuild_byte_for_byte(name):
    assert (golden.GOLDEN_DIR / name).read_bytes() == golden.build_all()[name]


def test_golden_check_command_agrees():
    from proto.golden.__main__ import main
    assert main(["--check"]) == 0


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_golden_chunk_decodes_to_its_arrays():
    data = (golden.GOLDEN_DIR / "session_request_chunk.bin").read_bytes()
    req = parse_request(data)
    assert req.chunk.envelope == golden.golden_envelope()
    h = req.chunk.bundle.tensors[0]
    assert [f.byte_offset for f in h.fragments] == [0, 40, 80]        # multi-fragment
    want = golden.expected_arrays()["session_request_chunk"]
    for got in (decode_bundle(req.chunk.bundle), read_request(data)[1]):
        assert got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)


def test_golden_decode_step_and_its_relay_frame():
    data = (golden.GOLDEN_DIR / "decode_step.bin").read_bytes()
    req = parse_request(data)
    assert (req.decode.idempotency_step, req.decode.position) == (131, 131)
    assert _same(decode_tensor(req.decode.tensor), golden.expected_arrays()["decode_step"]["h"])
    framed = (golden.GOLDEN_DIR / "decode_step_framed.bin").read_bytes()
    assert framed == encode_frame(data)
    reader = FrameReader()
    reader.feed(framed)
    assert reader.next_frame() == data


def test_golden_capability_record_verifies():
    rec = parse_signed_record((golden.GOLDEN_DIR / "capability_record.bin").read_bytes())
    verify_record_signature(rec)
    assert rec.public_key == golden.golden_key().public_key().public_bytes_raw()
    assert parse_capability(rec) == golden.capability_payload()


# (message, exact bytes). One comment per field: tag byte (field << 3 | wire type), then value.
TABLE = [
    ("flow control",
     pb.FlowControl(credits_granted=4, max_inflight_chunks=8, max_chunk_bytes=1 << 20,
                    max_prefill_chunk_tokens=128),
     H("08 04"            # credits_granted (1, varint) = 4
       "10 08"            # max_inflight_chunks (2, varint) = 8
       "18 80 80 40"      # max_chunk_bytes (3, varint) = 1 MiB
       "20 80 01")),      # max_prefill_chunk_tokens (4, varint) = 128
    ("release signal",
     pb.SessionRequest(release=pb.ReleaseSignal(route_session_id="s", route_epoch=2)),
     H("2a 05"            # SessionRequest.release (5, length 5)
       "0a 01 73"         #   route_session_id (1) = "s"
       "10 02")),         #   route_epoch (2) = 2
    ("cache miss status",
     pb.SessionResponse(status=pb.ShardStatus(
         work_id="w", error=pb.ShardError(code=pb.ERROR_CODE_CACHE_MISS, actual_past_len=300))),
     H("2a 0a"            # SessionResponse.status (5, length 10)
       "0a 01 77"         #   work_id (1) = "w"
       "22 05"            #   error (4, length 5)
       "08 05"            #     code (1) = ERROR_CODE_CACHE_MISS
       "20 ac 02")),      #     actual_past_len (4) = 300
    ("int8 tensor",
     pb.NamedTensor(name="t", shape=[2], dtype=pb.DTYPE_INT8, byte_order=pb.BYTE_ORDER_LITTLE_ENDIAN,
                    total_bytes=2, compression=pb.COMPRESSION_NONE,
                    checksum=pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_CRC32C, value=H("bdd53ff7")),
                    fragments=[pb.TensorFragment(fragment_count=1, payload=b"\x01\xfe")],
                    encoding=pb.TENSOR_ENCODING_RAW),
     H("0a 01 74"         # name (1) = "t"
       "12 01 02"         # shape (2, packed) = [2]
       "18 07"            # dtype (3) = DTYPE_INT8
       "20 01"            # byte_order (4) = LITTLE_ENDIAN
       "28 02"            # total_bytes (5) = 2
       "30 01"            # compression (6) = NONE
       "3a 08"            # checksum (7, length 8)
       "08 02"            #   algorithm (1) = CRC32C
       "12 04 bd d5 3f f7"  # value (2) = CRC32C(01 fe), big-endian
       "42 06"            # fragments (8, length 6); index 0 and offset 0 are defaults
       "10 01"            #   fragment_count (2) = 1
       "22 02 01 fe"      #   payload (4) = [1, -2] as int8
       "48 01"),          # encoding (9) = RAW
     np.array([1, -2], np.int8)),
    ("q8 tensor",
     pb.NamedTensor(name="q", shape=[3], dtype=pb.DTYPE_FLOAT32,
                    byte_order=pb.BYTE_ORDER_LITTLE_ENDIAN, total_bytes=5,
                    compression=pb.COMPRESSION_NONE,
                    checksum=pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_CRC32C, value=H("7aba36e1")),
                    fragments=[pb.TensorFragment(fragment_count=1, payload=H("09203f8120"))],
                    encoding=pb.TENSOR_ENCODING_Q8_BLOCK32),
     H("0a 01 71"         # name (1) = "q"
       "12 01 03"         # shape (2, packed) = [3]
       "18 03"            # dtype (3) = DTYPE_FLOAT32 (decodes to float32)
       "20 01"            # byte_order (4) = LITTLE_ENDIAN
       "28 05"            # total_bytes (5) = 2 (one fp16 scale) + 3 (int8)
       "30 01"            # compression (6) = NONE
       "3a 08 08 02 12 04 7a ba 36 e1"  # checksum (7): CRC32C of the 5 encoded bytes
       "42 09 10 01"      # fragments (8, length 9): fragment_count = 1
       "22 05 09 20"      #   payload (4): scale 0x2009 (fp16 LE) = 0.0078983, rounded UP from 1/127
       "3f 81 20"         #   int8 63, -127, 32
       "48 02"),          # encoding (9) = Q8_BLOCK32
     np.array([63, -127, 32], np.float32) * np.frombuffer(H("0920"), "<f2").astype(np.float32)),
    ("token-only tail answer",
     pb.SessionResponse(decode=pb.DecodeResult(idempotency_step=300, past_len=400, execution_nanos=1_000_000,
                                               sample=pb.TailSample(token_id=31999))),
     H("32 10"            # SessionResponse.decode (6, length 16): 18 bytes per decode step
       "08 ac 02"         #   idempotency_step (1) = 300
       "10 90 03"         #   past_len (2) = 400 (duplicate false: omitted; no bundle)
       "20 c0 84 3d"      #   execution_nanos (4) = 1_000_000
       "32 04"            #   sample (6, length 4)
       "08 ff f9 01")),   #     token_id (1) = 31999
    ("tail answer with logprobs",
     pb.SessionResponse(decode=pb.DecodeResult(idempotency_step=5, past_len=6, sample=pb.TailSample(
         token_id=2, logprob=-0.5, top=[pb.TokenLogprob(token_id=2, logprob=-0.5)]))),
     H("32 16"            # SessionResponse.decode (6, length 22)
       "08 05 10 06"      #   idempotency_step = 5, past_len = 6
       "32 10"            #   sample (6, length 16)
       "08 02"            #     token_id (1) = 2
       "15 00 00 00 bf"   #     logprob (2, fixed32) = -0.5 (float32 little-endian)
       "1a 07"            #     top (3, length 7): one TokenLogprob
       "08 02"            #       token_id = 2
       "15 00 00 00 bf")),  #     logprob = -0.5
    ("decode step",
     pb.SessionRequest(decode=pb.DecodeStep(
         idempotency_step=1, position=300,
         tensor=pb.NamedTensor(
             name="h", shape=[1, 2], dtype=pb.DTYPE_FLOAT16, byte_order=1, total_bytes=4,
             compression=1, checksum=pb.Checksum(algorithm=2, value=H("bc837142")),
             fragments=[pb.TensorFragment(fragment_count=1, payload=H("003c00c0"))], encoding=1))),
     H("1a 2c"            # SessionRequest.decode (3, length 44)
       "08 01"            #   idempotency_step (1) = 1
       "10 ac 02"         #   position (2) = 300 (expected_past_len 0: omitted)
       "22 25"            #   tensor (4, length 37)
       "0a 01 68"         #     name = "h"
       "12 02 01 02"      #     shape (packed) = [1, 2]
       "18 02 20 01 28 04 30 01"  # dtype FLOAT16, little-endian, total_bytes 4, NONE
       "3a 08 08 02 12 04 bc 83 71 42"  # CRC32C
       "42 08 10 01 22 04 00 3c 00 c0"  # one fragment: fp16 1.0, -2.0
       "48 01")),         #     encoding RAW
]


@pytest.mark.parametrize("row", TABLE, ids=[r[0] for r in TABLE])
def test_table_both_directions(row):
    _, message, data = row[:3]
    assert message.SerializeToString() == data                     # message -> bytes
    assert type(message).FromString(data) == message                # bytes -> message
    if len(row) == 4:
        got = decode_tensor(type(message).FromString(data))
        assert got.dtype == row[3].dtype and np.array_equal(got, row[3])


def test_table_decode_step_value():
    step = parse_request(TABLE[-1][2]).decode
    assert np.array_equal(decode_tensor(step.tensor), np.array([[1.0, -2.0]], np.float16))


def test_bf16_is_canonical_and_little_endian():
    h = golden.expected_arrays()["decode_step"]["h"]
    assert h.dtype == np.dtype(ml_dtypes.bfloat16)
    payload = parse_request((golden.GOLDEN_DIR / "decode_step.bin").read_bytes()).decode.tensor
    assert payload.fragments[0].payload[:4] == h.view(np.uint16)[0, :2].astype("<u2").tobytes()
