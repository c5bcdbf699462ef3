"""quaero's OpenEnv layer: environment sessions as chats, over the launchers of launchers.py.

    with open_envs(cfg.env, n) as pool:          # inprocess | local-server | remote
        env = pool.sessions[0]
        start = env.reset(seed=0)                # ChatReset(messages, info)
        step = env.step(assistant_message)       # ChatStep(messages, reward, done, malformed, info)

Modules: launchers (the launcher registry), loading (entry -> env types, user functions), transport
(in-process and WebSocket sessions, server endpoints), server (serve, the server app, LocalServer), mapping
(chat <-> actions/observations), session (ChatEnv, retries), pool (open_envs, the launchers' connectors),
tasks (the env's Task API).

The names below are imported when first used, so quaero/config.py can read launchers.py without loading the
client (whose modules import the config).
"""
from __future__ import annotations

import importlib
import os
import sys


def block_gradio() -> None:
    """openenv imports gradio only for its optional web UI (/web), which quaero never serves; keeping
    it out makes `import openenv.core` take ~1 s instead of ~5 s, in trainers and env servers alike.
    ENABLE_WEB_INTERFACE=1 (openenv's own switch) keeps it."""
    if os.environ.get("ENABLE_WEB_INTERFACE", "").lower() not in ("1", "true"):
        sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]


block_gradio()  # before anything imports openenv

_EXPORTS = {"EnvPool": "pool", "open_envs": "pool", "LocalServer": "server", "serve": "server", "ChatEnv": "session",
            "ChatReset": "session", "ChatStep": "session", "EpisodeDropped": "session",
            "EpisodeEndedAtReset": "session"}
__all__ = ["ChatEnv", "ChatReset", "ChatStep", "EnvPool", "EpisodeDropped", "EpisodeEndedAtReset",
           "LocalServer", "open_envs", "serve"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
