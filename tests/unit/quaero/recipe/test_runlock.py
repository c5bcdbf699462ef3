"""The run-folder lock: one holder, named in the refusal; a dead holder's lock is taken over."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quaero.recipe.runlock import RunFolderLocked, RunLock, refuse_if_held

ROOT = Path(__file__).resolve().parents[4]


@pytest.mark.hostile
def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path):
    with RunLock(tmp_path) as first:
        assert first.stale_pid is None
        assert first.path.read_text().strip() == str(os.getpid())
        with pytest.raises(RunFolderLocked, match=rf"\(pid {os.getpid()}\) holds .*train.lock"):
            RunLock(tmp_path).__enter__()
    with RunLock(tmp_path) as again:  # released at exit, and a clean exit leaves no pid behind
        assert again.stale_pid is None


@pytest.mark.hostile
def test_a_lock_whose_holder_was_killed_is_taken_over(tmp_path):
    code = ("import time; from quaero.recipe.runlock import RunLock; "
            f"RunLock({str(tmp_path)!r}).__enter__(); "
            "print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunFolderLocked, match=rf"pid {holder.pid}\b"):
        RunLock(tmp_path).__enter__()
    holder.kill()  # SIGKILL: no cleanup runs, its pid stays in the file
    holder.wait(timeout=10)
    with RunLock(tmp_path) as lock:
        assert lock.stale_pid == holder.pid


@pytest.mark.hostile
def test_a_second_quaero_train_is_refused_before_anything_loads(tmp_path):
    """The CLI peeks at the lock right after reading the config: no torch import, no model, no env server."""
    refuse_if_held(tmp_path / "run")  # no folder yet: nobody holds it
    code = ("import sys; from quaero.cli import main; rc = main(['train', 'envs/toolbench.toml', '--set', "
            f"'run.output_dir={tmp_path}', '--set', 'run.name=run']); print('torch' in sys.modules); "
            "sys.exit(rc)")
    with RunLock(tmp_path / "run"):
        with pytest.raises(RunFolderLocked, match=rf"\(pid {os.getpid()}\) holds"):
            refuse_if_held(tmp_path / "run")
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                                         timeout=120,
                              check=False)
    assert proc.returncode == 1 and proc.stdout.strip() == "False", proc.stderr
    assert proc.stderr == (f"error: {tmp_path / 'run'}: another `quaero train` (pid {os.getpid()}) holds "
                           f"{tmp_path / 'run' / 'train.lock'}; wait for it or stop it, or use another [run] "
                           "name\n")
    refuse_if_held(tmp_path / "run")  # released: the peek never holds it


@pytest.mark.hostile
def test_a_lock_file_that_is_a_link_is_never_written_through(tmp_path):
    (tmp_path / "precious.txt").write_text("precious")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train.lock").symlink_to(tmp_path / "precious.txt")
    with pytest.raises(RunFolderLocked, match=r"train.lock is a link to .*precious.txt; a run folder holds "
                                              r"no links"):
        RunLock(tmp_path / "run").__enter__()
    assert (tmp_path / "precious.txt").read_text() == "precious"


@pytest.mark.hostile
def test_a_lock_file_that_is_a_hard_link_is_never_truncated(tmp_path):
    (tmp_path / "precious.txt").write_text("precious")
    (tmp_path / "run").mkdir()
    os.link(tmp_path / "precious.txt", tmp_path / "run" / "train.lock")
    with pytest.raises(RunFolderLocked, match=r"train.lock is a hard link \(2 names for one file\); a run "
                                              r"folder holds no links: remove it$"):
        RunLock(tmp_path / "run").__enter__()
    assert (tmp_path / "precious.txt").read_text() == "precious"
