"""`quaero env serve` (quaero/openenv_client/server.py) with hostile arguments and a broken env: each fails at
start in one line naming what is wrong (the class and its error, the port, the host), and serving beyond
loopback says that the env's code is reachable there. The real CLI; a real uvicorn server for --host
0.0.0.0."""
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from fixtures.runs import ROOT

from quaero import cli

pytestmark = pytest.mark.hostile


@pytest.mark.parametrize("argv, line", [
    (["fixtures.crashing:BrokenInitToolBench", "--port", "0"],
     ("error: fixtures.crashing:BrokenInitToolBench: building the env raised RuntimeError: "
      "TOOLBENCH_API_KEY is "
      "not set; fix its setup (a dataset, file, key or --kwargs it needs?)\n")),
    (["envs.toolbench:ToolBenchEnv", "--port", "70000"],
     "error: --port 70000: a TCP port is 0..65535 (0: any free port)\n"),
])
def test_serve_fails_at_start_in_one_line(capsys, argv, line):
    assert cli.main(["env", "serve", *argv]) == 1
    assert capsys.readouterr().err == line


def test_an_unresolvable_host_is_named(capsys):
    assert cli.main(["env", "serve", "envs.toolbench:ToolBenchEnv", "--host", "no-such-host.invalid",
                     "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --host 'no-such-host.invalid': cannot resolve it (")
    assert err.count("\n") == 1


def test_a_busy_port_is_one_line(capsys):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert cli.main(["env", "serve", "envs.toolbench:ToolBenchEnv", "--port", str(port)]) == 1
    assert capsys.readouterr().err.startswith(f"error: --host 127.0.0.1 --port {port}: cannot listen there (")


@pytest.mark.slow
def test_serving_on_every_interface_warns_that_env_code_runs_there():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    proc = subprocess.Popen([sys.executable, "-m", "quaero.cli", "env", "serve",
                             "envs.toolbench:ToolBenchEnv",
                             "--host", "0.0.0.0", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    assert r.status == 200
                    break
            except OSError:
                time.sleep(0.2)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "env_serve_exposed" in out and "anyone who reaches this address runs the env's code" in out
