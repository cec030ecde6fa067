"""The import rule of docs/architecture.md ("Import direction"), checked by parsing the sources (nothing imported).

`serve_graph.builder` is the only module of `serve_graph` that imports `deployments`; `deployments` import the other
`serve_graph` modules (config, errors, metrics, routing), which import neither `deployments` nor the builder; the
model core imports neither package, and the client distribution not even the model core. Imports under
`if TYPE_CHECKING:` are type hints only and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER_PACKAGES = ("serve_graph", "deployments")
BUILDER = "serve_graph.builder"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_modules(source: str, module: str) -> set[str]:
    """Modules `source` imports at run time (anywhere in the file, functions included), relative ones resolved."""
    found: set[str] = set()
    package = module.rsplit(".", 1)[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def module_name(path: Path, root: Path) -> str:
    name = ".".join(path.relative_to(root).with_suffix("").parts)
    return name.removesuffix(".__init__")


def import_graph(package_dirs: list[Path], root: Path) -> dict[str, set[str]]:
    """module -> the modules of these packages it imports."""
    sources = {module_name(p, root): p.read_text() for d in package_dirs for p in sorted(d.rglob("*.py"))}
    graph = {}
    for mod, src in sources.items():
        graph[mod] = {m for m in imported_modules(src, mod) if m in sources and m != mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def _server_graph() -> dict[str, set[str]]:
    return import_graph([ROOT / p for p in SERVER_PACKAGES], ROOT)


def test_only_the_builder_imports_deployments():
    graph = _server_graph()
    importers = {m for m, deps in graph.items() if m.startswith("serve_graph") and any(
        d.startswith("deployments") for d in deps)}  # fmt: skip
    assert importers == {BUILDER}, f"only {BUILDER} may import deployments; also: {sorted(importers - {BUILDER})}"
    assert not [m for m, deps in graph.items() if BUILDER in deps], "nothing imports the builder (it is the top)"


def test_no_import_cycle_between_serve_graph_and_deployments():
    graph = _server_graph()
    assert any(graph.values()), "the parser found no imports at all"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_model_core_and_clients_import_no_server_package():
    # the client distribution installs alone on a robot: not even the model core may be imported from it
    for package_dir, root, forbidden in (
        (ROOT / "dreamzero", ROOT, SERVER_PACKAGES),
        (ROOT / "clients" / "dreamzero_client", ROOT / "clients", (*SERVER_PACKAGES, "dreamzero")),
    ):
        for path in sorted(package_dir.rglob("*.py")):
            imported = imported_modules(path.read_text(), module_name(path, root))
            bad = {m for m in imported if m.split(".")[0] in forbidden}
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_checker_sees_function_level_imports_and_skips_type_hints(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    hints_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import X\n"
    (pkg / "b.py").write_text(hints_only + "from . import a\n")
    (pkg / "c.py").write_text("import pkg.b\n")
    graph = import_graph([pkg], tmp_path)
    assert graph["pkg.a"] == {"pkg", "pkg.b"} and graph["pkg.b"] == {"pkg", "pkg.a"} and "pkg.c" not in graph["pkg.b"]
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    assert find_cycle({"x": {"y"}, "y": set()}) is None
