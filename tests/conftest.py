"""Shared pytest fixtures and helpers for meshd.

- ``wait_until(predicate, timeout_s, what)``: the one way a test waits for a condition
  another task, thread or process makes true. It polls the condition (it is not a
  sleep), on trio's clock (so under ``MockClock`` the timeout is virtual time), and a
  timeout fails the test naming what it waited for. ``wait_until_blocking`` is the same
  loop for tests that run no trio loop of their own (subprocess tests).
- ``model``: the seeded tiny Llama artifact (meshd/testing/models.py) the driver, shard and
  swarm tests run on; a module that was written against another seed says ``MODEL_SEED = n``.
"""
from __future__ import annotations

import inspect
import os
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from shard.model.digests import CACHE_ENV

# The artifact digest cache (shard/model/digests.py) of a test run is its own: the many
# throwaway artifacts tests build must not push a user's real entries out of
# ~/.cache/meshd/digests. Set here, at collection, so every child process a test
# starts (workers, daemons) inherits it.
if CACHE_ENV not in os.environ:
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="meshd-test-digests-")

# The longest any test may wait for one condition: a swarm of several daemons converging
# in the slow suite on a loaded 2-core CI machine. pytest's own per-test timeout (600 s)
# stays above it, so a wait fails with its own message, never with pytest's.
MAX_WAIT_S = 300.0
# Between two looks at the condition: short against every timeout here, long enough that
# polling a status socket or a routing table costs nothing measurable.
POLL_S = 0.02

Predicate = Callable[[], Any] | Callable[[], Awaitable[Any]]


async def wait_until(predicate: Predicate, timeout_s: float, what: str, *, poll_s: float = POLL_S) -> Any:
    """Poll ``predicate`` (plain or async) until it returns something truthy; return that.

    After ``timeout_s`` seconds of trio's clock the test fails with "timed out after T s
    waiting for WHAT". An exception from the predicate (e.g. ``pytest.fail`` when a
    process it watches died) ends the wait at once."""
    if not 0 < timeout_s <= MAX_WAIT_S:
        raise ValueError(f"wait_until timeout must be in (0, {MAX_WAIT_S}] s, got {timeout_s}")
    with trio.move_on_after(timeout_s):
        while True:
            got = predicate()
            if inspect.isawaitable(got):
                got = await got
            if got:
                return got
            await trio.sleep(poll_s)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


def wait_until_blocking(predicate: Callable[[], Any], timeout_s: float, what: str, *, poll_s: float = POLL_S) -> Any:
    """``wait_until`` for code outside any trio loop: the same loop, run in a loop of its own."""
    return trio.run(lambda: wait_until(predicate, timeout_s, what, poll_s=poll_s))


# The seed most tests were written against (their reference tokens come from the same model).
DEFAULT_MODEL_SEED = 3


def seeded_model(seed: int = DEFAULT_MODEL_SEED) -> Path:
    """The tiny seeded random Llama artifact (built once per seed, then cached on disk).

    One torch thread: the whole-model reference and the in-process shards compute like the
    single-threaded workers beside them, on this machine's two shared cores. Helpers outside
    a fixture's reach (tests/_swarm_helpers.py) call this; tests take the ``model`` fixture."""
    import torch

    from meshd.testing.models import build_random_llama

    torch.set_num_threads(1)
    return build_random_llama(seed=seed)


@pytest.fixture(scope="module")
def model(request: pytest.FixtureRequest) -> Path:
    """``seeded_model`` at the module's ``MODEL_SEED`` (DEFAULT_MODEL_SEED when it names none)."""
    return seeded_model(getattr(request.module, "MODEL_SEED", DEFAULT_MODEL_SEED))
