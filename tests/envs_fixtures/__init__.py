"""Test-only OpenEnv environments, outside quaero, plugged in by dotted name or URL, plus a helper
that serves one with the real `quaero env serve` CLI."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent
REPO_DIR = TESTS_DIR.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(entry: str, max_concurrent_envs: int = 8, timeout_s: float = 60.0):
    """`quaero env serve ENTRY` in a subprocess on 127.0.0.1; yields (url, proc); killed by pid."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(REPO_DIR), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryFile() as log:  # not a pipe: a chatty server must never block on a full pipe
        proc = subprocess.Popen([sys.executable, "-m", "quaero.cli", "env", "serve", entry, "--port", str(port),
                                 "--max-concurrent-envs", str(max_concurrent_envs)], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, port, log, timeout_s)
            yield f"ws://127.0.0.1:{port}", proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_healthy(proc: subprocess.Popen, port: int, log, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"quaero env serve exited: {log.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
