"""An env package that depends on `openenv-core` installed next to quaero in a fresh venv (openenv-core from
the package registry): its install overwrites the pinned openenv's files; quaero refuses the mixed install
with the one line to run, and after that line `quaero train` trains on the env at 2 x 2.

The fresh venv holds what the scenario is about: openenv, quaero and the env package (which brings
openenv-core). Everything else (torch, transformers, fastapi, gradio, ...) it sees through a .pth file that
appends this test run's own site-packages after the fresh venv's: installing those from scratch would take
most of the test's time and prove nothing. Being behind, they never shadow the fresh venv's `openenv`, and pip
counts them as installed, so the env package pulls in openenv-core alone (its other dependencies are met)."""
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
from fixtures import REPO_DIR, TESTS_DIR

PACKAGE = TESTS_DIR / "fixtures" / "openenv_core_env"
OPENENV = metadata.version("openenv")
FIX = f"pip install --force-reinstall --no-deps openenv=={OPENENV}"

# Whose files the fresh venv's `openenv` package is, by the sha256 each distribution's RECORD lists, and
# whether its create_app takes state_cls (quaero's server passes it; openenv-core's does not take it).
PROBE = textwrap.dedent("""
    import inspect, json, sys
    from importlib import metadata
    from quaero.openenv_client import block_gradio
    from quaero.openenv_client.loading import file_matches_record
    block_gradio()  # as quaero does: openenv's optional web UI is slow to import and not what is probed
    import openenv
    from openenv.core.env_server.http_server import create_app

    def owns(dist):
        files = [f for f in metadata.distribution(dist).files
                 if f.suffix == ".py" and f.parts[0] == "openenv"]
        return sum(map(file_matches_record, files)) / len(files)

    print(json.dumps({"openenv_file": openenv.__file__, "prefix": sys.prefix,
                      "openenv_dist": str(metadata.distribution("openenv").locate_file("")),
                      "openenv_owns": owns("openenv"), "openenv_core_owns": owns("openenv-core"),
                      "state_cls": "state_cls" in inspect.signature(create_app).parameters}))
""")

RUN = """
[run]
name = "coreboard"
output_dir = "{out}"

[model]
name = "tiny-qwen3"

[env]
entry = "coreboard:SayEnv"
launcher = "local-server"
max_turns = 1

[sampler]
backend = "hf"
max_tokens = 6

[training]
warmup_sft_steps = 1
steps = 1
eval_every = 0
eval_tasks = 0

[rollout]
tasks_per_step = 2
group_size = 2

[logging]
console = "none"
progress = false
"""


def _run(*cmd, cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=cwd, timeout=900)


def _ok(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _fresh_venv(root: Path) -> Path:
    """A venv that sees this test run's site-packages behind its own (see the module docstring); its pip is
    the test run's too, which installs into the venv it runs in."""
    _ok(_run(sys.executable, "-m", "venv", "--without-pip", str(root)))
    python = root / "bin" / "python"
    own = Path(_ok(_run(str(python), "-c",
                        "import sysconfig; print(sysconfig.get_paths()['purelib'])")).stdout.strip())
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (own / "zz-test-run-site-packages.pth").write_text("".join(f"{p}\n" for p in ours))
    return python


@pytest.mark.slow
def test_an_env_package_that_pulls_in_openenv_core_trains_after_the_fix(tmp_path, qwen3_tokenizer):
    python = _fresh_venv(tmp_path / "venv")
    pip, quaero = [str(python), "-m", "pip"], str(tmp_path / "venv" / "bin" / "quaero")
    # quaero as a user has it: the pinned openenv, then quaero (--ignore-installed: the test run's openenv
    # counts as installed, and it must be the fresh venv's own that openenv-core overwrites)
    _ok(_run(*pip, "install", "-q", "--ignore-installed", "--no-deps", f"openenv=={OPENENV}"))
    _ok(_run(*pip, "install", "-q", "--no-deps", str(REPO_DIR)))
    # pulls openenv-core from the registry, over openenv's files
    _ok(_run(*pip, "install", "-q", str(PACKAGE)))

    mixed = json.loads(_ok(_run(str(python), "-c", PROBE, cwd=tmp_path)).stdout)
    # the fresh venv's own openenv (its files and its RECORD), not the test run's
    assert mixed["openenv_file"].startswith(mixed["prefix"]) and mixed["openenv_dist"].startswith(
        mixed["prefix"]
    )
    # openenv-core's files over openenv's
    assert mixed["openenv_core_owns"] == 1.0 and mixed["openenv_owns"] < 1.0
    assert not mixed["state_cls"]  # the server API that crashed local-server and `quaero env serve`

    served = _run(quaero, "env", "serve", "coreboard:SayEnv", cwd=tmp_path)
    assert served.returncode == 1 and FIX in served.stderr and "Traceback" not in served.stderr
    config = tmp_path / "coreboard.toml"
    config.write_text(RUN.format(out=tmp_path / "runs"))
    refused = _run(quaero, "train", str(config), cwd=tmp_path)
    assert refused.returncode != 0 and FIX in refused.stderr and "Traceback" not in refused.stderr

    _ok(_run(*pip, *FIX.split()[1:]))  # the line quaero printed
    fixed = json.loads(_ok(_run(str(python), "-c", PROBE, cwd=tmp_path)).stdout)
    assert (
        fixed["openenv_file"] == mixed["openenv_file"] and fixed["openenv_owns"] == 1.0 and fixed["state_cls"]
    )

    _ok(_run(quaero, "train", str(config), cwd=tmp_path))
    run_dir = tmp_path / "runs" / "coreboard"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (opened,) = [e for e in events if e["event"] == "env_pool_opened"]
    # one per session
    assert (opened["launcher"], opened["sessions"], opened["servers"]) == ("local-server", 4, 4)
    sft, rl = [e for e in events if e["event"] == "train_step"]
    assert sft["phase"] == "sft" and sft["episodes"] == 2 and sft["reward_mean"] == 1.0  # the oracle's demos
    assert (
        sft["rows"] > 0 and sft["action_tokens"] > 0 and sft["echo_tokens"] > 0 and sft["forward_passes"] > 0
    )
    assert rl["phase"] == "rl" and rl["episodes"] == 4 and rl["episodes_dropped"] == 0
    assert events[-1]["event"] == "run_end" and events[-1]["status"] == "finished"
    rows = (run_dir / "rows" / "step-000001.jsonl").read_text().splitlines()
    (row, *_) = [json.loads(line) for line in rows]
    (prompt,) = [qwen3_tokenizer.decode(row["input_ids"][a:b])
                 for kind, a, b, _ in row["spans"] if kind == "prompt"]
    assert "The secret is " in prompt and '"number":{"type":"integer"}' in prompt  # what the model was shown
    review = _run(quaero, "review", str(run_dir), "--require-proof", cwd=tmp_path)
    assert review.returncode == 0, review.stdout + review.stderr
    assert "[PASS] trained at least one step" in review.stdout
