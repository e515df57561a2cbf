"""The route driver re-feeds a fresh hop in the batches the route first used (pure part)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from meshd.generate.driver import SwarmDriver


@pytest.mark.parametrize("past,target,batches", [
    (0, 14, [(0, 14)]),                          # the prompt: one prefill (the link chunks it)
    (14, 15, [(14, 15)]),                        # a decode step
    (0, 16, [(0, 14), (14, 15), (15, 16)]),      # a fresh hop after a failure at position 15
    (10, 16, [(10, 14), (14, 15), (15, 16)]),    # failed inside the prompt, then decode
    (15, 16, [(15, 16)]),
])
def test_replay_repeats_the_original_batches(past, target, batches):
    assert SwarmDriver._replay(SimpleNamespace(_prompt_len=14), past, target) == batches
