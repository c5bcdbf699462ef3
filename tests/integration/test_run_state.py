"""Run-state faults on the real main job (tiny-qwen3, toolbench server on 127.0.0.1, the `quaero` CLI):
a crafted checkpoint never runs, unusable checkpoints are refused rather than overwritten, a full disk
and a killed write are survived, one process per run folder, a deleted events file is recreated."""
import errno
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.runs import ROOT, alive, events_of, make_config, wait_for_first_step

from quaero.recipe import checkpoint
from quaero.telemetry.runlog import read_events


class _Payload:
    """What an attacker puts in a checkpoint: unpickling it creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def wait_for(predicate, timeout: float = 240, what: str = "") -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.hostile
@pytest.mark.slow
def test_crafted_checkpoint_never_runs_and_unusable_checkpoints_are_refused(tmp_path, capsys):
    from quaero.recipe.train import train

    path, cfg = make_config(tmp_path, "crafted", steps=0, warmup=2, eval_every=0, eval_tasks=0,
                            extra=["training.checkpoint_every=1"])
    run_dir = train(cfg)
    assert list((run_dir / "env-servers").glob("server-*.log"))  # the env server logged into the run folder
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"))
    assert [p.name for p in ckpts] == ["step-000001", "step-000002"]

    marker = tmp_path / "code-ran"
    payload = pickle.dumps(_Payload(marker))
    intact = {name: (ckpts[-1] / name).read_bytes() for name in ("tensors.safetensors", "state.json")}
    # every file a pickle (the old loader's state.pt too), the manifest vouching for each
    for folder in ckpts:
        manifest = json.loads((folder / "manifest.json").read_text())
        for name in ("tensors.safetensors", "state.json", "state.pt"):
            (folder / name).write_bytes(payload)
            manifest["sha256"][name] = checkpoint._sha256(folder / name)
        (folder / "manifest.json").write_text(json.dumps(manifest))

    from quaero.cli import main  # in this process: the imports are paid for already

    for flags in (["--resume"], []):  # explicit and automatic resume: both refuse to start over
        capsys.readouterr()
        assert main(["train", str(path), *flags]) == 1
        assert not marker.exists()
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: {run_dir / 'checkpoints'}: no intact checkpoint to resume from")
        assert "step-000002: unreadable" in line and "step-000001: unreadable" in line and "--restart" in line
    skipped = events_of(run_dir, "checkpoint_skipped")
    assert {Path(e["path"]).name for e in skipped} == {"step-000001", "step-000002"}

    # a sharded checkpoint's shards/.metadata is what torch.distributed.checkpoint reads with pickle: a real
    # state that says its model is in shards/, a payload there, the manifest vouching for both
    newest = ckpts[-1]
    doc = json.loads(intact["state.json"])
    backend = doc["state"]["backend"]
    doc["state"]["backend"] = {"backend": backend["backend"], "lora": False, "steps_done": 2, "shards": "dcp",
                               "scheduler": backend["scheduler"]}
    (newest / "state.pt").unlink()
    (newest / "tensors.safetensors").write_bytes(intact["tensors.safetensors"])
    (newest / "state.json").write_text(json.dumps(doc))
    (newest / "shards").mkdir()
    (newest / "shards" / ".metadata").write_bytes(payload)
    hashes = {n: checkpoint._sha256(newest / n) for n in ("tensors.safetensors", "state.json",
                                                          "shards/.metadata")}
    (newest / "manifest.json").write_text(json.dumps({"format": checkpoint.FORMAT, "step": 2,
                                                      "sha256": hashes}))
    assert checkpoint.verify(newest) is None
    capsys.readouterr()
    assert main(["train", str(path), "--resume"]) == 1 and not marker.exists()
    assert main(["export", str(run_dir), str(tmp_path / "out")]) == 1 and not marker.exists()
    train_line, export_line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert train_line.startswith(f"error: {newest}: verified but cannot be loaded into this run "
                                 "(UnpicklingError: shard metadata names pathlib.Path.touch, which is not "
                                 "checkpoint metadata")
    assert export_line.startswith(f"error: {newest}: verified but cannot be loaded into 'tiny-qwen3'")
    pickle.loads(payload)  # the payload is live: had anything unpickled it, the marker would exist
    assert marker.exists()


@pytest.mark.slow
@pytest.mark.hostile
def test_restart_keeps_unusable_checkpoints_aside_and_a_refused_resume_leaves_the_runs_config_json(tmp_path):
    """--restart starts over and keeps the unusable checkpoints aside. Then a resume is judged before the
    run's config.json is rewritten: a LoRA config against a full checkpoint is refused and leaves
    config.json, the change notes `quaero review` repeats and `quaero export` alone."""
    from quaero.cli import main
    from quaero.recipe.train import train

    _, cfg = make_config(tmp_path, "restart", steps=0, warmup=1, eval_every=0, eval_tasks=0)
    torn = cfg.run_dir / "checkpoints" / "step-000004"
    torn.mkdir(parents=True)
    (torn / "manifest.json").write_text("{")
    with pytest.raises(checkpoint.CheckpointError, match=r"step-000004: manifest.json unreadable"):
        train(cfg)
    train(cfg, restart=True)
    (aside,) = cfg.run_dir.glob("checkpoints.before-restart-*")
    assert [p.name for p in aside.iterdir()] == ["step-000004"]
    assert checkpoint.load_latest(cfg.run_dir / "checkpoints")[0].name == "step-000001"
    assert [e["step"] for e in events_of(cfg.run_dir, "train_step")] == [1]

    written = (cfg.run_dir / "config.json").read_bytes()
    _, lora = make_config(tmp_path, "restart", steps=0, warmup=2, eval_every=0, eval_tasks=0,
                          extra=["backend.lora=true"])
    with pytest.raises(checkpoint.CheckpointError, match=r"step-000001"):
        train(lora, resume=True)
    assert (cfg.run_dir / "config.json").read_bytes() == written
    assert not events_of(cfg.run_dir, "resume_config_changed")
    assert main(["export", str(cfg.run_dir), str(tmp_path / "out")]) == 0

    _, longer = make_config(tmp_path, "restart", steps=0, warmup=2, eval_every=0, eval_tasks=0)
    train(longer, resume=True)  # the good resume reports what changed since the config that trained
    (changed,) = events_of(cfg.run_dir, "resume_config_changed")
    assert list(changed["changes"]) == ["training.warmup_sft_steps"]
    assert json.loads((cfg.run_dir / "config.json").read_text())["training"]["warmup_sft_steps"] == 2


@pytest.mark.slow
@pytest.mark.hostile
def test_a_full_disk_stops_the_run_in_one_line_and_a_killed_write_does_not_block_resume(tmp_path,
                                                                                        monkeypatch):
    from quaero.recipe.train import train

    _, cfg = make_config(tmp_path, "disk", steps=0, warmup=2, eval_every=0, eval_tasks=0,
                         extra=["training.checkpoint_every=1"])
    real_save_file, calls = checkpoint.save_file, []

    def disk_fills_at_step_2(tensors, filename):
        calls.append(filename)
        if len(calls) == 2:
            Path(filename).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save_file(tensors, filename)

    monkeypatch.setattr(checkpoint, "save_file", disk_fills_at_step_2)
    with pytest.raises(checkpoint.CheckpointError) as e:
        train(cfg)
    message = str(e.value)
    assert "\n" not in message and "step-000002 not written" in message and " bytes, " in message
    ckpt_root = cfg.run_dir / "checkpoints"
    assert [p.name for p in ckpt_root.iterdir()] == ["step-000001"]  # no temp folder left behind
    assert events_of(cfg.run_dir, "checkpoint_failed")
    monkeypatch.undo()

    orphan = ckpt_root / ".step-000002-killed"  # what SIGKILL mid-write leaves
    orphan.mkdir()
    (orphan / "tensors.safetensors").write_bytes(b"half")
    train(cfg, resume=True)
    assert not orphan.exists()
    assert [e["step"] for e in events_of(cfg.run_dir, "resumed")] == [1]
    assert [e["step"] for e in events_of(cfg.run_dir, "train_step")] == [1, 2, 2]  # step 2 trained again
    assert sorted(p.name for p in ckpt_root.iterdir()) == ["step-000001", "step-000002"]
    assert checkpoint.verify(ckpt_root / "step-000002") is None


@pytest.mark.slow
@pytest.mark.hostile
def test_one_train_per_run_folder_stale_lock_taken_over_and_a_deleted_events_file_recreated(tmp_path, capsys):
    from quaero.cli import main
    from quaero.recipe.train import train

    path, cfg = make_config(tmp_path, "shared", steps=0, warmup=200, eval_every=0, eval_tasks=0,
                            extra=["training.checkpoint_every=1000"])
    first = subprocess.Popen([sys.executable, "-m", "quaero.cli", "train", str(path)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    events = cfg.run_dir / "events.jsonl"
    try:
        wait_for_first_step(first, cfg.run_dir, 240)
        run_id = read_events(events)[0][0]["run_id"]
        first_server = [e["pid"] for e in events_of(cfg.run_dir, "env_server_started")]

        capsys.readouterr()  # a second train, in this process: refused at the lock, before any model loads
        assert main(["train", str(path)]) == 1
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert f"another `quaero train` (pid {first.pid}) holds" in line
        assert {e["run_id"] for e in read_events(events)[0]} == {run_id}  # the refused run wrote nothing here

        events.unlink()  # `rm events.jsonl` mid-run
        wait_for(lambda: events.exists() and '"train_step"' in events.read_text(), what="the recreated "
                                                                                        "events")
        recreated, _ = read_events(events)
        assert recreated[0]["event"] == "events_file_recreated" and recreated[0]["run_id"] == run_id
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)  # dies holding the lock: no cleanup runs
        first.wait(timeout=30)
    assert (cfg.run_dir / "train.lock").read_text().strip() == str(first.pid)

    _, small = make_config(tmp_path, "shared", steps=0, warmup=1, eval_every=0, eval_tasks=0)
    train(small)
    (taken,) = events_of(cfg.run_dir, "run_lock_taken_over")
    assert taken["stale_pid"] == first.pid
    assert events_of(cfg.run_dir, "run_end")[-1]["status"] == "finished"
    assert first_server and not alive(first_server)  # the killed run's env server exited with it
    assert os.path.getsize(cfg.run_dir / "train.lock") == 0  # a clean exit leaves no pid behind


@pytest.mark.slow
@pytest.mark.hostile
@pytest.mark.parametrize("during", ["the untrained eval", "an eval", "a checkpoint write"])
def test_a_stop_during_an_eval_or_a_checkpoint_write_ends_the_run_there_without_another_step(tmp_path,
                                                                                             monkeypatch,
                                                                                             during):
    """A real SIGTERM sent while the run evaluates (the untrained baseline at step 0, or step 1's) or writes
    step 1's checkpoint: the run ends at that safe point, step 1 checkpointed, no step 2 trained."""
    from quaero.recipe import train as recipe

    _, cfg = make_config(tmp_path, "late", steps=0, warmup=3, eval_every=1, eval_tasks=1,
                         extra=["training.checkpoint_every=1"])
    at = {"the untrained eval": 0, "an eval": 1}.get(during)
    real_eval, real_save = recipe.evaluate_at, checkpoint.save

    def evaluate_at(parts, progress, step):
        if step == at:
            os.kill(os.getpid(), signal.SIGTERM)
        real_eval(parts, progress, step)

    def save(root, step, *args, **kwargs):
        if during == "a checkpoint write":
            os.kill(os.getpid(), signal.SIGTERM)  # from the writer's thread, as a scheduler's stop would land
            time.sleep(0.5)
        return real_save(root, step, *args, **kwargs)

    monkeypatch.setattr(recipe, "evaluate_at", evaluate_at)
    monkeypatch.setattr(checkpoint, "save", save)
    with pytest.raises(KeyboardInterrupt):
        recipe.train(cfg)
    trained = [e["step"] for e in events_of(cfg.run_dir, "train_step")]
    (end,) = events_of(cfg.run_dir, "run_end")
    assert end["status"] == "interrupted" and len(events_of(cfg.run_dir, "stop_requested")) == 1
    if at == 0:
        assert trained == [] and end["steps"] == 0 and "before the first step" in end["note"]
        assert not (cfg.run_dir / "checkpoints").exists()
    else:
        assert trained == [1] and end["steps"] == 1
        assert [p.name for p in (cfg.run_dir / "checkpoints").iterdir()] == ["step-000001"]


@pytest.mark.slow
@pytest.mark.hostile
@pytest.mark.parametrize("sampler", ["SignalledSampler"])
def test_a_sigterm_while_a_user_sampler_never_returns_ends_the_run_at_its_last_step(tmp_path, sampler):
    """Step 2's draw sends SIGTERM and never returns (the stop request was logged and ignored while inside the
    sampler): the run waits [sampler] stop_grace_s for it, then ends interrupted at step 1, checkpointed, step
    2 never trained."""
    from fixtures import hostile_samplers

    from quaero.recipe import train as recipe

    _, cfg = make_config(tmp_path, "hang", steps=3, warmup=0, eval_every=0, eval_tasks=0,
                         extra=["training.checkpoint_every=1", "sampler.stop_grace_s=0.5",
                                f'env.tasks.sampler="fixtures.hostile_samplers:{sampler}"'])
    hostile_samplers.RELEASE.clear()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            recipe.train(cfg)
    finally:
        hostile_samplers.RELEASE.set()
    assert [e["step"] for e in events_of(cfg.run_dir, "train_step")] == [1]
    (end,) = events_of(cfg.run_dir, "run_end")
    assert end["status"] == "interrupted" and end["steps"] == 1 and end["checkpoint_step"] == 1
    assert "sample(2) ran; step 2 was not trained" in end["note"]
    assert [e["signal"] for e in events_of(cfg.run_dir, "stop_requested")] == ["SIGTERM"]
    assert len(events_of(cfg.run_dir, "user_call_stopped")) == 1
    assert (cfg.run_dir / "checkpoints" / "step-000001").is_dir()
    assert not (cfg.run_dir / "checkpoints" / "step-000002").exists()
    assert time.monotonic() - t0 < 120
