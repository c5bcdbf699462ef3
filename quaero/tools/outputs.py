"""Where quaero's tools may write, and how: what `quaero inspect rows --html/--export`, `quaero review
--plots` and the benchmarks write is a new file of the user's, or one of their own earlier outputs.

A path is refused (one line naming it and the fix, before anything is written) when it is a symbolic link
(writing it writes wherever it points), a hard link (st_nlink > 1: writing it writes the file's other names
too, e.g. a run's config.json), a special file (a FIFO blocks the writer, a device is not a file), a folder,
a file inside a run folder (a run's own files are never output), or an existing file the user did not name
with `--force`. What passes is written under a temporary name beside it and renamed into place
(`write_replacing`): never through an existing name, so a link planted between the check and the write is
replaced, not followed.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from quaero.recipe.runlock import LOCK_FILE
from quaero.telemetry import names

# what a run folder holds of its own (the top-level names): never a tool's output
RUN_FILES = (names.EVENTS, names.CONFIG, names.CHECKPOINTS, names.FINAL, names.ROWS_DIR, names.ENV_SERVERS,
             names.SAMPLER_SERVERS, LOCK_FILE)


class OutputRefused(ValueError):
    """A path a tool will not write; the message is one line naming it and the fix."""


def link_problem(path: Path) -> str | None:
    """What makes an existing `path` no file to write (not followed): a symbolic link, a hard link, a special
    file or a folder; None for a plain file with one name, or for nothing there."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (or below a file: the writer says)
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"a symlink (to {os.readlink(path)}); name a plain file path"
    if stat.S_ISDIR(st.st_mode):
        return "a folder; name a file in a writable folder"
    if not stat.S_ISREG(st.st_mode):
        return "a special file (a FIFO, socket or device), not a plain file; name a new file"
    if st.st_nlink > 1:
        return (f"a hard link ({st.st_nlink} names for one file: writing it would change the others too); "
                "name a new file")
    return None


def run_folder_of(path: Path) -> Path | None:
    """The run folder `path` (resolved) lies in: the nearest folder above it holding events.jsonl or
    checkpoints/, or None."""
    for folder in Path(path).resolve().parents:
        if (folder / names.EVENTS).exists() or (folder / names.CHECKPOINTS).is_dir():
            return folder
    return None


def check_output(out: str | Path, flag: str, *, force: bool, run_dir: str | Path | None = None,
                 in_runs: bool = False, replaceable=None) -> Path:
    """`out` may take what `flag` writes; OutputRefused naming it otherwise, before anything is written.

    run_dir: the run read (its folder and everything in it are refused even before it holds events).
    in_runs: a path inside a run folder is allowed (review's plots folder) as long as it is not one of the
    run's own files (`RUN_FILES`). replaceable(path) -> bool: an existing file the tool itself wrote
    earlier (replaced without `--force`)."""
    path = Path(out)
    if problem := link_problem(path):
        raise OutputRefused(f"{flag} {out}: {problem}")
    resolved = path.resolve()
    if not in_runs:
        inside = run_dir is not None and Path(run_dir).resolve() in resolved.parents
        run = Path(run_dir).resolve() if inside else run_folder_of(path)
        if run is not None:
            raise OutputRefused(f"{flag} {out}: inside the run folder {run}, whose files are the run's own; "
                                "write it outside any run folder")
    elif (run := run_folder_of(path)) is not None and resolved.relative_to(run).parts[0] in RUN_FILES:
        raise OutputRefused(f"{flag} {out}: {resolved.relative_to(run).parts[0]} is the run {run}'s own; "
                            "write elsewhere (e.g. a plots/ folder of its own)")
    if path.exists() and not force and not (replaceable is not None and replaceable(path)):
        raise OutputRefused(f"{flag} {out}: already exists; choose a new file or pass --force to overwrite "
                            "it")
    return path


def write_replacing(path: Path, data: bytes | str) -> None:
    """Write `data` to a temporary file beside `path`, then rename it onto `path`: the bytes reach `path`'s
    name only, never a file an existing link there points to, and a crash leaves no half-written file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def saving_to(path: Path):
    """A temporary path beside `path` for a writer that takes a file name (matplotlib's `savefig`); `commit`
    renames it onto `path`. Used as `tmp, commit = saving_to(p); fig.savefig(tmp); commit()`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=path.suffix, dir=path.parent)
    os.close(fd)

    def commit() -> None:
        os.replace(tmp, path)

    return Path(tmp), commit


def bench_output(path: str | Path | None, flag: str = "--json") -> Path | None:
    """A benchmark's output file (`--json PATH`), checked before the benchmark works: one line (SystemExit)
    where `check_output` refuses it (a link, a special file, a folder, a run's own file); an earlier plain
    file there is replaced (a benchmark rerun writes its document again)."""
    if path is None:
        return None
    try:
        return check_output(path, flag, force=True)
    except OutputRefused as e:
        raise SystemExit(f"error: {e}") from None


def write_bench_output(path: str | Path, text: str, flag: str = "--json") -> None:
    """Write a benchmark's document to `path`, checked again (what the benchmark ran may have taken long)
    and written beside it then renamed (`write_replacing`)."""
    write_replacing(bench_output(path, flag), text)
