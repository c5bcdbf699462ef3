"""Ordinary bad paths a user types or a machine has, in the commands that write: each one error line naming
the path and the fix, exit 1, never a traceback (`quaero review --plots`, `quaero train`, `quaero doctor`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quaero import cli

pytestmark = pytest.mark.hostile

ROOT = Path(__file__).resolve().parents[2]


def one_error(capsys, argv) -> str:
    code = cli.main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(errors) == 1 and err.endswith(errors[0] + "\n"), err
    return errors[0]


def test_review_plots_below_a_file_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(json.dumps({"event": "train_step", "step": 1, "loss": 1.0}) + "\n")
    (tmp_path / "taken").write_text("mine")
    err = one_error(capsys, ["review", str(run), "--plots", str(tmp_path / "taken" / "plots")])
    assert err.startswith(f"error: {tmp_path / 'taken' / 'plots'}: Not a directory; fix that path")


def test_train_with_an_events_file_it_cannot_open_is_one_line(tmp_path, capsys):
    """events.jsonl a folder (as a read-only file would be): one line naming it, before any model loads."""
    run = tmp_path / "runs" / "toolbench"
    (run / "events.jsonl").mkdir(parents=True)
    err = one_error(capsys, ["train", str(ROOT / "envs" / "toolbench.toml"), "--set",
                             f"run.output_dir='{tmp_path / 'runs'}'"])
    assert err.startswith(f"error: {run / 'events.jsonl'}: Is a directory; fix that path")


def test_a_command_from_a_deleted_working_directory_is_one_line(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = (f"import os, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); "
              "from quaero.cli import main; sys.exit(main(['doctor']))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                                                       env=env,
                          cwd=tmp_path, check=False)
    assert proc.returncode == 1 and proc.stderr == (
        "error: the working directory was deleted; cd to an existing folder and run it again\n"), proc.stderr


def test_train_with_an_env_servers_path_it_cannot_use_is_one_line(tmp_path, capsys):
    """runs/NAME/env-servers a file (as an unwritable folder would be): the local env server's log cannot be
    made; one line naming it."""
    run = tmp_path / "runs" / "toolbench"
    run.mkdir(parents=True)
    (run / "env-servers").write_text("not a folder")
    err = one_error(capsys, ["train", str(ROOT / "envs" / "toolbench.toml"), "--set",
                             f"run.output_dir='{tmp_path / 'runs'}'",
                             "--set", "env.launcher='local-server'"])
    assert err.startswith(f"error: {run / 'env-servers'}") and "fix that path" in err


@pytest.mark.slow
def test_train_with_a_final_folder_it_cannot_write_is_one_line_and_keeps_its_checkpoint(tmp_path, capsys):
    """One warm-start step, then final/ cannot be written (a file below runs/NAME/final's place: its parent
    chain holds a file): one line naming final/, the step's checkpoint kept."""
    from fixtures.runs import make_config

    path, cfg = make_config(tmp_path, "final", steps=0, warmup=1, eval_every=0, eval_tasks=0)
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "final").write_text("a file where the model folder goes")
    err = one_error(capsys, ["train", str(path), "--set", "env.launcher='inprocess'", "--set",
                             "sampler.backend='hf'"])
    assert err.startswith(f"error: {cfg.run_dir / 'final'}: a file, not a folder; name a new folder")
    assert (cfg.run_dir / "checkpoints" / "step-000001").is_dir()
