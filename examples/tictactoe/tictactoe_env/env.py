"""Tic-tac-toe against a fixed opponent. The model plays X; a move is `{"move": N}`, N the number of a free
cell (1-9, rows top to bottom). Rewards: +1 win, 0 draw, -1 loss, -1 for an illegal move (which ends the
game). The opponent wins when it can, else blocks, else takes the centre, else a cell drawn from the
reset's seed, so a (seed, split) pair and the model's moves replay the same game.

Like most envs written for OpenEnv's own server, it leaves SUPPORTS_CONCURRENT_SESSIONS unset.
"""
from __future__ import annotations

import random
import uuid

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
PROMPT = "You play X against a fixed opponent (O). Take a free cell; three in a row wins."


class TicTacToeAction(Action):
    move: int = Field(description="the free cell to mark, 1-9")


class TicTacToeObservation(Observation):
    prompt: str = ""
    board: str = ""  # three rows; free cells show their number
    legal_moves: list[int] = Field(default_factory=list)
    opponent_move: int | None = None
    result: str = ""


class TicTacToeState(State):
    cells: list[str] = Field(default_factory=lambda: [""] * 9)
    seed: int | None = None
    split: str = "train"


def winner(cells: list[str]) -> str:
    return next((cells[a] for a, b, c in LINES if cells[a] and cells[a] == cells[b] == cells[c]), "")


def free_cells(cells: list[str]) -> list[int]:
    return [i + 1 for i, c in enumerate(cells) if not c]


def render_board(cells: list[str]) -> str:
    return "\n".join(" ".join(cells[i] or str(i + 1) for i in range(r, r + 3)) for r in (0, 3, 6))


class TicTacToeEnv(Environment[TicTacToeAction, TicTacToeObservation, TicTacToeState]):
    def __init__(self) -> None:
        super().__init__()
        self._state = TicTacToeState()
        self._rng = random.Random()

    def reset(self, seed: int | None = None, episode_id: str | None = None, split: str = "train",
              **kwargs) -> TicTacToeObservation:
        self._rng = random.Random(f"{split}/{seed}")  # the split is part of the task: eval games differ
        self._state = TicTacToeState(episode_id=episode_id or str(uuid.uuid4()), seed=seed, split=split)
        opening = self._opponent() if self._rng.random() < 0.5 else None
        return self._observe(prompt=PROMPT, opponent_move=opening)

    def step(self, action: TicTacToeAction, timeout_s: float | None = None, **kwargs) -> TicTacToeObservation:
        cells = self._state.cells
        self._state.step_count += 1
        if action.move not in free_cells(cells):
            why = "not a cell" if not 1 <= action.move <= 9 else "taken"
            return self._observe(result=f"illegal move {action.move} ({why}): you lose", done=True,
                                 reward=-1.0)
        cells[action.move - 1] = "X"
        if winner(cells) == "X":
            return self._observe(result="you win", done=True, reward=1.0)
        if not free_cells(cells):
            return self._observe(result="draw", done=True, reward=0.0)
        reply = self._opponent()
        if winner(cells) == "O":
            return self._observe(opponent_move=reply, result="O wins: you lose", done=True, reward=-1.0)
        if not free_cells(cells):
            return self._observe(opponent_move=reply, result="draw", done=True, reward=0.0)
        return self._observe(opponent_move=reply, reward=0.0)

    def _opponent(self) -> int:
        cells = self._state.cells
        free = free_cells(cells)

        def completes(mark: str) -> int | None:
            for cell in free:
                trial = list(cells)
                trial[cell - 1] = mark
                if winner(trial) == mark:
                    return cell
            return None

        cell = completes("O") or completes("X") or (5 if 5 in free else self._rng.choice(free))
        cells[cell - 1] = "O"
        return cell

    def _observe(self, **fields) -> TicTacToeObservation:
        cells = self._state.cells
        return TicTacToeObservation(board=render_board(cells), legal_moves=[] if fields.get("done") else
                                    free_cells(cells), **fields)

    @property
    def state(self) -> TicTacToeState:
        return self._state
