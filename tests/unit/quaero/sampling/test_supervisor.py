"""The server process (quaero/sampling/supervisor.py): a server that dies at startup names its log, one that
never answers times out and is stopped, close() leaves no process of its group behind, and a stop request
ends the wait for a server still starting."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from quaero.sampling.supervisor import ServedProcess, ServerStartError, free_port, start_all


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split(") ")[-1][0] != "Z"


def test_a_server_that_exits_at_startup_names_its_log_tail(tmp_path):
    crash = [sys.executable, "-c", ("import sys; print('loading model...'); print('boom: no such model'); "
                                   "sys.exit(3)")]
    p = ServedProcess(crash, f"http://127.0.0.1:{free_port()}", name="vllm-0", log_dir=tmp_path)
    with pytest.raises(ServerStartError, match=r"(?s)vllm-0 exited with 3 before answering .*/health; its "
                                               r"log \(.*vllm-0\.log\) ends:.*boom: no such model"):
        start_all([p], timeout_s=30)
    assert p.proc is None and (tmp_path / "vllm-0.log").exists()  # stopped, log kept


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    p = ServedProcess([sys.executable, "-c", "import time; time.sleep(600)"],
                                                                           f"http://127.0.0.1:{free_port()}",
                      name="vllm-0", log_dir=tmp_path)
    with pytest.raises(ServerStartError, match=r"did not answer .* within 1s \(\[sampler\] "
                                               r"server_start_timeout_s\)"):
        start_all([p], timeout_s=1)
    assert p.proc is None


def test_close_stops_the_server_and_its_children(tmp_path):
    """vLLM's API server forks engine processes: close() stops the whole group, not the supervisor alone."""
    port = free_port()
    pidfile = tmp_path / "child.pid"
    server = (f"import http.server, subprocess, sys, pathlib\n"
              f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              f"pathlib.Path({str(pidfile)!r}).write_text(str(c.pid))\n"
              f"class H(http.server.BaseHTTPRequestHandler):\n"
              f"    def do_GET(self): self.send_response(200); self.end_headers()\n"
              f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    p = ServedProcess([sys.executable, "-c", server], f"http://127.0.0.1:{port}", name="vllm-0")
    start_all([p], timeout_s=30)
    supervisor = p.proc.pid
    child = int(pidfile.read_text())
    assert _alive(supervisor) and _alive(child)
    log = p.log_path
    t0 = time.monotonic()
    p.close()
    assert not _alive(supervisor) and not _alive(child)
    assert time.monotonic() - t0 < 12 and not log.exists()  # a temp log goes with the server


def test_a_stop_request_ends_the_wait_for_a_server_still_starting(tmp_path):
    """SIGTERM while quaero's `vllm serve` boots: no step has begun, so there is none to finish; the wait
    ends and the server is stopped (was: the run waited out server_start_timeout_s, then trained a step)."""
    from quaero.recipe.stop import StopRequest

    booting = ServedProcess([sys.executable, "-c", "import time; time.sleep(120)"],
                            f"http://127.0.0.1:{free_port()}", name="booting", log_dir=tmp_path)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    t0 = time.monotonic()
    with StopRequest() as stop, pytest.raises(KeyboardInterrupt):
        start_all([booting], timeout_s=600.0)
    assert stop.requested and time.monotonic() - t0 < 15
    assert booting.proc is None and not booting.alive()  # stopped with its process group
