"""Speed of a worker's recent real steps, for its Health (the dashboard's "recent" speeds).

``observe(positions, layers, seconds)`` after each step the session manager ran
(shard/session/sessions.py): a single position is a decode step, more are a prefill
chunk. Each kind keeps an exponentially weighted moving average (ALPHA per
step: about the last 20 steps) and a count of positions. The capability's
numbers come from one validation pass at start; these from what the worker
actually did since. Pure; the caller holds the service lock.
"""
from __future__ import annotations

# Weight of the newest step in the average: ~20 steps of memory.
ALPHA = 0.1


class StepMeter:
    __slots__ = ("decode_ms_per_layer", "prefill_tokens_per_s", "decode_positions", "prefill_positions")

    def __init__(self) -> None:
        self.decode_ms_per_layer = 0.0
        self.prefill_tokens_per_s = 0.0
        self.decode_positions = 0
        self.prefill_positions = 0

    @staticmethod
    def _ewma(old: float, new: float) -> float:
        return new if old == 0.0 else old + ALPHA * (new - old)

    def observe(self, positions: int, layers: int, seconds: float) -> None:
        if positions <= 0 or layers <= 0 or seconds <= 0:
            return
        if positions == 1:
            self.decode_positions += 1
            self.decode_ms_per_layer = self._ewma(self.decode_ms_per_layer, seconds * 1000 / layers)
        else:
            self.prefill_positions += positions
            self.prefill_tokens_per_s = self._ewma(self.prefill_tokens_per_s, positions / seconds)
