"""Saved rows: `[logging] save_rows` keeps each step's trained rows in the run folder, for `quaero inspect
rows` (quaero/tools/inspect_rows.py) and OpenEnv's token formats (quaero/rollout/traces.py).

`[logging] save_rows` ("none" | "sample": the first SAMPLE_ROWS rows of each step | "all") writes
`runs/NAME/rows/step-000123.jsonl`, one JSON object per row: its `EchoRow.to_dict()` fields plus the step,
the row's index in the step, the phase (sft/rl), the policy version (the step number of the weights that
sampled it: the step before this step's update) and `sampled_actions`: each turn's action ids as the
sampler returned them, copied from the episode's `Transition`s. That copy is the independent record
`quaero inspect rows --verify` checks the row's action spans against. Rank 0 writes (quaero/recipe/train.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from quaero.rollout.rows import Transition
from quaero.rows import EchoRow
from quaero.telemetry import names
from quaero.telemetry.runlog import get_logger

log = get_logger(__name__)

SAMPLE_ROWS = 2  # rows per step under save_rows = "sample"


def rows_dir(run_dir: Path) -> Path:
    return Path(run_dir) / names.ROWS_DIR


def step_file(run_dir: Path, step: int) -> Path:
    return rows_dir(run_dir) / f"{names.step_folder_name(step)}.jsonl"


def row_record(row: EchoRow, transitions: list[Transition], *, step: int, index: int, phase: str,
               policy_version: int | None) -> dict:
    """One saved line: the row, where it was trained, the policy version that sampled it (trainer steps its
    weights had seen; None for a warm start's oracle demos) and the sampler's action ids of its turns."""
    turns = {s.turn for s in row.spans if s.kind == "action"}
    sampled = [{"turn": t.turn, "action_ids": list(t.action_ids)} for t in transitions if t.turn in turns]
    return {"step": step, "row": index, "phase": phase, "policy_version": policy_version, **row.to_dict(),
            "sampled_actions": sampled}


def save_step_rows(run_dir: Path, mode: str, step: int, rows: list[tuple[EchoRow, list[Transition]]], *,
                   phase: str, policy_version: int | None) -> dict[str, int]:
    """Write a step's rows (each with its episode's transitions) as `rows/step-NNNNNN.jsonl`; returns the
    step metrics `rows_saved` and `rows_save_failures`. The file is written beside and renamed into place,
    so a replayed (resumed) step replaces it and a reader never sees half a file. A failure is logged and
    counted, never raised: looking at rows must not cost the run."""
    if mode == "none" or not rows:
        return {}
    chosen = rows[:SAMPLE_ROWS] if mode == "sample" else rows
    path = step_file(run_dir, step)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".jsonl.tmp")
        with tmp.open("w") as f:
            for i, (row, transitions) in enumerate(chosen):
                f.write(json.dumps(row_record(row, transitions, step=step, index=i, phase=phase,
                                                    policy_version=policy_version)) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as e:
        log.warning(names.ROWS_SAVE_FAILED_EVENT, path=str(path), error=str(e),
                    note="training continues; rows not saved")
        return {names.ROWS_SAVED: 0, names.ROWS_SAVE_FAILURES: 1}
    return {names.ROWS_SAVED: len(chosen), names.ROWS_SAVE_FAILURES: 0}
