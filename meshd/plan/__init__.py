"""Pure planners: records in, decisions out (no I/O, injected clocks).

    adverts.py     shard adverts and the coverage map
    assignment.py  coverage-first range assignment sized to declared memory (one node)
    layout.py      the pool's layout: the fewest safe moves that cover, the shortfall when none does
    routing.py     Dijkstra over (peer, layer): the cheapest route, replacements
    tracker.py     consensus-free tracker ranking
    directives.py  LOAD/DROP directives: build (tracker) and accept (node)
    footprint.py   a model's per-layer memory, read from its headers
    modelinfo.py   cheap facts about a model file read before the worker starts
    experts.py     MoE: expert specs <-> record runs, usable placements, coverage, experts from memory
    errors.py      the planners' error tree
"""
