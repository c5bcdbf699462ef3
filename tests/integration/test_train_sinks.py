"""A real tiny training run with `[logging] report_to = ["tensorboard"]`: what TensorBoard holds equals
the train_step and eval events of events.jsonl, at the same steps."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.sink_readers import tensorboard_scalars

from quaero.telemetry.runlog import read_events
from quaero.telemetry.sinks import scalars_of

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
[run]
name = "sinks"
output_dir = "{out}"

[env]
entry = "envs.toolbench:ToolBenchEnv"
kwargs = {{difficulty = 1}}
max_turns = 2

[sampler]
backend = "hf"
max_tokens = 8

[training]

[rollout]
tasks_per_step = 1
group_size = 2

[logging]
console = "none"
progress = false
report_to = ["tensorboard"]
"""


@pytest.mark.slow
def test_training_run_mirrors_its_scalars_into_tensorboard(tmp_path):
    pytest.importorskip("tensorboard",
                        reason="tensorboard is not installed: pip install 'quaero[tensorboard]'")
    path = tmp_path / "sinks.toml"
    path.write_text(CONFIG.format(out=tmp_path / "runs"))
    cmd = [sys.executable, "-m", "quaero.cli", "train", str(path), "--set", "training.steps=1",
           "--set", "training.eval_every=1", "--set", "training.eval_tasks=1"]
    out = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "runs" / "sinks"
    events = [e for e in read_events(run_dir / "events.jsonl")[0] if e["event"] in ("train_step", "eval")]
    assert [(e["event"], e["step"]) for e in events] == [("eval", 0), ("train_step", 1), ("eval", 1)]
    expected: dict[str, list[tuple[int, float]]] = {}
    for e in events:
        for tag, value in scalars_of(e).items():
            expected.setdefault(tag, []).append((e["step"], value))
    assert {"train/loss", "train/rows", "train/echo_tokens", "eval/reward"} <= set(expected)
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert set(scalars) == set(expected)
    for tag, points in expected.items():
        assert [step for step, _ in scalars[tag]] == [step for step, _ in points], tag
        # TensorBoard stores float32
        assert [v for _, v in scalars[tag]] == pytest.approx([v for _, v in points], rel=1e-6, abs=1e-6), tag


# ── a sink that fails never costs the run its own record ───────────────────────────────────────────────────
# (the other faults: tests/unit/quaero/telemetry/test_sinks.py)


@pytest.mark.slow
@pytest.mark.hostile
def test_a_sink_that_raises_mid_run_is_a_warning_and_every_step_is_checkpointed(tmp_path, monkeypatch):
    """A real tiny run whose sink raises from step 2 on: the run finishes, every step is in events.jsonl and
    checkpointed, `run_end` is written, and the sink's failures are warnings with a count."""
    from fixtures.runs import events_of, make_config
    from fixtures.sink_faults import FaultySink

    from quaero.recipe.train import train
    from quaero.telemetry import sinks

    monkeypatch.setattr(FaultySink, "fault", "log")  # from step 2 on
    monkeypatch.setitem(sinks.SINKS, "faulty", FaultySink)
    _, cfg = make_config(tmp_path, "sink-log", steps=1, warmup=2, eval_every=0, eval_tasks=0, extra=[
        "env.launcher='inprocess'", "logging.report_to=['faulty']", "training.checkpoint_every=1"])
    run_dir = train(cfg)
    assert [e["step"] for e in events_of(run_dir, "train_step")] == [1, 2, 3]
    assert [e["step"] for e in events_of(run_dir, "checkpoint_saved")] == [1, 2, 3]
    (end,) = events_of(run_dir, "run_end")
    assert end["status"] == "finished" and (run_dir / "final").is_dir()
    assert [e["error"] for e in events_of(run_dir, "sink_failed")] == ["log: ValueError: sink down"] * 2
    (summary,) = events_of(run_dir, "sink_summary")
    assert (summary["sink"], summary["sink_errors"], summary["sink_events_dropped"]) == ("faulty", 2, 0)
