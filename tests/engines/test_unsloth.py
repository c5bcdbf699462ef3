"""The unsloth trainer on CPU (unsloth's CPU fallback): same shared step, same proofs as `local`.

unsloth must be imported before transformers in its process, so the unsloth side runs in a fresh
subprocess; this pytest process (which has imported transformers already) stays clean.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unsloth, pytest.mark.skipif(importlib.util.find_spec("unsloth") is None,
                                                      reason="unsloth is not installed (pip install "
                                                             "'quaero[unsloth]')")]

SCRIPT = r"""
import json, sys
assert "transformers" not in sys.modules  # so unsloth below really is imported first
import trainers.unsloth_trainer  # first: unsloth patches transformers on import
import torch
from benchmarks.smoke import run, smoke_spec, sparse_rows
from trainers.registry import trainer_class

out = {"full": run("unsloth")}
b = trainer_class("unsloth")(smoke_spec(lora=True), "cpu")
out["lora_type"] = type(b.model).__name__
out["lora"] = b.train_step(sparse_rows())
w = b.export_weights()
out["export_has_lora_keys"] = any("lora_" in k for k in w)
ids = torch.tensor([sparse_rows(1)[0].input_ids[:40]])
from transformers import AutoModelForCausalLM
from quaero.models.load import resolve_model
plain = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen3"))
plain.load_state_dict(w)
b.model.eval()
with torch.no_grad():
    out["export_max_abs_diff"] = (plain(ids).logits - b.model(ids).logits).abs().max().item()
print("RESULT " + json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def unsloth_run(tiny_model_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "UNSLOTH_DISABLE_CPU_FALLBACK": "0"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                                                       check=False,
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.slow
def test_unsloth_full_finetune_step_proves_sparse_selective_path(unsloth_run):
    m = unsloth_run["full"]
    assert m["local_train_selective_sparse_suffix_skips"] > 0
    assert m["local_train_selective_hidden_logprob_batches"] > 0
    assert m["local_train_selective_fallback_logprob_batches"] == 0
    assert m["forward_passes"] == m["microbatches"] > 0 and m["forward_passes_per_microbatch"] == 1
    assert m["echo_loss"] > 0


def test_unsloth_matches_local_on_the_same_rows(unsloth_run, local_smoke_metrics):
    """Same weights, same rows, same shared step: the losses and gradient norm agree with `local`."""
    local = local_smoke_metrics
    for key in ("rl_loss", "echo_loss", "grad_norm"):
        assert unsloth_run["full"][key] == pytest.approx(local[key], rel=1e-5), key


def test_unsloth_lora_step_and_merged_export(unsloth_run):
    m = unsloth_run["lora"]
    assert unsloth_run["lora_type"].startswith("PeftModel")
    assert m["local_train_selective_hidden_logprob_batches"] > 0 and m["forward_passes_per_microbatch"] == 1
    assert m["local_train_selective_fallback_logprob_batches"] == 0 and m["optimizer_stepped"]
    assert not unsloth_run["export_has_lora_keys"] and unsloth_run["export_max_abs_diff"] < 1e-4
