"""The env as an OpenEnv server app, the usual OpenEnv way (one session at a time, as the env declares):
`uvicorn tictactoe_env.server:app --host 127.0.0.1 --port 8011` (or `quaero env serve
tictactoe_env:TicTacToeEnv`)."""
from openenv.core.env_server.http_server import create_app

from .env import TicTacToeAction, TicTacToeEnv, TicTacToeObservation, TicTacToeState

app = create_app(TicTacToeEnv, TicTacToeAction, TicTacToeObservation, env_name="tictactoe",
                 state_cls=TicTacToeState)
