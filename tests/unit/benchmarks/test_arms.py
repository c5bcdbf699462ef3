"""`quaero bench arms`: arms by `--set`, each seed from its own warm start (`--from` template or SEED=RUN),
run as `bench samplers` arms (finished ones read, never trained again), joined per seed and pooled: paired
against the warm start and the first arm, the change split into format and task, per template, the loss's
figures, and the verdict "beats its warm start at every seed"; bad arms are one line before any trains."""
import json

import pytest

from benchmarks import arms, arms_plot, samplers
from quaero.telemetry import names, runlog
from quaero.tools import review

# per seed: the warm start's eval (successes, malformed actions) of tasks 0..7
WARM = {0: ([1, 0, 0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1, 0, 0]),
        1: ([1, 1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1])}
# per arm: the final eval's successes of tasks 0..7 at seed 0 and 1 (every action well formed), its RL steps'
# clip fraction, and its groups (successes of 8, spread, tokens)
ARMS = {"base": ({0: [1, 0, 0, 0, 0, 0, 0, 0], 1: [1, 1, 0, 0, 0, 0, 0, 0]}, 0.0, (0, 0, 1000)),
        "dapo": ({0: [1, 1, 1, 1, 1, 1, 0, 0], 1: [1, 1, 1, 1, 1, 1, 1, 0]}, 0.25, (4, 1, 500))}


def _events(run_dir, steps, evals):
    runlog.configure(console="none")
    log = runlog.get_logger("test")
    with runlog.RunLog(run_dir, run_id="r"):
        for step, (wins, spread, tokens), clip in steps:
            runlog.set_step(step)
            log.info(names.TASK_OUTCOMES_EVENT, for_step=step, groups=[["env", 0, "city", wins, 8, spread,
                                                                         tokens]])
            log.info(names.TRAIN_STEP_EVENT, phase="rl", loss=0.1, clip_fraction=clip,
                     generated_tokens=tokens)
        for step, wins, bad in evals:
            runlog.set_step(step)
            log.info(names.EVAL_EVENT, eval_results=[[i, w, float(w)] for i, w in enumerate(wins)],
                     eval_formats=[[i, m, 2] for i, m in enumerate(bad)])
        log.info(names.RUN_END_EVENT, status="finished")


@pytest.fixture
def warm_runs(tmp_path):
    from quaero.recipe import checkpoint

    for seed, (wins, bad) in WARM.items():
        source = tmp_path / f"warm-s{seed}"
        checkpoint.save(source / "checkpoints", 500, {"step": 500}, keep=2)
        _events(source, [], [(500, wins, bad)])
    return tmp_path


def test_arms_from_each_seeds_warm_start_are_paired_split_and_judged(tmp_path, warm_runs, monkeypatch,
                                                                      capsys):
    trained = []

    def train_arm(config, out, name, seed, arm, common, source, from_step):
        assert source == warm_runs / f"warm-s{seed}" and from_step == 500
        variant = out.name
        assert ("loss.policy.clip_eps_high=0.28" in common) == (variant == "dapo")
        wins, clip, group = ARMS[variant]
        _events(out / name, [(501, group, clip), (502, group, clip)], [(502, wins[seed], [0] * 8)])
        trained.append((variant, name))
        return out / name

    monkeypatch.setattr(samplers, "train_arm", train_arm)
    out = tmp_path / "out"
    argv = ["envs/toolbench.toml", "--from", str(warm_runs / "warm-s{seed}"), "--from-step", "500",
            "--seeds", "0,1", "--budget", "2000", "--arm", "base",
            "--arm", "dapo: loss.policy.clip_eps_high=0.28", "--out", str(out),
            "--json", str(tmp_path / "arms.json")]
    assert arms.main(argv) == 0
    assert trained == [("base", "sequential-s0"), ("dapo", "sequential-s0"), ("base", "sequential-s1"),
                       ("dapo", "sequential-s1")]  # seed-major: a cut comparison leaves whole seeds
    report = json.loads((tmp_path / "arms.json").read_text())
    row = next(r for r in report["rows"] if r["arm"] == "dapo" and r["seed"] == 1)
    assert (row["rl_steps"], row["tokens"], row["groups"], row["signal"], row["signal_per_1k"]) == (
        2, 1000, 2, 2, 2.0)
    assert (row["vs_warm_start"]["a_only"], row["vs_warm_start"]["b_only"]) == (5, 0)
    assert (row["vs_baseline"]["a_only"], row["vs_baseline"]["b_only"]) == (5, 0)
    assert row["clip_fraction"] == 0.25
    # seed 1's warm start: 4 of 8 malformed, 2 of the 4 well formed solved; the arm: all well formed, 7 of 8
    split = row["format_task_vs_warm_start"]
    assert (split["b_well_formed"], split["a_well_formed"]) == (0.5, 1.0)
    assert (split["b_task_success"], split["a_task_success"]) == (0.5, 7 / 8)
    pooled = report["pooled"]["dapo"]
    assert (pooled["vs_warm_start"]["pairs"], pooled["vs_warm_start"]["a_only"]) == (16, 10)
    assert (pooled["seeds_won"], pooled["seeds_lost"]) == (0, 0)  # +5/-0 at each seed: p 0.0625
    assert pooled["vs_warm_start"]["mcnemar_p"] < 0.01  # pooled, 10 of 10 discordant pairs
    assert report["pooled"]["base"]["vs_baseline"] is None
    text = capsys.readouterr().out
    assert "| dapo | 1 | 2 | 1,000 | 2 of 2 (2.000) | 0.875 | +5/-0, p 0.062" in text
    assert ("- dapo: beats its warm start at every seed: no (0 of 2 significant gains, 0 significant "
            "losses)") in text
    # the figure: every arm at every seed, from the seed's warm start (0 RL tokens) to the arm's eval
    assert f"figure {out / 'arms.png'}" in text
    png = (out / "arms.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    warm = {s: review.load_run(warm_runs / f"warm-s{s}").evals[0] for s in (0, 1)}
    curves = arms_plot.arm_curves([("base", "sequential", []), ("dapo", "sequential", [])], [0, 1], warm, out)

    def se(p):
        return (p * (1 - p) / 8) ** 0.5

    assert [(t, v) for t, v, _ in curves[("dapo", 1)]] == [(0, 2 / 8), (1000, 7 / 8)]  # 2 steps of 500 tokens
    assert [e for _, _, e in curves[("dapo", 1)]] == pytest.approx([se(2 / 8), se(7 / 8)])
    assert [(t, v) for t, v, _ in curves[("base", 0)]] == [(0, 1 / 8), (2000, 1 / 8)]
    # a second call reads the finished arms and trains none; --no-train only reads, and refuses an arm whose
    # sets differ (here in order) instead of training it again
    trained.clear()
    assert arms.main(argv) == 0 and arms.main([*argv, "--no-train"]) == 0 and trained == []
    reordered = [a.replace("loss.policy.clip_eps_high=0.28", "loss.policy.clip_eps_high=0.28 loss.beta=0")
                 for a in argv]
    with pytest.raises(SystemExit, match=r"--no-train: 2 arm\(s\) not finished with .*dapo seed 0"):
        arms.main([*reordered, "--no-train"])
    assert trained == []


@pytest.mark.parametrize("argv_more,says", [
    (["--arm", "base", "--arm", "base: loss.beta=0.1"], "--arm names repeat"),
    (["--arm", "../x"], "--arm '../x': expected NAME"),
    (["--arm", "kl: loss.beta"], "'loss.beta' is not SECTION.KEY=VALUE"),
    (["--arm", "kl: loss.beta=-1"], "beta"),
])
def test_bad_arms_are_one_line_before_anything_trains(tmp_path, warm_runs, monkeypatch, argv_more, says):
    monkeypatch.setattr(samplers, "train_arm", lambda *a, **k: pytest.fail("an arm was trained"))
    argv = ["envs/toolbench.toml", "--from", str(warm_runs / "warm-s{seed}"), "--from-step", "500",
            "--seeds", "0", "--budget", "2000", "--out", str(tmp_path / "out"), *argv_more]
    with pytest.raises((SystemExit, Exception), match=says):
        arms.main(argv)


def test_each_seed_gets_its_own_warm_start_and_a_seed_without_one_is_one_line():
    got = arms.sources(["runs/ws-s{seed}", "0=runs/ci"], [0, 1, 2])
    assert {s: str(p) for s, p in got.items()} == {0: "runs/ci", 1: "runs/ws-s1", 2: "runs/ws-s2"}
    with pytest.raises(SystemExit, match="--seeds has 3 but no --from names its warm start"):
        arms.sources(["0=runs/ci"], [0, 3])
    assert arms.parse_arm("cur: env.tasks.sampler=curriculum guidance.mode=episode") == (
        "cur", "curriculum", ["guidance.mode=episode"])


@pytest.mark.hostile
@pytest.mark.parametrize("argv_more,says", [
    # a user's run named by --set: the arm trained inside it (events appended, final/ overwritten)
    (["--set", "run.output_dir=runs", "--set", "run.name=mine", "--arm", "base"],
     "--set 'run.output_dir=runs': run.name, run.output_dir and run.seed are the bench's own"),
    (["--arm", "base: run.name=mine"], "--arm 'base: run.name=mine': 'run.name=mine': run.name"),
    (["--arm", "base", "--set", "run={name='mine'}"], "--set \"run={name='mine'}\": run.name"),
    (["--arm", "base", "--set", "run.seed=3"], "--set 'run.seed=3': .* choose the folder with --out"),
])
def test_bench_arms_never_trains_an_arm_in_a_run_a_set_names(tmp_path, warm_runs, monkeypatch, argv_more,
                                                             says):
    monkeypatch.setattr(samplers, "train_arm", lambda *a, **k: pytest.fail("an arm was trained"))
    argv = ["envs/toolbench.toml", "--from", str(warm_runs / "warm-s{seed}"), "--from-step", "500",
            "--seeds", "0", "--budget", "2000", "--out", str(tmp_path / "out"), *argv_more]
    with pytest.raises(SystemExit, match=says):
        arms.main(argv)


@pytest.mark.hostile
def test_bench_arms_json_is_refused_before_training_where_it_would_write_through_a_link_or_a_run(
        tmp_path, warm_runs, monkeypatch):
    import os

    monkeypatch.setattr(samplers, "train_arm", lambda *a, **k: pytest.fail("an arm was trained"))
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    (tmp_path / "link.json").symlink_to(outside)
    os.mkfifo(tmp_path / "fifo.json")
    config = warm_runs / "warm-s0" / "config.json"  # a run's own file
    config.write_text("{}")
    argv = ["envs/toolbench.toml", "--from", str(warm_runs / "warm-s{seed}"), "--from-step", "500",
            "--seeds", "0", "--budget", "2000", "--out", str(tmp_path / "out"), "--arm", "base"]
    for path, says in ((tmp_path / "link.json", "a symlink"), (tmp_path / "fifo.json", "a special file"),
                       (config, "inside the run folder")):
        with pytest.raises(SystemExit, match=f"--json {path}: {says}"):
            arms.main([*argv, "--json", str(path)])
    assert outside.read_text() == "keep" and config.read_text() == "{}"


@pytest.mark.hostile
def test_an_arms_own_run_name_folder_and_seed_come_after_every_user_set(tmp_path, monkeypatch):
    import subprocess

    from benchmarks import ablation

    ran = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **k: ran.append(cmd) or subprocess.CompletedProcess(
        cmd, 0))
    ablation.train_arm("envs/toolbench.toml", tmp_path, "a-s0", 0, ["loss.beta=0"], ["training.steps=2"],
                       None)
    sets = [x for x in ran[0] if "=" in x]
    assert sets[-3:] == ["run.name=a-s0", f"run.output_dir={tmp_path}", "run.seed=0"]


@pytest.mark.hostile
@pytest.mark.parametrize("arm", ["kl: training.nope=1", "kl: training.steps=[", "kl: =1"])
def test_a_bad_arm_set_through_the_cli_is_one_line_not_a_traceback(tmp_path, warm_runs, monkeypatch, capsys,
                                                                   arm):
    """`quaero bench` ran outside the CLI's error handling: a set the config refuses printed a traceback."""
    from quaero import cli

    monkeypatch.setattr(samplers, "train_arm", lambda *a, **k: pytest.fail("an arm was trained"))
    assert cli.main(["bench", "arms", "envs/toolbench.toml", "--from", str(warm_runs / "warm-s{seed}"),
                     "--from-step", "500", "--seeds", "0", "--budget", "2000", "--out", str(tmp_path / "out"),
                     "--arm", arm]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err


@pytest.mark.hostile
@pytest.mark.parametrize("warm_eval,arm_step,arm_eval", [
    ({"eval_results": "crafted"}, {}, {}),  # the warm start's per-task results unreadable, its formats not
    ({}, {}, {"eval_results": [[0, "x", "y"]]}),  # the arm's eval: no readable result
    ({}, {"guided_members": "many", "groups_guided": [1], "clip_fraction": float("nan")}, {}),
])
def test_crafted_events_never_make_bench_arms_raise(tmp_path, monkeypatch, warm_eval, arm_step, arm_eval):
    """Each raised TypeError in the report's join (format_and_task on None outcomes, sum over a string)."""
    from quaero.recipe import checkpoint

    def write(run_dir, events):
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / names.EVENTS).write_text("".join(json.dumps(e) + "\n" for e in events))

    def evaluation(step, **crafted):
        return {"event": names.EVAL_EVENT, "step": step, "eval_results": [[i, i % 2, 1.0] for i in range(4)],
                "eval_formats": [[i, 0, 2] for i in range(4)], **crafted}

    source = tmp_path / "warm-s0"
    checkpoint.save(source / "checkpoints", 500, {"step": 500}, keep=2)
    write(source, [evaluation(500, **warm_eval)])

    def train_arm(config, out, name, seed, arm, common, source, from_step):
        write(out / name, [{"event": names.TRAIN_STEP_EVENT, "step": 501, "phase": "rl", "loss": 0.1,
                            "generated_tokens": 10, **arm_step}, evaluation(502, **arm_eval),
                           {"event": names.RUN_END_EVENT, "step": 502, "status": "finished"}])
        return out / name

    monkeypatch.setattr(samplers, "train_arm", train_arm)
    assert arms.main(["envs/toolbench.toml", "--from", str(source), "--from-step", "500", "--seeds", "0",
                      "--budget", "2000", "--arm", "base", "--arm", "b: loss.beta=0", "--out",
                      str(tmp_path / "out"), "--json", str(tmp_path / "arms.json")]) == 0
    if arm_step:  # a field that is no finite number is no value
        row = json.loads((tmp_path / "arms.json").read_text())["rows"][0]
        assert (row["guided_members"], row["groups_guided"], row["clip_fraction"]) == (0, 0, None)
