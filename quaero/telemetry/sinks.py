"""Logging sinks: mirrors of the run log in TensorBoard, W&B or trackio (`[logging] report_to`).

`runs/NAME/events.jsonl` stays the source of truth; a sink is a copy for the tools people already
watch. Only `train_step` and `eval` events are mirrored, and only their top-level numbers (booleans
as 0/1; strings, nulls and nested values such as `cumulative` are skipped), at the event's own step:
`train_step` fields as `train/<field>`, `eval` fields as `eval/<field>` with their `eval_` prefix
dropped (`eval_reward` -> `eval/reward`).

Each sink's package is an optional extra (`pip install 'quaero[tensorboard]'`), imported only when a
config names it; `quaero check` reports a named sink that is not installed. W&B runs offline unless
`WANDB_MODE` says otherwise, so a run never needs a network or an account; `wandb sync` uploads it.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import numbers
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from quaero.telemetry import names
from quaero.telemetry.runlog import add_mirror, get_logger, remove_mirror

# event name -> metric prefix
MIRRORED_EVENTS = {names.TRAIN_STEP_EVENT: "train/", names.EVAL_EVENT: "eval/"}
_BOOKKEEPING = ("step", "event", "run_id", "timestamp", "level")


def scalars_of(event_dict: dict[str, Any]) -> dict[str, float]:
    """The mirrored scalars of one event, keyed `train/...` or `eval/...` ({} for other events)."""
    event = event_dict.get("event")
    prefix = MIRRORED_EVENTS.get(event)
    if prefix is None:
        return {}
    scalars = {}
    for key, value in event_dict.items():
        if key in _BOOKKEEPING or not isinstance(value, numbers.Real):
            continue
        value = float(value)  # bool -> 0.0 / 1.0
        if math.isfinite(value):  # events.jsonl writes non-finite numbers as null: mirror the same
            scalars[prefix + key.removeprefix(f"{event}_")] = value
    return scalars


class TensorBoardSink:
    """Scalars under `runs/NAME/tensorboard/` (`tensorboard --logdir runs/NAME/tensorboard`)."""

    package = "tensorboard"

    def __init__(self, run_dir: Path, run_name: str, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a crashed run keeps every step it logged, as events.jsonl does

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in project `$WANDB_PROJECT` (default "quaero"), files under `runs/NAME/wandb/`; the
    run folder keeps its W&B id, so a resumed run logs into the same W&B run."""

    package = "wandb"

    def __init__(self, run_dir: Path, run_name: str, config: dict) -> None:
        import wandb

        self.wandb = wandb
        # one W&B run per run folder: a resumed run continues the W&B run it started (its id is kept here)
        id_file = run_dir / "wandb" / "quaero-run-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        if not run_id:
            run_id = uuid.uuid4().hex[:12]  # W&B ids: letters and digits
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "quaero", name=run_name, id=run_id,
                              resume="allow", dir=str(run_dir), config=config,
                              mode=os.environ.get("WANDB_MODE") or "offline")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() can return before wandb's service has written the offline run file (seen with
        # wandb 0.31); teardown waits for the service to exit, so the file is whole when the run ends
        self.wandb.teardown()


class TrackioSink:
    """A trackio run in project "quaero", stored where trackio stores (`$TRACKIO_DIR`)."""

    package = "trackio"

    def __init__(self, run_dir: Path, run_name: str, config: dict) -> None:
        import trackio

        self.trackio = trackio
        # resume="allow": a resumed run appends to the trackio run of its name instead of starting another
        self.run = trackio.init(project="quaero", name=run_name, config=config, resume="allow", embed=False,
                                auto_log_gpu=False, auto_log_cpu=False)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.trackio.finish()


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "trackio": TrackioSink}


def unavailable_reason(name: str) -> str | None:
    """Why sink `name` cannot run here (unknown, or its package is missing), or None. Imports nothing."""
    if name not in SINKS:
        return f"unknown sink; use any of {', '.join(sorted(SINKS))}"
    package = SINKS[name].package
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed; pip install 'quaero[{name}]' (or remove it from report_to)"
    return None


# events a sink may fall behind by; past it (a sink that hangs) they are dropped, counted
SINK_QUEUE_EVENTS = 256
SINK_CLOSE_TIMEOUT_S = 60.0  # how long the end of a run waits for a sink to take its last events


class GuardedSink:
    """One sink, kept apart from the run: its `log` runs on a thread of its own, fed by a bounded queue, so a
    sink that hangs holds neither a step nor a stop request (its events past SINK_QUEUE_EVENTS are dropped and
    counted); an exception from it is counted and reported by a warning (quaero's `SinkMirror`), never raised
    into the run. events.jsonl, the checkpoints and `run_end` do not depend on any sink."""

    def __init__(self, name: str, sink) -> None:
        import queue
        import threading

        self.name, self.sink = name, sink
        self.errors, self.dropped = 0, 0
        self.failures: list[str] = []  # not yet reported (the mirror reports them on the logging thread)
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(SINK_QUEUE_EVENTS)
        self._worker = threading.Thread(target=self._drain, name=f"quaero-sink-{name}", daemon=True)
        self._worker.start()

    def failed(self, call: str, error: BaseException) -> None:
        from quaero.telemetry.runlog import error_line

        with self._lock:
            self.errors += 1
            self.failures.append(f"{call}: {error_line(error)}"[:300])

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self.sink.log(*item)
            except Exception as e:  # noqa: BLE001 - a sink's failure is the sink's, never the run's
                self.failed("log", e)

    def log(self, scalars: dict[str, float], step: int) -> None:
        import queue

        try:
            self._queue.put_nowait((scalars, step))
        except queue.Full:
            self.dropped += 1

    def close(self) -> bool:
        """Let the sink take its queued events and finish; False when it did not within SINK_CLOSE_TIMEOUT_S
        (it hangs: it is left behind on its daemon thread, unfinished)."""
        import queue

        try:
            self._queue.put(None, timeout=SINK_CLOSE_TIMEOUT_S)
        except queue.Full:
            return False
        self._worker.join(SINK_CLOSE_TIMEOUT_S)
        if self._worker.is_alive():
            return False
        try:
            self.sink.close()
        except Exception as e:  # noqa: BLE001
            self.failed("close", e)
        return True


class SinkMirror:
    """structlog processor: hand each mirrored event's scalars to the open sinks; the event passes on. A
    sink's failures since the last event are reported here, as `sink_failed` warnings, on the logging
    thread."""

    def __init__(self) -> None:
        self.sinks: list[GuardedSink] = []

    def __call__(self, logger, method_name, event_dict):
        if self.sinks:
            scalars = scalars_of(event_dict)
            if scalars:
                for sink in self.sinks:
                    sink.log(scalars, int(event_dict.get("step") or 0))
            if event_dict.get("event") != names.SINK_FAILED_EVENT:
                report_failures(self.sinks)
        return event_dict


mirror = SinkMirror()


def report_failures(sinks: list[GuardedSink], *, final: bool = False) -> None:
    """A `sink_failed` warning per sink failure not yet reported; at the run's end (`final`), `sink_summary`
    with each failing sink's counts: errors (exceptions it raised) and events dropped (it fell behind)."""
    log = get_logger(__name__)
    for sink in sinks:
        with sink._lock:
            failures, sink.failures = sink.failures, []
        for failure in failures:
            log.warning(names.SINK_FAILED_EVENT, sink=sink.name, error=failure, sink_errors=sink.errors,
                        note="the run goes on; events.jsonl keeps every event")
        if final and (sink.errors or sink.dropped):
            log.warning(names.SINK_SUMMARY_EVENT, sink=sink.name, sink_errors=sink.errors,
                        sink_events_dropped=sink.dropped)


@contextlib.contextmanager
def open_sinks(report_to: list[str], run_dir: str | Path, run_name: str, config: dict) -> Iterator[list]:
    """Open the named sinks for a run; they are closed (flushed) when it ends, by error or Ctrl-C too. A sink
    that cannot open is a warning and the run goes on without it (events.jsonl is the run's record)."""
    log = get_logger(__name__)
    opened = []
    try:
        for name in report_to:
            try:
                sink = SINKS[name](Path(run_dir), run_name, config)
            except Exception as e:  # noqa: BLE001 - the run does not need its mirrors
                from quaero.telemetry.runlog import error_line

                log.warning(names.SINK_FAILED_EVENT,
                            sink=name, error=f"open: {error_line(e)}"[:300], sink_errors=1,
                            note="the run goes on without this sink; events.jsonl keeps every event")
                continue
            opened.append(GuardedSink(name, sink))
        mirror.sinks = opened
        add_mirror(mirror)
        yield opened
    finally:
        remove_mirror(mirror)
        mirror.sinks = []
        for sink in reversed(opened):
            if not sink.close():
                log.warning(names.SINK_HUNG_EVENT, sink=sink.name, waited_s=SINK_CLOSE_TIMEOUT_S,
                            note="the sink did not take its last events; left unfinished")
        report_failures(opened, final=True)
