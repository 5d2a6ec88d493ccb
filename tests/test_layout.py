"""The project's shape (docs/architecture.md#layers): no import cycle among its modules, the one-way
dependency direction kernels <- engine <- kvstore <- actors <- cluster (and an engine free of
Ray), the rooms of cluster/ and of the engine depending on each other one way too
(docs/architecture.md#layout), and source files small enough to read (at most 400 lines).

Imports are read with `ast` from the source, not by importing it, so every import counts:
module level, inside functions, in any branch.
"""

from __future__ import annotations

import ast
import functools
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("kernels", "engine", "kvstore", "actors", "cluster", "scripts")
# Lower rank may not import higher rank; scripts sit on top and may use everything.
RANK = {"kernels": 0, "engine": 1, "kvstore": 2, "actors": 3, "cluster": 4, "scripts": 5}
MAX_LINES = 400
# cluster/'s rooms: one may import only the rooms listed for it (launch starts everything; the
# ingress reaches engine replicas, the P/D flow and the Coordinator; the P/D flow reaches
# engine replicas; replica, control and batch stand alone). cluster/'s own modules (tasks.py,
# roles.py, report.py: what every room speaks of a replica) are shared by all.
SHARED = ("cluster", "cluster.tasks", "cluster.roles", "cluster.report")
CLUSTER_ROOMS = {
    "launch": {"http", "pd", "replica", "control", "batch"},
    "http": {"pd", "replica", "control"},
    "pd": {"replica"},
    "replica": set(),
    "control": set(),
    "batch": set(),
}


def _module_files() -> dict[str, str]:
    """Dotted module name -> path, for every .py file under the project packages."""
    modules = {}
    for package in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, package)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join(parts)] = path
    return modules


MODULES = _module_files()


def _is_package(module: str) -> bool:
    return MODULES[module].endswith("__init__.py")


def _resolve(name: str) -> str | None:
    """The project module that `import name` loads last: `name` itself, or the closest
    enclosing module (`from pkg.mod import func` -> pkg.mod)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


@functools.cache
def _tree(module: str) -> ast.Module:
    """`module`'s syntax tree. CPython 3.11 keeps the AST converter's recursion counter in
    interpreter-wide state (gh-106905): another thread of the test process that builds an AST
    while this one converts (the GIL can switch inside the conversion) makes `ast.parse` raise
    "AST constructor recursion depth mismatch" on a good file, as CI saw once. Parse again
    then, a bounded number of times; any other error, or this one three times, still fails."""
    with open(MODULES[module]) as f:
        source = f.read()
    for attempt in range(3):
        try:
            return ast.parse(source, MODULES[module])
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def imports_of(module: str) -> set[str]:
    """Project modules `module` imports, anywhere in its source."""
    tree = _tree(module)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package upwards
                package = module.split(".") if _is_package(module) else module.split(".")[:-1]
                base = package[: len(package) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            # `from pkg import mod` imports the submodule pkg.mod when there is one.
            names = [f"{prefix}.{alias.name}" for alias in node.names] + [prefix]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                found.add(target)
    return found


def _third_party_imports(module: str) -> set[str]:
    tree = _tree(module)
    tops = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_find_cycle_reports_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"a2"}, "a2": {"b"}, "b": {"a2"}}) == ["a2", "b", "a2"]


def test_the_scan_sees_the_project():
    assert {"engine.args", "cluster.launch.app", "cluster.http.ingress", "kernels"} <= set(MODULES)
    # function-level imports count: cluster.launch.serve_cli imports cluster.launch.app inside run_serve
    assert "cluster.launch.app" in imports_of("cluster.launch.serve_cli")
    assert "engine.args" in imports_of("cluster.launch.app_config")


def test_no_import_cycle():
    graph = {m: imports_of(m) for m in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_dependencies_point_one_way():
    wrong = []
    for module in MODULES:
        rank = RANK[module.split(".")[0]]
        for target in sorted(imports_of(module)):
            if RANK[target.split(".")[0]] > rank:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "kernels <- engine <- kvstore <- actors <- cluster is broken:\n" + "\n".join(wrong)


def _cluster_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "cluster" and len(parts) > 1 and parts[1] in CLUSTER_ROOMS else None


def test_every_cluster_module_lives_in_a_room():
    loose = [m for m in MODULES if m.split(".")[0] == "cluster" and _cluster_room(m) is None
             and m not in SHARED]
    assert not loose, f"cluster modules outside {sorted(CLUSTER_ROOMS)}: {loose}"


def test_cluster_rooms_depend_on_each_other_one_way():
    wrong = []
    for module in MODULES:
        room = _cluster_room(module)
        if room is None:
            continue
        for target in sorted(imports_of(module)):
            other = _cluster_room(target)
            if other is not None and other != room and other not in CLUSTER_ROOMS[room]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, f"room dependencies {CLUSTER_ROOMS} are broken:\n" + "\n".join(wrong)


def test_the_scheduler_and_the_core_clients_stay_below_the_engine_core():
    """engine/sched/ knows nothing of where its core runs; a one-core client never reaches
    engine/dp/ (only make_core_client, which picks the data-parallel client, does)."""
    wrong = [f"{m} imports {t}" for m in MODULES if m.startswith("engine.sched")
             for t in imports_of(m) if t.startswith(("engine.core_client", "engine.dp", "engine.core"))
             and t != "engine.core_client.messages"]
    wrong += [f"{m} imports {t}" for m in MODULES if m.startswith("engine.core_client.")
              for t in imports_of(m) if t.startswith("engine.dp")]
    assert not wrong, "\n".join(wrong)


def test_engine_and_kernels_never_import_ray():
    wrong = [m for m in MODULES if m.split(".")[0] in ("engine", "kernels") and "ray" in _third_party_imports(m)]
    assert not wrong, f"these modules import ray: {wrong}"


@pytest.mark.parametrize("package", PACKAGES)
def test_source_files_are_at_most_400_lines(package):
    long = {}
    for module, path in MODULES.items():
        if module.split(".")[0] == package:
            with open(path) as f:
                n = sum(1 for _ in f)
            if n > MAX_LINES:
                long[os.path.relpath(path, ROOT)] = n
    assert not long, f"files over {MAX_LINES} lines: {long}"


def _layout_block() -> dict[str, set[str]]:
    """docs/architecture.md's layout block: folder -> the file names it lists."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        block = f.read().split("```layout\n", 1)[1].split("```", 1)[0]
    folders: dict[str, set[str]] = {}
    folder = None
    for line in block.splitlines():
        if not line.startswith(" "):
            folder, _, line = line.partition(" ")
            folders[folder] = set()
        folders[folder].update(line.split())
    return folders


def test_the_architecture_layout_names_every_source_file_and_no_other():
    listed = _layout_block()
    actual: dict[str, set[str]] = {}
    for package in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, package)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            names = {f for f in filenames if f.endswith((".py", ".c", ".h", ".sh")) and f != "__init__.py"}
            if names:
                actual[os.path.relpath(dirpath, ROOT) + "/"] = names
    missing = sorted(f"{d}{n}" for d, names in actual.items() for n in names - listed.get(d, set()))
    stale = sorted(f"{d}{n}" for d, names in listed.items() for n in names - actual.get(d, set()))
    assert not missing, f"files docs/architecture.md's layout does not name: {missing}"
    assert not stale, f"files docs/architecture.md's layout names that do not exist: {stale}"
