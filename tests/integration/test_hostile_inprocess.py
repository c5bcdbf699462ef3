"""An in-process env stuck in its own code (quaero/openenv_client/transport.py InProcessTransport): its call
is abandoned after [env] reset_timeout_s, and the stuck thread, a daemon, never holds the process at exit (a
ThreadPoolExecutor worker did: a run logged run_end and its process never exited). A real subprocess."""
import os
import subprocess
import sys
import time

import pytest
from fixtures.runs import ROOT

pytestmark = pytest.mark.hostile

SCRIPT = """
from quaero.openenv_client.loading import load_entry
from quaero.openenv_client.transport import EnvFault, InProcessTransport

transport = InProcessTransport(load_entry("fixtures.hanging:HangingResetEnv"))
try:
    transport.reset({"seed": 0}, 0.5)
except EnvFault as e:
    print("dropped:", e.kind, e)
transport.close()
print("done", flush=True)
"""


@pytest.mark.slow
def test_a_process_whose_in_process_env_hangs_in_reset_exits():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["dropped: timeout timeout: reset took longer than 0.5s", "done"]
    assert time.monotonic() - t0 < 30  # closing waits 5 s for the abandoned session at most
