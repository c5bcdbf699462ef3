"""tictactoe_env: a plain, non-concurrent OpenEnv game with penalties, trained by quaero as it is.

Entry point for configs: `tictactoe_env:TicTacToeEnv`; server app: `tictactoe_env.server:app`;
warm-start demonstrations: `oracle_policy` (quaero looks for it next to the entry point).
"""
from .env import TicTacToeAction, TicTacToeEnv, TicTacToeObservation, TicTacToeState
from .oracle import oracle_policy

__all__ = ["TicTacToeAction", "TicTacToeEnv", "TicTacToeObservation", "TicTacToeState", "oracle_policy"]
