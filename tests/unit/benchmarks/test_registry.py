"""`quaero bench NAME`: the CLI dispatches through the registry in benchmarks/__init__.py, whose every entry
is a module with `main(argv)`; where the benchmarks package is not importable, `quaero bench` says so in one
line."""
import ast
import importlib.util
import sys
from pathlib import Path

import benchmarks
from quaero import cli


def test_every_registered_benchmark_is_a_module_with_main():
    for name, (module, text) in benchmarks.BENCHMARKS.items():
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, name
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
        assert "main" in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}, name
        assert text and name in benchmarks.USAGE


def test_quaero_bench_lists_the_registry_and_refuses_an_unknown_name(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in benchmarks.BENCHMARKS)
    assert cli.main(["bench", "no-such-bench"]) == 2
    assert "unknown benchmark 'no-such-bench'" in capsys.readouterr().err


def test_quaero_bench_without_the_benchmarks_package_fails_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "benchmarks", None)  # an install without benchmarks/
    assert cli.main(["bench", "echo"]) == 1
    err = capsys.readouterr().err.strip()
    assert "the benchmarks package is not importable here" in err and "\n" not in err
