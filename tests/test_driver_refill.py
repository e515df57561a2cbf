"""A coverage gap mid-generation: the route driver waits for a refill (bounded), then re-prefills.

Shards of the tiny random Llama (6 layers) in memory (real ShardServices,
in-memory transports): A [0,2), B [2,4), C [4,6), and R [2,4), the refill,
running but not advertised at first. B is killed mid-decode: layers 2..3 then have no live server. The
route source's ads (an ``AdsRouteSource`` over a list, no DHT) include R
only once the driver has asked for them REFILL_AFTER_READS more times after
the kill -- the swarm refilling the gap "later", counted in the driver's own
re-reads instead of a clock. Star and push: the driver waits, then re-plans
A -> R -> C and re-prefills R (and, pushed, re-points A at it); the tokens
equal the whole model's. Without a refill it raises CoverageGap (a
RouteFailed naming the layers and the wait) once its bound passes, with
every hop's KV released; a cancel during the wait ends it at once.
Config: ``refill_wait_s`` (TOML, ``--refill-wait``), default TTL + 60 s.
"""
from __future__ import annotations

import threading

import pytest

from meshd.errors import ConfigError
from meshd.generate.driver import CoverageGap, GenerationCancelled, RouteFailed
from meshd.plan.adverts import Span
from tests._swarm_helpers import PROMPT, MemorySwarm, decode_input_of, whole_tokens
from tests._swarm_helpers import request as make_request

NEW_TOKENS = 20
KILL_AT = 6                   # tokens received before B dies
REFILL_AFTER_READS = 3        # the refill appears on the driver's 3rd read of the ads after the kill


@pytest.fixture(scope="module")
def reference():
    return whole_tokens(NEW_TOKENS)


@pytest.fixture
def shards():
    swarm = MemorySwarm()
    for peer, start, end in (("peer-a", 0, 2), ("peer-b", 2, 4), ("peer-c", 4, 6), ("peer-r", 2, 4)):
        swarm.start(peer, start, end)
    return swarm


class Swarm:
    """The ads as the swarm shows them: B until it is killed, R after ``refill_after`` reads past that."""

    def __init__(self, shards, refill_after: int | None, on_read=None) -> None:
        self.shards, self.refill_after, self.on_read = shards, refill_after, on_read
        self.killed = False
        self.reads_after_kill = 0
        self.lock = threading.Lock()

    def kill_b_after(self, tokens: int) -> None:
        """B dies as the step carrying token number ``tokens`` reaches it (a pushed route has that step
        in flight when the entry sees the token: the transport places the death exactly)."""
        reached = decode_input_of(tokens)

        def dies(body: bytes) -> bool:
            if not reached(body):
                return False
            with self.lock:
                self.killed = True
            return True
        self.shards["peer-b"].hop.kill_on(dies)

    def ads(self):
        with self.lock:
            if self.killed:
                self.reads_after_kill += 1
            reads = self.reads_after_kill
        if self.on_read is not None and self.killed:
            self.on_read(reads)
        live = ["peer-a", "peer-c"] + ([] if self.killed else ["peer-b"])
        if self.refill_after is not None and self.killed and reads >= self.refill_after:
            live.append("peer-r")
        return self.shards.ads(live)


def driver_for(shards: MemorySwarm, swarm: Swarm, topology: str, wait_s: float):
    return shards.driver(topology, source=shards.source(swarm.ads), replan_wait_s=wait_s)


def request():
    return make_request(NEW_TOKENS)


@pytest.mark.parametrize("topology", ["star", "push"])
def test_a_gap_refilled_later_is_waited_for_and_the_tokens_stay_exact(shards, reference, topology):
    swarm = Swarm(shards, refill_after=REFILL_AFTER_READS)
    driver = driver_for(shards, swarm, topology, wait_s=60.0)
    swarm.kill_b_after(KILL_AT)
    tokens = [token.id for token in driver.generate(request())]
    assert tokens == reference
    assert swarm.reads_after_kill >= REFILL_AFTER_READS        # it waited, re-reading the view
    (event,) = driver.stats.failovers
    # Pushed, the entry may notice B's death before or after it takes the token B's step carried
    # (two threads of the in-memory transport): the failover is at that step or the one before,
    # and either way the tokens are exact (above).
    assert event.failed_peer == "peer-b"
    assert event.position in ((len(PROMPT) + KILL_AT,) if topology == "star" else
                              (len(PROMPT) + KILL_AT - 1, len(PROMPT) + KILL_AT))
    assert driver.stats.routes[-1].peers == ("peer-a", "peer-r", "peer-c")
    assert 1 in event.reprefilled                              # the refill was re-prefilled from the history
    assert shards.idle("peer-a", "peer-c", "peer-r")


@pytest.mark.parametrize("topology", ["star", "push"])
def test_a_gap_never_refilled_is_a_coverage_gap_after_the_bound(shards, topology):
    swarm = Swarm(shards, refill_after=None)
    wait_s = 1.0
    driver = driver_for(shards, swarm, topology, wait_s=wait_s)
    swarm.kill_b_after(KILL_AT)
    gen = driver.generate(request())
    taken = []
    with pytest.raises(CoverageGap) as info:
        for token in gen:
            taken.append(token)
    # Pushed, the entry may notice B's death before or after it takes the token B's step carried
    # (two threads of the in-memory transport): the gap is raised after that token or the one before.
    assert len(taken) in ((KILL_AT,) if topology == "star" else (KILL_AT - 1, KILL_AT))
    gap = info.value
    assert isinstance(gap, RouteFailed)                         # the API's 503, the control socket's error
    assert gap.spans == (Span(2, 4),) and gap.waited_s >= wait_s
    assert "2..3" in str(gap) and "waited" in str(gap) and "peer-b" in str(gap)
    assert swarm.reads_after_kill >= 2                          # it did re-read while waiting
    assert shards.idle("peer-a", "peer-c")


def test_a_cancel_during_the_refill_wait_ends_it_at_once(shards):
    driver_box = []
    swarm = Swarm(shards, refill_after=None, on_read=lambda reads: reads == 2 and driver_box[0].cancel())
    driver = driver_for(shards, swarm, "push", wait_s=600.0)   # far longer than the test may take
    driver_box.append(driver)
    swarm.kill_b_after(KILL_AT)
    gen = driver.generate(request())
    for _ in range(KILL_AT):
        next(gen)
    with pytest.raises(GenerationCancelled):
        list(gen)
    assert swarm.reads_after_kill == 2                          # no read after the cancel
    assert shards.idle("peer-a", "peer-c")


def test_refill_wait_config(tmp_path):
    from meshd.config import REFILL_SLACK_S, DaemonConfig, load_config

    assert DaemonConfig().refill_wait == DaemonConfig().record_ttl_s + REFILL_SLACK_S
    assert DaemonConfig(record_ttl_s=10).refill_wait == 10 + REFILL_SLACK_S
    assert DaemonConfig(refill_wait_s=0).refill_wait == 0.0
    path = tmp_path / "c.toml"
    path.write_text("refill_wait_s = 45\n")
    assert load_config(path).refill_wait == 45.0
    assert load_config(path, {"refill_wait_s": 7.5}).refill_wait == 7.5    # --refill-wait wins
    for bad in (-1, 4000, "soon", True):
        with pytest.raises(ConfigError, match="refill_wait_s"):
            DaemonConfig(refill_wait_s=bad)


def test_join_parses_the_refill_wait_flag():
    import argparse

    from meshd.cli.join import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--refill-wait", "90"]).refill_wait_s == 90.0
    assert parser.parse_args([]).refill_wait_s is None
