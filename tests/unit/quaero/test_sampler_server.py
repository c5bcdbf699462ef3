"""Server mode without vLLM: the config rules, and the server process's fault paths (a server that dies
at startup names its log; close() leaves no process of its group behind)."""
from __future__ import annotations

import os
import sys
import time

import pytest

from quaero.config import ConfigError, QuaeroConfig, check_rules
from quaero.sampling.launch import ServedProcess, ServerStartError, free_port, start_all


def _cfg(**sampler) -> QuaeroConfig:
    return QuaeroConfig.model_validate({"env": {"entry": "x:y"}, "sampler": sampler})


@pytest.mark.parametrize("sampler, match", [
    ({"mode": "server", "backend": "hf"}, r"\[sampler\] mode='server' with backend='hf'.*set backend = 'vllm'"),
    ({"urls": ["http://127.0.0.1:8000"]}, r"\[sampler\] urls=.* with mode='colocated'.*set mode = 'server'"),
    ({"mode": "server", "servers": 2, "urls": ["http://127.0.0.1:8000"]}, r"servers=2 and urls=.*remove one"),
    ({"mode": "server", "urls": ["127.0.0.1:8000"]}, r"urls: '127.0.0.1:8000' is not a server address"),
])
def test_server_mode_config_rules(sampler, match):
    with pytest.raises(ConfigError, match=match):
        check_rules(_cfg(**sampler), "run.toml")


def test_server_mode_config_accepts_auto_vllm_and_urls():
    for sampler in ({"mode": "server"}, {"mode": "server", "backend": "vllm", "servers": 2},
                    {"mode": "server", "urls": ["http://127.0.0.1:8000", "http://10.0.0.2:8001/"]}):
        check_rules(_cfg(**sampler), "run.toml")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split(") ")[-1][0] != "Z"


def test_a_server_that_exits_at_startup_names_its_log_tail(tmp_path):
    crash = [sys.executable, "-c", "import sys; print('loading model...'); print('boom: no such model'); sys.exit(3)"]
    p = ServedProcess(crash, f"http://127.0.0.1:{free_port()}", name="vllm-0", log_dir=tmp_path)
    with pytest.raises(ServerStartError, match=r"(?s)vllm-0 exited with 3 before answering .*/health; its log "
                                               r"\(.*vllm-0\.log\) ends:.*boom: no such model"):
        start_all([p], timeout_s=30)
    assert p.proc is None and (tmp_path / "vllm-0.log").exists()  # stopped, log kept


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    p = ServedProcess([sys.executable, "-c", "import time; time.sleep(600)"], f"http://127.0.0.1:{free_port()}",
                      name="vllm-0", log_dir=tmp_path)
    with pytest.raises(ServerStartError, match=r"did not answer .* within 1s \(\[sampler\] server_start_timeout_s\)"):
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
