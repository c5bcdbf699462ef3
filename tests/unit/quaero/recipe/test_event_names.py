"""Every event the recipe logs (quaero/recipe/) is a name declared in quaero/telemetry/names.py, never a
string spelled at the call: readers (`quaero review`, the proofs, the docs) select on those names."""
from __future__ import annotations

import ast
from pathlib import Path

from quaero.telemetry import names

RECIPE = Path(__file__).resolve().parents[4] / "quaero" / "recipe"
LOG_CALLS = {"debug", "info", "warning", "error"}


def literal_events(source: str) -> list[str]:
    """The events `source` logs with a string literal (`log.info("x", ...)`), as "line N: x"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
            continue
        first = node.args[0]
        if node.func.attr in LOG_CALLS and isinstance(first, ast.Constant) and isinstance(first.value, str):
            found.append(f"line {node.lineno}: {first.value}")
    return found


def test_the_recipe_logs_only_declared_event_names():
    found = {p.name: hits for p in sorted(RECIPE.glob("*.py")) if (hits := literal_events(p.read_text()))}
    assert found == {}


def test_a_literal_event_name_is_found_and_a_declared_one_is_not():
    source = 'log.info("made_up", x=1)\nlog.warning(names.RUN_END_EVENT)\nlog.info(event, done=0)\n'
    assert literal_events(source) == ["line 1: made_up"]
    assert names.RUN_END_EVENT == "run_end"
