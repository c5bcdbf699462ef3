"""The house's import rules, read from the source (every import, lazy ones inside functions and relative ones
too): every import points down or along a floor (FLOORS), so no module of quaero/ or trainers/ reaches,
through any chain of imports, back to itself; the run side never imports the tools users run after or beside
training; trainers/ never imports the recipe, the rollout driver or the tools."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The floors, ground first: a module stands on the floor of the longest name here that is it or a package
# above it, and imports only modules on its own floor or below (docs/architecture.md, Packages).
FLOORS: list[tuple[str, ...]] = [
    # 0 the ground: leaves every floor reads (registries, names, counts, the process group, the row contract)
    ("quaero", "quaero.launcher_registry", "quaero.sampler_registry", "quaero.resolve",
     "quaero.process_group", "quaero.processes", "quaero.model", "quaero.telemetry", "quaero.rollout.rows",
     "quaero.rollout.advantages", "trainers.spec", "trainers.registry"),
    # 1 the config schema
    ("quaero.config",),
    # 2 the components: env sessions, samplers, the trainers' compute
    ("quaero.openenv_client", "quaero.sampling", "trainers"),
    # 3 the rollout: episodes played on those components, turned into rows
    ("quaero.rollout",),
    # 4 the recipe that wires them
    ("quaero.recipe",),
    # 5 what users run after or beside training
    ("quaero.tools", "quaero.bench"),
    # 6 the command line
    ("quaero.cli",),
]


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (a package's `__init__` is the package's name)."""
    files = {}
    for package in ("quaero", "trainers"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = ".".join(p for p in (base if node.level else "", node.module or "") if p)
                named = [source, *(f"{source}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            else:
                continue
            graph[module] |= {n for n in named if n in files and n != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def floor(module: str) -> int:
    """The floor of `module`: that of the longest FLOORS name that is the module or a package above it."""
    found = [(len(name), level) for level, names in enumerate(FLOORS) for name in names
             if module == name or module.startswith(name + ".")]
    assert found, f"{module} stands on no floor: add it (or its package) to FLOORS"
    return max(found)[1]


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import of a module on a higher floor than the importer's."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if floor(b) > floor(a))


def test_every_import_points_down_a_floor_or_along_one():
    assert upward(import_graph()) == []


def test_an_import_up_a_floor_is_found():
    planted = {"quaero.config": {"quaero.openenv_client.launchers"}, "quaero.openenv_client.launchers": set(),
               "trainers.batch": {"quaero.rollout.rows"}, "quaero.rollout.rows": set()}
    assert upward(planted) == [("quaero.config", "quaero.openenv_client.launchers")]


def test_relative_imports_are_arrows():
    graph = import_graph()
    assert "quaero.openenv_client.loading" in graph["quaero.openenv_client.pool"]
    assert "quaero.openenv_client.pool" in graph["quaero.openenv_client"]


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50 and cycles(graph) == []


def test_the_circle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_run_side_never_imports_the_tools_and_trainers_never_import_the_app():
    run_side = ("quaero.recipe", "quaero.rollout", "quaero.telemetry", "quaero.sampling",
                "quaero.openenv_client", "trainers")
    arrows = [(a, b) for a, targets in import_graph().items() for b in targets]
    assert [(a, b) for a, b in arrows if a.startswith(run_side) and b.startswith("quaero.tools")] == []
    app = ("quaero.recipe", "quaero.tools", "quaero.cli", "quaero.bench", "quaero.config")
    assert [(a, b) for a, b in arrows if a.startswith("trainers") and b.startswith(app)] == []


def test_unit_tests_mirror_every_subpackage():
    """tests/unit/quaero/ holds a folder per subpackage of quaero/, and no folder for one that is gone (the
    benchmarks' tests stay beside the top-level modules' while quaero/bench/ is in the product)."""
    packages = {p.parent.name for p in (ROOT / "quaero").glob("*/__init__.py")} - {"bench"}
    unit = ROOT / "tests" / "unit" / "quaero"
    mirrored = {p.name for p in unit.iterdir() if p.is_dir() and not p.name.startswith("_")}
    assert packages == mirrored
