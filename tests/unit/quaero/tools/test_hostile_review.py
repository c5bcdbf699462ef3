"""`quaero review` (quaero/tools/review.py) against hostile outputs and events: `--plots DIR` never writes
through a link, into a special file or over a file it did not write (unless `--force` names it), nor a
run's own file; one huge, non-float or non-finite field is shown as bounded text, `--json` is strict JSON,
and a malformed event is counted, not a traceback. The real CLI in process, on logs `RunLog` wrote."""
import os

import pytest

from quaero import cli
from quaero.telemetry import runlog

pytestmark = pytest.mark.hostile

PLOTS = ("reward", "losses", "memory", "branches")


def record(run_dir, steps):
    runlog.configure(console="none")
    log = runlog.get_logger("test")
    with runlog.RunLog(run_dir, run_id="r1"):
        for i, fields in enumerate(steps, start=1):
            runlog.set_step(i)
            log.info("train_step", phase="rl", **fields)
        log.info("run_end", status="finished")
    return run_dir


@pytest.fixture
def run(tmp_path):
    return record(tmp_path / "runs" / "toy", [{"rl_loss": 0.5, "reward_mean": 0.1 * i} for i in range(3)])


def review(*argv) -> int:
    return cli.main(["review", *map(str, argv)])


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_plots_refuse_a_symlink_and_write_nothing(run, tmp_path, capsys):
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep me")
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "reward.png").symlink_to(target)
    assert review(run, "--plots", plots, "--force") == 1
    assert one_error(capsys).startswith(f"error: --plots {plots / 'reward.png'}: a symlink (to {target})")
    assert target.read_text() == "keep me" and sorted(p.name for p in plots.iterdir()) == ["reward.png"]


def test_plots_refuse_a_hard_link_to_a_runs_file_and_a_fifo(run, tmp_path, capsys):
    plots = tmp_path / "plots"
    plots.mkdir()
    config = run / "config.json"
    config.write_text('{"run": {}}')
    os.link(config, plots / "losses.png")
    assert review(run, "--plots", plots, "--force") == 1
    assert "losses.png: a hard link (2 names for one file" in one_error(capsys)
    assert config.read_text() == '{"run": {}}'
    os.unlink(plots / "losses.png")
    os.mkfifo(plots / "memory.png")
    assert review(run, "--plots", plots, "--force") == 1
    assert "memory.png: a special file" in one_error(capsys)
    assert not (plots / "reward.png").exists()  # refused before any plot was written


def test_plots_keep_a_users_file_unless_force_and_replace_their_own(run, tmp_path, capsys):
    plots = tmp_path / "plots"
    assert review(run, "--plots", plots) == 0
    capsys.readouterr()
    first = (plots / "reward.png").stat().st_ino
    assert review(run, "--plots", plots) == 0  # review's own plots are replaced without --force
    capsys.readouterr()
    assert (plots / "reward.png").stat().st_ino != first  # renamed into place, not written through
    (plots / "branches.png").write_bytes(b"my own picture")
    assert review(run, "--plots", plots) == 1
    assert "branches.png: already exists; choose a new file or pass --force" in one_error(capsys)
    assert (plots / "branches.png").read_bytes() == b"my own picture"
    assert review(run, "--plots", plots, "--force") == 0
    assert (plots / "branches.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in plots.iterdir()) == sorted(f"{n}.png" for n in PLOTS)  # no temp file left


def test_plots_never_replace_a_runs_own_files(tmp_path, capsys):
    """`--plots` into the run folder itself is allowed (README: runs/NAME/plots), but not onto a name the run
    owns: a plots folder named `rows` or `checkpoints` inside it."""
    run = record(tmp_path / "run", [{"rl_loss": 0.5}])
    assert review(run, "--plots", run / "checkpoints", "--force") == 1
    assert "checkpoints is the run" in one_error(capsys)
    assert review(run, "--plots", run / "plots") == 0
