"""The project's import graph, read from the source with ast: no module imports itself
through others (a cycle makes import order matter and hides which concept depends on
which), and the engine never imports the service, which is built on it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "service")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {
        module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
    }


def imported_modules(tree: ast.AST, module: str, package: str, modules: set[str]) -> set[str]:
    """The project modules an import statement anywhere in the tree names: at module level,
    in a function, or under TYPE_CHECKING. `from a import b` names the module a.b when there
    is one, else a; a package a submodule sits in is not counted (Python imports it first,
    whoever asks)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from this module's package, or one above it
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                names.add(submodule if submodule in modules else base)
    return {_project_module(name, modules) for name in names} - {None, module}


def _project_module(name: str, modules: set[str]) -> str | None:
    """The project module `name` is or lies in (`a.b.f` -> `a.b`); None outside the project."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Each project module -> the project modules it imports."""
    modules = project_modules()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        graph[module] = imported_modules(tree, module, package, set(modules))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as the modules along it (first == last), or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for target in sorted(graph[node]):
            if target in on_path:
                return path[path.index(target) :] + [target]
            if target not in done and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_graph_holds_the_edges_it_checks():
    graph = import_graph()
    assert {
        "engine.core.startup",
        "engine.text.tokenizer",
        "service.serve",
        "service.rest.server",
    } <= set(graph)
    assert "engine.text.tokenizer" in graph["engine.core.startup"]  # a module-level import
    assert "service.rest.server" in graph["service.serve"]  # a function-level one
    assert "engine.errors" in graph["engine.text.tokenizer"]  # `from engine.errors import ...`
    # `from engine.kernels import triton_kernels`, in a function: the submodule, not the package
    assert graph["engine.kernels.norm"] == {
        "engine.kernels.dispatch",
        "engine.kernels.triton_kernels",
    }


def test_relative_imports_resolve_against_their_package():
    tree = ast.parse("from . import b\nfrom .. import c\nfrom .b import f\n")
    modules = {"p", "p.q", "p.q.a", "p.q.b", "p.c"}
    assert imported_modules(tree, "p.q.a", "p.q", modules) == {"p.q.b", "p.c"}
    assert imported_modules(tree, "p.q", "p.q", modules) == {"p.q.b", "p.c"}


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_itself_through_others():
    assert find_cycle(import_graph()) is None


def service_imports_in_engine(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(engine module, service module) for each import of the service by the engine."""

    def package(name: str) -> str:
        return name.partition(".")[0]

    return sorted(
        (module, target)
        for module, targets in graph.items()
        if package(module) == "engine"
        for target in targets
        if package(target) == "service"
    )


def test_service_imports_in_engine_finds_one():
    graph = {"engine.a": {"service.b", "engine.c"}, "service.b": {"engine.a"}, "engine.c": set()}
    assert service_imports_in_engine(graph) == [("engine.a", "service.b")]


def test_the_engine_never_imports_the_service():
    graph = import_graph()
    assert "engine.core.engine" in graph["service.serve"]  # the other way is read too
    assert service_imports_in_engine(graph) == []
