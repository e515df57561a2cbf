"""Free KV in our capability record: republished when it moves, never more often than allowed.

The worker admits sessions against its KV budget (shard/session/sessions.py); routes
avoid a peer whose record says it has less free KV than a generation needs
(meshd/plan/routing.py). So the record's ``free_kv_tokens`` must follow the
worker: the node polls its own worker's Health every POLL_S (loopback, a few
ms) and feeds ``FreeKvGate``, which says when to republish.

Rules (sans-I/O; the caller passes the time):
* publish when free KV moved by more than MOVE_FRACTION of the budget since
  the last value published (a 2,048-token session in a 4,096-token budget is
  a 50% move; single tokens of decode never are: reservations move, not
  cached tokens);
* never twice within MIN_INTERVAL_S (a DHT put costs every replica a store);
  a move held back is published once the interval has passed, if it still holds.
State: the last value published and when.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FreeKvGate", "MOVE_FRACTION", "MIN_INTERVAL_S", "POLL_S"]

# "Moves by more than 10%": of the worker's KV budget.
MOVE_FRACTION = 0.10
# At most one republish for free KV per 2 s: bursts of opens coalesce.
MIN_INTERVAL_S = 2.0
# How often the node asks its worker (loopback Health: a few ms; the worker's
# lock makes it wait at most for one forward).
POLL_S = 1.0


@dataclass
class FreeKvGate:
    published: int | None = None
    published_at: float = float("-inf")

    def offer(self, free: int, budget: int, now: float) -> bool:
        """True when ``free`` should be published now (the caller then publishes it)."""
        if budget <= 0:
            return False
        free = max(0, min(free, budget))
        if self.published is not None and abs(free - self.published) <= MOVE_FRACTION * budget:
            return False
        if now - self.published_at < MIN_INTERVAL_S:
            return False
        self.published, self.published_at = free, now
        return True

    def reset(self) -> None:
        """A new worker (or none): the next value is published as soon as it is known."""
        self.published, self.published_at = None, float("-inf")
