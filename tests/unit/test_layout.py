"""The house's import rules, read from the source (every import, lazy ones inside functions and relative ones
too): every import points down or along a floor (FLOORS), so no module of quaero/, trainers/ or benchmarks/
reaches, through any chain of imports, back to itself; the run side never imports the tools users run after or
beside training, nor the benchmarks; trainers/ never imports the recipe, the rollout driver or the tools;
nothing in quaero/ or trainers/ imports the benchmarks but the CLI's `quaero bench`, lazily; and no code
outside tests/ replaces a project function at run time."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("quaero", "trainers", "benchmarks")
RUN_SIDE = ("quaero.recipe", "quaero.rollout", "quaero.telemetry", "quaero.sampling", "quaero.openenv_client",
            "trainers")

# The floors, ground first: a module stands on the floor of the longest name here that is it or a package
# above it, and imports only modules on its own floor or below (docs/architecture.md, Packages).
FLOORS: list[tuple[str, ...]] = [
    # 0 the ground: leaves every floor reads (registries, names, counts, the process group, the row contract)
    ("quaero", "quaero.launcher_registry", "quaero.sampler_registry", "quaero.task_sampler_registry",
     "quaero.resolve", "quaero.process_group", "quaero.processes", "quaero.models", "quaero.chat",
     "quaero.telemetry", "quaero.rows"),
    # 1 the trainers' compute and the spec that tells a trainer what to do
    ("trainers",),
    # 2 the config schema (its sections take the trainer options from trainers/spec.py)
    ("quaero.config",),
    # 3 the components: env sessions, samplers
    ("quaero.openenv_client", "quaero.sampling"),
    # 4 the rollout: episodes played on those components, turned into rows
    ("quaero.rollout",),
    # 5 `quaero check`: a config judged against the components before any run (the recipe builds through it)
    ("quaero.preflight",),
    # 6 the recipe that wires them
    ("quaero.recipe",),
    # 7 what users run after or beside training
    ("quaero.tools",),
    # 8 the command line, and the benchmarks it dispatches (`quaero bench`, lazily)
    ("quaero.cli", "benchmarks"),
]


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (a package's `__init__` is the package's name)."""
    files = {}
    for package in PACKAGES:
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


def below_their_package(floors: list[tuple[str, ...]]) -> list[tuple[str, str]]:
    """(module, package) where `floors` puts a module on a lower floor than a package above it: an exception
    that would hide the package's imports up a floor (trainers/spec.py once stood on the ground that way)."""
    level = {name: i for i, names in enumerate(floors) for name in names}
    return sorted((m, p) for m in level for p in level if m.startswith(p + ".") and level[m] < level[p])


def test_no_module_stands_below_its_package():
    assert below_their_package(FLOORS) == []
    assert below_their_package([("trainers.spec",), ("trainers",)]) == [("trainers.spec", "trainers")]


def test_an_import_up_a_floor_is_found():
    planted = {"quaero.config": {"quaero.openenv_client.launchers"}, "quaero.openenv_client.launchers": set(),
               "trainers.batch": {"quaero.rollout.rows", "quaero.rows"}, "quaero.rollout.rows": set(),
               "quaero.rows": set()}
    assert upward(planted) == [("quaero.config", "quaero.openenv_client.launchers"),
                               ("trainers.batch", "quaero.rollout.rows")]


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
    arrows = [(a, b) for a, targets in import_graph().items() for b in targets]
    assert [(a, b) for a, b in arrows if a.startswith(RUN_SIDE) and b.startswith("quaero.tools")] == []
    app = ("quaero.recipe", "quaero.tools", "quaero.cli", "benchmarks", "quaero.config")
    assert [(a, b) for a, b in arrows if a.startswith("trainers") and b.startswith(app)] == []


def _arrows_into_benchmarks(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() if not a.startswith("benchmarks") for b in targets
                  if b == "benchmarks" or b.startswith("benchmarks."))


def test_the_run_side_never_imports_the_benchmarks():
    arrows = _arrows_into_benchmarks(import_graph())
    assert [(a, b) for a, b in arrows if a.startswith(RUN_SIDE)] == []


def module_level_imports(path: Path) -> set[str]:
    """The modules `path` imports when it is imported (module and class bodies, not inside functions)."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []) or [])

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return found


def test_only_the_cli_bench_dispatch_imports_the_benchmarks_and_lazily():
    """quaero/ and trainers/ reach the benchmarks only through `quaero bench` (quaero/cli.py), inside the
    function that dispatches it: importing quaero never loads them."""
    arrows = _arrows_into_benchmarks(import_graph())
    assert arrows == [("quaero.cli", "benchmarks")]
    eager = {n for n in module_level_imports(ROOT / "quaero" / "cli.py") if n.split(".")[0] == "benchmarks"}
    assert eager == set()


def test_module_level_imports_sees_an_eager_import_and_not_a_lazy_one(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import a\ntry:\n    from b import c\nexcept ImportError:\n    pass\n"
                    "def f():\n    import d\n", encoding="utf-8")
    assert module_level_imports(path) == {"a", "b", "b.c"}


def runtime_replacements(source: str) -> list[str]:
    """Where `source` replaces an attribute of a project module object at run time: an assignment to
    `module.attr` (or deeper) or a `setattr(module, ...)`, the module bound by an import or
    `importlib.import_module`; and any `monkeypatch`. Each as "line N: text"."""
    tree = ast.parse(source)
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update((a.asname or a.name.split(".")[0]) for a in node.names
                           if a.name.split(".")[0] in PACKAGES)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            modules.update(a.asname or a.name for a in node.names
                           if (ROOT / node.module.replace(".", "/") / a.name).is_dir()
                           or (ROOT / node.module.replace(".", "/") / f"{a.name}.py").is_file())
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
              and "import_module" in ast.unparse(node.value.func)):
            modules.update(t.id for t in node.targets if isinstance(t, ast.Name))

    def root(expr: ast.expr) -> str | None:
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        hit = [t for t in targets if isinstance(t, ast.Attribute) and root(t) in modules]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and node.args
                and (root(node.args[0]) in modules or "import_module" in ast.unparse(node.args[0]))):
            hit.append(node)
        if isinstance(node, ast.Name) and node.id == "monkeypatch":
            hit.append(node)
        found += [f"line {node.lineno}: {ast.unparse(node)[:80]}" for _ in hit[:1]]
    return found


def test_no_code_outside_tests_replaces_a_project_function_at_run_time():
    """A benchmark or tool drives quaero through its API and hooks (e.g. `TrainerSpec.logprob_fn`), never by
    swapping a function of a project module, which no reader and no import graph can see."""
    files = [p for top in (*PACKAGES, "envs", "scripts", "examples") for p in (ROOT / top).rglob("*.py")]
    assert len(files) > 100
    found = {str(p.relative_to(ROOT)): hits for p in files
             if (hits := runtime_replacements(p.read_text("utf-8")))}
    assert found == {}


def test_the_replacement_finder_finds_a_swap():
    swap = ("import importlib\nfrom trainers import step\nimport quaero.rollout.rows as rows\n"
            "def f(fake):\n    m = importlib.import_module('trainers.step')\n"
            "    m.microbatch_logprobs = fake\n"
            "    step.shared_forward_step = fake\n    setattr(rows, 'EchoRow', fake)\n"
            "    setattr(importlib.import_module('trainers.step'), 'x', fake)\n"
            "    obj = object()\n    obj.attr = fake\n")
    found = [hit.split(":")[0] for hit in runtime_replacements(swap)]
    assert found == ["line 6", "line 7", "line 8", "line 9"]


def test_unit_tests_mirror_every_subpackage():
    """tests/unit/quaero/ holds a folder per subpackage of quaero/, and no folder for one that is gone."""
    packages = {p.parent.name for p in (ROOT / "quaero").glob("*/__init__.py")}
    unit = ROOT / "tests" / "unit" / "quaero"
    mirrored = {p.name for p in unit.iterdir() if p.is_dir() and not p.name.startswith("_")}
    assert packages == mirrored


# The packages (and ground-floor modules) of the training path whose every module has a test file of its own,
# tests/unit/<package path>/test_<module>.py (a package joins when each of its modules has one).
MIRRORED = ("quaero.recipe", "quaero.rollout", "quaero.sampling", "quaero.chat", "trainers", "quaero.rows")


def modules_without_tests(root: Path = ROOT, packages: tuple[str, ...] = MIRRORED) -> list[str]:
    """The modules of `packages` with no test file of their own (a name that is one module, not a package,
    stands for itself: quaero.rows needs tests/unit/quaero/test_rows.py)."""
    out = []
    for package in packages:
        source, tests = root / package.replace(".", "/"), root / "tests" / "unit" / package.replace(".", "/")
        modules = sorted(p for p in source.glob("*.py") if p.name != "__init__.py")
        found = ([(f"{package}.{p.stem}", tests / f"test_{p.stem}.py") for p in modules] if source.is_dir()
                 else [(package, tests.parent / f"test_{source.name}.py")])
        out += [module for module, test in found if not test.is_file()]
    return out


def test_every_module_of_the_training_path_has_its_test_file():
    assert modules_without_tests() == []


def test_a_module_without_its_test_file_is_found(tmp_path):
    for path in ("pkg/__init__.py", "pkg/kept.py", "pkg/new.py", "tests/unit/pkg/test_kept.py", "pkg/leaf.py",
                 "pkg/bare.py", "tests/unit/pkg/test_leaf.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert modules_without_tests(tmp_path, ("pkg",)) == ["pkg.bare", "pkg.new"]
    assert modules_without_tests(tmp_path, ("pkg.leaf", "pkg.bare")) == ["pkg.bare"]
