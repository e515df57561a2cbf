"""The fetch scheduler (meshd/fetch/scheduler.py), sans-I/O, driven by in-memory providers on trio's
MockClock: parallel assignment, blame at the first bad chunk, resume, back-off, NOT_HELD, stuck."""
from __future__ import annotations

import pytest
import trio
import trio.testing

from meshd.fetch.scheduler import MAX_FAILURES, RETRY_BASE_S, Scheduler
from shard.model import manifest as M

CHUNK = 1024


def _model(sizes=(5000, 3000, 8192, 100)) -> tuple[M.Manifest, list[bytes]]:
    datas = [bytes((i * 7 + k) % 251 for k in range(n)) for i, n in enumerate(sizes)]
    entries = tuple(M.entry_of(M.TENSOR, f"t{i}", d, dtype="U8", shape=(len(d),), chunk_bytes=CHUNK)
                    for i, d in enumerate(datas))
    return M.Manifest(M.KIND_GGUF, CHUNK, (), entries), datas


def _wanted(m: M.Manifest, entries=None) -> list[tuple[int, int]]:
    entries = range(len(m.entries)) if entries is None else entries
    return [(i, c) for i in entries for c in range(len(m.entries[i].chunks))]


class MemProvider:
    """A provider that sends ``rate`` bytes per (virtual) second, optionally corrupting some chunks."""

    def __init__(self, name: str, datas, *, rate: float = 1e6, corrupt=(), fail_after: int | None = None,
                 start_at: float = 0.0):
        self.name, self.datas, self.rate, self.start_at = name, datas, rate, start_at
        self.corrupt, self.fail_after = set(corrupt), fail_after
        self.requests: list = []
        self.sent_chunks = 0

    async def serve(self, run, m: M.Manifest):
        self.requests.append(run)
        for c in range(run.first, run.first + run.count):
            if self.fail_after is not None and self.sent_chunks >= self.fail_after:
                raise ConnectionError("reset")
            off, length = m.chunk_span(run.entry, c)
            await trio.sleep(length / self.rate)
            data = bytearray(self.datas[run.entry][off:off + length])
            if (run.entry, c) in self.corrupt:
                data[0] ^= 0xFF
            self.sent_chunks += 1
            yield c, bytes(data)


async def drive(sched: Scheduler, m: M.Manifest, providers: dict[str, MemProvider], out: dict) -> None:
    """What meshd/fetch/fetcher.py does, on trio: each provider pulls runs until nothing is left."""
    async def loop(name: str, p: MemProvider) -> None:
        await trio.sleep(p.start_at)    # trio may start tasks in any order: who comes first is set here
        while not sched.done and sched.usable(name):
            run = sched.next_run(name, trio.current_time())
            if run is None:
                await trio.sleep(0.05)
                if sched.stuck():
                    return
                continue
            try:
                async for c, data in p.serve(run, m):
                    if not m.chunk_ok(run.entry, c, data):
                        sched.chunk_bad(name, run.entry, c)
                        out.setdefault("blamed_at", []).append((name, run.entry, c, trio.current_time()))
                        return
                    out[(run.entry, c)] = data
                    sched.chunk_ok(name, run.entry, c)
            except ConnectionError:
                sched.run_failed(name, run, trio.current_time(), "reset")

    async with trio.open_nursery() as nursery:
        for name, p in providers.items():
            sched.add_provider(name)
            nursery.start_soon(loop, name, p)


def _run(coro_fn, *args):
    trio.run(coro_fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


def test_two_providers_share_the_work_and_every_chunk_is_asked_once():
    m, datas = _model()
    sched = Scheduler(m, _wanted(m), run_bytes=2 * CHUNK)
    a, b = MemProvider("a", datas), MemProvider("b", datas)
    out: dict = {}
    _run(drive, sched, m, {"a": a, "b": b}, out)
    assert sched.done and sched.verified_bytes == sched.total_bytes == sum(len(d) for d in datas)
    asked = [(r.entry, c) for p in (a, b) for r in p.requests for c in range(r.first, r.first + r.count)]
    assert sorted(asked) == sorted(_wanted(m))               # no chunk twice, none missing
    assert a.requests and b.requests                         # both worked, in parallel
    assert all(r.nbytes <= 2 * CHUNK for p in (a, b) for r in p.requests)
    assert all(out[k] == datas[k[0]][k[1] * CHUNK:(k[1] + 1) * CHUNK] for k in _wanted(m))


def test_a_bad_chunk_blames_its_sender_at_once_and_the_rest_comes_from_the_other():
    m, datas = _model()
    bad = MemProvider("bad", datas, rate=4e6, corrupt={(0, 2)})
    good = MemProvider("good", datas, rate=1e6, start_at=1e-6)
    sched = Scheduler(m, _wanted(m), run_bytes=8 * CHUNK)
    out: dict = {}
    _run(drive, sched, m, {"bad": bad, "good": good}, out)
    assert sched.done and sched.blamed == ["bad"]
    (name, entry, chunk, _), = out["blamed_at"]
    assert (name, entry, chunk) == ("bad", 0, 2)
    assert bad.sent_chunks == 3            # chunks 0, 1 and the bad 2: detected at the first bad chunk
    assert len(bad.requests) == 1          # never asked again
    assert sched.next_run("bad", 1e9) is None
    assert all(out[k] == datas[k[0]][k[1] * CHUNK:(k[1] + 1) * CHUNK] for k in _wanted(m))


def test_resume_never_asks_for_verified_chunks():
    m, datas = _model()
    done = _wanted(m)[::2]
    sched = Scheduler(m, _wanted(m), done, run_bytes=4 * CHUNK)
    assert sched.resumed_bytes == sched.verified_bytes == sum(m.chunk_span(*k)[1] for k in done)
    p = MemProvider("p", datas)
    _run(drive, sched, m, {"p": p}, {})
    asked = {(r.entry, c) for r in p.requests for c in range(r.first, r.first + r.count)}
    assert sched.done and asked == set(_wanted(m)) - set(done)


def test_transport_failures_back_off_on_the_clock_then_drop_the_provider():
    m, _ = _model()
    sched = Scheduler(m, _wanted(m), run_bytes=CHUNK)
    sched.add_provider("p")
    now = 100.0
    for failure in range(1, MAX_FAILURES + 1):
        run = sched.next_run("p", now)
        assert run is not None
        sched.run_failed("p", run, now, "reset")
        wait = RETRY_BASE_S * 2 ** (failure - 1)
        if failure < MAX_FAILURES:
            assert sched.next_run("p", now + wait - 0.001) is None      # backing off
            now += wait
    assert not sched.usable("p") and sched.stuck()                    # dropped: nobody left
    assert sched.verified_bytes == 0 and sched.missing() == _wanted(m)


def test_not_held_sends_the_entry_to_whoever_has_it():
    m, datas = _model()
    sched = Scheduler(m, _wanted(m), run_bytes=16 * CHUNK)
    sched.add_provider("partial", entries=[0, 1])
    sched.add_provider("whole")
    run = sched.next_run("partial", 0.0)
    assert run.entry == 0
    sched.not_held("partial", run)          # it lost entry 0 after all
    assert sched.next_run("partial", 0.0).entry == 1
    assert sched.next_run("whole", 0.0).entry == 0
    assert sched.next_run("partial", 0.0) is None     # entries 2, 3: not its


def test_stuck_only_when_nobody_usable_holds_a_missing_chunk():
    m, datas = _model()
    sched = Scheduler(m, _wanted(m), run_bytes=16 * CHUNK)
    sched.add_provider("a", entries=[0, 1, 2])
    assert sched.stuck()                       # entry 3: nobody
    sched.add_provider("b", entries=[3])
    assert not sched.stuck()
    run = sched.next_run("b", 0.0)
    sched.chunk_bad("b", run.entry, run.first)
    assert sched.stuck() and sched.blamed == ["b"]


@pytest.mark.parametrize("run_bytes", [CHUNK, 3 * CHUNK, 64 * CHUNK])
def test_runs_stay_inside_one_entry_and_within_the_run_size(run_bytes):
    m, _ = _model()
    sched = Scheduler(m, _wanted(m), run_bytes=run_bytes)
    sched.add_provider("p")
    seen = []
    while (run := sched.next_run("p", 0.0)) is not None:
        assert run.nbytes <= max(run_bytes, CHUNK) and run.first + run.count <= len(m.entries[run.entry].chunks)
        seen += [(run.entry, c) for c in range(run.first, run.first + run.count)]
    assert seen == _wanted(m)
