"""The log filter of long-running nodes: repeats held back with a count, no empty reasons,
and py-libp2p's INFO/DEBUG only at -vv (a fake clock; no sleeps)."""
from __future__ import annotations

import io
import logging

import pytest
import trio

from meshd.cli.common import setup_logging
from meshd.cli.logfilter import MAX_KINDS, NO_REASON, REPEAT_INTERVAL_S, RepeatFilter


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(msg: str, *args: object, name: str = "libp2p.kad_dht", level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def emitted(flt: RepeatFilter, rec: logging.LogRecord) -> str | None:
    return rec.getMessage() if flt.filter(rec) else None


PEERS = ["12D3KooWFWxpMjGkH8coWrg8hyJVN8e5Pkv9HaBKJAPUMLZARoqD",
         "12D3KooWM82bDYYgzgXaayHDdVciFe3bGvJ69qHnbSztNUJ933VQ"]


def test_a_flood_of_one_warning_is_one_line_per_interval_with_the_count():
    clock = FakeClock()
    flt = RepeatFilter(clock=clock)
    lines = []
    # 25 a second for 10 seconds, alternating peers (formatted into the text, as py-libp2p does)
    for i in range(250):
        clock.now = 1000.0 + i * 0.04
        line = emitted(flt, record(f"Failed to open stream to peer {PEERS[i % 2]}: attempt {i}"))
        if line is not None:
            lines.append(line)
    assert len(lines) == 10                      # one per second
    assert "more like this" not in lines[0]
    for line in lines[1:]:
        assert line.endswith("[24 more like this in the last 1 s]"), line


def test_distinct_warnings_and_levels_are_not_held_back_by_each_other():
    flt = RepeatFilter(clock=FakeClock())
    assert emitted(flt, record("dial failed: %s", "refused")) is not None
    assert emitted(flt, record("stream reset by %s", PEERS[0])) is not None
    assert emitted(flt, record("dial failed: %s", "refused", level=logging.ERROR)) is not None
    assert emitted(flt, record("dial failed: %s", "refused", name="relay.hop")) is not None
    assert emitted(flt, record("dial failed: %s", "refused")) is None      # the same one again


def test_debug_records_always_pass():
    flt = RepeatFilter(clock=FakeClock())
    assert all(flt.filter(record("chatty %d", i, level=logging.DEBUG)) for i in range(100))


@pytest.mark.parametrize("reason,shown", [
    (trio.ClosedResourceError(), "ClosedResourceError"),
    (EOFError(""), "EOFError"),
    (ValueError("bad varint"), "bad varint"),
])
def test_an_empty_reason_is_never_logged(reason, shown):
    flt = RepeatFilter(clock=FakeClock())
    line = emitted(flt, record("Failed to read DHT message from stream: %s", reason))
    assert line == f"Failed to read DHT message from stream: {shown}"


def test_a_message_ending_at_its_colon_says_no_reason_was_given():
    flt = RepeatFilter(clock=FakeClock())
    assert emitted(flt, record("relayed stream closed while sending: ")) == \
        f"relayed stream closed while sending: {NO_REASON}"


def test_the_table_of_kinds_is_bounded():
    clock = FakeClock()
    flt = RepeatFilter(clock=clock, max_kinds=8)
    for i in range(100):
        flt.filter(record(f"warning kind {chr(65 + i % 26)}{chr(65 + i // 26)}"))
    assert len(flt._kinds) == 8 and MAX_KINDS >= 8


def test_libp2p_info_and_debug_only_at_vv():
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    lib = logging.getLogger("libp2p")
    saved_lib = (lib.level, lib.propagate)
    out = io.StringIO()
    root.handlers = [logging.StreamHandler(out)]
    try:
        for verbosity, shown in ((0, set()), (1, {"WARNING"}), (2, {"WARNING", "INFO", "DEBUG"})):
            setup_logging(verbosity)
            setup_logging(verbosity)                  # idempotent: still one filter
            assert sum(isinstance(f, RepeatFilter) for f in root.handlers[0].filters) == 1
            out.seek(0)
            out.truncate()
            child = logging.getLogger("libp2p.relay.circuit_v2.protocol")
            for level in ("DEBUG", "INFO", "WARNING"):
                # a distinct text per verbosity: the filter (kept across calls) would hold a repeat back
                child.log(getattr(logging, level), "library %s line at %s", level, "vvv"[:verbosity] or "quiet")
            got = {level for level in ("DEBUG", "INFO", "WARNING") if f"library {level} line" in out.getvalue()}
            assert got == shown, (verbosity, got)
    finally:
        root.handlers, _ = saved[0], root.setLevel(saved[1])
        lib.setLevel(saved_lib[0])
        lib.propagate = saved_lib[1]
    assert REPEAT_INTERVAL_S == 1.0      # the bound: one line per second per warning
