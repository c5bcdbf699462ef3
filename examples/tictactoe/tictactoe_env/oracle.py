"""The warm-start hook: `oracle_policy(info)`, found by quaero next to the entry point.

quaero calls it once per episode with the reset's info (`seed`, `split`, `index`, `task_id` and the reset
observation's metadata) and then calls the returned function once per turn with the chat so far; it
returns the next assistant message, shaped like a parsed model turn. Those demonstrations train the
`[training] warmup_sft_steps` steps before RL starts.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache

from .env import TicTacToeAction, TicTacToeEnv, free_cells, winner


@cache
def _value(board: str, to_move: str) -> int:
    """Minimax value for X (+1 win, 0 draw, -1 loss) against an opponent that plays its best."""
    cells = ["" if c == "." else c for c in board]
    if (w := winner(cells)) or not free_cells(cells):
        return {"X": 1, "O": -1}.get(w, 0)
    values = [_value(board[:i - 1] + to_move + board[i:],
                     "O" if to_move == "X" else "X") for i in free_cells(cells)]
    return max(values) if to_move == "X" else min(values)


def best_move(cells: list[str]) -> int:
    board = "".join(c or "." for c in cells)
    return max(free_cells(cells), key=lambda i: _value(board[:i - 1] + "X" + board[i:], "O"))


def oracle_policy(info: dict) -> Callable[[list[dict]], dict]:
    """Replays the episode's game on a private env (same seed and split, same moves) and plays the minimax
    move: it never loses and never makes an illegal move."""
    moves: list[int] = []

    def policy(messages: list[dict]) -> dict:
        env = TicTacToeEnv()
        env.reset(seed=info.get("seed"), split=info.get("split", "train"))
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        for move in moves[:turn]:
            env.step(TicTacToeAction(move=move))
        move = best_move(env.state.cells)
        del moves[turn:]
        moves.append(move)
        return {"role": "assistant", "content": json.dumps({"move": move}), "reasoning_content": "I take "
                                                                                                 f"{move}."}

    return policy
