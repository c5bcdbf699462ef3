"""quaero bench scaling: the throughput model returns the measured step at the run's own shape, and its
projections follow the documented formulas."""
import json

import pytest
import torch
from safetensors.torch import save_file

from quaero.tools import scaling


def make_run(tmp_path, *, ranks=1, sync=0.0, steps=((10.0, 6.0), (14.0, 8.0))):
    """A run folder: RL train_step events (total, rollout seconds) and a 1,000-parameter fp32 model."""
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    save_file({"w": torch.zeros(10, 100)}, run / "final" / "model.safetensors")
    lines = [{"event": "train_step", "phase": "sft", "rows": 4, "total_step_time_s": 1.0}]
    for total, rollout in steps:
        lines.append({"event": "train_step", "phase": "rl", "rows": 8, "ranks": ranks, "episodes": 16,
                      "total_step_time_s": total, "rollout_time_s": rollout, "weight_sync_s": sync,
                      "rollout_action_tokens": 700, "row_tokens": 4000, "env_steps": 40})
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return run


def test_the_runs_own_shape_returns_the_measured_step(tmp_path):
    for ranks, sync in ((1, 0.0), (2, 0.5)):
        costs, work = scaling.measure(make_run(tmp_path / str(ranks), ranks=ranks, sync=sync))
        assert work.measured_step_s == 12.0 and work.measured_ranks == ranks
        assert costs.bytes_per_param == pytest.approx(4.0, rel=0.05)  # fp32 (+ the file's small header)
        got = scaling.predict(costs, work, trainers=ranks, samplers=0)
        assert got["step_s"] == pytest.approx(12.0)
        assert got["sample_s"] == pytest.approx(7.0 - sync) and got["train_s"] == pytest.approx(5.0)


def test_projections_follow_the_formulas(tmp_path):
    costs, work = scaling.measure(make_run(tmp_path, sync=0.0))
    one = scaling.predict(costs, work, trainers=1, samplers=0)
    four = scaling.predict(costs, work, trainers=4, samplers=0)
    assert four["sample_s"] == pytest.approx(one["sample_s"] / 4) and four["train_s"] == pytest.approx(
        one["train_s"] / 4
    )
    assert one["bottleneck"] == "sampling" and one["push_s"] == 0.0  # the run's sampler shared the module
    overlapped = scaling.predict(costs, work, trainers=1, samplers=0, off_policy_steps=1)
    assert overlapped["step_s"] == pytest.approx(max(one["sample_s"], one["train_s"]))
    linked = scaling.predict(costs, work, trainers=4, samplers=0, allreduce_gb_s=1e-6)
    grad_gb = costs.model_gb / costs.bytes_per_param * 4
    assert linked["allreduce_s"] == pytest.approx(2 * 3 / 4 * grad_gb / 1e-6)
    assert linked["bottleneck"] == "all-reduce"
    env = scaling.predict(costs, work, trainers=2, samplers=0, env_s_per_step=0.1)
    assert env["sample_s"] == pytest.approx(one["sample_s"] / 2 + 40 / 2 * 0.1)


def test_a_separate_sampler_fleet_needs_a_measured_or_given_push(tmp_path, capsys):
    run = make_run(tmp_path, sync=0.0)
    costs, work = scaling.measure(run)
    with pytest.raises(ValueError, match="--push-s-per-gb"):
        scaling.predict(costs, work, trainers=2, samplers=2)
    assert scaling.main([str(run), "--trainers", "2", "--samplers", "2", "--push-s-per-gb", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (row,) = doc["predictions"]
    assert row["push_s"] == pytest.approx(3 * costs.model_gb)


def test_a_run_without_rl_steps_is_one_line(tmp_path, capsys):
    run = make_run(tmp_path, steps=())
    assert scaling.main([str(run)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no RL train_step" in err and err.count("\n") == 1
    assert scaling.main([str(tmp_path / "missing")]) == 1
    assert capsys.readouterr().err.startswith("error: ")


def test_a_run_that_sampled_ahead_is_refused_in_one_line(tmp_path, capsys):
    """Its steps overlapped sampling and training: total - rollout is no training time."""
    run = make_run(tmp_path)
    events = run / "events.jsonl"
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    lines[-1].update(rollout_wait_s=0.0, policy_staleness=1)
    events.write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert scaling.main([str(run)]) == 1
    err = capsys.readouterr().err
    assert "max_off_policy_steps = 0" in err and err.count("\n") == 1


def test_env_latency_moves_time_out_of_sampling_and_back_at_the_runs_shape(tmp_path):
    run = make_run(tmp_path, ranks=2)
    costs, work = scaling.measure(run, env_s_per_step=0.05)
    got = scaling.predict(costs, work, trainers=2, samplers=0, env_s_per_step=0.05)
    assert got["step_s"] == pytest.approx(12.0)
    bare, _ = scaling.measure(run)
    assert costs.sampler_tokens_per_s > bare.sampler_tokens_per_s  # the env's share is not sampling
