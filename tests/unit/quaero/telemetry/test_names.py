"""Every event name a run logs is declared in quaero/telemetry/names.py: no module of quaero/ or trainers/
spells one as a literal (`log.warning("env_retry", ...)`, `{"event": "events_lost", ...}`,
`e.get("event") == "..."`)."""
import ast
from pathlib import Path

from quaero.telemetry import names

ROOT = Path(__file__).resolve().parents[4]
LEVELS = ("debug", "info", "warning", "error", "exception", "critical")


def literal_event_names(source: str) -> list[str]:
    """The event names `source` spells as string literals: a log call's first argument, the value of an
    "event" key in a dict literal, and a string compared with an `.get("event")` or `["event"]` lookup."""

    def is_event_lookup(node: ast.expr) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            key = node.args[0] if node.args else None
        elif isinstance(node, ast.Subscript):
            key = node.slice
        else:
            return False
        return isinstance(key, ast.Constant) and key.value == "event"

    def is_log_method(func: ast.expr) -> bool:  # log.info, or (log.info if ... else log.warning)
        if isinstance(func, ast.IfExp):
            return is_log_method(func.body) and is_log_method(func.orelse)
        return isinstance(func, ast.Attribute) and func.attr in LEVELS

    def text(node: ast.expr | None) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and is_log_method(node.func) and node.args and (
                name := text(node.args[0])) is not None:
            found.append(name)
        elif isinstance(node, ast.Dict):
            found += [name for k, v in zip(node.keys, node.values)
                      if text(k) == "event" and (name := text(v)) is not None]
        elif isinstance(node, ast.Compare) and any(map(is_event_lookup, [node.left, *node.comparators])):
            found += [name for side in [node.left, *node.comparators] if (name := text(side)) is not None]
            found += [text(e) for side in node.comparators if isinstance(side, (ast.Tuple, ast.List, ast.Set))
                      for e in side.elts if text(e) is not None]
    return found


def test_no_module_spells_an_event_name():
    files = [p for top in ("quaero", "trainers") for p in (ROOT / top).rglob("*.py")]
    assert len(files) > 60
    spelled = {rel: found for p in files if (rel := p.relative_to(ROOT).as_posix())
               and (found := literal_event_names(p.read_text(encoding="utf-8")))}
    assert spelled == {}, "declare these in quaero/telemetry/names.py (NAME_EVENT = ...) and log the constant"


def test_the_finder_finds_a_literal_event_name():
    lines = ['log.warning("env_retry", attempt=1)',
             'get_logger(__name__).info("ready")',
             'log.info(names.TRAINER_READY_EVENT)',
             '(log.info if ok else log.warning)("rl_signal")',
             'record = {"event": "events_lost", "events": 3}',
             'if e.get("event") == "resumed" or e["event"] in ("a", "b"):',
             '    print("not an event")']
    source = "\n".join(lines)
    found = literal_event_names(source)
    assert sorted(found) == sorted(["env_retry", "ready", "rl_signal", "events_lost", "resumed", "a", "b"])


def test_event_names_are_declared_once():
    declared = [v for k, v in vars(names).items() if k.endswith("_EVENT")]
    assert len(declared) == len(set(declared)) > 40
