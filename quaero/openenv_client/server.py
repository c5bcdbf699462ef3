"""Serving OpenEnv envs: `serve` (blocking, for `quaero env serve`) and `LocalServer` (the
`local-server` launcher: a uvicorn subprocess of this interpreter on 127.0.0.1; `start_env_servers` starts
a pool of them at once).

LocalServer binds the listening socket itself and hands it to the child, so the port is known
without a race and survives restarts: a client reconnecting during a restart just waits in the
backlog for the new server. The child is stopped by its pid at close and at exit, and exits by
itself when the parent process is gone.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from quaero.processes import (
    ServerStartError,
    child_env,
    forget_at_exit,
    log_file,
    start_together,
    stop_at_exit,
)
from quaero.telemetry import names
from quaero.telemetry.runlog import error_line, first_text_line, get_logger

from .loading import EnvSpec, load_entry
from .transport import observation_reply_model

log = get_logger(__name__)


def build_app(spec: EnvSpec, max_concurrent_envs: int) -> Any:
    """OpenEnv's own FastAPI app for the env (WebSocket /ws, /health, /schema, /mcp, ...)."""
    from openenv.core.env_server import http_server
    from openenv.core.env_server.http_server import create_app

    # the app looks its frame model up by this name: NaN/inf rewards then reach clients as such, not as null
    http_server.WSObservationResponse = observation_reply_model()
    env_name = spec.env_cls.__name__.lower()
    return create_app(spec.factory, spec.action_cls, spec.observation_cls, env_name=env_name,
                      max_concurrent_envs=max_concurrent_envs, state_cls=spec.state_cls)


class ServeError(RuntimeError):
    """`quaero env serve` cannot start: the env cannot be built, or the address cannot be listened on."""


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); ServeError naming the host or port when there is none."""
    if not 0 <= port <= 65535:
        raise ServeError(f"--port {port}: a TCP port is 0..65535 (0: any free port)")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise ServeError(f"--host {host!r}: cannot resolve it ({e.strerror}); use an address such as "
                         "127.0.0.1 or a name this machine resolves") from None
    try:
        return socket.create_server((host, port), family=family, backlog=256)
    except OSError as e:
        raise ServeError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); choose a "
                         "free port or an address of this machine") from None


def check_builds(spec: EnvSpec) -> None:
    """Build one instance of the env (and close it): an env whose construction raises fails at start in one
    line, not with a traceback per session, and never reaches a client as an HTTP 500."""
    try:
        env = spec.factory()
    except Exception as e:  # noqa: BLE001 - the env's own failure, reported in one line
        raise ServeError(f"{spec.entry}: building the env raised {error_line(e)}; fix its setup (a dataset, "
                         "file, key or --kwargs it needs?)") from None
    with contextlib.suppress(Exception):
        env.close()


def serve(entry: str, host: str = "127.0.0.1", port: int = 8000, max_concurrent_envs: int = 16,
          fd: int | None = None, parent_pid: int | None = None, kwargs: dict | None = None,
          action: str | None = None) -> None:
    """Serve any OpenEnv env (`module:Class`) with OpenEnv's own app; blocks until stopped. fd: serve on an
    inherited listening socket; parent_pid: exit when that process is gone (both for LocalServer); action:
    `[env] action`, for an env that names no Action class itself. One instance is built first
    (`check_builds`); ServeError when it cannot be, or when (host, port) cannot be listened on."""
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    import uvicorn

    sock = socket.socket(fileno=fd) if fd is not None else listen(host, port)
    if fd is None and host not in LOOPBACK:
        log.warning(names.ENV_SERVE_EXPOSED_EVENT, host=host, port=port,
                    note="listening beyond this machine: anyone who reaches this address runs the env's code "
                    "through its sessions; serve on 127.0.0.1 unless that is meant")
    spec = load_entry(entry, kwargs, action)
    if fd is None:  # `quaero env serve`; a LocalServer's env was loaded by the run, whose sessions report it
        check_builds(spec)
    if max_concurrent_envs > 1 and not spec.supports_concurrency:
        log.warning(names.ENV_SERVE_SINGLE_SESSION_EVENT, entry=entry, requested=max_concurrent_envs,
                    reason="SUPPORTS_CONCURRENT_SESSIONS is False; serving one session at a time")
        max_concurrent_envs = 1
    app = build_app(spec, max_concurrent_envs)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", ws_ping_interval=None)
    uvicorn.Server(config).run(sockets=[sock])


def _exit_with_parent(parent_pid: int) -> None:
    """In the server child: exit when the process that launched it is gone (even after SIGKILL, when no
    atexit runs). Polling the parent pid, unlike PR_SET_PDEATHSIG, ties the child to the parent process,
    not to the thread that happened to start it."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="quaero-parent-watch").start()


# "ValueError: signal only works in ..."
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b.*:")


class LocalServer:
    def __init__(self, entry: str, host: str = "127.0.0.1", max_concurrent_envs: int = 16,
                 start_timeout_s: float = 60.0, kwargs: dict | None = None, action: str | None = None,
                 log_dir: Path | None = None) -> None:
        self.entry, self.host, self.kwargs, self.action = entry, host, dict(kwargs or {}), action
        self.max_concurrent_envs, self.start_timeout_s = max_concurrent_envs, start_timeout_s
        self._sock = socket.create_server((host, 0), backlog=256)
        self._sock.set_inheritable(True)
        self.port = self._sock.getsockname()[1]
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        # a run keeps its servers' logs (runs/NAME/env-servers/); without a run folder the log is a temp file,
        # removed at stop (a failed start names it in its error, and that path never reaches stop)
        self._log_path, self._temp_log = log_file(log_dir, f"server-{self.port}")

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}/ws"

    def start(self) -> LocalServer:
        return start_env_servers([self])[0]

    def _spawn(self) -> None:
        self._launch()
        self._wait_healthy()

    def _launch(self) -> None:
        env = child_env()  # the child must import whatever the parent can (tests add folders to sys.path)
        cmd = [sys.executable, "-m", "quaero.openenv_client", "serve", self.entry, "--fd",
               str(self._sock.fileno()),
               "--host", self.host, "--port", str(self.port), "--max-concurrent-envs",
               str(self.max_concurrent_envs),
               "--parent-pid", str(os.getpid()), "--kwargs", json.dumps(self.kwargs)]
        if self.action:
            cmd += ["--action", self.action]
        # a session of its own: a terminal's Ctrl-C (sent to the whole foreground group) is for quaero, which
        # finishes the step on these servers and then stops them; they still exit with their parent
        # (--parent-pid)
        with self._log_path.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         pass_fds=(self._sock.fileno(),), stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def _launch_tracked(self) -> None:
        with self._lock:
            self._launch()
        stop_at_exit(self, self.stop)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self._log_path.read_text(errors="replace")[-2000:]
                raise ServerStartError(f"env server for {self.entry!r} exited with {self.proc.returncode} "
                                       f"before becoming healthy; its log ({self._log_path}):\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.http_url}/health", timeout=1.0) as r:
                    if r.status == 200:
                        log.info(names.ENV_SERVER_STARTED_EVENT,
                                 entry=self.entry, url=self.http_url, pid=self.proc.pid)
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self._kill()
        raise ServerStartError(f"env server for {self.entry!r} not healthy after {self.start_timeout_s}s "
                               f"([env] server_start_timeout_s); log: {self._log_path}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_hint(self, wait_s: float = 2.0) -> str:
        """"; its log (PATH) ends in: <the last exception line>", for a one-line error about a request this
        server answered with a failure (the env raised inside it: the reason is only in its log); "" without
        one. The server logs the traceback after it has answered: up to `wait_s` for it to arrive."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                text = self._log_path.read_text(errors="replace")
            except OSError:
                return ""
            lines = text.splitlines()
            found = [i for i, line in enumerate(lines) if _EXCEPTION_LINE.match(line)]
            if found:
                line = lines[found[-1]].strip()
                if line.endswith(":"):  # its message starts on the next lines (nltk's LookupError)
                    rest = first_text_line("\n".join(lines[found[-1] + 1:]))
                    line = f"{line} {rest}".rstrip()
                return f"; its log ({self._log_path}) ends in: {line[:300]}"
            if time.monotonic() > deadline:
                return ""
            time.sleep(0.05)

    def ensure_alive(self, grace_s: float = 0.0) -> bool:
        """Restart the server if it died (once, however many sessions notice); True if it restarted.
        `grace_s`: how long a server that is still running may take to be seen gone. A session lost to a
        dying server sees its socket close before the process is reaped (the kernel closes a process's files
        before it reports the exit), so one look right after the loss can find it alive and leave the restart
        to a later step."""
        with self._lock:
            if self.proc is None:
                return False
            if grace_s > 0:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=grace_s)
            if self.alive():
                return False
            log.warning(names.ENV_SERVER_DIED_EVENT, entry=self.entry, pid=self.proc.pid,
                        returncode=self.proc.returncode)
            self._spawn()
            return True

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def stop(self, keep_log: bool = False) -> None:
        with self._lock:
            self._kill()
            self.proc = None
        self._sock.close()
        forget_at_exit(self)
        if self._temp_log and not keep_log:
            self._log_path.unlink(missing_ok=True)


def start_env_servers(servers: list[LocalServer]) -> list[LocalServer]:
    """Launch every server, then wait for each to be healthy (`start_together`): they boot in parallel."""
    return start_together(servers, launch=LocalServer._launch_tracked, wait=LocalServer._wait_healthy,
                          stop=LocalServer.stop)
