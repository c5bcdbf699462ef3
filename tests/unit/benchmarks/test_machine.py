"""`quaero bench machine`: its efficiency formulas on hand-computed numbers, a run's efficiencies from
synthetic events, and a tiny real measurement."""
import json

import pytest
import torch
from safetensors.torch import save_file

import benchmarks
from benchmarks.machine import decoding_efficiency, run_efficiency, training_efficiency


def test_training_efficiency_counts_six_flops_per_trained_and_four_per_frozen_weight():
    # full fine-tuning: 6 x 10 params x 100 tokens = 6000 FLOPs in 2 s at 3000 FLOP/s -> all of it
    assert training_efficiency(trainable_params=10, frozen_params=0, tokens=100, step_s=2,
                               peak_flops=3000) == pytest.approx(1.0)
    # LoRA: (6 x 1 + 4 x 10) x 100 = 4600 FLOPs in 1 s at 9200 FLOP/s -> half
    assert training_efficiency(trainable_params=1, frozen_params=10, tokens=100, step_s=1,
                               peak_flops=9200) == pytest.approx(0.5)


def test_decoding_efficiency_is_weight_bytes_read_over_the_bandwidth():
    # 1000 bytes x 50 steps = 50000 bytes in 2 s at 100000 B/s -> a quarter
    assert decoding_efficiency(weight_bytes=1000, decode_steps=50, decode_s=2,
                               bandwidth_bytes_per_s=100_000) == pytest.approx(0.25)


def test_run_efficiency_reads_unique_tokens_and_the_rollout_from_events(tmp_path):
    (tmp_path / "final").mkdir()
    save_file({"w": torch.zeros(10, 10, dtype=torch.bfloat16)}, tmp_path / "final" / "model.safetensors")
    nbytes = (tmp_path / "final" / "model.safetensors").stat().st_size
    steps = [{"event": "train_step", "rows": 4, "row_tokens": 900, "local_train_tree_row_tokens": 700,
              "local_train_tree_unique_tokens": 100,
              "step_time_s": s, "rollout_time_s": 3.0, "weight_sync_s": 1.0, "rollout_action_tokens": 40}
             for s in (1.0, 3.0)]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in steps))
    r = run_efficiency(tmp_path, {"float32": 0.0009}, gb_s=1e-6)  # 9e5 FLOP/s, 1000 B/s
    assert (r["trainable_params"], r["frozen_params"]) == (100, 0)
    # 200 unpacked row tokens + 100 unique tokens of the packed 700: 300 computed
    assert (r["row_tokens_per_step"], r["tokens_per_step"]) == (900, 300)
    # 6 x 100 params x 300 tokens / (2 s mean x 9e5 FLOP/s)
    assert r["training_efficiency"]["float32"] == pytest.approx(0.1)
    # the file's bytes x 40 tokens / ((3 - 1) s x 1000 B/s)
    assert r["decoding_efficiency"] == pytest.approx(nbytes * 40 / (2 * 1000), rel=1e-3)
    # two ranks: the same counts over the same times on twice the devices
    (tmp_path / "events.jsonl").write_text("".join(json.dumps({**e, "ranks": 2}) + "\n" for e in steps))
    two = run_efficiency(tmp_path, {"float32": 0.0009}, gb_s=1e-6)
    assert two["training_efficiency"]["float32"] == pytest.approx(0.05)
    assert two["decoding_efficiency"] == pytest.approx(r["decoding_efficiency"] / 2, rel=1e-3)


def test_a_lora_run_counts_its_adapter_as_trained_and_its_base_as_frozen(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    (tmp_path / "final").mkdir()
    save_file({"lora_A": torch.zeros(4, 8), "lora_B": torch.zeros(8, 4)},
              tmp_path / "final" / "adapter_model.safetensors")
    (tmp_path / "final" / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(tiny_model_dir)}))
    (tmp_path / "events.jsonl").write_text(json.dumps(
        {"event": "train_step", "rows": 1, "row_tokens": 10, "step_time_s": 1.0}) + "\n")
    base = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    r = run_efficiency(tmp_path, {"float32": 1.0}, gb_s=1.0)
    assert (r["trainable_params"], r["frozen_params"], r["tokens_per_step"]) == (64, base, 10)
    assert r["training_efficiency"]["float32"] == pytest.approx((6 * 64 + 4 * base) * 10 / 1e9, abs=1e-4)
    assert "decoding_efficiency" not in r  # no rollout in these steps


def test_bench_machine_measures_positive_peaks_and_bandwidth(capsys):
    assert benchmarks.main(["machine", "--sizes", "64", "--repeats", "1", "--bandwidth-mb", "4",
                            "--threads", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["matmul"]["float32"]["peak_gflops"] > 0 and doc["matmul"]["bfloat16"]["peak_gflops"] > 0
    assert doc["bandwidth"]["gb_s"] > 0 and doc["bandwidth"]["bytes_per_call"] == 3 * 4 * 2**20
