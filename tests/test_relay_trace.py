"""relay.trace: opt-in marks, and the frame-by-frame pairing of two processes' marks."""
from __future__ import annotations

from relay import trace

PATH = ("e.pump_got", "e.trio_got", "e.write_done", "h.read_done", "h.iter_yield", "h.pump_got",
        "h.trio_got", "h.write_done", "e.read_done", "e.next_return")


def _write(tmp_path, pid, marks):
    (tmp_path / f"{pid}.trace").write_text("".join(f"{n} {t}\n" for n, t in marks))


def test_breakdown_pairs_requests_with_the_responses_that_follow(tmp_path):
    entry, home = [], []
    for step in range(3):
        base = step * 100_000_000                     # 100 ms apart
        times = [base + i * 1_000_000 * (step + 1) for i in range(len(PATH))]
        for name, t in zip(PATH, times):
            (entry if name.startswith("e.") else home).append((name, t))
    home.append(("h.pump_got", 250_000_000))          # a flow-control response: not on a step's path
    _write(tmp_path, 1, entry)
    _write(tmp_path, 2, home)
    got = trace.breakdown(tmp_path, last=3)
    assert got["e.pump_got->e.trio_got"] == 2.0        # median of 1, 2, 3 ms
    assert got["total"] == 18.0
    assert set(got) == {f"{a}->{b}" for a, b in zip(PATH, PATH[1:])} | {"total"}
    assert trace.breakdown(tmp_path, last=1)["total"] == 27.0


def test_breakdown_is_empty_without_both_sides(tmp_path):
    _write(tmp_path, 1, [("e.pump_got", 1)])
    assert trace.breakdown(tmp_path, last=5) == {}


def test_marks_are_recorded_only_while_enabled(tmp_path, monkeypatch):
    monkeypatch.delenv(trace.TRACE_ENV, raising=False)
    trace.mark("e.pump_got")
    trace.enable(tmp_path)
    try:
        trace.mark("e.pump_got")
        trace.mark("e.write_done")
    finally:
        trace.disable()
    trace.mark("e.read_done")
    lines = next(tmp_path.glob("*.trace")).read_text().split("\n")
    assert [line.split()[0] for line in lines if line] == ["e.pump_got", "e.write_done"]
