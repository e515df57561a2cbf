"""``meshd bench churn``'s pure parts on synthetic swarm views (the benchmark itself runs real daemons:
meshd/benchmarks/churn.py; the tracker's side of it runs on a fake clock in tests/test_tracker_sim.py)."""
from __future__ import annotations

import pytest

from meshd.benchmarks.churn import ChurnSetupError, choose_victims, healed, movers


def ad(peer: str, start: int, end: int) -> dict:
    return {"peer_id": peer, "start": start, "end": end, "num_layers": 6}


# The twelve-node layout of the old churn test: three servers of 0:2 (entry e, tracker side), 2:4 has
# four, 4:6 has five; the entry's route goes e -> m1 -> t1.
TWELVE = [ad("e", 0, 2), ad("h1", 0, 2), ad("h2", 0, 2),
          ad("m1", 2, 4), ad("m2", 2, 4), ad("m3", 2, 4), ad("m4", 2, 4),
          ad("t1", 4, 6), ad("t2", 4, 6), ad("t3", 4, 6), ad("t4", 4, 6), ad("t5", 4, 6)]


def test_four_victims_empty_the_least_served_span_the_entry_does_not_serve():
    victims, gap = choose_victims(TWELVE, "e", ["e", "m1", "t1"], 4)
    assert gap == (2, 4) and sorted(victims) == ["m1", "m2", "m3", "m4"]


def test_the_rest_are_redundant_peers_on_the_route_first_and_every_other_layer_keeps_two():
    layout = [ad("e", 0, 2), ad("h1", 0, 2), ad("m1", 2, 4), ad("m2", 2, 4),
              ad("t1", 4, 6), ad("t2", 4, 6), ad("t3", 4, 6), ad("t4", 4, 6)]
    victims, gap = choose_victims(layout, "e", ["e", "m1", "t3"], 4)
    assert gap == (2, 4)
    assert victims[:2] == ["m1", "m2"] and victims[2] == "t3"        # the route's peer first
    assert len(victims) == 4 and victims[3] in {"t1", "t2", "t4"}
    left = [a for a in layout if a["peer_id"] not in victims]
    assert sum(1 for a in left if a["start"] == 4) == 2              # 4:6 keeps two servers


def test_the_gap_is_every_layer_only_the_victims_serve():
    wide = [ad("e", 0, 2), ad("h1", 0, 2), ad("m1", 2, 5), ad("m2", 2, 5), ad("t1", 5, 6), ad("t2", 5, 6)]
    victims, gap = choose_victims(wide, "e", ["e", "m1", "t1"], 2)
    assert sorted(victims) == ["m1", "m2"] and gap == (2, 5)
    layout = [ad("e", 0, 2), ad("h1", 0, 3), ad("m1", 2, 5), ad("m2", 3, 5), ad("t1", 5, 6), ad("t2", 4, 6)]
    victims, gap = choose_victims(layout, "e", ["e", "m1", "t1"], 2)
    assert sorted(victims) == ["m1", "m2"] and gap == (3, 4)          # t2 still serves layer 4


def test_layer_zero_servers_and_the_entry_are_never_victims():
    layout = [ad("e", 0, 6), ad("h1", 0, 6), ad("x", 2, 4)]
    with pytest.raises(ChurnSetupError, match="no layer span"):
        choose_victims(layout, "e", ["e"], 2)                       # every layer is served by e or h1


def test_too_few_redundant_peers_is_a_clear_error():
    layout = [ad("e", 0, 2), ad("h1", 0, 2), ad("m1", 2, 4), ad("m2", 2, 4), ad("t1", 4, 6), ad("t2", 4, 6)]
    with pytest.raises(ChurnSetupError, match="only 2 of 3"):
        choose_victims(layout, "e", ["e", "m1", "t1"], 3)            # 4:6 would lose a second span


def test_movers_are_survivors_whose_new_range_meets_the_gap():
    before = [ad("e", 0, 2), ad("h1", 0, 2), ad("m1", 2, 4), ad("t1", 4, 6), ad("t2", 4, 6)]
    after = [ad("e", 0, 2), ad("h1", 0, 2), ad("t1", 4, 6), ad("t2", 2, 4), ad("new", 2, 4)]
    assert movers(before, after, (2, 4)) == [{"peer_id": "t2", "from": [4, 6], "to": [2, 4]}]
    assert movers(before, before, (2, 4)) == []


def test_healed_means_fully_covered_without_a_victim():
    view = {"coverage": {"fully_covered": True}, "ads": [ad("e", 0, 6)]}
    assert healed(view, ["m1"])
    assert not healed({**view, "ads": [ad("e", 0, 6), ad("m1", 2, 4)]}, ["m1"])   # a dead record still listed
    assert not healed({**view, "coverage": {"fully_covered": False}}, ["m1"])
    assert not healed({**view, "coverage": None}, ["m1"]) and not healed(None, ["m1"])
