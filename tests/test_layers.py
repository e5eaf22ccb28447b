"""The package's layering: no module imports a higher layer, no import cycles, and every
module imports on its own (in a fresh interpreter, nothing imported before it).

Layers, lowest first (docs/architecture.md has the module table):
settings, logs, blas, kernels < model < runtime < actors < engine < api, router < tools, cli.
Every import counts, also one inside a function or under TYPE_CHECKING: a lazy import
is still an arrow between the modules.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

LAYERS = [
    ("slotserve.settings", "slotserve.logs", "slotserve.blas", "slotserve.kernels"),
    ("slotserve.model",),
    ("slotserve.runtime",),
    ("slotserve.actors",),
    ("slotserve.engine",),
    ("slotserve.api", "slotserve.router"),
    ("slotserve.tools", "slotserve.cli"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    name = ".".join(("slotserve", *parts))
    return name.removesuffix(".__init__")


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def layer_of(name: str) -> int:
    for level, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return level
    if name == "slotserve":
        return 0
    raise AssertionError(f"{name} belongs to no layer: add it to LAYERS and the docs' table")


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `path` imports (a `from pkg import mod` counts as pkg.mod)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` is an arrow to pkg.mod; `from mod import name` to mod
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                     else node.module for a in node.names]
        found.update(n for n in names if n in known)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def test_every_module_has_a_layer() -> None:
    for name in modules():
        layer_of(name)


def test_no_module_imports_a_higher_layer() -> None:
    bad = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
           for a, deps in graph().items() for b in sorted(deps)
           if layer_of(b) > layer_of(a)]
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    g = graph()
    # a package's __init__ is an arrow to each of its submodules only when it imports them
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.timeout(300)
def test_each_module_imports_alone() -> None:
    names = [n for n in modules() if not n.endswith("__main__")]

    def run(name: str) -> tuple[str, int, str]:
        p = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True,
                           text=True, timeout=120)
        return name, p.returncode, p.stderr[-2000:]

    with ThreadPoolExecutor(2) as pool:
        failed = [r for r in pool.map(run, names) if r[1] != 0]
    assert not failed, "\n\n".join(f"{n}:\n{err}" for n, _, err in failed)
