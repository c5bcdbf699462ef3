"""`quaero bench ablation`'s pairing: per seed on the tasks both runs' last evals finished, pooled over
seeds."""
import pytest

from benchmarks import ablation
from quaero.telemetry import runlog
from quaero.tools.significance import paired_outcomes


def _run(path, wins, *, stale=None):
    runlog.configure(console="none")
    log = runlog.get_logger("test")
    with runlog.RunLog(path, run_id="r"):
        for step, w in ((1, stale), (2, wins)):
            if w is None:
                continue
            runlog.set_step(step)
            log.info("eval", eval_reward=sum(w) / len(w), eval_results=[[i, x, float(x)] for i,
                                                                                       x in enumerate(w)])
    return path


def test_pairs_per_task_on_the_last_eval_and_pools_over_seeds(tmp_path):
    # the last eval counts
    a0 = ablation.final_outcomes(_run(tmp_path / "a0", [1] * 10 + [0] * 6, stale=[0] * 16))
    b0 = ablation.final_outcomes(_run(tmp_path / "b0", [1] * 4 + [0] * 12))
    c = paired_outcomes(a0, b0)
    assert (c["pairs"], c["a_only"], c["b_only"], c["a_success"], c["b_success"]) == (16, 6, 0, 10 / 16,
                                                                                      4 / 16)
    assert c["mcnemar_p"] == pytest.approx(2 / 2**6) and c["reward_diff"] == pytest.approx(6 / 16)
    # a run that finished only half the tasks: pairs are the shared ones
    b1 = {k: v for k, v in b0.items() if k < 8}
    assert paired_outcomes(a0, b1)["pairs"] == 8
    pooled = paired_outcomes({(s, k): v for s in (0, 1) for k, v in a0.items()},
                              {(s, k): v for s in (0, 1) for k, v in b0.items()})
    assert (pooled["pairs"], pooled["a_only"]) == (32, 12) and pooled["mcnemar_p"] < c["mcnemar_p"]
    text = ablation.table([("0", c), ("pooled", pooled)], "echo.enabled=true", "echo.enabled=false")
    assert "| 0 | 16 | 0.625 | 0.250 | 6 | 0 | 0.0312 | +0.375" in text and "| pooled | 32 |" in text


def test_a_run_without_per_task_results_is_a_one_line_error(tmp_path):
    runlog.configure(console="none")
    with runlog.RunLog(tmp_path, run_id="r"):
        runlog.get_logger("t").info("eval", eval_reward=0.5)
    with pytest.raises(SystemExit, match="no per-task results"):
        ablation.final_outcomes(tmp_path)


def test_arms_start_from_a_chosen_or_the_latest_checkpoint_of_a_shared_run(tmp_path):
    from quaero.recipe import checkpoint

    root = tmp_path / "warm" / "checkpoints"
    for step in (400, 450):
        checkpoint.save(root, step, {"step": step, "cursor": step * 4}, keep=5)
    ablation._seed_start(tmp_path / "warm", tmp_path / "arm", 400)
    assert [p.name for p in (tmp_path / "arm" / "checkpoints").iterdir()] == ["step-000400"]
    # a fresh folder each time: the latest only
    ablation._seed_start(tmp_path / "warm", tmp_path / "arm", None)
    assert [p.name for p in (tmp_path / "arm" / "checkpoints").iterdir()] == ["step-000450"]
    with pytest.raises(SystemExit, match="--from-step 7: .* is unusable"):
        ablation._seed_start(tmp_path / "warm", tmp_path / "arm", 7)


@pytest.mark.hostile
def test_from_step_without_from_is_refused_before_any_arm_trains(tmp_path, monkeypatch):
    """`--from-step 1` without `--from` trained every arm from scratch without a word (peers-trl refuses
    it)."""
    monkeypatch.setattr(ablation, "train_arm", lambda *a, **k: pytest.fail("an arm was trained"))
    with pytest.raises(SystemExit, match=r"^error: --from-step needs --from RUN$"):
        ablation.main(["envs/toolbench.toml", "--from-step", "1", "--out", str(tmp_path)])


@pytest.mark.hostile
@pytest.mark.parametrize("argv_more,says", [
    (["--set", "run.output_dir=runs"], "--set 'run.output_dir=runs': run.name, run.output_dir and run.seed"),
    (["--arm-a", "run.name=mine"], "--arm-a 'run.name=mine': run.name"),
    (["--arm-b", "run.seed=7"], "--arm-b 'run.seed=7': run.name"),
])
def test_ablation_and_samplers_refuse_a_set_of_the_benchs_own_run_keys(tmp_path, monkeypatch, argv_more,
                                                                      says):
    from benchmarks import samplers

    monkeypatch.setattr(ablation, "train_arm", lambda *a, **k: pytest.fail("an arm was trained"))
    with pytest.raises(SystemExit, match=says):
        ablation.main(["envs/toolbench.toml", "--out", str(tmp_path / "out"), *argv_more])
    assert not (tmp_path / "out").exists()
    if argv_more[0] == "--set":
        with pytest.raises(SystemExit, match=says):
            samplers.main(["envs/toolbench.toml", "--from", str(tmp_path), "--from-step", "5", "--budget",
                           "9", "--out", str(tmp_path / "out"), *argv_more])
