"""`[logging] save_rows` in a real tiny run (toolbench in-process, tiny-qwen3, the local trainer): the default
"sample" saves each step's first rows, and the real `quaero inspect rows --verify` passes on them."""
import json
import os
import subprocess
import sys

import pytest
from fixtures.runs import ROOT, events_of, make_config


@pytest.mark.slow
def test_a_tiny_run_saves_rows_that_verify(tmp_path):
    from quaero.recipe.train import train

    _, cfg = make_config(tmp_path, "rows", steps=1, warmup=1, eval_every=0, eval_tasks=0,
                         extra=["env.launcher=inprocess"])
    assert cfg.logging.save_rows == "sample"
    run_dir = train(cfg)
    saved = {p.name: [json.loads(x) for x in p.read_text().splitlines()]
             for p in (run_dir / "rows").iterdir()}
    assert sorted(saved) == ["step-000001.jsonl", "step-000002.jsonl"]
    for step, phase, version in ((1, "sft", None), (2, "rl", 1)):  # a warm start's rows are the oracle's
        recs = saved[f"step-{step:06d}.jsonl"]
        assert [(r["step"], r["row"], r["phase"], r["policy_version"]) for r in recs] == [
            (step, 0, phase, version), (step, 1, phase, version)]
        assert all(r["sampled_actions"] for r in recs)
    steps = events_of(run_dir, "train_step")
    assert [(s["rows_saved"], s["rows_save_failures"]) for s in steps] == [(2, 0), (2, 0)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "quaero.cli", "inspect", "rows", str(run_dir), "--verify"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("verified 4 rows of 2 step(s)")
