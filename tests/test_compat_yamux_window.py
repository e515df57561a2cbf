"""Yamux WINDOW_UPDATEs batched at half the window, over real libp2p hosts and a relay on loopback.

Counts, never timings: the library's own method sends about one update per read at
every yamux layer of a relayed hop; the batched one sends none for small frames and
still keeps large transfers (far over one window) flowing both ways."""
from __future__ import annotations

import os

import pytest
import trio
from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE, YamuxStream

from dht.compat import yamux_window
from meshd.benchmarks.relay_home import ECHO_PROTOCOL, echo
from relay.transport import RelayedFrameChannel
from tests._relay_helpers import new_host, triangle


@pytest.fixture(autouse=True, scope="module")
def _host_built():
    """The host builder installs the patch (dht/compat/registry.py), not the import: build one first."""
    new_host()


def _echo_round_trips(sizes: list[int], *, library_rule: bool = False) -> int:
    """Echo each size once through relay -> home and back; the WINDOW_UPDATEs sent meanwhile.

    ``library_rule``: the library's own method during the echo (restored after the hosts
    are built, since building a host applies the patch)."""
    sent = [0]
    original = YamuxStream.send_window_update

    async def counting(self, *args, **kwargs):
        sent[0] += 1
        return await original(self, *args, **kwargs)

    async def main():
        async with triangle() as t:
            if library_rule:
                yamux_window.restore()
            t.home.set_stream_handler(ECHO_PROTOCOL, echo)
            channel = RelayedFrameChannel(await t.dialer.new_stream(t.home.get_id(), [ECHO_PROTOCOL]))
            await channel.send(b"warm-up")
            assert await channel.receive() == b"warm-up"
            sent[0] = 0
            for size in sizes:
                body = os.urandom(size)
                await channel.send(body)
                with trio.fail_after(60):
                    assert await channel.receive() == body
            await channel.close()

    YamuxStream.send_window_update = counting
    try:
        trio.run(main)
    finally:
        YamuxStream.send_window_update = original
    return sent[0]


def test_the_patch_is_installed_by_the_host_builder():
    assert yamux_window.APPLIED
    assert YamuxStream._auto_tune_and_send_window_update is yamux_window._batched_window_update


def test_small_frames_draw_no_window_updates_and_the_library_rule_draws_many():
    frames = [300, 4096] * 10
    batched = _echo_round_trips(frames)
    try:
        per_read = _echo_round_trips(frames, library_rule=True)
    finally:
        assert yamux_window.apply()
    # 20 round trips of < 100 KiB in all stay under half of one window at every layer.
    assert batched == 0
    assert per_read >= 2 * len(frames), per_read


def test_transfers_of_many_windows_keep_flowing_both_ways():
    big = 3 * DEFAULT_WINDOW_SIZE + 12345       # needs credit back several times per direction
    updates = _echo_round_trips([big, 17, big])
    # Credit comes back in half-window batches per yamux layer: a handful per window, not per read.
    windows = 2 * 2 * big / DEFAULT_WINDOW_SIZE
    assert 0 < updates <= 3 * 2 * windows + 6, updates
