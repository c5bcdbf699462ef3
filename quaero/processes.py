"""Server processes quaero starts and owns: env servers (`quaero/openenv_client/server.py`) and vLLM servers
(`quaero/sampling/supervisor.py`). What both do alike: the child's import path, the log file, and starting
several at once, and stopping at exit whatever is still running. Imports nothing heavy: the vLLM servers'
supervisor runs supervisor.py as a small script.
"""
from __future__ import annotations

import atexit
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

S = TypeVar("S")
_LIVE: dict[object, Callable[[], None]] = {}  # what this process started and has not stopped yet


class ServerStartError(RuntimeError):
    """A server exited or never answered its health check; the message names its log."""


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) with a PYTHONPATH that lets the child import whatever
    this process can (tests and user configs add folders to sys.path)."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [out.get("PYTHONPATH",
                                                                              "")]).rstrip(os.pathsep)
    return out


def log_file(log_dir: Path | None, name: str) -> tuple[Path, bool]:
    """Where server `name` logs, and whether that file is temporary: `log_dir/NAME.log` in a run folder
    (kept), else a temp file (its owner removes it at stop, unless the start failed: the error names it)."""
    if log_dir is None:
        fd, path = tempfile.mkstemp(prefix=f"quaero-{name}-", suffix=".log")
        os.close(fd)
        return Path(path), True
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    return Path(log_dir) / f"{name}.log", False


def start_together(servers: list[S], *, launch: Callable[[S], None], wait: Callable[[S], None],
                   stop: Callable[..., None]) -> list[S]:
    """Launch every server, then wait for each: they boot in parallel, not one after another. If one fails,
    all are stopped (`stop(server, keep_log=...)`); the one that failed keeps its log, which its error
    names."""
    waiting = None
    try:
        for server in servers:
            launch(server)
        for waiting in servers:
            wait(waiting)
    except BaseException:
        for server in servers:
            stop(server, keep_log=server is waiting)
        raise
    return servers


def stop_at_exit(server: object, stop: Callable[[], None]) -> None:
    """Call `stop()` when this process exits, unless `forget_at_exit(server)` came first: a server quaero
    started never outlives a process that did not close it (an error, a missed `close`)."""
    _LIVE[server] = stop


def forget_at_exit(server: object) -> None:
    """`server` was stopped: nothing left to do for it at exit."""
    _LIVE.pop(server, None)


@atexit.register
def _stop_all() -> None:
    for stop in list(_LIVE.values()):
        stop()
