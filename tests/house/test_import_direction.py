"""The import rules of docs/architecture.md ("Import direction"), checked over the whole tree by parsing the sources.

Every module of every package is read (imports inside functions count; imports under `if TYPE_CHECKING:` are type
hints and do not), and four rules hold:
1. no import circle between files;
2. packages only import the packages below them (`ALLOWED`): the composition root on top, the client distribution
   at the ground, so no arrow runs back up;
3. inside `deployments`, the layers of one request path: the ingress host, the doors (which never import each
   other), the graph runner, the replicas and stages, and the shared pieces at the bottom (`DEPLOYMENT_LAYERS`);
4. the model core takes no request type: of the client distribution it imports only the ground docs/architecture.md
   declares (`CORE_GROUND`: the errors, the session report, the OpenPI / DROID key names).
`test_a_planted_circle_or_upward_import_fails` plants a violation in a copy of the tree and sees each rule fail.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: package -> (its source folder, the folder its module names start from)
PACKAGES = {
    "serve_graph": ("serve_graph", "."),
    "deployments": ("deployments", "."),
    "eval": ("eval", "."),
    "benchmarks": ("benchmarks", "."),
    "scripts": ("scripts", "."),
    "dreamzero": ("dreamzero", "."),
    "dreamzero_client": ("clients/dreamzero-client/dreamzero_client", "clients/dreamzero-client"),
    "dreamzero_droid": ("clients/dreamzero-droid/dreamzero_droid", "clients/dreamzero-droid"),
    "dreamzero_franka": ("clients/dreamzero-franka/dreamzero_franka", "clients/dreamzero-franka"),
}

#: which of our packages each package may import (top to bottom). `scripts` and `benchmarks` are run, never imported
#: by a package (the GPU check runs the latency benchmark's docs writer); the robot's client distribution installs
#: alone on a robot, so it imports none of ours; the DROID runtime stands on it, the Franka app on both.
ALLOWED = {
    "scripts": {"benchmarks", "serve_graph", "deployments", "eval", "dreamzero", "dreamzero_client", "dreamzero_droid"},
    "benchmarks": {"serve_graph", "deployments", "eval", "dreamzero", "dreamzero_client", "dreamzero_droid"},
    "serve_graph": {"deployments", "dreamzero", "dreamzero_client"},
    "deployments": {"dreamzero", "dreamzero_client"},
    "eval": {"dreamzero", "dreamzero_client", "dreamzero_droid"},
    "dreamzero": {"dreamzero_client", "dreamzero_droid"},  # dreamzero_droid.lerobot: the one LeRobot reader and writer
    "dreamzero_franka": {"dreamzero_droid", "dreamzero_client"},
    "dreamzero_droid": {"dreamzero_client"},
    "dreamzero_client": set(),
}

#: the modules of the client distribution the model core may import (docs/architecture.md, "Why the model core imports
#: the client package"): never a request type or a parser; the server turns a wire request into a `ModelBatch`
CORE_GROUND = {
    "dreamzero_client.errors",
    "dreamzero_client.wire.openpi",
    "dreamzero_client.wire.replies",
}

#: layers of `deployments`, top first: a module imports its own layer or lower ones; doors never import each other
DEPLOYMENT_LAYERS = (
    ("host", ("deployments.ingress",)),
    ("door", ("deployments.doors",)),
    ("runner", ("deployments.graph_runner",)),
    (
        "replica",
        (
            "deployments.policy", "deployments.batcher", "deployments.batch_merge", "deployments.replay",
            "deployments.preprocess", "deployments.postprocess", "deployments.stages", "deployments.calls",
            "deployments.model_info", "deployments.cfg_rank", "deployments.live_tuning", "deployments.tenant_ledger",
            "deployments.engine", "deployments.admission", "deployments.replica_report", "deployments.batch_slices",
        ),
    ),
    (
        "shared",
        (
            "deployments.config", "deployments.error_replies", "deployments.metrics",
            "deployments.routing", "deployments.auth", "deployments.tenants", "deployments.audit",
            "deployments.requests",
        ),
    ),
)  # fmt: skip


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Modules `source` imports at run time (anywhere in the file, functions included), relative ones resolved."""
    found: set[str] = set()
    package = module if is_package else module.rsplit(".", 1)[0]

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


def _resolve(name: str, modules: set[str]) -> str | None:
    """The module of ours that an imported name refers to (a name inside a module resolves to that module)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def tree_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of our packages it imports. A package's `__init__` importing its own submodules, and a
    submodule importing its package's `__init__`, are not edges (Python runs the `__init__` first either way)."""
    files: dict[str, tuple[Path, bool]] = {}
    for source, base in PACKAGES.values():
        for path in sorted((root / source).rglob("*.py")):
            files[module_name(path, root / base)] = (path, path.name == "__init__.py")
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for mod, (path, is_pkg) in files.items():
        deps = set()
        for name in imported_modules(path.read_text(), mod, is_pkg):
            dep = _resolve(name, modules)
            if dep is None or dep == mod:
                continue
            if (is_pkg and dep.startswith(mod + ".")) or (files[dep][1] and mod.startswith(dep + ".")):
                continue
            deps.add(dep)
        graph[mod] = deps
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


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports across packages that `ALLOWED` does not list."""
    bad = []
    for mod, deps in sorted(graph.items()):
        top = mod.split(".")[0]
        for dep in sorted(deps):
            other = dep.split(".")[0]
            if other != top and other not in ALLOWED[top]:
                bad.append(f"{mod} -> {dep} ({top} may import only {sorted(ALLOWED[top]) or 'none of ours'})")
    return bad


def deployment_layer(module: str) -> int | None:
    for i, (_, prefixes) in enumerate(DEPLOYMENT_LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports inside `deployments` that point up a layer, or from one door to another; modules in no layer."""
    bad = []
    for mod, deps in sorted(graph.items()):
        if not mod.startswith("deployments.") or mod == "deployments.doors":
            continue
        layer = deployment_layer(mod)
        if layer is None:
            bad.append(f"{mod} is in no layer of DEPLOYMENT_LAYERS: place it")
            continue
        for dep in sorted(d for d in deps if d.startswith("deployments.") and d != "deployments.doors"):
            dep_layer = deployment_layer(dep)
            if dep_layer is not None and dep_layer < layer:
                bad.append(f"{mod} ({DEPLOYMENT_LAYERS[layer][0]}) -> {dep} ({DEPLOYMENT_LAYERS[dep_layer][0]})")
            elif DEPLOYMENT_LAYERS[layer][0] == "door" and dep_layer == layer:
                bad.append(f"{mod} -> {dep}: a door never imports another door")
    return bad


def core_request_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of the model core from the client distribution beyond the declared ground (`CORE_GROUND`)."""
    return [
        f"{mod} -> {dep} (the model core imports only {sorted(CORE_GROUND)} of the client distribution)"
        for mod, deps in sorted(graph.items())
        if mod.split(".")[0] == "dreamzero"
        for dep in sorted(deps)
        if dep.split(".")[0] == "dreamzero_client" and dep not in CORE_GROUND
    ]


def problems(root: Path) -> list[str]:
    graph = tree_graph(root)
    cycle = find_cycle(graph)
    found = [f"import circle: {' -> '.join(cycle)}"] if cycle else []
    return found + upward_imports(graph) + layer_violations(graph) + core_request_imports(graph)


def test_the_tree_has_no_circle_and_no_import_that_points_up():
    graph = tree_graph(ROOT)
    assert len(graph) > 150 and sum(map(len, graph.values())) > 300, "the parser found too few modules or imports"
    assert {m.split(".")[0] for m in graph} == set(PACKAGES)
    assert problems(ROOT) == []


def test_no_package_imports_the_composition_root():
    run_only = ("benchmarks", "scripts")  # entry points, like `serve run`, may build the app
    importers = [m for m, deps in tree_graph(ROOT).items() if "serve_graph.builder" in deps]
    assert [m for m in importers if not m.startswith(run_only)] == [], f"serve_graph.builder is the top: {importers}"


def test_the_model_core_and_the_client_distribution_import_no_server_code():
    # the checker's table says so too; this names the two rules a robot install and the Ray-free core rely on
    assert ALLOWED["dreamzero"] == {"dreamzero_client", "dreamzero_droid"} and ALLOWED["dreamzero_client"] == set()
    assert ALLOWED["dreamzero_droid"] == {"dreamzero_client"}
    # of the DROID runtime, the core uses only the LeRobot module (training reads what the recorders write)
    graph = tree_graph(ROOT)
    core = {
        d
        for m, deps in graph.items()
        if m.split(".")[0] == "dreamzero"
        for d in deps
        if d.startswith("dreamzero_droid")
    }
    assert core and all(d.startswith("dreamzero_droid.lerobot") for d in core), sorted(core)


def test_a_planted_circle_or_upward_import_fails(tmp_path):
    for source, _ in PACKAGES.values():
        shutil.copytree(ROOT / source, tmp_path / source, ignore=shutil.ignore_patterns("assets", "__pycache__"))
    assert problems(tmp_path) == []

    def plant(relative: str, line: str) -> list[str]:
        target = tmp_path / relative
        original = target.read_text()
        target.write_text(original + f"\n\ndef _planted():\n    {line}\n")  # a function-level import counts too
        try:
            return problems(tmp_path)
        finally:
            target.write_text(original)

    circle = plant("deployments/config/settings.py", "from deployments.policy import PolicyDeployment")
    assert any(p.startswith("import circle:") and "deployments.config.settings" in p for p in circle), circle
    core_circle = plant("dreamzero/device.py", "from dreamzero.checkpoint.hf import read_weight_map")  # issue 31's
    assert len(core_circle) == 1 and core_circle[0].startswith("import circle: "), core_circle
    assert set(core_circle[0].removeprefix("import circle: ").split(" -> ")) == {
        "dreamzero.device",
        "dreamzero.checkpoint.hf",
    }
    request = plant("dreamzero/types.py", "from dreamzero_client.wire.generations import GenerationRequest")
    assert request == [
        "dreamzero.types -> dreamzero_client.wire.generations (the model core imports only "
        f"{sorted(CORE_GROUND)} of the client distribution)"
    ]
    upward = plant("dreamzero/types.py", "import serve_graph.config")
    assert any(p.startswith("dreamzero.types -> serve_graph.config") for p in upward), upward
    ground = plant("clients/dreamzero-client/dreamzero_client/wire/codec.py", "from dreamzero import errors")
    assert any(p.startswith("dreamzero_client.wire.codec -> dreamzero.errors") for p in ground), ground
    sideways = plant("deployments/doors/zmq.py", "from deployments.doors.http import HttpDoor")
    assert any("a door never imports another door" in p for p in sideways), sideways
    hints = plant(
        "dreamzero/types.py", "from typing import TYPE_CHECKING\n    if TYPE_CHECKING:\n        import serve_graph"
    )
    assert hints == [], "imports under TYPE_CHECKING are type hints, not arrows"
