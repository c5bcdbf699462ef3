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

# event name -> metric prefix
MIRRORED_EVENTS = {"train_step": "train/", "eval": "eval/"}
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


class SinkMirror:
    """structlog processor: hand each mirrored event's scalars to the open sinks; the event passes on."""

    def __init__(self) -> None:
        self.sinks: list = []

    def __call__(self, logger, method_name, event_dict):
        if self.sinks:
            scalars = scalars_of(event_dict)
            if scalars:
                for sink in self.sinks:
                    sink.log(scalars, int(event_dict.get("step") or 0))
        return event_dict


mirror = SinkMirror()


@contextlib.contextmanager
def open_sinks(report_to: list[str], run_dir: str | Path, run_name: str, config: dict) -> Iterator[list]:
    """Open the named sinks for a run; they are closed (flushed) when it ends, by error or Ctrl-C too."""
    opened = []
    try:
        for name in report_to:
            opened.append(SINKS[name](Path(run_dir), run_name, config))
        mirror.sinks = opened
        yield opened
    finally:
        mirror.sinks = []
        for sink in reversed(opened):
            sink.close()
