"""Step deadlines of one hop, derived from that hop's own measured step times (pure).

A hop that stops answering -- a SIGSTOPped or suspended machine, a wedged
process whose connection stays open -- raises no error: only a deadline
notices it. One fixed deadline must cover the slowest legitimate step (a
128-token prefill chunk of a big model on a slow CPU: minutes), so it would
notice a frozen hop only after minutes, while a decode step takes
milliseconds. So each hop link keeps what it measured (round trips from the
entry: compute plus transport) and asks for a deadline per step:

    open (SessionAccepted)   OPEN_DEADLINE_S: admission only, no compute
    prefill chunk            nothing measured on this link yet: FIRST_CHUNK_DEADLINE_S;
                             else max(PREFILL_FLOOR_S, FACTOR x tokens / measured rate)
    decode step              max(DECODE_FLOOR_S, FACTOR x the slowest of the last
                             RECENT decode steps); before the first decode step the
                             slowest measured chunk stands in for it
    patience                 every deadline is multiplied by it: the route driver
                             doubles it for a peer that was cut but had no
                             replacement, so a peer that is merely slow once is
                             retried with more room instead of being cut forever

With the floors below a silent hop is cut about DECODE_FLOOR_S after its
last decode step was due (plus one watchdog tick), where a dead one (its
connection reset) fails at once.

State: the recent decode round trips (bounded), the slowest chunk and the
prefill rate. No clock: callers pass durations.
"""
from __future__ import annotations

from collections import deque

# Admission, KV reservation and the SessionAccepted reply: no compute.
OPEN_DEADLINE_S = 15.0
# A link's first prefill chunk, before anything was measured on it: the old
# fixed bound, generous for a 128-token chunk of a big model on a slow CPU.
FIRST_CHUNK_DEADLINE_S = 120.0
# Measured steps are multiplied by this much headroom: a loaded machine (a
# shared 2-core box) may run a step several times slower than the last ones.
FACTOR = 10.0
# Never cut a decode step sooner than this: a garbage-collection pause or a
# scheduling stall of a second must not look like a dead peer.
DECODE_FLOOR_S = 2.0
# Same for a prefill chunk once the link's prefill rate is known.
PREFILL_FLOOR_S = 10.0
# Decode round trips remembered per link (their maximum sets the deadline).
RECENT = 16
# Patience never grows past this (a peer cut this often is treated as failed anyway).
MAX_PATIENCE = 16.0


class StepDeadlines:
    """What one hop link measured, and the deadline of its next step."""

    __slots__ = ("patience", "_decode", "_slowest_chunk", "_prefill_tokens", "_prefill_s")

    def __init__(self, patience: float = 1.0) -> None:
        self.patience = min(MAX_PATIENCE, max(1.0, patience))
        self._decode: deque[float] = deque(maxlen=RECENT)
        self._slowest_chunk = 0.0
        self._prefill_tokens = 0
        self._prefill_s = 0.0

    # -- measurements ------------------------------------------------------------------
    def chunk_done(self, tokens: int, seconds: float) -> None:
        self._slowest_chunk = max(self._slowest_chunk, seconds)
        self._prefill_tokens += tokens
        self._prefill_s += seconds

    def decode_done(self, seconds: float) -> None:
        self._decode.append(seconds)

    # -- deadlines ---------------------------------------------------------------------
    def open_s(self) -> float:
        return OPEN_DEADLINE_S * self.patience

    def chunk_s(self, tokens: int) -> float:
        if self._prefill_tokens == 0 or self._prefill_s <= 0.0:
            return FIRST_CHUNK_DEADLINE_S * self.patience
        per_token = self._prefill_s / self._prefill_tokens
        return max(PREFILL_FLOOR_S, FACTOR * tokens * per_token) * self.patience

    def decode_s(self) -> float:
        if self._decode:
            slowest = max(self._decode)
        elif self._slowest_chunk > 0.0:
            slowest = self._slowest_chunk
        else:
            return FIRST_CHUNK_DEADLINE_S * self.patience   # a link that never ran anything
        return max(DECODE_FLOOR_S, FACTOR * slowest) * self.patience
