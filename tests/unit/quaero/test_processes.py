"""The servers quaero starts (quaero/processes.py): one registry stops, at exit, every one still running,
env servers and vLLM servers alike; a server stopped by its owner is no longer in it."""
import sys

from quaero import processes
from quaero.sampling.supervisor import ServedProcess


def test_what_is_left_running_is_stopped_at_exit_and_what_was_stopped_is_forgotten():
    stopped = []
    processes.stop_at_exit("a", lambda: stopped.append("a"))
    processes.stop_at_exit("b", lambda: stopped.append("b"))
    processes.forget_at_exit("a")  # its owner stopped it
    try:
        processes._stop_all()
    finally:
        processes.forget_at_exit("b")
    assert stopped == ["b"]


def test_a_supervised_server_left_running_is_stopped_at_exit(tmp_path):
    server = ServedProcess([sys.executable, "-c", "import time; time.sleep(60)"], "http://127.0.0.1:9",
                           name="sleeper", log_dir=tmp_path)
    server.launch()
    assert server.alive() and processes._LIVE.get(server) == server.close
    proc = server.proc
    processes._stop_all()  # what atexit runs
    assert proc.poll() is not None and server not in processes._LIVE
