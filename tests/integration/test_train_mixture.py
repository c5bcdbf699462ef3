"""A mixture run end to end (quaero/recipe/train.py over `[[envs]]`): toolbench (MCP, on a local server, a
curriculum pooled by template) and the Task-API sum env (plain JSON actions, in process, uniform) in one
run, with a warm start from each env's oracle; resumed from its mid-mixture checkpoint, it reaches the same
weights, bit for bit, as the run that was not stopped; a checkpoint of another mixture is refused in one
line."""
from __future__ import annotations

import json
import shutil

import pytest
from fixtures.runs import events_of, mixture, rewind, steps_by_number

from quaero.config import load_config
from quaero.telemetry.runlog import read_events

EVERY_2 = ["training.checkpoint_every=2"]  # the uninterrupted run keeps step 2's checkpoint to resume from


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from quaero.recipe.train import train

    tmp = tmp_path_factory.mktemp("mixture")
    return tmp, train(load_config(mixture(tmp, "whole"), EVERY_2))


def _weights(run_dir) -> bytes:
    return b"".join(p.read_bytes() for p in sorted((run_dir / "final").glob("*.safetensors")))


def _tasks(run_dir) -> dict[int, dict]:
    return {e["for_step"]: e["envs"] for e in events_of(run_dir, "tasks_drawn")}


@pytest.mark.slow
def test_a_mixture_run_shares_each_step_by_ratio_and_logs_per_env_figures(uninterrupted):
    _, run = uninterrupted
    drawn = _tasks(run)
    per_step = {s: {env: len(picks) for env, picks in envs.items()} for s, envs in drawn.items()}
    # 3 groups a step at 2:1: tools 2, sum 1, every step (the warm start's too)
    assert per_step == {s: {"tools": 2, "sum": 1} for s in range(1, 5)}
    assert all(p["weight"] is not None for envs in drawn.values() for picks in envs.values() for p in picks)
    steps = steps_by_number(run)
    for s in (2, 3, 4):
        by_env = steps[s]["by_env"]
        assert set(by_env) == {"tools", "sum"}
        assert by_env["tools"]["groups"] + by_env["sum"]["groups"] == steps[s]["groups"]
        assert steps[s]["signal_groups"] == by_env["tools"]["signal_groups"] + by_env["sum"]["signal_groups"]
        assert steps[s]["generated_tokens"] > 0
    outcomes = [g for e in events_of(run, "task_outcomes") for g in e["groups"]]
    assert {g[0] for g in outcomes} == {"tools", "sum"}
    assert {g[2] for g in outcomes if g[0] == "tools"} <= {"price", "city", "stock"}  # toolbench's templates
    # each env's own group size and ECHO weight on its rows (sum: echo_weight = 0)
    rows = [json.loads(line) for f in sorted((run / "rows").glob("step-*.jsonl"))
            for line in f.read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    members = {r["meta"]["episode"].split("/")[1].split(":")[0]: set() for r in rl}
    for r in rl:
        members[r["meta"]["episode"].split("/")[1].split(":")[0]].add(r["meta"]["episode"].rsplit("/", 1)[1])
    assert members == {"tools": {"0", "1"}, "sum": {"0", "1", "2"}}
    env_of = lambda r: r["meta"]["episode"].split("/")[1].split(":")[0]
    assert not any(any(r["echo_weights"]) for r in rows if env_of(r) == "sum")
    assert any(any(r["echo_weights"]) for r in rows if env_of(r) == "tools")  # the oracle demos' tool results


@pytest.mark.slow
@pytest.mark.hostile
def test_a_mixture_resumed_mid_run_reaches_the_same_weights_bit_for_bit(uninterrupted):
    from quaero.recipe import checkpoint
    from quaero.recipe.train import train

    tmp, whole = uninterrupted
    copy = tmp / "copy"
    shutil.copytree(whole, copy / "runs" / whole.name)  # the run, to resume from its step-2 checkpoint
    rewind(copy / "runs" / whole.name, 2)
    resumed = train(load_config(mixture(copy, "whole"), EVERY_2), resume=True)  # resumes at step 3
    assert [e["step"] for e in events_of(resumed, "resumed")] == [2]
    events = read_events(resumed / "events.jsonl")[0]
    since = next(i for i, e in enumerate(events) if e["event"] == "resumed")
    redrawn = {e["for_step"]: e["envs"] for e in events[since:] if e["event"] == "tasks_drawn"}
    assert redrawn == {s: envs for s, envs in _tasks(whole).items() if s > 2}  # from the restored samplers
    assert _weights(resumed) == _weights(whole)
    # a checkpoint of another mixture is refused in one line saying what differs
    with pytest.raises(checkpoint.CheckpointError, match=r"another mixture \(env ratios tools: 2.0 -> 3.0\)"
                       ) as e:
        train(load_config(mixture(copy, "whole", steps=4, ratio=3), EVERY_2))
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_quaero_check_prints_every_env_and_the_mixture_as_fractions_of_a_step(capsys):
    from quaero import cli

    assert cli.main(["check", "envs/toolbench_mixture.toml"]) == 0
    out = capsys.readouterr().out
    assert "env 'd1'   envs.toolbench:ToolBenchEnv(difficulty=1) via local-server" in out
    assert "env 'd2'   envs.toolbench:ToolBenchEnv(difficulty=2) via local-server" in out
    assert "task sampler curriculum (key group, cost tokens" in out
    assert "mixture     d1 75.0% (~3 of 4 groups a step), d2 25.0% (~1 of 4 groups a step)" in out
    assert out.count("env action  MCP tool calls") == 2 and out.count("splits 'train' (1000000 tasks)") == 2


# A one-env run before mixtures and task samplers (main at 3495e64, seed 1, dynamic sampling): each step's
# episodes (step/task index/member; steps 2-4 sample 3 further tasks each) and losses.
BEFORE_EPISODES = {
    1: [(50741, 0), (277910, 0)],
    2: [(t, g) for t in (505079, 732248, 959417, 186586, 413755, 640924) for g in (0, 1)],
    3: [(t, g) for t in (868093, 95262, 322431, 549600, 776769, 3938) for g in (0, 1)],
    4: [(t, g) for t in (231107, 458276, 685445, 912614, 139783, 366952) for g in (0, 1)],
}
BEFORE_LOSSES = {1: (0.0, 1.232444167137146, 0), 2: (0.0, 0.0, 6), 3: (0.0, 0.0, 6), 4: (0.0, 0.0, 6)}


@pytest.mark.slow
def test_a_one_env_run_plays_the_tasks_and_losses_it_played_before_mixtures(tmp_path):
    from fixtures.runs import make_config

    from quaero.recipe.train import train

    _, cfg = make_config(tmp_path, "one", steps=3, warmup=1, eval_every=0, eval_tasks=0,
                         extra=["run.seed=1", "logging.save_rows='all'", "rollout.dynamic_sampling=true"])
    run = train(cfg)
    steps = steps_by_number(run)
    for step, want in BEFORE_EPISODES.items():
        saved = (run / "rows" / f"step-{step:06d}.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in saved]
        played = sorted({tuple(int(x) for x in r["meta"]["episode"].split("/")[1:]) for r in rows})
        assert played == sorted(want), step
        rl, echo, groups = BEFORE_LOSSES[step]
        assert steps[step]["rl_loss"] == pytest.approx(rl, abs=1e-9)
        assert steps[step]["echo_loss"] == pytest.approx(echo, rel=1e-6)
        assert steps[step].get("groups", 0) == groups


@pytest.mark.slow
def test_a_mixture_samples_ahead_and_resamples_groups_without_spread_from_their_own_env(tmp_path):
    """Rollouts sampled ahead (`max_off_policy_steps = 1`) draw the next step's groups by the mixture as the
    loop does; dynamic sampling (a run of its own: the two do not combine) draws each further group from the
    sampler of an env whose group had no spread."""
    from quaero.recipe.train import train

    ahead = train(load_config(mixture(tmp_path, "ahead", steps=2), ["rollout.max_off_policy_steps=1"]))
    steps = steps_by_number(ahead)
    assert [steps[s].get("policy_staleness") for s in range(1, 4)] == [None, 0, 1]
    drawn = _tasks(ahead)
    assert {s: {env: len(p) for env, p in envs.items()} for s, envs in drawn.items()} == {
        s: {"tools": 2, "sum": 1} for s in range(1, 4)}
    assert all(set(steps[s]["by_env"]) == {"tools", "sum"} for s in (2, 3))

    dynamic = train(load_config(mixture(tmp_path, "dynamic", steps=2), ["rollout.dynamic_sampling=true"]))
    for e in events_of(dynamic, "task_outcomes"):  # group: [env, task, key, wins, episodes, spread, ..]
        first, further = e["groups"][:3], e["groups"][3:]  # the drawn groups, then the further ones
        assert steps_by_number(dynamic)[e["for_step"]]["groups_resampled"] == len(further)
        lacking = {g[0] for g in first if not g[5]}  # the envs whose drawn group had no spread
        first_round = 3 - sum(g[5] for g in first)  # the first round: a group per spread missing
        if not lacking:
            assert not further
        assert len(further) >= first_round and all(g[0] in lacking for g in further[:first_round])
    assert any(len(e["groups"]) > 3 for e in events_of(dynamic, "task_outcomes"))  # it did resample
