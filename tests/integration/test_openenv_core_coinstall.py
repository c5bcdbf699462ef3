"""An env package that depends on `openenv-core` installed next to quaero in a fresh venv (from the package
registry): its install overwrites the pinned openenv's files; quaero refuses the mixed install with the one
line to run, and after that line a local-server pool serves the env and plays its episodes."""
import os
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest
from fixtures import REPO_DIR, TESTS_DIR

PACKAGE = TESTS_DIR / "fixtures" / "openenv_core_env"
OPENENV = metadata.version("openenv")

PLAY = textwrap.dedent("""
    from quaero.config import EnvConfig
    from quaero.openenv_client import open_envs

    with open_envs(EnvConfig(entry="coreboard:SayEnv", launcher="local-server"), 2) as pool:
        rewards = []
        for seed, env in enumerate(pool.sessions, start=3):
            start = env.reset(seed=seed)
            rewards.append(env.step({"role": "assistant", "content": '{"number": %d}' % start.info["secret"]}).reward)
        print("servers", len(pool.servers), "rewards", rewards)
""")


def _run(*cmd, cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=cwd, timeout=900)


def _ok(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_an_env_package_that_pulls_in_openenv_core(tmp_path):
    _ok(_run(sys.executable, "-m", "venv", str(tmp_path / "venv")))
    python, pip = str(tmp_path / "venv" / "bin" / "python"), [str(tmp_path / "venv" / "bin" / "python"), "-m", "pip"]
    _ok(_run(*pip, "install", "-q", f"openenv=={OPENENV}", "structlog>=24.1", "pydantic>=2", "uvicorn",
             "websockets>=15", "fastmcp>=3,<4"))
    _ok(_run(*pip, "install", "-q", "--no-deps", str(REPO_DIR)))
    _ok(_run(*pip, "install", "-q", str(PACKAGE)))  # pulls openenv-core, over openenv's files
    assert _ok(_run(*pip, "show", "openenv-core")).stdout

    served = _run(python, "-m", "quaero.cli", "env", "serve", "coreboard:SayEnv", cwd=tmp_path)
    fix = f"pip install --force-reinstall --no-deps openenv=={OPENENV}"
    assert served.returncode == 1 and fix in served.stderr and "Traceback" not in served.stderr
    refused = _run(python, "-c", PLAY, cwd=tmp_path)
    assert refused.returncode != 0 and fix in refused.stderr

    _ok(_run(*pip, *fix.split()[1:]))  # the line quaero printed
    played = _ok(_run(python, "-c", PLAY, cwd=tmp_path))
    assert "servers 2 rewards [1.0, 1.0]" in played.stdout
