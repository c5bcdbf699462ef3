"""Honest outcomes (quaero/telemetry/outcomes.py, quaero/telemetry/proofs.py): RL steps that carried no signal
are said to have none during the run and at its end, with the fix, and `quaero review` reports RL and ECHO
training apart."""
import pytest
from fixtures.runs import events_of

from quaero import cli
from quaero.telemetry import runlog
from quaero.telemetry.outcomes import SignalWatch
from quaero.tools import review

SILENT = {"phase": "rl", "action_tokens": 0, "echo_tokens": 40, "turns": 8, "malformed_actions": 8, "rows": 4,
          "groups": 2, "groups_zero_advantage": 2}


def test_rl_steps_without_signal_are_said_so_during_the_run_and_at_its_end(tmp_path):
    runlog.configure(console="none")
    watch = SignalWatch()
    with runlog.RunLog(tmp_path, run_id="r1"):
        watch.step(1, {"phase": "sft", "action_tokens": 30, "turns": 2})  # a warm start is not RL
        for step in range(2, 14):
            watch.step(step, SILENT)
        totals = watch.finish()
    warned = events_of(tmp_path, "rl_no_signal")
    assert [w["step"] for w in warned] == [2, 12]  # the first, then every 10th
    assert "0 of 8 actions were valid, 0 of 2 groups had rewards that differ" in warned[0]["note"]
    end = events_of(tmp_path, "rl_signal")[0]
    assert end["level"] == "warning" and totals["rl_steps"] == 12 and totals["rl_steps_with_signal"] == 0
    assert "only ECHO trained: RL learned nothing. Fix: warm-start from demonstrations" in end["note"]


def test_a_format_that_collapses_after_rl_trained_is_warned_at_once_with_the_fixes_that_apply(tmp_path):
    # the 20M main job at seed 1: RL trained, then from one step on every action was malformed and nothing
    # trained again; the first such step fell between two warnings (said 4 steps late), and the note told a
    # warm-started run to warm-start
    runlog.configure(console="none")
    watch = SignalWatch()
    trained = {**SILENT, "action_tokens": 30, "malformed_actions": 1, "groups_zero_advantage": 1}
    collapsed = {**SILENT, "echo_tokens": 0}
    with runlog.RunLog(tmp_path, run_id="r1"):
        watch.step(1, trained)
        watch.step(2, {**SILENT, "malformed_actions": 2})  # no signal yet valid actions: not a collapse
        watch.step(3, trained)
        for step in range(4, 16):
            watch.step(step, collapsed)
        totals = watch.finish()
    warned = events_of(tmp_path, "rl_no_signal")
    assert [(w["step"], w.get("format_collapsed_at")) for w in warned] == [(2, None), (4, 4), (13, 4)]
    for w in warned[1:]:
        assert ("0 of 8 actions were valid, at every step since step 4, after RL steps that trained action "
                "tokens (the last: step 3): the policy's format collapsed") in w["note"]
        assert 'Fix: [guidance] mode = "episode"' in w["note"] and "warm-start" not in w["note"]
    end = events_of(tmp_path, "rl_signal")[0]
    assert end["level"] == "warning" and end["format_collapsed_at"] == 4
    assert totals["rl_steps_with_signal"] == 2
    assert "but no action was valid from step 4 to the end: the policy's format collapsed" in end["note"]

    watch = SignalWatch()  # a format that comes back: the end says nothing of a collapse
    with runlog.RunLog(tmp_path / "b", run_id="r2"):
        for step, m in enumerate([trained, collapsed, trained], start=1):
            watch.step(step, m)
        watch.finish()
    end = events_of(tmp_path / "b", "rl_signal")[0]
    assert end["level"] == "info" and "collapsed" not in end["note"] and "format_collapsed_at" not in end


def test_rl_steps_whose_episodes_were_all_dropped_are_not_told_to_warm_start(tmp_path):
    # the real dipg_safety_env (its step returns StepResult): every episode was dropped, and the note said
    # "only ECHO trained" (nothing had) with the warm-start fix, which cannot help
    runlog.configure(console="none")
    watch = SignalWatch()
    with runlog.RunLog(tmp_path, run_id="r1"):
        watch.step(1, {"phase": "rl", "action_tokens": 0, "echo_tokens": 0, "turns": 0, "rows": 0,
                       "episodes_dropped": 2})
        watch.finish()
    for event in ("rl_no_signal", "rl_signal"):
        note = events_of(tmp_path, event)[0]["note"]
        assert ("0 of 0 actions were valid; no episode was played to train: of the episodes, 2 were dropped "
                "(the env_episode_dropped events say why; fix what drops them)") in note
        assert "only ECHO trained" not in note and "warm-start" not in note


def test_rl_steps_whose_resets_all_ended_say_so_not_that_episodes_were_dropped(tmp_path, capsys):
    # coding_tools_env without its sandbox key (issue #33's survey, D3): the note and review said "every one
    # was dropped (the env_episode_dropped events say why)" where no episode was dropped and no such event
    # existed, and review's table had no row for the resets that ended
    runlog.configure(console="none")
    watch = SignalWatch()
    ended = {"phase": "rl", "action_tokens": 0, "echo_tokens": 0, "turns": 0, "rows": 0,
             "episodes_dropped": 0, "episodes_ended_at_reset": 2}
    log = runlog.get_logger("test")
    with runlog.RunLog(tmp_path, run_id="r1"):
        runlog.set_step(1)
        watch.step(1, ended)
        log.info("train_step", **ended)
        watch.finish()
    for event in ("rl_no_signal", "rl_signal"):
        note = events_of(tmp_path, event)[0]["note"]
        assert ("no episode was played to train: of the episodes, 2 ended at their reset (the "
                "env_reset_ended line gives the env's reason; fix what the env needs); so RL learned "
                "nothing") in note
        assert "dropped" not in note and "warm-start" not in note
    assert cli.main(["review", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 ended at their reset" in out and "dropped (the env_episode_dropped" not in out
    assert review.summarize(review.load_run(tmp_path)).episodes_ended_at_reset == 2


def test_actions_the_env_rejected_point_at_the_env_not_at_the_model(tmp_path):
    # korrel without its persona's key (issue #33's survey, D2): every valid action was rejected with one
    # message, and the note told the user to warm-start or change the model
    runlog.configure(console="none")
    watch = SignalWatch()
    with runlog.RunLog(tmp_path, run_id="r1"):
        watch.step(1, {**SILENT, "env_rejected_actions": 8})
        watch.step(2, {**SILENT, "env_rejected_actions": 1})  # 1 of 8 invalid actions: the model's
        watch.finish()
    first, second = (e["note"] for e in events_of(tmp_path, "rl_no_signal")[:1] + events_of(tmp_path,
                                                                                            "rl_signal"))
    assert "0 of 8 actions were valid (8 rejected by the env)" in first
    assert "Fix: the env raised on the actions themselves (the env_action_rejected lines" in first
    assert "warm-start" not in first
    assert "0 of 16 actions were valid (9 rejected by the env)" in second and "Fix: the env raised" in second
    watch = SignalWatch()
    with runlog.RunLog(tmp_path / "b", run_id="r2"):
        watch.step(1, {**SILENT, "env_rejected_actions": 1})
    assert "Fix: warm-start from demonstrations" in events_of(tmp_path / "b", "rl_no_signal")[0]["note"]


def test_review_reports_rl_and_echo_training_apart(tmp_path, capsys):
    runlog.configure(console="none")
    log = runlog.get_logger("test")
    with runlog.RunLog(tmp_path, run_id="r1"):
        for step, m in enumerate([{"phase": "sft", "action_tokens": 30, "echo_tokens": 20, "rows": 2,
                                   "turns": 2},
                                  SILENT, SILENT], start=1):
            runlog.set_step(step)
            log.info("train_step", **m)
        log.info("run_end", status="finished")
    # reported, not required: ECHO-only is a choice
    assert cli.main(["review", str(tmp_path), "--require-proof"]) == 0
    out = capsys.readouterr().out
    assert "[PASS] trained at least one step" in out and "[PASS] ECHO trained (env tokens)" in out
    assert "[WARN] RL trained (action tokens with advantage)" in out
    assert "0 of 2 RL steps trained action tokens (0 with an advantage); 0 of 16 actions were valid" in out
    summary = review.summarize(review.load_run(tmp_path))
    assert (summary.rl_action_tokens, summary.rl_groups, summary.rl_groups_zero_advantage) == (0, 4, 4)


def test_rl_steps_that_trained_nothing_do_not_say_echo_trained(tmp_path, capsys):
    # every advantage 0 and no ECHO token either (ECHO off, or no env text kept): the note said "so only ECHO
    # trained" although nothing had; it says what did train
    runlog.configure(console="none")
    watch = SignalWatch()
    nothing = {**SILENT, "echo_tokens": 0}
    log = runlog.get_logger("test")
    with runlog.RunLog(tmp_path, run_id="r1"):
        for step in (1, 2):
            runlog.set_step(step)
            watch.step(step, nothing)
            log.info("train_step", **nothing)
        watch.finish()
        log.info("run_end", status="finished")
    for event in ("rl_no_signal", "rl_signal"):
        note = events_of(tmp_path, event)[0]["note"]
        assert "only ECHO trained" not in note
        assert "every advantage was 0 and no ECHO token trained, so nothing trained: RL learned" in note
    assert cli.main(["review", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "only ECHO trained" not in out and "so nothing trained" in out


@pytest.mark.hostile
def test_rl_steps_the_optimizer_skipped_are_never_counted_as_trained(tmp_path, capsys):
    # all_fail_advantage=-1e308 (accepted then): every step's loss was inf, its gradient skipped (0 optimizer
    # steps), yet its action tokens said the step trained, and review printed [PASS] "RL trained"
    runlog.configure(console="none")
    watch = SignalWatch()
    skipped = {**SILENT, "action_tokens": 30, "optimizer_steps": 0, "nonfinite_grad_skips": 1}
    log = runlog.get_logger("test")
    with runlog.RunLog(tmp_path, run_id="r1"):
        for step in (1, 2):
            runlog.set_step(step)
            watch.step(step, skipped)
            log.info("train_step", **skipped)
        totals = watch.finish()
        log.info("run_end", status="finished")
    assert totals["rl_steps_with_signal"] == totals["action_tokens"] == 0
    assert totals["rl_steps_without_update"] == 2
    for event, skips in (("rl_no_signal", 1), ("rl_signal", 2)):
        note = events_of(tmp_path, event)[0]["note"]
        assert f"{skips} took no optimizer step (a non-finite gradient), so nothing trained" in note
        assert "Fix: a finite loss" in note
    assert cli.main(["review", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[PASS] RL trained" not in out and "[WARN] RL trained (action tokens with advantage)" in out
    assert "[PASS] trained at least one step" not in out and "[PASS] ECHO trained" not in out
    summary = review.summarize(review.load_run(tmp_path))
    assert (summary.rl_action_tokens, summary.rl_steps_without_update, summary.echo_tokens) == (0, 2, 0)
