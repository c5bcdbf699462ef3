"""The env as an OpenEnv server app, the usual OpenEnv way:
`uvicorn anagram_env.server:app --host 127.0.0.1 --port 8010` (or `quaero env serve
anagram_env:AnagramEnv`)."""
from openenv.core.env_server.http_server import create_app

from .env import AnagramAction, AnagramEnv, AnagramObservation, AnagramState

app = create_app(AnagramEnv, AnagramAction, AnagramObservation, env_name="anagram", max_concurrent_envs=32,
                 state_cls=AnagramState)
