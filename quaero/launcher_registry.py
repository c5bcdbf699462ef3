"""Env launchers (the `[env] launcher` values): how sessions reach an env, and what each declares; importable
without openenv.

quaero/config/ takes the launcher names and its `[env]` rules from here (a launcher that starts the env
needs `entry`, one that connects needs `url`/`urls`); `open_envs` (quaero/openenv_client/pool.py) opens a
pool's sessions through the launcher's `open` function. Adding a launcher is that function and one entry
here.
"""
from __future__ import annotations

from dataclasses import dataclass

from quaero.resolve import resolve_name


@dataclass(frozen=True)
class Launcher:
    # "package.module:function": open(cfg, spec, n, counts, log_dir) -> Launched
    # (quaero/openenv_client/pool.py);
    # spec is the loaded [env] entry, None for a launcher that does not start the env
    open: str
    starts_env: bool  # quaero starts the env from [env] entry (kwargs, action); else it connects to url/urls
    about: str  # one line for docs/reference.md


LAUNCHERS: dict[str, Launcher] = {
    "inprocess": Launcher("quaero.openenv_client.pool:open_inprocess", True,
                          "an env instance per session, in this process"),
    "local-server": Launcher("quaero.openenv_client.pool:open_local_servers", True,
                             "env servers quaero starts (uvicorn on `host`), one per session for an env "
                             "without concurrent sessions"),
    "remote": Launcher("quaero.openenv_client.pool:open_remote", False,
                       "running OpenEnv servers at `url` or `urls`, sessions spread over them"),
}
DEFAULT = "inprocess"
# a url implies CONNECTING[0]
CONNECTING = tuple(name for name, launcher in LAUNCHERS.items() if not launcher.starts_env)


def opener(name: str):
    """Import and return launcher `name`'s open function."""
    return resolve_name(LAUNCHERS[name].open, f"quaero/launcher_registry.py LAUNCHERS[{name!r}].open",
                        want=callable, wanted="a function")
