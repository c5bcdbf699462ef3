"""`quaero bench machine`: its efficiency formulas on hand-computed numbers, a run's efficiencies from
synthetic events, and a tiny real measurement."""
import json

import pytest
import torch
from safetensors.torch import save_file

import benchmarks
from benchmarks.machine import (
    FlopParams,
    computed_tokens,
    cpu_time_limits,
    decoding_efficiency,
    head_positions,
    run_efficiency,
    training_efficiency,
)


def test_train_flops_count_six_per_trained_and_four_per_frozen_weight_and_the_head_at_its_positions():
    # full fine-tuning: 6 x 10 backbone params x 100 tokens + 6 x 5 head params x 20 head positions
    full = FlopParams(backbone_trainable=10, backbone_frozen=0, head=5, head_trainable=True)
    assert full.train_flops(100, 20) == 6 * 10 * 100 + 6 * 5 * 20
    # LoRA: (6 x 1 + 4 x 10) x 100 + a frozen head's 4 x 5 x 20
    lora = FlopParams(backbone_trainable=1, backbone_frozen=10, head=5, head_trainable=False)
    assert lora.train_flops(100, 20) == (6 + 40) * 100 + 4 * 5 * 20
    assert training_efficiency(flops=4600, step_s=1, peak_flops=9200) == pytest.approx(0.5)


def test_flop_params_leave_the_embedding_out_and_count_a_tied_head_once(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    fp = FlopParams.of(model)
    assert model.get_output_embeddings().weight is embedding  # tiny-qwen3 ties them
    assert (fp.head, fp.head_trainable, fp.backbone_frozen) == (embedding.numel(), True, 0)
    assert fp.backbone_trainable == total - embedding.numel()  # the old 6N counted the embedding twice over
    assert fp.decode_params == total
    for p in model.parameters():
        p.requires_grad_(False)
    model.model.norm.weight.requires_grad_(True)
    frozen = FlopParams.of(model)
    assert (frozen.backbone_trainable, frozen.head_trainable) == (model.model.norm.weight.numel(), False)
    assert frozen.backbone_frozen + frozen.backbone_trainable == fp.backbone_trainable


def test_decoding_efficiency_is_weight_bytes_read_over_the_bandwidth():
    # 1000 bytes x 50 steps = 50000 bytes in 2 s at 100000 B/s -> a quarter
    assert decoding_efficiency(weight_bytes=1000, decode_steps=50, decode_s=2,
                               bandwidth_bytes_per_s=100_000) == pytest.approx(0.25)


def test_computed_tokens_are_the_packed_microbatches_unique_tokens_and_the_others_row_tokens():
    step = {"row_tokens": 900, "local_train_tree_row_tokens": 700, "local_train_tree_unique_tokens": 100,
            "local_train_tree_batches": 1}
    assert computed_tokens(step) == 300
    # a trie built but not packed ("auto" declined, or a fallback): the rows were computed
    assert computed_tokens({**step, "local_train_tree_batches": 0}) == 900
    assert head_positions({"action_tokens": 30, "echo_tokens": 12, "row_tokens": 900,
                           "local_train_selective_suffix_logits": True}) == 42
    full_logits = {"action_tokens": 30, "row_tokens": 900, "local_train_selective_suffix_logits": False}
    assert head_positions(full_logits) == 900


def _final(run_dir, model_dir):
    """run_dir/final: the model folder's files (links), as a run's final weights."""
    (run_dir / "final").mkdir()
    for f in model_dir.iterdir():
        if f.is_file():
            (run_dir / "final" / f.name).symlink_to(f)


def test_run_efficiency_reads_unique_tokens_and_the_rollout_from_events(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    _final(tmp_path, tiny_model_dir)
    fp = FlopParams.of(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    steps = [{"event": "train_step", "rows": 4, "row_tokens": 900, "local_train_tree_row_tokens": 700,
              "local_train_tree_unique_tokens": 100, "local_train_tree_batches": 1, "action_tokens": 30,
              "echo_tokens": 10, "local_train_selective_suffix_logits": True,
              "step_time_s": s, "rollout_time_s": 3.0, "weight_sync_s": 1.0, "rollout_action_tokens": 40}
             for s in (1.0, 3.0)]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in steps))
    r = run_efficiency(tmp_path, {"float32": 1.0}, gb_s=1e-6)  # 1e9 FLOP/s, 1000 B/s
    assert r["flop_params"] == vars(fp)
    # 200 unpacked row tokens + 100 unique tokens of the packed 700: 300 computed; the head at 40 targets
    assert (r["row_tokens_per_step"], r["tokens_per_step"], r["head_tokens_per_step"]) == (900, 300, 40)
    # (6 x backbone x 300 + 6 x head x 40) / (2 s mean x 1e9 FLOP/s)
    want = (6 * fp.backbone_trainable * 300 + 6 * fp.head * 40) / 2e9
    assert r["training_efficiency"]["float32"] == pytest.approx(want, abs=1e-4)
    # float32 weights: 4 bytes x every weight a decode step reads x 40 tokens / ((3 - 1) s x 1000 B/s)
    assert r["decoding_efficiency"] == pytest.approx(4 * fp.decode_params * 40 / (2 * 1000), rel=1e-3)
    # two ranks: the same counts over the same times on twice the devices
    (tmp_path / "events.jsonl").write_text("".join(json.dumps({**e, "ranks": 2}) + "\n" for e in steps))
    two = run_efficiency(tmp_path, {"float32": 1.0}, gb_s=1e-6)
    assert two["training_efficiency"]["float32"] == pytest.approx(r["training_efficiency"]["float32"] / 2,
                                                                  abs=1e-4)
    assert two["decoding_efficiency"] == pytest.approx(r["decoding_efficiency"] / 2, rel=1e-3)


def test_a_lora_run_counts_its_adapter_as_trained_and_its_base_and_head_as_frozen(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    (tmp_path / "final").mkdir()
    save_file({"lora_A": torch.zeros(4, 8), "lora_B": torch.zeros(8, 4)},
              tmp_path / "final" / "adapter_model.safetensors")
    (tmp_path / "final" / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(tiny_model_dir)}))
    (tmp_path / "events.jsonl").write_text(json.dumps(
        {"event": "train_step", "rows": 1, "row_tokens": 10, "action_tokens": 2, "step_time_s": 1.0}) + "\n")
    base = FlopParams.of(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    r = run_efficiency(tmp_path, {"float32": 1.0}, gb_s=1.0)
    assert r["flop_params"] == {"backbone_trainable": 64, "backbone_frozen": base.backbone_trainable,
                                "head": base.head, "head_trainable": False}
    want = ((6 * 64 + 4 * base.backbone_trainable) * 10 + 4 * base.head * 2) / 1e9
    assert r["training_efficiency"]["float32"] == pytest.approx(want, abs=1e-4)
    assert "decoding_efficiency" not in r  # no rollout in these steps


def test_cpu_time_limits_are_positive():
    out = cpu_time_limits([64], 4, 1, min_cpu_s=0.01)
    assert out["float32"]["peak_gflops"] > 0 and out["bfloat16"]["peak_gflops"] > 0
    assert out["bandwidth_gb_s"] > 0


def test_bench_machine_measures_positive_peaks_and_bandwidth(capsys):
    assert benchmarks.main(["machine", "--sizes", "64", "--repeats", "1", "--bandwidth-mb", "4",
                            "--threads", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["matmul"]["float32"]["peak_gflops"] > 0 and doc["matmul"]["bfloat16"]["peak_gflops"] > 0
    assert doc["bandwidth"]["gb_s"] > 0 and doc["bandwidth"]["bytes_per_call"] == 3 * 4 * 2**20
    assert doc["cpu_time"]["float32"]["peak_gflops"] > 0 and doc["cpu_time"]["bandwidth_gb_s"] > 0
