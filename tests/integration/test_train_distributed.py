"""`quaero train --nproc 2` end to end: the main job's recipe on 2 ranks (torchrun, gloo, CPU) on the real
toolbench env and tiny-qwen3. Rank 0 alone writes the run folder; the events hold the ranks' totals; an
FSDP2 run checkpoints in shards, `quaero export` reads them whole, and a run stopped after step k and
resumed equals the uninterrupted run at step k + 1.
"""
import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
from fixtures.runs import ROOT, events_of, make_config, steps_by_number
from safetensors.torch import load_file

from quaero.metrics import read_events


def with_strategy(path, strategy):
    path.write_text(path.read_text() + f'\n[distributed]\nstrategy = "{strategy}"\n')
    return path


def quaero(*args, timeout=900):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.run([sys.executable, "-m", "quaero.cli", *map(str, args)], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_finish_the_main_job_write_once_and_pass_review(tmp_path, strategy):
    path, cfg = make_config(tmp_path, strategy, steps=1, warmup=2, eval_every=3, eval_tasks=2)
    quaero("train", with_strategy(path, strategy), "--nproc", 2)
    run_dir = cfg.run_dir
    events, unreadable = read_events(run_dir / "events.jsonl")
    count = Counter(e["event"] for e in events)
    assert unreadable == 0 and count["run_start"] == 1 and count["run_end"] == 1 and count["trainer_ready"] == 1
    assert count["train_step"] == 3 and count["eval"] == 2  # once each, by rank 0
    assert events_of(run_dir, "run_start")[0]["ranks"] == 2
    steps = events_of(run_dir, "train_step")
    for s in steps:
        # every rank's episodes are counted: 2 tasks x group 1 (warm start) or 2 (RL), split 1 + 1 over the ranks
        assert s["episodes"] == 2 * (1 if s["phase"] == "sft" else 2) and s["episodes_dropped"] == 0
        assert s["ranks"] == 2 and sum(s["rank_rows"]) == s["rows"] > 0
        assert s["env_responses"] == s["env_responses_captured"] and s["prefix_mismatches"] == 0
        assert s["forward_passes"] == s["microbatches"] - s["lm_head_skipped_microbatches"]
    assert [e["eval_episodes"] for e in events_of(run_dir, "eval")] == [2, 2]
    assert steps[-1]["cumulative"]["episodes"] == 2 + 2 + 4
    assert events_of(run_dir, "run_end")[0]["status"] == "finished"
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == ["step-000002", "step-000003"]
    last = run_dir / "checkpoints" / "step-000003"
    assert (last / "shards").is_dir() == (strategy == "fsdp2")
    quaero("review", run_dir, "--require-proof")  # exit 0: every required proof passes on the totals
    # one process exports the last checkpoint (FSDP2: its shards read whole): the weights of final/
    quaero("export", run_dir, tmp_path / "exported")
    final = load_file(run_dir / "final" / "model.safetensors")
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    assert sorted(final) == sorted(exported)
    for name, w in final.items():
        torch.testing.assert_close(exported[name], w, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_fsdp2_stopped_and_resumed_from_shards_equals_uninterrupted(tmp_path):
    """Warm-start steps (the env's oracle: the same rows every time): 3 steps straight through, against
    2 steps, then the same run folder resumed from its sharded step-2 checkpoint for step 3."""
    compare = ("loss", "sft_loss", "echo_loss", "grad_norm", "row_tokens", "action_tokens", "echo_tokens")
    ref_path, ref_cfg = make_config(tmp_path, "ref", steps=0, warmup=3, eval_every=0, eval_tasks=0)
    quaero("train", with_strategy(ref_path, "fsdp2"), "--nproc", 2)
    path, cfg = make_config(tmp_path, "cut", steps=0, warmup=2, eval_every=0, eval_tasks=0)
    quaero("train", with_strategy(path, "fsdp2"), "--nproc", 2)
    assert (cfg.run_dir / "checkpoints" / "step-000002" / "shards").is_dir()
    quaero("train", path, "--nproc", 2, "--set", "training.warmup_sft_steps=3")
    assert [e["step"] for e in events_of(cfg.run_dir, "resumed")] == [2]
    ref, resumed = steps_by_number(ref_cfg.run_dir), steps_by_number(cfg.run_dir)
    for key in compare:
        assert resumed[3][key] == pytest.approx(ref[3][key], rel=1e-6, abs=1e-9), key
    want = load_file(ref_cfg.run_dir / "final" / "model.safetensors")
    got = load_file(cfg.run_dir / "final" / "model.safetensors")
    worst = max(float((got[n] - w).abs().max()) for n, w in want.items())
    assert worst <= 1e-6, worst
    print(json.dumps({"step3_loss": [ref[3]["loss"], resumed[3]["loss"]], "max_weight_diff": worst}))


@pytest.mark.slow
@pytest.mark.hostile
def test_a_locked_run_folder_ends_every_rank_with_the_lock_error(tmp_path):
    """`--nproc` refuses a locked run folder before it launches any rank; ranks torchrun launched itself stop
    when rank 0 cannot take the lock: every rank with its message (none waits in a collective)."""
    from quaero.runlock import RunLock

    path, cfg = make_config(tmp_path, "locked", steps=1, warmup=0, eval_every=0, eval_tasks=0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    config = str(with_strategy(path, "ddp"))
    with RunLock(cfg.run_dir):
        launcher = subprocess.run([sys.executable, "-m", "quaero.cli", "train", config, "--nproc", "2"], check=False,
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        ranks = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                "-m", "quaero.cli", "train", config], check=False, cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=600)
    assert launcher.returncode == 1 and launcher.stderr.count(f"holds {cfg.run_dir / 'train.lock'}") == 1
    assert ranks.returncode == 1
    assert ranks.stderr.count("error: ") == 2 and ranks.stderr.count(f"holds {cfg.run_dir / 'train.lock'}") == 2
    assert not (cfg.run_dir / "events.jsonl").exists()


def test_nproc_with_strategy_none_is_refused_before_any_launch(tmp_path, capsys):
    from quaero import cli

    path, _ = make_config(tmp_path, "none", steps=1, warmup=0)
    assert cli.main(["train", str(path), "--nproc", "2"]) == 1
    assert f"{path} [distributed] strategy='none' with --nproc 2: set strategy = 'ddp' or 'fsdp2'" in \
        capsys.readouterr().err
