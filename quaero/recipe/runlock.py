"""One `quaero train` per run folder: an exclusive flock on `runs/NAME/train.lock`, the holder's pid inside.

The kernel releases an flock when its process dies, however it dies (SIGKILL included), so a lock
file left behind by a dead run is never mistaken for a live one: the next run takes it over and says
whose it was. The pid in the file is only for the messages; the flock is the lock.
"""
from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

LOCK_FILE = "train.lock"


class RunFolderLocked(RuntimeError):
    pass


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 64, 0).decode("ascii", errors="replace").strip()
    return int(text) if text.isdigit() else None


def _held(path: Path, holder: int | None) -> str:
    return (f"{path.parent}: another `quaero train` (pid {holder or 'unknown'}) holds {path}; wait for it or "
            "stop it, or use another [run] name")


def refuse_if_held(run_dir: Path) -> None:
    """Raise RunFolderLocked now when another process holds the run folder's lock: `quaero train` asks
    before anything loads, so a second run is refused at once. Only a peek (released at once): RunLock
    takes the lock itself."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file (or no folder) yet: nobody holds it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunFolderLocked(_held(path, _read_pid(fd))) from None
    finally:
        os.close(fd)


class RunLock:
    """Held for the whole run. `stale_pid`: the pid of a previous holder that died holding it."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.stale_pid: int | None = None
        self._fd: int | None = None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:  # never through a link: truncating the lock file would truncate whatever it points at
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise RunFolderLocked(f"{self.path} is a link to {os.path.realpath(self.path)}; a run folder "
                                  "holds no links: remove it") from None
        # a hard link: another name for a file elsewhere, which ftruncate would empty
        if os.fstat(fd).st_nlink > 1:
            os.close(fd)
            raise RunFolderLocked(f"{self.path} is a hard link ({os.stat(self.path).st_nlink} names for one "
                                  "file); a run folder holds no links: remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise RunFolderLocked(_held(self.path, holder)) from None
        previous = _read_pid(fd)  # a clean exit empties the file: a pid here died holding the lock
        self.stale_pid = previous if previous != os.getpid() else None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # releases the flock
            self._fd = None
