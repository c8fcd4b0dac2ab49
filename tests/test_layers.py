"""The house's import arrows, read from the source (no import runs): no circle between modules or between engine's
packages, and no arrow upward or sideways:

    specconsole  ->  engine's backends (exact, process, vllm, llamacpp)  ->  engine.serving, engine.loading, ...
                                                                          ->  engine's neutral modules (engine/*.py)

- engine never imports specconsole;
- engine's neutral modules (request, events, metrics, limits, ...) import no engine package;
- the server backends share engine.serving and import neither each other nor the exact engine; engine.serving and
  engine.loading import no backend.

Imports under `if TYPE_CHECKING:` are for the type checker only and are left out."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# engine's packages and the other engine packages each may import. Anything may import engine's neutral modules
# (engine/*.py), which import no package; engine.setup, the entry points' one call, is listed like a package.
MAY_IMPORT = {
    "engine.exact": {"engine.loading"},
    "engine.process": {"engine.exact", "engine.setup"},  # its child process is an entry point
    "engine.vllm": {"engine.serving"},
    "engine.llamacpp": {"engine.serving"},
    "engine.serving": set(),
    "engine.loading": set(),
    "engine.analysis": set(),
    "engine.setup": {"engine.serving"},
}


def modules() -> dict[str, Path]:
    found = {}
    for package in ("engine", "specconsole"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict) -> set[str]:
    """The project's modules that `path` imports, anywhere in it but under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for statement in block.body for node in ast.walk(statement)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {name for name in out if name in known}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def package(module: str) -> str:
    """engine.exact.decode -> engine.exact; engine.request -> engine.request; specconsole.* -> specconsole."""
    parts = module.split(".")
    if parts[0] != "engine":
        return parts[0]
    return ".".join(parts[:2])


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in arrows.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while not members or members[-1] != v:
                members.append(stack.pop())
                on_stack.discard(members[-1])
            if len(members) > 1:
                found.append(sorted(members))

    for v in list(arrows):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_round_a_circle():
    assert circles(graph()) == []


def test_no_engine_package_imports_itself_round_a_circle():
    packages: dict[str, set[str]] = {}
    for a, targets in graph().items():
        packages.setdefault(package(a), set()).update(package(b) for b in targets if package(b) != package(a))
    assert circles(packages) == []


def neutral(module: str) -> bool:
    """engine/*.py (and engine/__init__.py): not in one of engine's packages."""
    return package(module) == module and module.startswith("engine") and module not in MAY_IMPORT


def test_no_arrow_upward_or_sideways():
    wrong = []
    for a, targets in graph().items():
        for b in targets:
            pa, pb = package(a), package(b)
            if pa == pb or pa == "specconsole" or (neutral(b) and pb != "specconsole"):
                continue  # within a package, the console on top of everything, anything onto a neutral module
            if pb == "specconsole" or pb not in MAY_IMPORT.get(pa, set()):
                wrong.append((a, b))
    assert sorted(wrong) == []


def test_the_check_sees_a_planted_circle_and_wrong_arrows():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    arrows = graph()
    assert "engine.serving.stream" in arrows["engine.llamacpp.backend"]  # the graph is read
    assert neutral("engine.request") and neutral("engine") and not neutral("engine.setup")
    assert "engine.serving" not in MAY_IMPORT["engine.exact"] and "engine.vllm" not in MAY_IMPORT["engine.llamacpp"]
