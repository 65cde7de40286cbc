"""The package's import graph: the engine and the KV code stand alone, the cost models sit
below everything that uses them, nothing imports the worker process, and no new import cycle
appears (the one listed below is known and being taken apart)."""

from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pdserve")

# engine/, kv/ and kvstore/ run inside a worker and under the offline API: they must not
# reach up into the server, the router, the simulator, the benchmark client or the planner
LOWER = ("pdserve.engine", "pdserve.kv", "pdserve.kvstore")
UPPER = (
    "pdserve.server",
    "pdserve.worker",
    "pdserve.router",
    "pdserve.sim",
    "pdserve.bench",
    "pdserve.planner",
    "pdserve.testing",
)

# the cost models (pdserve/costmodel.py) are shared by the router, the worker, the simulator
# and the planner: they import none of them
COSTMODEL = "pdserve.costmodel"

# the worker process is started (`pdserve worker`), never imported: the router reaches it over
# HTTP and the KV bridge, the launchers by its command line
WORKER = "pdserve.worker"

# File-level cycles that exist today (counting imports inside functions and for type checking
# too). Shrink this list; never grow it.
KNOWN_CYCLES = [
    # plan.py runs the steps, which take its PlanInputs (a type-checking import)
    {"pdserve.planner.plan", "pdserve.planner.steps", "pdserve.planner.steps_speed"},
]


def _modules() -> dict[str, str]:
    mods = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path[:-3], os.path.dirname(ROOT)).replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = path
    return mods


def _imports(path: str, mods: dict[str, str]) -> set[str]:
    """Every pdserve module `path` imports, at the top or in a function. `from P import N`
    needs the module P.N when there is one (as `import P.N` does), else P itself."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdserve"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in mods else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("pdserve"))
    return {m for m in out if m in mods}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, mods) - {m} for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_engine_and_kv_import_nothing_above_them():
    bad = {m: sorted(d for d in deps if d.startswith(UPPER)) for m, deps in _graph().items() if m.startswith(LOWER)}
    assert not {m: d for m, d in bad.items() if d}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_cost_models_import_no_package_that_uses_them():
    assert not {d for d in _graph()[COSTMODEL] if d.startswith(UPPER)}


def test_nothing_imports_the_worker_process():
    bad = {m: sorted(d for d in deps if _in(d, WORKER)) for m, deps in _graph().items() if not _in(m, WORKER)}
    assert not {m: d for m, d in bad.items() if d}


def test_no_new_import_cycles():
    found = _cycles(_graph())
    new = [c for c in found if c not in KNOWN_CYCLES]
    assert not new, f"new import cycles: {new}"
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"cycles taken apart: remove them from KNOWN_CYCLES: {gone}"
