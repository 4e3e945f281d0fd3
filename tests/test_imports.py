"""The shape of the Python code: the flag table imports nothing of the server, and no module imports another
that imports it back (at the top or inside a function: either makes a change in one ripple into the other)."""

from __future__ import annotations

import ast
import subprocess
import sys

from conftest import ROOT, child_env

PACKAGES = {"psd": "psd", "psd.learner": "learner", "psd.watchdog": "watchdog"}


def _modules() -> dict[str, ast.Module]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = [p for p in f.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = ast.parse(f.read_text(), str(f))
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the psd modules it imports anywhere in its text."""
    mods = _modules()
    graph = {}
    for name, tree in mods.items():
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    deps.add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert {"psd.server", "psd.flags", "psd.nodelink", "psd.learner.client"} <= set(graph)  # the walk saw them
    assert circles(graph) == []
    # The detector itself finds a circle when there is one.
    assert circles({**graph, "psd.choices": graph["psd.choices"] | {"psd.flags"}}) == [["psd.choices", "psd.flags"]]


def test_the_flag_table_imports_nothing_of_the_server():
    r = subprocess.run([sys.executable, "-c", "import sys, psd.flags; print(sorted(m for m in sys.modules "
                        "if m.startswith('psd')))"], capture_output=True, text=True, env=child_env(), check=True)
    assert ast.literal_eval(r.stdout) == ["psd", "psd._version", "psd.choices", "psd.errors", "psd.flags"]
