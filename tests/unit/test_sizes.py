"""The house's sizes, read from the source: no product file (quaero/, trainers/, envs/) over MAX_FILE_LINES
lines, and at most MAX_LONG_FUNCTIONS functions over LONG_FUNCTION_LINES lines (a def to its last line,
docstring included; methods and nested functions each count)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("quaero", "trainers", "envs")
MAX_FILE_LINES = 500
LONG_FUNCTION_LINES = 60
MAX_LONG_FUNCTIONS = 3


def _sources(root: Path) -> list[Path]:
    return sorted(p for d in PRODUCT for p in (root / d).rglob("*.py"))


def long_functions(path: Path, limit: int = LONG_FUNCTION_LINES) -> list[str]:
    """`path:line name (n lines)` of each function in `path` longer than `limit` lines."""
    return [f"{path}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno + 1 > limit]


def test_no_product_file_is_over_the_size_a_reader_takes_in():
    big = [f"{p.relative_to(ROOT)} ({n} lines)" for p in _sources(ROOT)
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES]
    assert big == [], f"split these files (at most {MAX_FILE_LINES} lines each): {big}"


def test_at_most_a_few_functions_are_long():
    long = [f for p in _sources(ROOT) for f in long_functions(p)]
    assert len(long) <= MAX_LONG_FUNCTIONS, (
        f"{len(long)} functions over {LONG_FUNCTION_LINES} lines (at most {MAX_LONG_FUNCTIONS}): {long}")


def test_a_long_function_is_found(tmp_path):
    body = "".join(f"        x{i} = {i}\n" for i in range(LONG_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\nclass C:\n    def long(self):\n{body}")
    (found,) = long_functions(tmp_path / "m.py")
    assert found.endswith(f"long ({LONG_FUNCTION_LINES + 1} lines)")
