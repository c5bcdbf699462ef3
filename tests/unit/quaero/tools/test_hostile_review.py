"""`quaero review` (quaero/tools/review.py) against hostile outputs and events: `--plots DIR` never writes
through a link, into a special file or over a file it did not write (unless `--force` names it), nor a
run's own file; one huge, non-float or non-finite field is shown as bounded text, `--json` is strict JSON,
and a malformed event is counted, not a traceback. The real CLI in process, on logs `RunLog` wrote."""
import json
import os

import pytest

from quaero import cli
from quaero.telemetry import runlog

pytestmark = pytest.mark.hostile

PLOTS = ("reward", "losses", "memory", "branches", "heldout")


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


def _raw_events(tmp_path, *lines):
    run = tmp_path / "raw"
    run.mkdir()
    (run / "events.jsonl").write_text("".join(
        (line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
        + '{"event":"run_end"}\n')
    return run


STEP = {"event": "train_step", "phase": "rl", "rl_loss": 0.5, "reward_mean": 0.2, "action_tokens": 10}


def test_a_huge_field_is_a_bounded_cell_not_gigabytes_of_padding(tmp_path, capsys):
    """One 5 MB field padded every row of the table to its width (330 MB printed; 2.1 GB for 100 MB)."""
    big = "x" * 5_000_000
    run = _raw_events(tmp_path, dict(STEP, step=1, local_train_compile_selective_ce_mode=big,
                                     local_train_compile_selective_ce_fallback_reason="\x1b[2J" + big))
    assert review(run) == 0
    out = capsys.readouterr().out
    assert len(out) < 50_000 and "\x1b" not in out
    assert "... (+4,999,940 chars)" in out
    assert review("--compare", run, run) == 0 and len(capsys.readouterr().out) < 50_000


@pytest.mark.parametrize("flag", [[], ["--json"], ["--plots", "PLOTS"]])
def test_huge_integers_are_text_not_an_overflow_traceback(tmp_path, capsys, flag):
    """A 400-digit integer field raised OverflowError (float() of it) in the table, --json and plots."""
    huge = 10**400
    run = _raw_events(tmp_path, dict(STEP, step=1, rl_loss=huge, action_tokens=huge, echo_loss=huge),
                      dict(STEP, step=2, weight_transfer=huge),
                      {"event": "eval", "step": 2, "eval_success_rate": 0.5, "eval_episodes": huge,
                       "eval_reward": huge, "eval_results": [[0, 1, huge], [1, 0, 0.0]]},
                      dict(STEP, step=huge))
    argv = [str(tmp_path / "plots") if a == "PLOTS" else a for a in flag]
    assert review(run, *argv) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "1 line(s) could not be read" in captured.err  # the huge step
    if flag == ["--json"]:
        summary = json.loads(captured.out)["summary"]
        assert summary["action_tokens"] == 10 and summary["weight_transfer"] == str(huge)
    elif not flag:
        line = next(x for x in captured.out.splitlines() if x.startswith("weight_transfer"))
        assert line.endswith("1" + "0" * 59 + "... (+341 chars)") and len(captured.out) < 50_000


def test_json_is_strict_nan_and_infinity_are_null(tmp_path, capsys):
    run = _raw_events(tmp_path, '{"event":"train_step","step":1,"phase":"rl","reward_mean":NaN,'
                                '"success_rate":NaN,"rl_loss":Infinity,"peak_mem_mb":-Infinity}')
    assert review(run, "--json") == 0
    text = capsys.readouterr().out

    def refuse(constant):
        raise AssertionError(f"bare {constant} in --json")

    summary = json.loads(text, parse_constant=refuse)["summary"]
    assert summary["train_success_last"] is None and summary["rl_loss_first"] is None
    assert review("--compare", run, run, "--json") == 0
    json.loads(capsys.readouterr().out, parse_constant=refuse)


def test_malformed_events_are_counted_in_one_warning_not_a_traceback(tmp_path, capsys):
    big = "y" * 100_000
    run = _raw_events(tmp_path, dict(STEP, step=1, by_env={"a": {"groups": "x", "signal_groups": 10**400},
                                                           "b": 3}),
                      {"event": "eval", "step": 1, "eval_success_rate": "high", "eval_by_env": {big: {}},
                       "eval_results": [[0, 1, 10**400], "x", [1, 1, "a"]]},
                      {"event": "resume_config_changed", "checkpoint_step": big,
                       "changes": {big: [big, 10**400]}, "trained": [big]},
                      dict(STEP, step=-5), dict(STEP, step="7"), "[1, 2]", "{torn")
    assert review(run) == 0
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "4 line(s) could not be read" in captured.err
    assert max(len(line) for line in captured.out.splitlines()) < 2_100
