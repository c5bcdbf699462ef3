"""The run log: structlog configured once, here; every other module just logs.

Each run writes `runs/NAME/events.jsonl`: one JSON object per line with `run_id`, `step`, `event`,
`timestamp`, `level` and the event's fields, flushed per event so a crash loses nothing written.
The console gets structlog's human renderer. Modules log with `get_logger(__name__).info(...)`
and bind the step with `set_step(k)`.

Step metrics accumulate across steps with `Cumulative`, each as its name's declaration in
quaero/telemetry/names.py says (summed, the largest, the latest, or per step only).
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import sys
import uuid
from pathlib import Path
from typing import IO, Any

import structlog

from quaero.telemetry import names
from quaero.telemetry.metrics import LATEST, MAX, SUM, total_of

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        return value.item()
    return str(value)


class _JsonLinesSink:
    """structlog processor: append the event as one JSON line to the run's events file, then flush.

    Before each write one stat() checks that the path still names the open file: an events file
    deleted or replaced mid-run is recreated, starting with an `events_file_recreated` line, instead
    of every later event going to an unlinked inode. A write that fails (a full disk) is counted, said
    once on stderr and reported by an `events_lost` line when writing works again: it never ends a run
    (the checkpoint write, which needs far more room, stops it in one line naming the bytes needed)."""

    def __init__(self) -> None:
        # unbuffered: one write(2) per line, so a failed one loses only itself
        self.file: IO[bytes] | None = None
        self.path: Path | None = None
        self.lost = 0  # events not written since the last write that worked (a full disk)
        self.torn = False  # the last write stopped mid-line: the next one ends that line first

    def open(self, path: Path) -> None:
        self.path = path
        self.file = path.open("ab", buffering=0)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        self.file = self.path = None

    def _moved(self) -> bool:
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return True
        ours = os.fstat(self.file.fileno())
        return (on_disk.st_dev, on_disk.st_ino) != (ours.st_dev, ours.st_ino)

    def __call__(self, logger, method_name, event_dict):
        if self.file is not None:
            try:
                self._write(event_dict)
            # a full disk must not end the run mid-step: the checkpoint says so, in one line
            except OSError as e:
                if not self.lost:
                    print(f"warning: {self.path}: cannot append events ({e.strerror or e}); the run goes on "
                          "and counts the events it could not write", file=sys.stderr)
                self.lost += 1
        return event_dict

    def _write(self, event_dict) -> None:
        notice = {k: event_dict[k] for k in ("run_id", "step", "timestamp") if k in event_dict}
        if self._moved():
            self.file.close()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file, self.torn = self.path.open("ab", buffering=0), False
            self._append({"event": names.EVENTS_FILE_RECREATED_EVENT, "level": "warning", **notice,
                          "path": str(self.path),
                          "note": "the events file was deleted or replaced mid-run; earlier events of this "
                          "run are not in it"})
        if self.lost:
            self._append({"event": names.EVENTS_LOST_EVENT, "level": "warning", **notice, "events": self.lost,
                          "note": "events that could not be written (a full disk?)"})
            self.lost = 0
        self._append(_jsonable(event_dict))

    def _append(self, record: dict) -> None:
        data = (b"\n" if self.torn else b"") + (json.dumps(record) + "\n").encode("utf-8")
        self.torn = True  # until the whole line is down
        if self.file.write(data) != len(data):
            raise OSError(errno.ENOSPC, "short write")
        self.torn = False


# The console shows a step's headline; events.jsonl keeps every field.
CONSOLE_STEP_KEYS = ("event", "step", names.PHASE, names.REWARD_MEAN, names.SUCCESS_RATE, names.RL_LOSS,
                     names.ECHO_LOSS, names.SFT_LOSS, names.ACTION_TOKENS, names.ECHO_TOKENS,
                     names.ROW_TOKENS,
                     names.TOKENS_PER_S, names.TOTAL_STEP_TIME_S, names.EPISODES_DROPPED,
                     names.PREFIX_MISMATCHES,
                     names.HIDDEN_BATCHES, names.FALLBACK_BATCHES, "timestamp", "level")
_CONSOLE_HIDDEN = ("run_id", "cumulative", "config", names.EVAL_RESULTS)  # eval_results: one entry per task


class _ConsoleGate:
    def __init__(self) -> None:
        self.enabled = True

    def __call__(self, logger, method_name, event_dict):
        if not self.enabled:
            raise structlog.DropEvent
        if event_dict.get("event") == names.TRAIN_STEP_EVENT:
            return {k: _round(event_dict[k]) for k in CONSOLE_STEP_KEYS if k in event_dict}
        return {k: _round(v) for k, v in event_dict.items() if k not in _CONSOLE_HIDDEN}


def _round(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


class _ProgressSafeStderr:
    """Console lines go through tqdm.write so they do not tear the progress bar."""

    def write(self, text: str) -> None:
        if text.strip():
            from tqdm.auto import tqdm

            tqdm.write(text.rstrip("\n"), file=sys.stderr)

    def flush(self) -> None:
        sys.stderr.flush()


class _Mirrors:
    """structlog processor: the run log's copies elsewhere, plugged in while they are open (`[logging]
    report_to`: quaero/telemetry/sinks.py `open_sinks` adds its mirror); each one passes the event on."""

    def __init__(self) -> None:
        self.processors: list = []

    def __call__(self, logger, method_name, event_dict):
        for processor in self.processors:
            event_dict = processor(logger, method_name, event_dict)
        return event_dict


def add_mirror(processor) -> None:
    """Hand every event to `processor` too (after events.jsonl has it), until `remove_mirror`."""
    _mirrors.processors.append(processor)


def remove_mirror(processor) -> None:
    if processor in _mirrors.processors:
        _mirrors.processors.remove(processor)


_sink = _JsonLinesSink()
_mirrors = _Mirrors()
_console = _ConsoleGate()
_configured_level: str | None = None


def configure(level: str = "info", console: str = "pretty") -> None:
    """Configure structlog for the process (idempotent). console: pretty | plain | none."""
    global _configured_level
    _console.enabled = console != "none"
    renderer = (structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()) if console == "pretty"
                else structlog.processors.KeyValueRenderer(key_order=["event", "step"]))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
            _sink,
            _mirrors,  # TensorBoard / W&B / trackio copies ([logging] report_to)
            _console,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=_ProgressSafeStderr()),
        cache_logger_on_first_use=False,
    )
    _configured_level = level


def get_logger(name: str = "quaero"):
    if _configured_level is None:
        configure()
    return structlog.get_logger(name)


def set_step(step: int) -> None:
    structlog.contextvars.bind_contextvars(step=step)


class RunLog:
    """Owns `run_dir/events.jsonl` (`names.EVENTS`) for the duration of a run (append mode: resumes continue
    it)."""

    def __init__(self, run_dir: str | Path, run_id: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / names.EVENTS
        self.run_id = run_id or uuid.uuid4().hex[:12]

    def __enter__(self):
        if _configured_level is None:
            configure()
        _sink.open(self.path)
        structlog.contextvars.bind_contextvars(run_id=self.run_id, step=0)
        return self

    def __exit__(self, *exc) -> None:
        structlog.contextvars.unbind_contextvars("run_id", "step")
        _sink.close()


def read_events(path: str | Path) -> tuple[list[dict], int]:
    """The events of an events file, and how many non-blank lines could not be read.

    A line that is not UTF-8, not JSON, or JSON but not an object (a torn last line of a run that
    crashed mid-write, a damaged file) is skipped and counted, so a reader can say so. OSError
    (a missing file, a directory) is the caller's to report."""
    events, unreadable = [], 0
    with Path(path).open("rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                value = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                value = None
            if isinstance(value, dict):
                events.append(value)
            else:
                unreadable += 1
    return events, unreadable


class Cumulative:
    """Running totals of step metrics, each totalled as its name declares (quaero/telemetry/names.py)."""

    def __init__(self, state: dict | None = None) -> None:
        self.totals: dict[str, Any] = dict(state or {})

    def add(self, metrics: dict[str, Any]) -> dict[str, Any]:
        for k, v in metrics.items():
            how = total_of(k, v)
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if how == LATEST and v is not None:
                self.totals[k] = v
            elif how == MAX and number:
                self.totals[k] = max(self.totals.get(k, v), v)
            elif how == SUM and number:
                self.totals[k] = self.totals.get(k, 0) + v
        return dict(self.totals)


def first_text_line(text: str) -> str:
    """The first line of `text` that says something (a letter or digit in it), stripped; "" without one. A
    message may open on a blank or a rule of stars: nltk's LookupError starts with a newline and `*****`."""
    return next((line.strip() for line in text.splitlines() if any(c.isalnum() for c in line)), "")


def error_line(e: BaseException, limit: int = 300) -> str:
    """`TypeName: its message on one line`, for one-line errors that wrap whatever a crafted or foreign file
    made a parser raise, or an env's setup: the message's lines that say something, joined while they fit in
    `limit` characters (the first one cut to it), so a second line that names the fix is kept (carla's "Or use
    mode='mock'", nltk's `nltk.download('words')`) and a long dump is not."""
    lines = [line.strip() for line in str(e).splitlines() if any(c.isalnum() for c in line)]
    text = lines[0][:limit] if lines else ""
    for line in lines[1:]:
        if len(text) + 1 + len(line) > limit:
            break
        text += " " + line
    return f"{type(e).__name__}: {text}"
