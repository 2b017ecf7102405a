"""The layer rule (docs/ARCHITECTURE.md, "Layers"): a module imports only from its own layer or
below, never from a sibling layer (the worker and the producers meet only in the contract), no two
packages import each other, directly or round a loop, and no two modules do either.
Imports are read with `ast` from every module, function-level and TYPE_CHECKING imports
included, so a lazy import cannot hide an upward edge or a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("backends", "dispatcher", "ecosystem", "worker")

# The layer table, top to bottom: (level, name, prefixes). A module may import from its own row or
# any row of a deeper level (a larger number). Rows of one level are siblings: neither imports the
# other, so what both need lives below them (the worker and the producers share only the contract
# and the backends). A module belongs to the row of the longest prefix that names it.
LAYERS: tuple[tuple[int, str, tuple[str, ...]], ...] = (
    (1, "tools: the `fleet` CLI that assembles everything", ("ecosystem.cli",)),
    (2, "ecosystem: placement, process managers, local fleets, bench", ("ecosystem",)),
    (3, "worker: the worker process", ("worker",)),
    (3, "producers: Fleet, AsyncFleet, the gateway", ("dispatcher",)),
    (4, "backends: engines", ("backends",)),
    (5, "contract: keys, codec, retry, schemas, settings", ("backends.contract",)),
)
# Units of the package graph: the top-level packages and every prefix of the layer table (so the
# contract is apart from the backends, the CLI apart from the rest of ecosystem); a subpackage
# belongs to its package.
UNITS = (*PACKAGES, *(p for _, _, ps in LAYERS for p in ps))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield module_name(path), path


def imports(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in the file, at any depth."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            # `from pkg import name` names pkg.name when that is a module, else pkg: resolving
            # each to the nearest known module keeps `from pkg import submodule` off pkg itself
            for alias in node.names:
                yield f"{target}.{alias.name}", node.lineno


def longest_prefix(module: str, prefixes: tuple[str, ...]) -> str | None:
    hits = [p for p in prefixes if module == p or module.startswith(p + ".")]
    return max(hits, key=len) if hits else None


def layer_of(module: str) -> int | None:
    """The module's row in LAYERS."""
    prefixes = tuple(p for _, _, ps in LAYERS for p in ps)
    hit = longest_prefix(module, prefixes)
    if hit is None:
        return None
    return next(i for i, (_, _, ps) in enumerate(LAYERS) if hit in ps)


def forbidden(src: str, dst: str) -> str | None:
    """Why `src` may not import `dst` (an upward or a sibling edge); None when it may."""
    a, b = layer_of(src), layer_of(dst)
    assert a is not None and b is not None, (src, dst)
    (level_a, name_a, _), (level_b, name_b, _) = LAYERS[a], LAYERS[b]
    if a == b or level_b > level_a:
        return None
    kind = "upward" if level_b < level_a else "sibling"
    return f"{kind}: {name_a} -> {name_b}"


def project_modules() -> dict[str, Path]:
    return dict(modules())


def project_target(target: str, known: dict[str, Path]) -> str | None:
    """The project module an import names (`from pkg import name` names pkg when name is no module)."""
    while target:
        if target in known:
            return target
        target = target.rpartition(".")[0]
    return None


def edges() -> list[tuple[str, str, int]]:
    known = project_modules()
    out: set[tuple[str, str, int]] = set()
    for name, path in known.items():
        for target, line in imports(name, path):
            resolved = project_target(target, known)
            if resolved is not None and resolved != name:
                out.add((name, resolved, line))
    return sorted(out)


def unit_of(module: str) -> str:
    hit = longest_prefix(module, UNITS)
    assert hit is not None, module
    return hit


def grouped_graph(group_of: Callable[[str], str]) -> dict[str, set[str]]:
    """The import graph between groups of modules (`group_of` names a module's group)."""
    graph: dict[str, set[str]] = {}
    for src, dst, _line in edges():
        a, b = group_of(src), group_of(dst)
        graph.setdefault(a, set())
        graph.setdefault(b, set())
        if a != b:
            graph[a].add(b)
    return graph


def module_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in project_modules()}
    for src, dst, _line in edges():
        graph[src].add(dst)
    return graph


def part_of(module: str) -> str:
    """Its part of its package: the subpackage it is in (`worker.serving`), else the module itself
    (`worker.settings`), so a package's top-level modules stand each on their own."""
    package, _, rest = module.partition(".")
    head = rest.split(".")[0]
    return f"{package}.{head}" if head and (ROOT / package / head).is_dir() else module


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer() -> None:
    assert [n for n, _ in modules() if layer_of(n) is None] == []


def test_no_import_runs_upward() -> None:
    """Nor sideways, between sibling layers."""
    bad = []
    for src, dst, line in edges():
        why = forbidden(src, dst)
        if why is not None:
            bad.append(f"{src}:{line} imports {dst} ({why})")
    assert bad == [], "imports that run upward or between siblings:\n" + "\n".join(bad)


def test_worker_and_producers_are_siblings() -> None:
    """The worker and the producers sit side by side over the contract: an import either way
    between worker/ and dispatcher/ fails, while both may use the backends and the contract and
    the tools and ecosystem above may use both."""
    worker, producers = layer_of("worker.serving.loop"), layer_of("dispatcher.client")
    assert worker is not None and producers is not None and worker != producers
    assert LAYERS[worker][0] == LAYERS[producers][0]
    assert forbidden("worker.hooks.batch_hook", "dispatcher.gateway.batch.record") == (
        f"sibling: {LAYERS[worker][1]} -> {LAYERS[producers][1]}")
    assert forbidden("dispatcher.gateway.app", "worker.settings") == (
        f"sibling: {LAYERS[producers][1]} -> {LAYERS[worker][1]}")
    for below in ("backends.registry", "backends.contract.keys", "backends.contract.batch.line_record"):
        assert forbidden("worker.hooks.facts", below) is None and forbidden("dispatcher.jobs", below) is None
    for above in ("ecosystem.cli.worker", "ecosystem.local.processes"):
        assert forbidden(above, "worker.serving.loop") is None
        assert forbidden(above, "dispatcher.client") is None
    between = [(s, d, n) for s, d, n in edges()
               if {unit_of(s), unit_of(d)} == {"worker", "dispatcher"}]
    assert between == [], between


def test_no_package_cycle() -> None:
    assert cycles(grouped_graph(unit_of)) == []


def test_no_subpackage_cycle() -> None:
    """Inside a package, its subpackages (and top-level modules) import one way too: serving
    uses claiming, claiming never serving; what both need lives in a part below them."""
    found = cycles(grouped_graph(part_of))
    assert found == [], "parts of a package that import each other, round a loop:\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_no_module_cycle() -> None:
    """Not even inside a package: a module never needs one that needs it back. (Importing a
    submodule runs its package's __init__ first; that is no edge here, only an import is.)"""
    found = cycles(module_graph())
    assert found == [], "modules that import each other, round a loop:\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_fleet_worker_loads_no_gateway_batch_bench_or_kubernetes_code() -> None:
    """The `fleet` group adds those commands on first use of one of them, not at every worker start."""
    watched = ("dispatcher.gateway.serve", "dispatcher.gateway.batch", "dispatcher.observe",
               "ecosystem.local", "ecosystem.kubernetes", "ecosystem.cli.", "fastapi")
    code = ("import sys, click\n"
            "from ecosystem.cli import cli\n"
            "assert cli.get_command(click.Context(cli), 'worker') is not None\n"
            f"print(sorted(m for m in sys.modules if m.startswith({watched!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['ecosystem.cli.jobs', 'ecosystem.cli.options', 'ecosystem.cli.worker']"


def test_the_checker_sees_function_level_imports_and_cycles() -> None:
    """The checker itself: a lazy import counts, and a two-package loop is found."""
    source = "def f():\n    from worker.serving.loop import FleetWorker\n"
    tree = ast.parse(source)
    found = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert found == ["worker.serving.loop"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("backends.contract.keys") == len(LAYERS) - 1
    assert forbidden("backends.registry", "dispatcher.client") is not None  # upward
    assert layer_of("ecosystem.cli.batch") == 0 and layer_of("ecosystem.up") == 1
    assert unit_of("ecosystem.cli.batch") == "ecosystem.cli"
    assert unit_of("ecosystem.local.bench") == "ecosystem"
    assert part_of("worker.serving.loop") == "worker.serving"
    assert part_of("worker.settings") == "worker.settings"


def test_producers_and_the_contract_import_without_llama_cpp() -> None:
    """Producer-only hosts have no llama-cpp-python: neither the producers nor what they stand on
    may pull it in (nor the worker's settings, which `fleet` loads for every command)."""
    code = ("import sys, dispatcher, dispatcher.client, backends, backends.registry, worker.settings\n"
            "import backends.contract.keys, backends.contract.settings, backends.contract.stream\n"
            "import backends.contract.gateway_settings, backends.contract.observe_schema\n"
            "import backends.contract.batch.line_record, dispatcher.gateway.settings\n"
            "print(sorted(m for m in sys.modules if m.startswith('llama_cpp')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
