"""The rooms of the code and their order: a module imports only from its own room or a room
below it, two rooms on one level do not import each other, and no files import each other in a
circle. Every import counts, at the top of a file or inside a function; `if TYPE_CHECKING:`
imports do not (they never run)."""
from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("pdtb", "prefill_node", "decode_node", "kv_transport", "fairness")

# Bottom first. A module belongs to the room of its longest matching prefix.
LEVELS = (
    ("pdtb.common", "pdtb.aio", "pdtb.security", "pdtb.cputime"),  # helpers every room may use
    ("pdtb.shapes",),  # accelerators and model shapes
    ("pdtb.engine",),  # the paged engine over a stock transformers model
    ("fairness",),  # policies behind the scheduler's questions
    ("kv_transport",),  # moving KV pages between processes
    ("pdtb.nodes",),  # what every node process shares: protocol, control loop, hand-off states
    ("pdtb.colocated",),  # the colocated node (the prefill node builds on it)
    ("prefill_node", "decode_node"),  # the disaggregated roles
    ("pdtb.generate",),  # offline generation, and the engine flags the nodes share
    ("pdtb.node_cli",),  # one node process of any role, as `pdtb prefill|decode|colocated` starts it
    ("pdtb.router",),  # the HTTP front door
    ("pdtb.policies",),  # a policy's conformance run on the real scheduler
    ("pdtb.integrations",),  # the project's policies inside another engine's scheduler (vLLM)
    ("pdtb.figures",),  # figures and documents from results files
    ("pdtb.client",),  # the load client
    ("pdtb.sim",),  # the simulator core
    ("pdtb.sim.repro",),  # paper reproductions and validation on the simulator
    ("pdtb.planner",),  # capacity planning: searches over simulated clusters
    ("pdtb.microbench",),  # micro-benchmarks of the rooms below
    ("pdtb.ray_cluster", "pdtb.local_cluster"),  # Ray placement of whole nodes; local clusters' supervision
    ("pdtb.chaos",),  # fault campaigns against a running cluster, and their checker
    ("pdtb.sim.cli", "pdtb.client.__main__", "pdtb.demo"),  # entry points, each above those it calls
    ("pdtb.cli", "pdtb"),
    ("pdtb.__main__",),
)
ROOM_LEVEL = {room: i for i, rooms in enumerate(LEVELS) for room in rooms}


def room_of(module: str) -> str | None:
    best = None
    for room in ROOM_LEVEL:
        if (module == room or module.startswith(room + ".")) and (best is None or len(room) > len(best)):
            best = room
    return best


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = f
    return out


def runtime_imports(tree: ast.AST, known: dict) -> set[str]:
    """Modules of ours that `tree` imports when it runs (a `from P import m` of a submodule m
    is an import of P.m; type-checking blocks are left out)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(known)
            out |= subs or {node.module}
    return {m for m in out if m.split(".")[0] in PACKAGES}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: {d for d in runtime_imports(ast.parse(f.read_text()), known) if d in known and d != m}
            for m, f in known.items()}


def test_every_module_has_a_room():
    assert [m for m in modules() if room_of(m) is None] == []


def test_no_room_imports_one_above_it_or_beside_it():
    bad = []
    for m, deps in graph().items():
        a = room_of(m)
        for d in deps:
            b = room_of(d)
            if a == b or b is None:
                continue
            if ROOM_LEVEL[b] >= ROOM_LEVEL[a]:
                bad.append(f"{m} ({a}) imports {d} ({b})")
    assert bad == [], "\n".join(sorted(bad))


def test_no_files_import_each_other_in_a_circle():
    g = graph()
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    assert circles == []


def test_the_checker_sees_an_upward_import_and_a_circle():
    assert room_of("pdtb.sim.repro.essay") == "pdtb.sim.repro" and room_of("pdtb.sim.cluster") == "pdtb.sim"
    assert ROOM_LEVEL[room_of("pdtb.engine.engine")] < ROOM_LEVEL[room_of("pdtb.sim.cluster")]
    known = {"pdtb.engine.x": None, "pdtb.sim.y": None}
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pdtb.router\n"
                     "def f():\n    from pdtb.sim import y\n")
    assert runtime_imports(tree, known) == {"pdtb.sim.y"}


def test_every_module_has_an_opening_docstring():
    from pdtb.figures.module_map import entries

    assert entries(ROOT)[1] == [], "the module map shows each module's docstring: give these one"


def test_the_module_map_is_generated():
    """The modules' lines of docs/architecture.md are what the modules' docstrings say."""
    from pdtb.figures.module_map import render, split

    _, text, _ = split((ROOT / "docs" / "architecture.md").read_text())
    stale = "docs/architecture.md's module map is out of date: run python -m pdtb.figures.module_map"
    assert text == render(ROOT), stale


def test_the_architecture_page_has_a_heading_per_part_and_short_lines():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    long = [i for i, line in enumerate(text.splitlines(), 1) if len(line) > 120]
    assert long == [], f"docs/architecture.md lines over 120 characters: {long}"
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert heads[:2] == ["## What each part owns", "## Module map"], heads


def test_the_module_map_lists_rooms_bottom_first():
    from pdtb.figures.module_map import ROOMS

    titled = [p for _, prefixes in ROOMS for p in prefixes if p in ROOM_LEVEL]
    assert set(ROOM_LEVEL) - set(titled) == set(), "give each room a title in pdtb/figures/module_map.py's ROOMS"
    levels = [ROOM_LEVEL[p] for p in titled]
    assert levels == sorted(levels)


def test_no_line_of_the_architecture_page_is_over_120_characters():
    lines = (ROOT / "docs" / "architecture.md").read_text().splitlines()
    assert [i for i, line in enumerate(lines, 1) if len(line) > 120] == []


def test_every_script_and_test_file_is_in_the_module_map():
    """docs/architecture.md's hand-written lists name every script and test file (an item may
    name siblings of its first file by their base names, and tests by a pattern)."""
    import fnmatch
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    named, patterns = set(), []
    # a list item goes on over the lines indented under it
    for item in re.sub(r"\n  +", " ", text).splitlines():
        if not item.startswith("- `") or "`:" not in item:
            continue
        tokens = re.findall(r"`([^`\s]+)`", item[:item.index("`:") + 1])
        base = tokens[0].rsplit("/", 1)[0] if "/" in tokens[0] else ""
        for t in tokens:
            full = t if "/" in t or not base else f"{base}/{t}"
            if "*" in full:
                patterns.append(full)
            else:
                named.add(full.rstrip("/"))
    missing = []
    for top in ("tests", "scripts"):
        for f in sorted((ROOT / top).rglob("*")):
            if f.suffix not in (".py", ".sh") or "__pycache__" in f.parts or f.name == "__init__.py":
                continue
            rel = str(f.relative_to(ROOT))
            if rel not in named and not any(fnmatch.fnmatch(rel, p) for p in patterns):
                missing.append(rel)
    assert missing == [], "not in docs/architecture.md's module map: " + ", ".join(missing)
