"""`quaero bench real-shape` on the tiny model: every memory knob's step is measured and its plan error
reported, a short warm-up row still leaves the AdamW state the measured step needs, and the unsloth
trainer is measured through the same hook (in a process of its own: unsloth patches transformers)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import real_shape

ROOT = Path(__file__).resolve().parents[3]


def test_each_knob_is_measured_against_the_plan_after_a_short_warm_up(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "rs.json"
    real_shape.main(["--model", "tiny-qwen3", "--seq-len", "192", "--warmup-seq-len", "48", "--targets", "16",
                     "--cases", "selective,full+checkpointing,checkpointing,crop,lora,kl,lora+kl", "--json",
                     str(out)])
    doc = json.loads(out.read_text())
    cases = {c["case"]: c for c in doc["cases"]}
    assert doc["backend"] == "local"
    assert list(cases) == ["selective", "full+checkpointing", "checkpointing", "crop", "lora", "kl",
                           "lora+kl"]
    for c in cases.values():
        assert c["step_s"] is None and c["measured_step_s"] > 0  # the warm-up row was the short one
        assert c["resident_gib"] > 0 and c["step_peak_gib"] > 0
        assert abs(c["plan_error"]) < 0.15, c
    # the full head's [192, V] logits cost more than the selective head's [16, V]
    assert cases["full+checkpointing"]["fwd_bwd_peak_gib"] > cases["checkpointing"]["fwd_bwd_peak_gib"]
    # LoRA: AdamW state for the adapters only, and no gradient for the frozen embedding/head
    assert cases["lora"]["resident_gib"] < cases["selective"]["resident_gib"] / 2
    assert cases["lora"]["fwd_bwd_peak_gib"] < cases["selective"]["fwd_bwd_peak_gib"]
    # the AdamW state came from the warm-up, whatever its row length: m and v as large as the weights, twice
    parts = cases["selective"]["plan_parts_gib"]
    resident = cases["selective"]["resident_gib"]
    assert resident == pytest.approx(parts["weights"] + parts["optimizer"], rel=0.05)
    # the KL reference: a copy of the weights beside them (the plan counts it), none with LoRA; its forward
    # timed
    kl = cases["kl"]
    assert kl["resident_gib"] == pytest.approx(resident + parts["weights"], rel=0.05)
    assert kl["reference_forward_s"] > 0 and cases["selective"]["reference_forward_s"] is None
    assert cases["lora+kl"]["resident_gib"] == pytest.approx(cases["lora"]["resident_gib"], rel=0.01)
    assert cases["lora+kl"]["reference_forward_s"] > 0


@pytest.mark.parametrize("length, targets, span", [(8192, 64, 2048), (192, 16, 48), (1000, 10, 250)])
def test_the_plan_is_given_the_span_the_row_really_has(length, targets, span):
    """A crop keeps K tokens before a row's first target: the plan must be told where that target is (told
    the whole `--span`, it over-counted an 8k row's cropped activations by a quarter at full depth)."""
    row = real_shape.tail_row(length, targets, span, vocab=1000)
    first = min(s.start for s in row.spans if s.kind != "prompt")
    assert length - first == real_shape.tail_span(targets, span)


def test_an_unknown_case_is_one_line_naming_the_cases():
    with pytest.raises(SystemExit, match="no case 'fulll'; choose from full, selective, .* or join them"):
        real_shape.case_settings("fulll+checkpointing")
    assert real_shape.case_settings("full+checkpointing") == (
        {"selective_logits": False, "gradient_checkpointing": True},
        {"selective": False, "gradient_checkpointing": True})


@pytest.mark.unsloth
@pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="unsloth is not installed")
def test_the_unsloth_trainer_is_measured_through_the_same_hook(tiny_model_dir, tmp_path):
    out = tmp_path / "rs.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    argv = ["--backend", "unsloth", "--model", "tiny-qwen3", "--seq-len", "96", "--targets", "8",
            "--cases", "selective", "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "quaero.cli", "bench", "real-shape", *argv], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["backend"] == "unsloth" and "Unsloth" in proc.stdout + proc.stderr
    (case,) = doc["cases"]
    assert case["step_s"] > 0 and abs(case["plan_error"]) < 0.15, case
