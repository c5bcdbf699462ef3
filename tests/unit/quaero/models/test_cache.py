"""A named model's folder in the cache against its deterministic build (quaero/models/cache.py): a build
killed half way leaves nothing for good, a damaged folder is built again (said), an edited one is refused."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import structlog

from quaero.models import cache
from quaero.models.base import ModelNotFound

pytestmark = pytest.mark.hostile


@pytest.fixture(scope="module")
def first_build(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    old = os.environ.get("QUAERO_CACHE")
    os.environ["QUAERO_CACHE"] = str(root)
    try:
        cache.materialize_named("tiny-qwen3")
    finally:
        os.environ.pop("QUAERO_CACHE") if old is None else os.environ.update(QUAERO_CACHE=old)
    return root


@pytest.fixture
def built(first_build, tmp_path, monkeypatch):
    """tiny-qwen3 as its build wrote it, in a cache of this test's own (a copy: a build once per module)."""
    shutil.copytree(first_build, tmp_path / "cache")
    monkeypatch.setenv("QUAERO_CACHE", str(tmp_path / "cache"))
    return cache.named_folder("tiny-qwen3")


def _rebuilt(folder):
    with structlog.testing.capture_logs() as logs:
        assert cache.materialize_named("tiny-qwen3") == folder
    return [e for e in logs if e.get("damaged")]


def test_a_build_killed_half_way_leaves_no_folder_behind_for_good(built):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    left = {}
    for name, builder, age in (("killed", {"pid": int(dead.stdout), "host": os.uname().nodename}, 0),
                               ("running", {"pid": os.getpid(), "host": os.uname().nodename}, 0),
                               ("old-unsaid", None, 2 * cache.STALE_S), ("new-unsaid", None, 0)):
        tmp = built.parent / f".{built.name}-{name}"
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"\0" * 1000)  # half a build's weights
        if builder:
            (tmp / cache.BUILDER_FILE).write_text(json.dumps(builder))
        os.utime(tmp, (os.path.getmtime(tmp) - age,) * 2)
        left[name] = tmp
    cache.materialize_named("tiny-qwen3")
    assert {n for n, tmp in left.items() if tmp.exists()} == {"running", "new-unsaid"}
    assert json.loads((built / cache.BUILD_FILE).read_text())["weights_bytes"] > 0


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_built_folder_is_built_again_and_said(built, damage):
    weights = built / "model.safetensors"
    size = weights.stat().st_size
    if damage == "truncate":
        os.truncate(weights, size // 2)
    else:
        weights.unlink()
    (said,) = _rebuilt(built)
    assert "is damaged" in said["note"] and weights.stat().st_size == size
    assert _rebuilt(built) == []  # and then used as it is


@pytest.mark.parametrize("edit", ["chat_template.jinja", "tokenizer_config.json", "extra.jinja"])
def test_a_named_models_folder_changed_since_its_build_is_refused_in_one_line(built, edit):
    (built / edit).write_text("{{ messages }}", encoding="utf-8")
    with pytest.raises(ModelNotFound) as e:
        cache.materialize_named("tiny-qwen3")
    assert str(e.value).startswith(f"{built}: {edit} changed since quaero built this named model; copy the "
                                   "folder elsewhere") and "\n" not in str(e.value)
    assert (built / edit).read_text() == "{{ messages }}"  # never replaced: it may be someone's edit


def test_the_build_says_it_builds_now_whichever_command_builds(tmp_path, monkeypatch):
    """`quaero check` of a SmolLM2 config builds the model (its tokenizer lives in the folder): the line it
    logged said 'the first run builds it once' while check wrote the folder itself."""
    monkeypatch.setenv("QUAERO_CACHE", str(tmp_path))
    with structlog.testing.capture_logs() as logs:
        cache.materialize_named("tiny-qwen3")
    (said,) = [e for e in logs if e.get("note", "").startswith("tiny-qwen3 is not built yet")]
    assert "building it once now into" in said["note"] and "first run" not in said["note"]
    # check's line for a shape it leaves to the first run
    assert "the first run builds it once" in cache.build_note("tiny-qwen3")
