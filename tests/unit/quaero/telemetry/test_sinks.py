"""Logging sinks: train_step / eval scalars mirrored into TensorBoard, W&B (offline) and trackio, read back
with each tool's reader; events.jsonl unchanged; a missing sink package is a `quaero check` error."""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.sink_readers import tensorboard_scalars, wandb_offline_history

from quaero.config import ConfigError
from quaero.preflight.plan import load_checked
from quaero.telemetry import runlog
from quaero.telemetry.sinks import mirror, open_sinks, scalars_of

ROOT = Path(__file__).resolve().parents[4]
MAIN = ROOT / "envs" / "toolbench.toml"


def log_three_events(run_dir, report_to):
    """step 1 and 2 train_step, an eval at step 2, and an event that is not mirrored."""
    runlog.configure(console="none")
    log = runlog.get_logger("test")
    with runlog.RunLog(run_dir), open_sinks(report_to, run_dir, "sinks-test", {"seed": 0}):
        for step, loss in ((1, 1.5), (2, 0.75)):
            runlog.set_step(step)
            log.info("train_step", loss=loss, rows=4 * step, weights_pushed=True, phase="rl",
                     reward_mean=None,
                     cumulative={"rows": 4})
        log.info("eval", eval_reward=0.25, eval_episodes=8, sample_transcript=["user: hi"])
        log.info("checkpoint_saved", path="x", bytes=123)


def test_scalars_of_keeps_numbers_and_bools_and_prefixes_by_event():
    event = {"event": "train_step", "step": 3, "run_id": "r", "level": "info", "timestamp": "t",
             "loss": 1.5, "rows": 4, "strict": False, "ok": True, "phase": "rl", "reward_mean": None,
             "grad_norm": float("nan"), "cumulative": {"rows": 9}}
    assert scalars_of(event) == {"train/loss": 1.5, "train/rows": 4.0, "train/strict": 0.0, "train/ok": 1.0}
    assert scalars_of({"event": "eval", "step": 5, "eval_reward": 0.5, "prefix_mismatches": 0}) == {
        "eval/reward": 0.5, "eval/prefix_mismatches": 0.0}
    assert scalars_of({"event": "checkpoint_saved", "step": 5, "bytes": 10}) == {}


def test_tensorboard_reads_back_the_scalars_at_the_event_steps(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install "
                                              "'quaero[tensorboard]'")
    log_three_events(tmp_path, ["tensorboard"])
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars == {"train/loss": [(1, 1.5), (2, 0.75)], "train/rows": [(1, 4.0), (2, 8.0)],
                       "train/weights_pushed": [(1, 1.0), (2, 1.0)],
                       "eval/reward": [(2, 0.25)], "eval/episodes": [(2, 8.0)]}
    # the events file is still the whole record, strings and nested values included
    events, _ = runlog.read_events(tmp_path / "events.jsonl")
    assert [e["event"] for e in events] == ["train_step", "train_step", "eval", "checkpoint_saved"]
    assert events[0]["phase"] == "rl" and events[0]["cumulative"] == {"rows": 4}
    assert mirror.sinks == []


def test_sinks_are_closed_and_flushed_when_the_run_is_interrupted(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install "
                                              "'quaero[tensorboard]'")
    runlog.configure(console="none")
    log = runlog.get_logger("test")
    with (pytest.raises(KeyboardInterrupt), runlog.RunLog(tmp_path),
          open_sinks(["tensorboard"], tmp_path, "cut", {}) as sinks):
        runlog.set_step(7)
        log.info("train_step", loss=2.0)
        raise KeyboardInterrupt
    assert mirror.sinks == []
    assert sinks[0].sink.writer.file_writer is None  # SummaryWriter.close() ran
    assert tensorboard_scalars(tmp_path / "tensorboard") == {"train/loss": [(7, 2.0)]}


def test_wandb_is_offline_by_default_and_its_run_file_holds_the_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'quaero[wandb]'")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    log_three_events(tmp_path, ["wandb"])
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # offline: nothing left the machine
    history = wandb_offline_history(run_file)
    steps = {h["_step"]: h for h in history}
    assert sorted(steps) == [1, 2], history
    assert steps[1]["train/loss"] == 1.5 and steps[1]["train/weights_pushed"] == 1.0
    assert steps[2]["train/loss"] == 0.75 and steps[2]["eval/reward"] == 0.25
    assert not any(key.endswith(("phase", "cumulative", "sample_transcript")) for h in history for key in h)


def test_a_resumed_run_logs_into_the_same_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'quaero[wandb]'")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    log_three_events(tmp_path, ["wandb"])
    log_three_events(tmp_path, ["wandb"])  # the same run folder again: a resume
    run_id = (tmp_path / "wandb" / "quaero-run-id").read_text().strip()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # `wandb sync` joins them; two starts within one second get a "-1" after the id (the same stamp)
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", r.name)
                                  for r in runs), [r.name for r in runs]
    other = tmp_path / "other"
    log_three_events(other, ["wandb"])  # another run folder is another W&B run
    assert (other / "wandb" / "quaero-run-id").read_text().strip() != run_id


TRACKIO_SCRIPT = """
import json, sys
from quaero.telemetry import runlog
from quaero.telemetry.sinks import open_sinks
runlog.configure(console="none")
log = runlog.get_logger("test")
with runlog.RunLog(sys.argv[1]), open_sinks(["trackio"], sys.argv[1], "sinks-test", {}):
    runlog.set_step(3)
    log.info("train_step", loss=1.5, phase="rl")
with runlog.RunLog(sys.argv[1]), open_sinks(["trackio"], sys.argv[1], "sinks-test", {}):  # resumed
    runlog.set_step(4)
    log.info("train_step", loss=0.5, phase="rl")
from trackio.sqlite_storage import SQLiteStorage
rows = SQLiteStorage.get_logs("quaero", "sinks-test")
print("LOGS", json.dumps([{"step": r["step"], "train/loss": r.get("train/loss")} for r in rows]))
"""


@pytest.mark.skipif(importlib.util.find_spec("trackio") is None,
                    reason="trackio is not installed: pip install 'quaero[trackio]'")
def test_trackio_stores_the_scalars_and_a_resume_appends(tmp_path):
    # a subprocess: trackio fixes its storage folder ($TRACKIO_DIR) when it is imported
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", TRACKIO_SCRIPT, str(tmp_path / "run")], check=False, env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("LOGS "))
    # the resumed run appended to the same trackio run
    assert json.loads(line[5:]) == [{"step": 3, "train/loss": 1.5}, {"step": 4, "train/loss": 0.5}]


def test_check_names_the_pip_command_for_a_missing_sink_and_rejects_unknown_ones(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    with pytest.raises(ConfigError) as e:
        load_checked(MAIN, ['logging.report_to=["wandb"]'])
    assert str(e.value) == (f"{MAIN} [logging] report_to='wandb': wandb is not installed; "
                            "pip install 'quaero[wandb]' (or remove it from report_to)")
    with pytest.raises(ConfigError, match=r"report_to='mlflow': unknown sink; use any of tensorboard, "
                                          r"trackio, wandb"):
        load_checked(MAIN, ['logging.report_to=["mlflow"]'])
    assert load_checked(MAIN).logging.report_to == []


@pytest.mark.slow
def test_check_does_not_import_the_sink_packages():
    code = ("import sys; from quaero.preflight.plan import load_checked; "
            f"load_checked({str(MAIN)!r}, ['logging.report_to=[\"tensorboard\", \"wandb\"]']); "
            "print(sorted(m for m in ('tensorboard', 'wandb', 'torch.utils.tensorboard') if m in "
            "sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                                                    timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    if out.returncode and "is not installed" in out.stderr:
        pytest.skip(f"a sink package is missing here: {out.stderr.strip().splitlines()[-1]}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.hostile
@pytest.mark.parametrize("fault, warned, counts", [
    ("log", [("sink_failed", "log: ValueError: sink down")] * 3, (3, 0)),
    ("open", [("sink_failed", "open: RuntimeError: wandb.errors.CommError: could not reach the server")],
     None),
    ("close", [("sink_failed", "close: OSError: disk quota exceeded")], (1, 0)),
    ("hang", [("sink_hung", None)], (0, 2)),
])
def test_a_failing_or_hanging_sink_is_a_warning_and_the_run_log_keeps_every_event(tmp_path, monkeypatch,
                                                                                  fault,
                                                                                   warned, counts):
    """A sink that raises in open, log or close, or hangs in log: the run's events all reach events.jsonl,
    nothing is raised into the run, and the sink's trouble is a warning with counts (`sink_summary`). A
    hanging sink holds nothing: its queue (1 event here) fills and the rest are dropped and counted."""
    import threading
    import time

    from fixtures.sink_faults import FaultySink

    from quaero.telemetry import sinks

    monkeypatch.setattr(FaultySink, "fault", fault)
    monkeypatch.setattr(FaultySink, "release", threading.Event())
    monkeypatch.setitem(sinks.SINKS, "faulty", FaultySink)
    monkeypatch.setattr(sinks, "SINK_QUEUE_EVENTS", 1)
    monkeypatch.setattr(sinks, "SINK_CLOSE_TIMEOUT_S", 0.3)
    runlog.configure(console="none")
    log = runlog.get_logger("test")
    t0 = time.monotonic()
    try:
        with runlog.RunLog(tmp_path), open_sinks(["faulty"], tmp_path, "faulty", {}):
            for step in (1, 2, 3, 4):
                runlog.set_step(step)
                log.info("train_step", loss=1.0 / step)
                time.sleep(0.05)  # the sink's thread takes the event (or fails on it)
            log.info("run_end", status="finished")
    finally:
        FaultySink.release.set()
    assert time.monotonic() - t0 < 5
    events = runlog.read_events(tmp_path / "events.jsonl")[0]
    assert [e["step"] for e in events if e["event"] == "train_step"] == [1, 2, 3, 4]
    assert [e["event"] for e in events].count("run_end") == 1
    assert [(e["event"], e.get("error")) for e in events if e["event"] in ("sink_failed",
                                                                           "sink_hung")] == warned
    summary = [(e["sink_errors"], e["sink_events_dropped"]) for e in events if e["event"] == "sink_summary"]
    assert summary == ([] if counts is None else [counts])
    assert mirror.sinks == []
