"""Small tensor frames skip the Python wire scan (proto.frames): the worst such frame stays
bounded in memory and gets a typed error from the tensor decoder."""
from __future__ import annotations

import os

import pytest

from proto.errors import ProtocolError


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("field", ["fragments", "shape"])
def test_small_tensor_frames_skip_the_wire_scan_and_stay_bounded(field):
    """Frames up to MAX_UNSCANNED_FRAME_BYTES go straight to protobuf: the worst small frame
    (every byte an element: empty fragments, or a packed shape of 1s) still costs little
    memory, and the decoder refuses it with a typed error."""
    from proto.decoding import decode_tensor
    from proto.frames import parse_request
    from proto.limits import MAX_UNSCANNED_FRAME_BYTES
    from proto.tensors import varint

    room = MAX_UNSCANNED_FRAME_BYTES - 64
    if field == "fragments":
        tensor = b"\x0a\x01h" + b"\x42\x00" * (room // 2)
    else:
        tensor = b"\x0a\x01h\x12" + varint(room - 8) + b"\x01" * (room - 8)
    step = b"\x08\x01\x10\x00\x18\x00\x22" + varint(len(tensor)) + tensor
    frame = b"\x1a" + varint(len(step)) + step
    assert len(frame) <= MAX_UNSCANNED_FRAME_BYTES
    before = _rss_bytes()
    req = parse_request(frame)
    with pytest.raises(ProtocolError):
        decode_tensor(req.decode.tensor)
    assert _rss_bytes() - before < 32 * 2**20
