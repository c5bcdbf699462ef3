"""The docs name only things that exist: every repository path and quaero module written in
`docs/architecture.md` and `README.md` (in backticks) is checked against the tree."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["docs/architecture.md", "README.md"]
TOP = ("quaero/", "trainers/", "envs/", "tests/", "examples/", "docs/", "benchmarks/", "scripts/", ".ci/")
ROOT_FILES = ("README.md", "pyproject.toml")
PACKAGES = ("quaero", "trainers", "envs")


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _module_path(dotted: str) -> Path | None:
    """quaero.rows -> quaero/rows.py (or a package folder); None when neither exists."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def named_paths(text: str) -> set[str]:
    """Repository paths: tokens starting with a top-level folder (a trailing `:Class` or `(...)` cut)."""
    found = set()
    for span in _code_spans(text):
        for token in span.split():
            token = token.split(":")[0].rstrip(",.;)")
            is_path = token.startswith(TOP) and re.fullmatch(r"[\w./-]+", token) and "NAME" not in token
            if is_path or token in ROOT_FILES:
                found.add(token)
    return found


def named_modules(text: str) -> set[str]:
    """Dotted module names of quaero's packages, e.g. `quaero.rows` or `envs.toolbench:ToolBenchEnv`."""
    found = set()
    for span in _code_spans(text):
        for token in re.findall(r"\b((?:quaero|trainers|envs)(?:\.\w+)+)(?::\w+)?", span):
            found.add(token)
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_path_exists(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    paths = named_paths(text)
    assert paths, f"{doc}: no repository paths found (the extractor is broken)"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_module_exists(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    missing = sorted(m for m in named_modules(text) if _module_path(m) is None)
    assert not missing, f"{doc} names modules that do not exist: {missing}"


def test_the_checker_catches_a_missing_path():
    text = "see `quaero/no_such_module.py` and `trainers.nothing_here`"
    assert named_paths(text) == {"quaero/no_such_module.py"}
    assert not (ROOT / "quaero/no_such_module.py").exists()
    assert _module_path("trainers.nothing_here") is None
