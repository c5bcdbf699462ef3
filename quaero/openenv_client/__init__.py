"""quaero's OpenEnv layer: environment sessions as chats, over three launchers.

    with open_envs(cfg.env, n) as pool:          # inprocess | local-server | remote
        env = pool.sessions[0]
        start = env.reset(seed=0)                # ChatReset(messages, info)
        step = env.step(assistant_message)       # ChatStep(messages, reward, done, malformed, info)

Modules: loading (entry -> env types, server app), transport (in-process and WebSocket sessions),
server (serve, LocalServer), mapping (chat <-> actions/observations), session (ChatEnv, retries),
pool (open_envs, the in-process and server connectors).
"""
from .loading import block_gradio

block_gradio()  # before anything imports openenv

from .pool import EnvPool, open_envs
from .server import LocalServer, serve
from .session import ChatEnv, ChatReset, ChatStep, EpisodeDropped

__all__ = ["ChatEnv", "ChatReset", "ChatStep", "EnvPool", "EpisodeDropped", "LocalServer", "open_envs", "serve"]
