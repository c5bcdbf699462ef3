"""Server processes a sampler owns (`[sampler] mode = "server"`): start, wait until healthy, stop.

Each server runs under a small supervisor, `python quaero/sampling/supervisor.py --parent-pid PID --
PROGRAM...`, in a session of its own: a terminal's Ctrl-C (sent to the whole foreground group) is for quaero,
which finishes its step and then stops the servers, and it cannot reach vLLM's engine processes mid-step (the
colocated engine is kept out of it by running in quaero's process, quaero/sampling/vllm.py). The supervisor
stops its whole process group when the parent is gone, also after a SIGKILL that leaves no atexit to run;
`close()` stops the group too, so vLLM's engine-core and worker children never outlive the run.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from quaero.processes import (
    ServerStartError,
    child_env,
    forget_at_exit,
    log_file,
    start_together,
    stop_at_exit,
)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (vLLM binds its own socket: another process could take it first, a rare failed
    start)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServedProcess:
    """One server program, supervised in its own process group; `url` answers `GET /health` once ready."""

    def __init__(self, argv: list[str], url: str, *, name: str, log_dir: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.argv, self.url, self.name, self.env = list(argv), url.rstrip("/"), name, env
        self.proc: subprocess.Popen | None = None
        self.log_path, self._temp_log = log_file(log_dir, name)  # runs/NAME/sampler-servers/ in a run

    def launch(self) -> None:
        # the server imports quaero (vLLM's worker extension) from where this process does
        env = child_env(self.env)
        # run as a file: the supervisor stays a small process (the package would import torch)
        cmd = [sys.executable, os.path.abspath(__file__), "--parent-pid", str(os.getpid()), "--", *self.argv]
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        stop_at_exit(self, self.close)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        """Until `url` answers /health: raises ServerStartError past `timeout_s` or when the server exits,
        KeyboardInterrupt at a stop request (`quaero train`'s first Ctrl-C or SIGTERM: no step has begun, so
        there is none to finish; `start_together` stops the servers)."""
        from quaero.bounded import STOP_REQUESTED  # here: this file also runs as the small supervisor

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if STOP_REQUESTED.is_set():
                raise KeyboardInterrupt
            if self.proc.poll() is not None:
                raise ServerStartError(f"{self.name} exited with {self.proc.returncode} before answering "
                                       f"{self.url}/health; its log ({self.log_path}) "
                                       f"ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as r:
                    if r.status == 200:
                        from quaero.telemetry import names
                        from quaero.telemetry.runlog import get_logger

                        get_logger(__name__).info(names.SAMPLER_SERVER_STARTED_EVENT,
                                                  name=self.name, url=self.url,
                                                  pid=self.proc.pid, start_s=round(time.monotonic() - t0, 1),
                                                  log=str(self.log_path))
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise ServerStartError(f"{self.name} did not answer {self.url}/health within {timeout_s:g}s "
                               f"([sampler] server_start_timeout_s); its log ({self.log_path}) "
                               f"ends:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self, keep_log: bool = False) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL to whatever is left after 10 s."""
        if self.proc is not None:
            _stop_group(self.proc)
            self.proc = None
        forget_at_exit(self)
        if self._temp_log and not keep_log:
            self.log_path.unlink(missing_ok=True)


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    pgid = proc.pid  # start_new_session: the supervisor leads its group
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (proc.poll() is None or _group_alive(pgid)):
        time.sleep(0.1)
    _signal_group(pgid, signal.SIGKILL)
    proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def start_all(procs: list[ServedProcess], timeout_s: float) -> list[ServedProcess]:
    """Launch every server, then wait for each (`start_together`): they boot in parallel."""
    return start_together(procs, launch=ServedProcess.launch, wait=lambda p: p.wait_ready(timeout_s),
                          stop=ServedProcess.close)


def supervise(parent_pid: int, argv: list[str]) -> int:
    """In the supervisor: run argv as a child in this process group; stop the group when the parent is
    gone."""
    child = subprocess.Popen(argv)

    def watch() -> None:
        while os.getppid() == parent_pid and child.poll() is None:
            time.sleep(1.0)
        if child.poll() is None:
            os.killpg(os.getpgrp(), signal.SIGTERM)
            time.sleep(10.0)
            os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="quaero-parent-watch").start()
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())  # close(): the child shuts down, then we exit
    return child.wait()


def main(args: list[str]) -> int:
    if len(args) < 4 or args[0] != "--parent-pid" or args[2] != "--":
        print("usage: python quaero/sampling/supervisor.py --parent-pid PID -- PROGRAM [ARGS...]",
              file=sys.stderr)
        return 2
    return supervise(int(args[1]), args[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
