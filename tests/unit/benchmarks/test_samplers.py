"""`quaero bench samplers`: each arm's groups with signal per generated token from its `task_outcomes`, its
last eval paired against the warm start's and against the `sequential` arm of its seed, per spec group
through the env's own Task API, and finished arms read instead of trained again."""
import json
import shutil

import pytest

from benchmarks import samplers
from quaero.config import load_config
from quaero.telemetry import names, runlog

# per sampler: (groups per RL step as (task, template, successes, spread, tokens), eval successes of tasks
# 0..7)
ARMS = {
    "sequential": ([[(0, "price", 0, 0, 500), (1, "city", 8, 0, 500)]] * 2, [1, 1, 0, 0, 0, 0, 0, 0]),
    "curriculum": ([[(2, "city", 4, 1, 250), (3, "city", 3, 1, 250)]] * 4, [1, 1, 1, 1, 0, 0, 0, 0]),
}


def _events(run_dir, steps, evals):
    runlog.configure(console="none")
    log = runlog.get_logger("test")
    with runlog.RunLog(run_dir, run_id="r"):
        for step, groups in steps:
            runlog.set_step(step)
            log.info(names.TASK_OUTCOMES_EVENT, for_step=step, groups=[
                ["env", task, template, wins, 8, spread, tokens]
                for task, template, wins, spread, tokens in groups])
            log.info(names.TRAIN_STEP_EVENT, phase="rl", loss=0.1)
        for step, wins in evals:
            runlog.set_step(step)
            log.info(names.EVAL_EVENT, eval_results=[[i, w, float(w)] for i, w in enumerate(wins)])
        log.info(names.RUN_END_EVENT, status="finished")


@pytest.fixture
def warm_run(tmp_path):
    from quaero.recipe import checkpoint

    source = tmp_path / "warm"
    checkpoint.save(source / "checkpoints", 500, {"step": 500}, keep=2)
    _events(source, [], [(500, [1, 0, 0, 0, 0, 0, 0, 0])])
    return source


def test_every_env_of_a_mixture_gets_the_sampler_and_a_learner_its_key():
    cfg = load_config("envs/toolbench_mixture.toml")
    assert samplers.arm_sets(cfg.views(), True, "curriculum", "group") == [
        "envs.d1.tasks.sampler=curriculum", "envs.d1.tasks.key=group",
        "envs.d2.tasks.sampler=curriculum", "envs.d2.tasks.key=group"]
    one = load_config("envs/toolbench.toml")
    assert samplers.arm_sets(one.views(), False, "uniform", "group") == ["env.tasks.sampler=uniform"]


def test_arms_compare_per_token_and_pair_with_the_warm_start_and_sequential(tmp_path, warm_run, monkeypatch):
    trained = []

    def train_arm(config, out, name, seed, arm, common, source, from_step):
        sampler = name.rsplit("-s", 1)[0]
        assert "training.rl_token_budget=2000" in common and source == warm_run and from_step == 500
        steps, wins = ARMS[sampler]
        _events(out / name, [(501 + i, g) for i, g in enumerate(steps)], [(500 + len(steps), wins)])
        trained.append(name)
        return out / name

    monkeypatch.setattr(samplers, "train_arm", train_arm)
    argv = ["envs/toolbench.toml", "--from", str(warm_run), "--from-step", "500", "--seeds", "0,1",
            "--samplers", "sequential,curriculum", "--budget", "2000", "--out", str(tmp_path / "out")]
    assert samplers.main(argv) == 0
    assert sorted(trained) == ["curriculum-s0", "curriculum-s1", "sequential-s0", "sequential-s1"]
    report = json.loads((tmp_path / "out" / "samplers.json").read_text())["envs"]["None"]
    row = next(r for r in report["rows"] if r["sampler"] == "curriculum" and r["seed"] == 1)
    # 8 groups, all with spread, over 2,000 tokens; sequential: 0 of 4 over 2,000
    assert (row["rl_steps"], row["tokens"], row["groups"], row["signal"]) == (4, 2000, 8, 8)
    assert row["signal_per_1k"] == 4.0 and row["by_group"] == {"city": [8, 8, 28, 64]}
    assert (row["vs_warm_start"]["a_only"], row["vs_warm_start"]["b_only"]) == (3, 0)
    assert (row["vs_sequential"]["a_only"], row["vs_sequential"]["b_only"]) == (2, 0)
    pooled = report["pooled"]["curriculum"]
    assert (pooled["vs_sequential"]["pairs"], pooled["vs_sequential"]["a_only"]) == (16, 4)
    # held-out per template, through toolbench's own get_task on its eval split
    from envs.toolbench import ToolBenchEnv

    env = ToolBenchEnv(**load_config("envs/toolbench.toml").env.kwargs)
    templates = [env.get_task("eval", i)["group"] for i in range(8)]
    wins = ARMS["curriculum"][1]
    solved = {t: 2 * sum(w for w, tt in zip(wins, templates) if tt == t) for t in set(templates)}
    assert {k: v[0] for k, v in pooled["eval_by_group"].items()} == solved
    text = samplers.render(json.loads((tmp_path / "out" / "samplers.json").read_text()))
    assert "| 1 | curriculum | 4 | 2,000 | 8 | 8 | 4.000 | 0.500 | +3/-0, p 0.25 | +2/-0, p 0.5 |" in text
    assert "| sequential | 4,000 | 8 | 0 | 0.000 | 0.250 | +2/-0, p 0.5 | n/a |" in text
    assert "| curriculum | 4,000 | 16 | 16 | 4.000 | 0.500 | +6/-0, p 0.031 | +4/-0, p 0.12 |" in text

    # a second call reads the finished arms and trains none
    trained.clear()
    assert samplers.main(argv) == 0 and trained == []


# ── hostile: nothing the bench did not create is deleted or overwritten, and bad input is one line ──────────


def _argv(warm_run, out, *more, samplers="sequential", seeds="0"):
    return ["envs/toolbench.toml", "--from", str(warm_run), "--from-step", "500", "--seeds", seeds,
            "--samplers", samplers, "--budget", "2000", "--out", str(out), *more]


@pytest.fixture
def no_training(monkeypatch):
    monkeypatch.setattr(samplers, "train_arm", lambda *a, **k: pytest.fail("an arm was trained"))


def _one_line(e) -> str:
    msg = str(e.value)
    assert msg.startswith("error: ") and "\n" not in msg
    return msg


@pytest.mark.hostile
def test_an_arm_name_with_a_path_is_refused_before_anything_is_touched(tmp_path, warm_run, no_training):
    """`--samplers ../victim` emptied runs/victim-s0, outside --out, and lost a user's file there."""
    victim = tmp_path / "victim-s0"
    victim.mkdir()
    (victim / "notes.txt").write_text("mine")
    for bad in ("../victim", "a/b", "/abs", ".."):
        with pytest.raises(SystemExit) as e:
            samplers.main(_argv(warm_run, tmp_path / "out", samplers=bad))
        assert f"--samplers {bad!r}: not one of sequential" in _one_line(e)
    assert (victim / "notes.txt").read_text() == "mine" and not (tmp_path / "out").exists()


@pytest.mark.hostile
def test_the_from_run_under_an_arms_name_in_out_is_refused_never_deleted(tmp_path, warm_run, no_training):
    out = tmp_path / "out"
    out.mkdir()
    inside = out / "sequential-s0"
    warm_run.rename(inside)
    before = sorted(p.relative_to(inside) for p in inside.rglob("*"))
    with pytest.raises(SystemExit) as e:
        samplers.main(_argv(inside, out))
    assert "is (or holds, or lies in) the --from run" in _one_line(e)
    assert sorted(p.relative_to(inside) for p in inside.rglob("*")) == before


@pytest.mark.hostile
@pytest.mark.parametrize("kind", ["user folder", "link out"])
def test_a_folder_the_bench_did_not_make_is_refused_never_emptied(tmp_path, warm_run, no_training, kind):
    out = tmp_path / "out"
    out.mkdir()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.txt").write_text("mine")
    arm = out / "sequential-s0"
    if kind == "user folder":
        mine.rename(arm)
        mine = arm
    else:
        arm.symlink_to(mine)
    with pytest.raises(SystemExit) as e:
        samplers.main(_argv(warm_run, out))
    assert ("holds files no bench wrote" if kind == "user folder" else "outside --out") in _one_line(e)
    assert (mine / "data.txt").read_text() == "mine"


@pytest.mark.hostile
@pytest.mark.parametrize("flag,value,says", [("--seeds", "x", "--seeds 'x': expected integers"),
                                             ("--seeds", ",", "expected at least one seed"),
                                             ("--budget", "0", "--budget 0: every arm's"),
                                             ("--budget", "-5", "--budget -5: every arm's"),
                                             ("--samplers", ",", "--samplers names no sampler"),
                                             ("--samplers", "nopkg.nomod:Sampler", "cannot import module"),
                                             ("--samplers", "json:dumps", "not a class")])
def test_bad_arguments_are_one_line(tmp_path, warm_run, no_training, flag, value, says):
    argv = _argv(warm_run, tmp_path / "out")
    argv[argv.index(flag) + 1] = value
    with pytest.raises(SystemExit) as e:
        samplers.main(argv)
    assert says in _one_line(e)


@pytest.mark.hostile
def test_a_source_run_without_events_is_one_line(tmp_path, warm_run, no_training):
    (warm_run / names.EVENTS).unlink()
    with pytest.raises(SystemExit) as e:
        samplers.main(_argv(warm_run, tmp_path / "out"))
    assert _one_line(e).startswith("error: --from: ") and "no events.jsonl here" in str(e.value)


@pytest.mark.hostile
def test_a_user_sampler_class_is_an_arm_and_a_failing_arm_is_one_line(tmp_path, warm_run, monkeypatch):
    import subprocess
    from types import SimpleNamespace

    monkeypatch.setattr(subprocess, "run", lambda cmd, check=False: SimpleNamespace(returncode=2))
    with pytest.raises(SystemExit) as e:
        samplers.main(_argv(warm_run, tmp_path / "out",
                            samplers="quaero.rollout.task_samplers:SequentialSampler"))
    assert _one_line(e).startswith(
        "error: arm quaero.rollout.task_samplers+SequentialSampler-s0: `quaero train` exited 2")
    # the arm's folder was the bench's own: marked, holding the warm start's checkpoint
    arm = tmp_path / "out" / "quaero.rollout.task_samplers+SequentialSampler-s0"
    assert (arm / ".quaero-bench-arm").is_file() and (arm / "checkpoints" / "step-000500").is_dir()


@pytest.mark.hostile
def test_malformed_finished_arms_and_nested_groups_are_read_not_a_traceback(tmp_path, warm_run, monkeypatch):
    """A finished arm whose marker is not JSON trains again; task_outcomes groups of another shape are left
    out; an RFC 013 group nested in lists or dicts is a key by its JSON text."""
    trained = []

    def train_arm(config, out, name, seed, arm, common, source, from_step):
        shutil.rmtree(out / name, ignore_errors=True)  # as the real one's fresh folder
        runlog.configure(console="none")
        log = runlog.get_logger("test")
        with runlog.RunLog(out / name, run_id="r"):
            runlog.set_step(501)
            log.info(names.TASK_OUTCOMES_EVENT, for_step=501, groups=[
                ["env", 0, {"tier": ["a", 1]}, 3, 8, 1, 400], ["env", 1, ["x"], 2, 8, True, 100],
                ["too", "short"], "not a list", ["env", 2, "g", "3", 8, 1, 10**400],
                ["env", 3, "g", 1, 8, 0, -1]])
            log.info(names.TRAIN_STEP_EVENT, phase="rl", loss=0.1)
            log.info(names.EVAL_EVENT, eval_results=[[0, 1, 1.0], [1, 0, 0.0], "junk", [2, 1, "nan"]])
            log.info(names.RUN_END_EVENT, status="finished")
        trained.append(name)
        return out / name

    monkeypatch.setattr(samplers, "train_arm", train_arm)
    argv = _argv(warm_run, tmp_path / "out")
    assert samplers.main(argv) == 0
    (tmp_path / "out" / "sequential-s0" / samplers.MARKER).write_text("{not json")
    assert samplers.main(argv) == 0 and trained == ["sequential-s0", "sequential-s0"]
    row = json.loads((tmp_path / "out" / "samplers.json").read_text())["envs"]["None"]["rows"][0]
    assert (row["groups"], row["signal"], row["tokens"]) == (2, 2, 500)
    assert row["by_group"] == {'{"tier": ["a", 1]}': [1, 1, 3, 8], '["x"]': [1, 1, 2, 8]}


@pytest.mark.hostile
def test_an_out_that_is_a_file_is_one_line(tmp_path, warm_run, no_training):
    (tmp_path / "taken").write_text("mine")
    with pytest.raises(SystemExit) as e:
        samplers.main(_argv(warm_run, tmp_path / "taken"))
    assert "--out" in _one_line(e) and (tmp_path / "taken").read_text() == "mine"


def test_a_finished_arm_is_its_sets_in_any_order_where_the_order_cannot_matter():
    head = ["envs/toolbench.toml", "runs/ws", "500", "1"]
    command = [*head, "loss.beta=0.04", "training.num_iterations=2", "training.rl_token_budget=26000"]
    assert samplers.same_arm([*head, "training.num_iterations=2", "training.rl_token_budget=26000",
                              "loss.beta=0.04"], command)
    assert not samplers.same_arm([*head, "training.num_iterations=2", "training.rl_token_budget=26000",
                                  "loss.beta=0.05"], command)  # another value
    assert not samplers.same_arm([*head[:3], "2", *command[4:]], command)  # another seed
    assert not samplers.same_arm(command[:-1], command) and not samplers.same_arm("junk", command)
    # where the order decides the value, only the same order is the same arm
    ordered = [*head, "env.kwargs={difficulty = 1}", "env.kwargs.difficulty=2"]
    assert samplers.same_arm(list(ordered), ordered)
    assert not samplers.same_arm([*head, ordered[5], ordered[4]], ordered)
    twice = [*head, "loss.beta=0.1", "loss.beta=0.2"]
    assert not samplers.same_arm([*head, twice[5], twice[4]], twice)
