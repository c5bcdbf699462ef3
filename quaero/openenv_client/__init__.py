"""quaero's OpenEnv layer: environment sessions as chats, over the launchers of quaero/launcher_registry.py.

    with open_envs(cfg.env, n) as pool:          # inprocess | local-server | remote
        env = pool.sessions[0]
        start = env.reset(seed=0)                # ChatReset(messages, info)
        step = env.step(assistant_message)       # ChatStep(messages, reward, done, malformed, info)

Modules: loading (entry -> env types, user functions), transport (in-process and WebSocket sessions, server
endpoints), server (serve, the server app, LocalServer), mapping (chat <-> actions/observations), session
(ChatEnv, retries), pool (open_envs, the launchers' open functions), tasks (the env's Task API).
"""
from __future__ import annotations

from quaero.openenv_client.loading import block_gradio
from quaero.openenv_client.pool import EnvPool, open_envs
from quaero.openenv_client.server import LocalServer, serve
from quaero.openenv_client.session import ChatEnv, ChatReset, ChatStep, EpisodeDropped, EpisodeEndedAtReset

# before anything imports openenv: these modules import it only inside their functions
block_gradio()

__all__ = ["ChatEnv", "ChatReset", "ChatStep", "EnvPool", "EpisodeDropped", "EpisodeEndedAtReset",
           "LocalServer", "block_gradio", "open_envs", "serve"]
