"""Saved rows (quaero/recipe/saved_rows.py): a step's rows as `rows/step-NNNNNN.jsonl`, each with the
sampler's own action ids beside it; "sample" keeps the first rows; a replayed step replaces its file; a
failure to write is counted, never raised."""
from __future__ import annotations

import json

import structlog

from quaero.recipe.saved_rows import SAMPLE_ROWS, save_step_rows, step_file
from quaero.rollout.rows import EchoRow, Span, Transition


def _collected(n: int) -> list:
    row = EchoRow([1, 2, 3, 4], [Span("prompt", 0, 1, 0), Span("action", 1, 3, 0), Span("env", 3, 4, 0)],
                  [0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, -0.5, -0.5, 0.0])
    turn = Transition(0, [1], [2, 3], [-0.5, -0.5], [4], ["env"])
    return [(row, [turn])] * n


def test_a_steps_rows_are_saved_with_the_samplers_action_ids(tmp_path):
    assert save_step_rows(tmp_path, "all", 3, _collected(3), phase="rl", policy_version=2) == {
        "rows_saved": 3, "rows_save_failures": 0}
    lines = [json.loads(x) for x in step_file(tmp_path, 3).read_text().splitlines()]
    assert [(r["step"], r["row"], r["phase"], r["policy_version"]) for r in lines] == [(3, i, "rl", 2)
                                                                                      for i in range(3)]
    assert lines[0]["sampled_actions"] == [{"turn": 0, "action_ids": [2, 3]}]
    assert lines[0]["input_ids"] == [1, 2, 3, 4]
    save_step_rows(tmp_path, "sample", 3, _collected(5), phase="rl", policy_version=2)  # a replayed step
    assert len(step_file(tmp_path, 3).read_text().splitlines()) == SAMPLE_ROWS
    assert save_step_rows(tmp_path, "none", 4, _collected(1), phase="rl", policy_version=3) == {}
    assert not step_file(tmp_path, 4).exists()


def test_a_failed_write_is_counted_and_the_run_goes_on(tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("a file where the run folder should be")
    with structlog.testing.capture_logs() as logs:
        out = save_step_rows(blocker, "all", 1, _collected(1), phase="sft", policy_version=None)
    assert out == {"rows_saved": 0, "rows_save_failures": 1}
    assert [e["event"] for e in logs] == ["rows_save_failed"]
