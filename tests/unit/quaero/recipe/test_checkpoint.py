"""Checkpoints: an exact round trip without pickle, verified pruning, orphans, failed writes."""
import errno
import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from quaero.recipe import checkpoint
from quaero.recipe.checkpoint import CheckpointError, NoIntactCheckpoint

ROOT = Path(__file__).resolve().parents[4]


def trained_state(step: int = 3) -> dict:
    """A backend-shaped state: a model, AdamW with int-keyed per-param state and tuple betas, a scheduler."""
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    for _ in range(2):
        model(torch.randn(5, 4, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        sched.step()
    return {"step": step, "cursor": 4 * step, "rng": checkpoint.rng_state(), "cumulative": {"env_steps": 7,
                                                                                            "mode": "off"},
            "backend": {"backend": "local", "lora": False, "model": {k: v.clone() for k,
                                                                     v in model.state_dict().items()},
                        "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_round_trip_is_exact_and_the_files_are_data_only(tmp_path):
    state = trained_state()
    tied = torch.randn(3, 3)
    state["odd"] = {(1, 2): b"\x00\xff", "nested": [(1.5, None, True)], "one": {"__tensor__": "not a tag"},
                    "tied": [tied, tied, tied[1]]}  # shared memory and a view, as tied weights give
    path = checkpoint.save(tmp_path, 3, state)
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "state.json", "tensors.safetensors"]
    loaded_path, loaded = checkpoint.load_latest(tmp_path)
    assert loaded_path == path and same(state, loaded)
    assert list(loaded["backend"]["optimizer"]["state"]) == [0, 1, 2, 3]  # int param ids restored
    assert loaded["backend"]["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    from safetensors.torch import load_file

    names = set(load_file(path / "tensors.safetensors"))
    assert "backend/optimizer/state/0/exp_avg" in names and "rng/torch" in names
    with pytest.raises(pickle.UnpicklingError):  # nothing in the folder is a pickle
        pickle.loads((path / "state.json").read_bytes())


def test_restored_rng_replays_the_same_draws(tmp_path):
    checkpoint.save(tmp_path, 1, {"step": 1, "rng": checkpoint.rng_state()})
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)  # move on, as a run does
    _, state = checkpoint.load_latest(tmp_path)
    checkpoint.set_rng_state(state["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


@pytest.mark.hostile
def test_a_hash_valid_pickle_is_skipped_without_running(tmp_path):
    """Whoever can write a checkpoint can write its manifest: the hashes are no defence, the format is."""
    marker = tmp_path / "pwned"
    checkpoint.save(tmp_path, 1, trained_state(1))
    bad = checkpoint.save(tmp_path, 2, trained_state(2))
    payload = pickle.dumps(_Payload(str(marker)))
    manifest = json.loads((bad / "manifest.json").read_text())
    for name in ("tensors.safetensors", "state.json"):
        (bad / name).write_bytes(payload)
        manifest["sha256"][name] = checkpoint._sha256(bad / name)
    (bad / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoint.verify(bad) is None  # the manifest vouches for the payload
    path, state = checkpoint.load_latest(tmp_path)
    assert path.name == "step-000001" and state["step"] == 1
    assert not marker.exists()
    pickle.loads(payload)  # the payload is live: unpickling it is what would have run it
    assert marker.exists()


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.mark.hostile
def test_an_older_pickle_checkpoint_is_never_opened(tmp_path):
    old = tmp_path / "step-000004"
    old.mkdir()
    (old / "state.pt").write_bytes(pickle.dumps({"step": 4}))
    (old / "manifest.json").write_text(json.dumps({"step": 4,
                                                   "sha256": checkpoint._sha256(old / "state.pt")}))
    with pytest.raises(NoIntactCheckpoint) as e:
        checkpoint.load_latest(tmp_path)
    assert "step-000004: state.pt is a pickle written by an older quaero" in str(e.value)


@pytest.mark.hostile
def test_all_corrupt_names_every_folder_and_why(tmp_path):
    a = checkpoint.save(tmp_path, 2, trained_state(2))
    b = checkpoint.save(tmp_path, 4, trained_state(4))
    (a / "tensors.safetensors").write_bytes(b"torn")
    (b / "state.json").unlink()
    with pytest.raises(NoIntactCheckpoint) as e:
        checkpoint.load_latest(tmp_path)
    assert str(e.value).count("\n") == 0
    assert "step-000004: state.json missing" in str(e.value)
    assert "step-000002: tensors.safetensors does not match its manifest hash" in str(e.value)
    assert checkpoint.load_latest(tmp_path / "none") is None  # no checkpoints at all: a fresh start


@pytest.mark.hostile
def test_pruning_counts_only_intact_checkpoints(tmp_path):
    """A run resumed from step 4 past corrupt 6 and 8 saves step 5: 5 and 4 are kept, not 6 and 8."""
    for step in (2, 4, 6, 8):
        checkpoint.save(tmp_path, step, trained_state(step), keep=10)
    for step in (6, 8):
        (tmp_path / f"step-{step:06d}" / "tensors.safetensors").write_bytes(b"torn")
    checkpoint.save(tmp_path, 5, trained_state(5), keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000004", "step-000005", "step-000006",
                                                                "step-000008"]
    path, state = checkpoint.load_latest(tmp_path)
    assert path.name == "step-000005" and state["step"] == 5
    checkpoint.save(tmp_path, 6, trained_state(6), keep=2)  # reaching a corrupt step overwrites it
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000005", "step-000006", "step-000008"]
    assert checkpoint.verify(tmp_path / "step-000006") is None


@pytest.mark.hostile
def test_pruning_never_counts_a_newer_folder_whose_hashes_match_but_which_cannot_load(tmp_path):
    """Resumed from step 4 past 6 and 8 (their state.json a pickle, the manifest updated: hash-valid,
    unloadable): saving step 5 must not count 6 and 8 as the two kept and delete 5 and 4."""
    for step in (2, 4, 6, 8):
        checkpoint.save(tmp_path, step, trained_state(step), keep=10)
    for step in (6, 8):
        folder = tmp_path / f"step-{step:06d}"
        manifest = json.loads((folder / "manifest.json").read_text())
        (folder / "state.json").write_bytes(pickle.dumps({"step": step}))
        manifest["sha256"]["state.json"] = checkpoint._sha256(folder / "state.json")
        (folder / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoint.load_latest(tmp_path)[0].name == "step-000004"
    checkpoint.save(tmp_path, 5, trained_state(5), keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000004", "step-000005", "step-000006",
                                                                "step-000008"]
    assert checkpoint.load_latest(tmp_path)[0].name == "step-000005"


@pytest.mark.hostile
def test_orphan_temp_folders_are_removed(tmp_path):
    checkpoint.save(tmp_path, 1, trained_state(1))
    orphan = tmp_path / ".step-000002-abc123"
    orphan.mkdir()
    (orphan / "tensors.safetensors").write_bytes(b"half")
    assert checkpoint.remove_orphans(tmp_path) == [orphan]
    assert not orphan.exists() and checkpoint.load_latest(tmp_path)[1]["step"] == 1


@pytest.mark.hostile
def test_a_full_disk_is_one_line_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 1, trained_state(1))

    def full_disk(tensors, filename):
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    with pytest.raises(CheckpointError) as e:
        checkpoint.save(tmp_path, 2, trained_state(2))
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "step-000002") in msg and "No space left on device" in msg
    needed = int(msg.split(" needs ")[1].split(" bytes")[0])
    assert needed > sum(t.numel() * t.element_size() for t in trained_state(2)["backend"]["model"].values())
    assert not list(tmp_path.glob(".step-*")) and not (tmp_path / "step-000002").exists()
    path, state = checkpoint.load_latest(tmp_path)
    assert path.name == "step-000001" and same(state["backend"]["model"],
                                               trained_state(1)["backend"]["model"])


@pytest.mark.hostile
def test_a_real_write_failure_is_caught(tmp_path):
    """A real failing write (the file size limit, EFBIG) in a child process, not a patched function."""
    code = textwrap.dedent(f"""
        import resource, signal, sys
        from pathlib import Path
        import torch
        from quaero.recipe import checkpoint
        root = Path({str(tmp_path)!r})
        checkpoint.save(root, 1, {{"step": 1, "w": torch.zeros(10)}})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
        try:
            checkpoint.save(root, 2, {{"step": 2, "w": torch.zeros(1_000_000)}})
        except checkpoint.CheckpointError as e:
            print(e)
            sys.exit(3)
    """)
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "step-000002 not written" in proc.stdout and "4000" in proc.stdout  # names the bytes needed
    assert not list(tmp_path.glob(".step-*"))
    assert checkpoint.load_latest(tmp_path)[1]["step"] == 1


@pytest.mark.hostile
def test_a_process_killed_mid_write_leaves_nothing_that_blocks_resume(tmp_path):
    """A real SIGKILL of the writing process, after the files are written and before the rename."""
    code = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        import torch
        from quaero.recipe import checkpoint
        root = Path({str(tmp_path)!r})
        checkpoint.save(root, 1, {{"step": 1, "w": torch.ones(10)}})
        checkpoint._fsync = lambda path: os.kill(os.getpid(), signal.SIGKILL)
        checkpoint.save(root, 2, {{"step": 2, "w": torch.zeros(10)}})
    """)
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr
    (orphan,) = tmp_path.glob(".step-000002-*")
    assert (orphan / "tensors.safetensors").exists() and not (tmp_path / "step-000002").exists()
    assert checkpoint.load_latest(tmp_path)[1]["step"] == 1
    assert checkpoint.remove_orphans(tmp_path) == [orphan] and not orphan.exists()
    checkpoint.save(tmp_path, 2, {"step": 2, "w": torch.zeros(10)})
    assert checkpoint.load_latest(tmp_path)[1]["step"] == 2


@pytest.mark.hostile
def test_shard_files_written_first_are_hashed_and_verified(tmp_path):
    """A sharded trainer's files (written into `temp_folder` by every rank) join the manifest: a torn or
    missing shard makes the checkpoint skipped like a torn tensors file."""
    root = tmp_path / "checkpoints"
    first = checkpoint.save(root, 1, {"step": 1})
    folder = checkpoint.temp_folder(root, 2)
    (folder / checkpoint.SHARDS).mkdir()
    (folder / checkpoint.SHARDS / "__0_0.distcp").write_bytes(b"rank 0")
    (folder / checkpoint.SHARDS / ".metadata").write_bytes(b"meta")
    path = checkpoint.save(root, 2, {"step": 2}, folder=folder)
    assert not folder.exists() and checkpoint.verify(path) is None
    hashed = json.loads((path / checkpoint.MANIFEST).read_text())["sha256"]
    assert sorted(hashed) == sorted([checkpoint.TENSORS, checkpoint.STATE, "shards/.metadata",
                                     "shards/__0_0.distcp"])
    (path / checkpoint.SHARDS / "__0_0.distcp").write_bytes(b"torn")
    assert "shards/__0_0.distcp does not match" in checkpoint.verify(path)
    assert checkpoint.load_latest(root)[0] == first
    (path / checkpoint.SHARDS / "__0_0.distcp").unlink()
    assert checkpoint.verify(path) == "shards/__0_0.distcp missing"


@pytest.mark.hostile
def test_a_manifest_naming_a_file_outside_its_folder_is_refused(tmp_path):
    path = checkpoint.save(tmp_path, 1, {"step": 1})
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    manifest["sha256"]["../outside"] = "0" * 64
    (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    assert "outside the checkpoint" in checkpoint.verify(path)


@pytest.mark.hostile
@pytest.mark.parametrize("forged, manifest_too", [(999999, False), (999999, True), (-3, True), (4, True)])
def test_a_rehashed_state_step_is_checked_against_its_folder_and_manifest(tmp_path, forged, manifest_too):
    """state.json's step rewritten and the manifest rehashed (999999: a run that would "resume" past its end
    and train nothing; -3: a run that would redo its warm start and write step--00001): the folder is skipped,
    naming why, and the one before it resumes."""
    for step in (4, 6):
        checkpoint.save(tmp_path, step, trained_state(step), keep=10)
    folder = tmp_path / "step-000006"
    doc = json.loads((folder / "state.json").read_text())
    doc["state"]["step"] = forged
    (folder / "state.json").write_text(json.dumps(doc))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["sha256"]["state.json"] = checkpoint._sha256(folder / "state.json")
    if manifest_too:
        manifest["step"] = forged
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoint.verify(folder) is None  # the hashes match: only the cross-check catches it
    path, state = checkpoint.load_latest(tmp_path)
    assert (path.name, state["step"]) == ("step-000004", 4)
    with pytest.raises(ValueError, match=rf"state.json says step {forged} in folder step-000006 whose "
                                         rf"manifest.json says step {forged if manifest_too else 6}; a "
                                         "checkpoint's step is its folder's"):
        checkpoint.load(folder)


@pytest.mark.hostile
@pytest.mark.parametrize("code", [errno.EPERM, errno.EACCES, errno.EROFS])
def test_an_unwritable_checkpoints_folder_is_named_as_such_not_as_a_full_disk(tmp_path, monkeypatch, code):
    """An immutable (chattr +i: EPERM), read-only (EACCES) or read-only-mounted (EROFS) checkpoints/ folder:
    the error names permissions, not free space (the fault: the write raising what such a folder raises)."""
    checkpoint.save(tmp_path, 1, trained_state(1))

    def refused(tensors, filename):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(checkpoint, "save_file", refused)
    with pytest.raises(CheckpointError) as e:
        checkpoint.save(tmp_path, 2, trained_state(2))
    assert str(e.value) == (f"checkpoint {tmp_path / 'step-000002'} not written (tensors.safetensors: "
                            f"{os.strerror(code)}): {tmp_path} is not writable by this process; fix its "
                            "permissions (chattr -i, chmod u+w, a read-write mount) and resume with `quaero "
                            "train CONFIG --resume`")
    assert checkpoint.load_latest(tmp_path)[0].name == "step-000001"
