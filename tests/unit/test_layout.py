"""The house's import rules, read from the source (every import, lazy ones inside functions too): no module of
quaero/ or trainers/ reaches, through any chain of imports, back to itself; the run side never imports the
tools users run after or beside training; trainers/ never imports the recipe, the rollout driver or the tools."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
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


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50 and cycles(graph) == []


def test_the_circle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_run_side_never_imports_the_tools_and_trainers_never_import_the_app():
    run_side = ("quaero.recipe", "quaero.rollout", "quaero.telemetry", "quaero.sampling", "quaero.openenv_client",
                "trainers")
    arrows = [(a, b) for a, targets in import_graph().items() for b in targets]
    assert [(a, b) for a, b in arrows if a.startswith(run_side) and b.startswith("quaero.tools")] == []
    app = ("quaero.recipe", "quaero.tools", "quaero.cli", "quaero.bench", "quaero.config")
    assert [(a, b) for a, b in arrows if a.startswith("trainers") and b.startswith(app)] == []
