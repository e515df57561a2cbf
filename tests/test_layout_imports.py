"""Dependencies point down: every module's imports (ast, including imports inside
functions) are checked against the layer rules of docs/architecture.md.

Top-level folders: ``proto`` <- ``shard`` <- ``native``; ``proto`` <- ``dht`` <-
``relay``; ``meshd`` on top of all. Inside ``meshd/`` the rooms form layers, top
first; a room imports only rooms below it (or itself):

    cli                      the entry point and one module per command
    benchmarks               ``meshd bench``, local-swarm and relay harnesses
    daemon                   node composition root, control socket, supervisor, relay mode
    api                      OpenAI-compatible HTTP, metrics, dashboard (the daemon serves it)
    swarm                    tracker duty, swarm view, join/directive wire
    generate | fetch         the route driver, hop links, routes, tokenizer | weights from peers
    plan | reach             pure planners | reachability, relays, TLS (not each other)
    config, errors, sizes    the ground floor

``meshd.testing`` (seeded random models, worker subprocesses) is imported only
by tests and benchmarks; ``meshd.benchmarks`` only by itself (``meshd bench NAME``
loads a benchmark by name; the product imports nothing from it).

Inside ``shard/`` and ``proto/`` the sub-rooms have floors too, top first; a
folder's flat modules (and its ``__init__``) are its ground floor:

    shard:  edges > push > session | experts > model > errors.py, __init__
    proto:  moe | golden (committed golden frames) > the codec's flat modules
    dht:    the flat records/Kademlia modules (records, keys, validator, node, ...)
            > host (building and running a node's libp2p host, which relay/ builds on too)
            > compat (every py-libp2p patch, behind one version gate) > errors, identity, __init__

And the whole module graph of our folders (imports inside functions included;
``from pkg import mod`` is an edge to ``pkg.mod``, ``from pkg import name`` one
to ``pkg``'s ``__init__``) has no cycle. The sans-I/O stream core imports
nothing that starts a thread, and the daemon's side of the house loads no torch.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("proto", "shard", "native", "dht", "relay", "meshd")
ALLOWED_TOP = {
    "proto": {"proto"},
    "shard": {"proto", "shard"},
    "native": {"proto", "shard", "native"},
    "dht": {"proto", "dht"},
    "relay": {"proto", "dht", "relay"},
    "meshd": set(OURS),
}
GROUND = {"config", "errors", "sizes", "__init__"}
RANK = {"__main__": 9, "cli": 8, "benchmarks": 7, "daemon": 6, "api": 5, "swarm": 4, "generate": 3,
        "fetch": 3, "plan": 2, "reach": 2, "testing": 2}
TESTING_USERS = {"benchmarks", "testing"}
BENCH_USERS = {"benchmarks"}
# Floors of the sub-rooms of a top-level folder (flat modules: 0). Rooms on one floor do not
# import each other.
SUB_RANK = {
    "shard": {"model": 1, "session": 2, "experts": 2, "push": 3, "edges": 4},
    "proto": {"moe": 1, "golden": 1},
    "dht": {"compat": 1, "host": 2, "kademlia": 4},
}
# Floors of a folder's flat modules where they are not all its ground floor: dht's records and
# lookup code sit above its host and compat rooms; only its errors and identity are ground. The
# sans-I/O Kademlia core (dht/kademlia/) sits on them, and the edge that runs it over libp2p
# (node, its RPC client, the library's validator and value store around the core's rules) on it.
FLAT_RANK = {"dht": (3, {"errors": 0, "identity": 0, "__init__": 0, "node": 5, "rpc": 5, "validator": 5})}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _rank(room: str) -> int:
    return 0 if room in GROUND else RANK[room]


def _sub_room(module: str, root: Path) -> tuple[str, int] | str:
    """(room, floor) of a module of a folder with floors: a sub-room, or for a flat module
    ("(flat)" rooms) its floor from FLAT_RANK (default: the ground floor, 0). A sub-room missing
    from SUB_RANK is returned as its name alone (a problem to report)."""
    top, _, rest = module.partition(".")
    name = rest.split(".")[0] if rest else "__init__"
    if rest and (root / top / name).is_dir():
        ranks = SUB_RANK[top]
        return (name, ranks[name]) if name in ranks else name
    default, flat = FLAT_RANK.get(top, (0, {}))
    floor = flat.get(name, default)
    return (f"(flat {floor})", floor)


def _sub_violation(module: str, target: str, root: Path) -> str | None:
    top = module.split(".")[0]
    src, dst = _sub_room(module, root), _sub_room(target, root)
    for room in (src, dst):
        if isinstance(room, str):
            return f"room {top}/{room} has no floor in SUB_RANK"
    assert not isinstance(src, str) and not isinstance(dst, str)
    if src[0] == dst[0] or dst[1] < src[1]:
        return None
    name = src[0] if not src[0].startswith("(flat") else module.partition(".")[2] or "__init__"
    return f"{top}/{name} may not import {target} (same or higher floor)"


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            # "from meshd import testing" names a module too
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                    if (root / node.module.replace(".", "/") / a.name).is_dir()
                    or (root / node.module.replace(".", "/") / f"{a.name}.py").is_file()]
        elif isinstance(node, ast.ImportFrom) and node.level:
            out.append((node.lineno, "<relative>"))
    return out


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for top in OURS:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            module = ".".join(rel.with_suffix("").parts)
            for line, target in _imports(path, root):
                where = f"{rel}:{line} imports {target}"
                if target == "<relative>":
                    found.append(f"{where}: use absolute imports")
                    continue
                head = target.split(".")[0]
                if head not in OURS:
                    continue
                if head not in ALLOWED_TOP[top]:
                    found.append(f"{where}: {top}/ may import only {sorted(ALLOWED_TOP[top])}")
                    continue
                if top == "meshd" and head == "meshd":
                    src, dst = _room(module), _room(target)
                    if dst == "testing" and src not in TESTING_USERS:
                        found.append(f"{where}: only tests and benchmarks import meshd.testing")
                    elif dst == "benchmarks" and src not in BENCH_USERS:
                        found.append(f"{where}: meshd.benchmarks is `meshd bench NAME` only; the product "
                                     "imports nothing from it")
                    elif src != dst and _rank(dst) >= _rank(src) and dst not in GROUND:
                        found.append(f"{where}: room {src} may not import room {dst} (same or higher layer)")
                if top == head and top in SUB_RANK:
                    problem = _sub_violation(module, target, root)
                    if problem:
                        found.append(f"{where}: {problem}")
    return found


# -- the module graph: cycles, and what the stream core pulls in -----------------------------
def _module_files(root: Path) -> dict[str, Path]:
    files = {}
    for top in OURS:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _resolve(name: str, files: dict[str, Path]) -> str | None:
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name or None


def module_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, Path]]:
    """Our modules and, for each, the modules it imports (anywhere in the file).

    ``import a.b`` and ``from a import b`` (b a module) are edges to ``a.b``; ``from a import
    name`` is an edge to ``a`` (its ``__init__`` defines the name). The parent packages a
    submodule import also runs are not edges: every package would otherwise be in a cycle
    with the modules its ``__init__`` re-exports."""
    files = _module_files(root)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                         for a in node.names]
            else:
                continue
            for name in names:
                target = _resolve(name, files) if name.split(".")[0] in OURS else None
                if target is not None and target != module:
                    graph[module].add(target)
    return graph, files


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


# Calls that start a thread (or a pool of them).
THREAD_STARTERS = {"Thread", "Timer", "ThreadPoolExecutor", "start_new_thread"}
# Every thread of the product starts through this module's ThreadGroup: importing it counts.
THREAD_GROUPS = "proto.threads"


def starts_threads(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == THREAD_GROUPS:
            return True
        if isinstance(node, ast.Import) and any(a.name == THREAD_GROUPS for a in node.names):
            return True
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in THREAD_STARTERS:
                return True
    return False


def pulled_in(module: str, graph: dict[str, set[str]], files: dict[str, Path]) -> set[str]:
    """What importing ``module`` runs of ours: its imports, transitively, and their packages."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        parents = [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in files]
        todo += [*graph[name], *parents]
    return seen


def test_every_top_level_folder_and_room_imports_only_downwards():
    assert violations() == []


def test_nothing_below_meshd_imports_meshd():
    bad = [v for v in violations() if not v.startswith("meshd")]
    assert bad == []


def test_the_checker_sees_upward_imports(tmp_path):
    # the rules are live: a small fake tree with one upward import of each kind is reported
    for rel, src in {
        "shard/a.py": "import meshd.config\n",
        "dht/b.py": "from relay import hop\n",
        "dht/compat/c.py": "from dht import node\n",
        "dht/host/h.py": "from dht.records import CapabilityRecord\nfrom dht.compat import c\nimport dht.identity\n",
        "dht/node.py": "from dht.host import h\nfrom dht.compat import c\n",
        "meshd/plan/c.py": "from meshd.generate import driver\n",
        "meshd/daemon/d.py": "from meshd import testing\n",
        "meshd/testing/__init__.py": "",
        "meshd/generate/driver.py": "from meshd.plan import c\nimport proto\n",
        "relay/hop.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    found = violations(tmp_path)
    assert {v.split(":")[0] for v in found} == {"shard/a.py", "dht/b.py", "meshd/plan/c.py", "meshd/daemon/d.py",
                                              "dht/compat/c.py", "dht/host/h.py"}, found
    assert [v for v in found if v.startswith("dht/host/h.py")] == [
        "dht/host/h.py:1 imports dht.records: dht/host may not import dht.records (same or higher floor)"], found


def test_the_sub_room_and_bench_rules_are_live(tmp_path):
    # a fake tree with one violation of each rule inside the folders, next to allowed imports
    for rel, src in {
        "shard/errors.py": "",
        "shard/model/backend.py": "from shard.push import hub\n",            # model imports push: up
        "shard/session/stream.py": "from shard.model import backend\nimport shard.errors\n",   # fine
        "shard/experts/spec.py": "from shard.session import stream\n",       # same floor, other room
        "shard/push/hub.py": "from shard.session import stream\n",           # fine
        "shard/edges/server.py": "from shard.push import hub\nfrom shard.experts import spec\n",  # fine
        "shard/stray/x.py": "import shard.errors\n",                          # a room with no floor
        "shard/y.py": "from shard.model import backend\n",                   # ground imports a room
        "proto/wire.py": "def f():\n    from proto.moe import link\n",     # ground imports a room
        "proto/moe/link.py": "from proto import wire\n",                      # fine
        "meshd/cli/demo.py": "from meshd.benchmarks import harness\n",       # the product uses a bench
        "meshd/benchmarks/harness.py": "from meshd.benchmarks import other\n",  # fine
        "meshd/benchmarks/other.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    found = violations(tmp_path)
    assert {v.split(":")[0] for v in found} == {"shard/model/backend.py", "shard/experts/spec.py",
                                                 "shard/stray/x.py", "shard/y.py", "proto/wire.py",
                                                 "meshd/cli/demo.py"}, found


def test_the_module_graph_has_no_cycle():
    graph, _ = module_graph()
    assert cycles(graph) == []


def test_the_cycle_check_sees_cycles(tmp_path):
    # a cycle through an import inside a function, and one through a package's __init__
    for rel, src in {
        "proto/a.py": "from proto import b\n",
        "proto/b.py": "def later():\n    import proto.a\n",
        "shard/x.py": "from proto import a\n",
        "relay/__init__.py": "from relay.k import K\n",
        "relay/k.py": "from relay import m\nK = 1\n",
        "relay/m.py": "from relay import K\n",                 # a name of the package: its __init__
        "dht/__init__.py": "from dht.p import P\n",
        "dht/p.py": "from dht import q\nP = 1\n",             # a submodule: no edge to dht itself
        "dht/q.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    graph, _ = module_graph(tmp_path)
    assert sorted(cycles(graph)) == [["proto.a", "proto.b"], ["relay", "relay.k", "relay.m"]]


def test_the_stream_core_imports_nothing_that_starts_threads():
    graph, files = module_graph()
    reached = pulled_in("shard.session.stream", graph, files)
    assert "shard.push.hub" not in reached and "shard.push.successor" not in reached
    assert sorted(m for m in reached if starts_threads(files[m])) == []
    assert starts_threads(files["shard.push.successor"]) and starts_threads(files["shard.edges.grpc_server"])


def test_the_daemon_side_loads_no_torch():
    # the rooms' __init__ re-export only torch-free pieces: the daemon, which plans and routes but
    # never loads weights, imports shard.model, shard.session, shard.experts and shard.edges
    probe = ("import sys, meshd.cli, meshd.daemon.node, meshd.generate.service, meshd.plan.experts, "
             "shard.model, shard.session, shard.experts, shard.edges, shard.push; "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_repo_root_constants_point_at_the_checkout():
    # children get PYTHONPATH=REPO_ROOT: after a module moves, its REPO_ROOT must still be the checkout
    from meshd.benchmarks import recipes, relay_harness
    from meshd.daemon import local_swarm, worker_process
    from meshd.testing import procs

    for module in (local_swarm, recipes, relay_harness, worker_process, procs):
        assert module.REPO_ROOT == ROOT, module.__name__
