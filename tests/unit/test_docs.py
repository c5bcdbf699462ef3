"""The docs name only things that exist and say what the code says: every repository path and quaero
module written in README.md and docs/*.md (in backticks) is checked against the tree, and the generated
reference tables of docs/reference.md against the config schema and the metric names' owners."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
        "benchmarks/README.md", "benchmarks/FIELDS.md", "benchmarks/HISTORY.md"]
TOP = ("quaero/", "trainers/", "envs/", "tests/", "examples/", "docs/", "benchmarks/", "scripts/", ".ci/")
ROOT_FILES = ("README.md", "pyproject.toml")
PACKAGES = ("quaero", "trainers", "envs")


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _module_path(dotted: str) -> Path | None:
    """quaero.rollout.rows -> quaero/rollout/rows.py (or a package folder); None when neither exists."""
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
    """Dotted module names of quaero's packages, e.g. `quaero.rollout.rows` or
    `envs.toolbench:ToolBenchEnv`."""
    found = set()
    for span in _code_spans(text):
        for token in re.findall(r"\b((?:quaero|trainers|envs|benchmarks)(?:\.\w+)+)(?::\w+)?", span):
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


def test_the_docs_pages_are_all_checked():
    assert {"README.md", "docs/architecture.md", "docs/reference.md", "docs/environments.md",
            "docs/scaling.md", "docs/after-training.md", "benchmarks/README.md", "benchmarks/FIELDS.md",
            "benchmarks/HISTORY.md"} <= set(DOCS)


def _gen_reference():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_config_key_and_metric_has_a_meaning():
    assert _gen_reference().problems() == []


def test_the_generated_reference_tables_match_the_code():
    gen = _gen_reference()
    current = gen.REFERENCE.read_text(encoding="utf-8")
    assert gen.render(current) == current, (
        "docs/reference.md drifted from the code: run python scripts/gen_reference.py"
    )


def test_the_reference_lists_every_config_key():
    from quaero.config import EnvConfig, MixtureEnv, QuaeroConfig

    text = (ROOT / "docs/reference.md").read_text(encoding="utf-8")
    for section, field in QuaeroConfig.model_fields.items():
        model = {"env": EnvConfig, "envs": MixtureEnv}.get(section, field.annotation)
        for key in model.model_fields:
            if section == "envs" and key in EnvConfig.model_fields:
                continue  # [[envs]] has every [env] key, listed under [env]
            assert f"| `[{section}]` | `{key}` |" in text or key in ("options",
                                                                     "tasks"), f"[{section}] {key} missing"
    for key in (
        QuaeroConfig.model_fields["env"].annotation.__args__[0].model_fields["tasks"].annotation.model_fields
    ):
        assert f"| `[env.tasks]` | `{key}` |" in text, f"[env.tasks] {key} missing"


def test_the_drift_check_catches_a_stale_table(tmp_path, monkeypatch):
    gen = _gen_reference()
    stale = gen.REFERENCE.read_text(encoding="utf-8").replace("| `[run]` | `seed` | int | `0` |",
                                                               "| `[run]` | `seed` | int | `1` |")
    assert gen.render(stale) != stale
    page = tmp_path / "reference.md"
    page.write_text(stale, encoding="utf-8")
    monkeypatch.setattr(gen, "REFERENCE", page)
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0


def test_an_undeclared_or_unemitted_metric_is_a_problem(monkeypatch):
    from quaero.telemetry import metrics, names

    gen = _gen_reference()
    rollout, recipe = (next(t for t in names.TABLES if t.title == title)
                       for title in ("Rollout", "Recipe, per step"))
    monkeypatch.setattr(rollout, "names", [n for n in rollout.names if n != names.ENV_RETRIES])
    monkeypatch.setattr(recipe, "names", [*recipe.names, "no_such_metric"])
    monkeypatch.setitem(metrics.METRICS, "no_such_metric",
                        metrics.Metric("no_such_metric", metrics.SUM, "gone", recipe.title))
    found = gen.problems()
    assert any("'env_retries' is not declared in quaero/telemetry/names.py" in p for p in found)
    assert any("'no_such_metric' is not emitted by quaero/recipe/train.py" in p for p in found)
