"""`quaero bench echo` and `quaero bench step` at tiny shapes: fields present, value check live.

No timing assertions: timings on a shared CPU are noise; the benchmarks' figures are reported, not
tested. The value check is tested by injecting a wrong region and expecting BenchValueError.
"""
import json

import pytest
import torch

from quaero.bench import echo_regions as er
from quaero.bench import main as bench_main
from quaero.bench.measure import cpu_peak_bytes

TINY_ECHO = ["echo", "--device", "cpu", "--seq-len", "96", "--early-target-pos", "4", "--selected-tokens", "6",
             "--vocab-size", "256", "--hidden-size", "32", "--repeats", "2", "--memory-repeats", "1",
             "--chunk-size", "4", "--min-sample-s", "0", "--threads", "1"]

REGION_FIELDS = {"median_s", "min_s", "max_s", "inner_calls", "value", "median_peak_allocated_mb", "branch"}


def _run(argv, tmp_path, capsys):
    path = tmp_path / "out.json"
    rc = bench_main(argv + ["--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    doc = json.loads(path.read_text())
    assert json.loads(out) == doc  # stdout carries the same document
    return doc


def test_bench_echo_fields_and_smoke(tmp_path, capsys):
    doc = _run(TINY_ECHO, tmp_path, capsys)
    for key in ("device", "dtype", "torch_version", "cuda_available", "cuda_device_name", "memory_method",
                "config", "region_benchmark", "value_check", "echo_train_smoke"):
        assert key in doc
    rb = doc["region_benchmark"]
    for name in ("suffix_path", "selected_logsoftmax_path", "selected_cross_entropy_path",
                 "selected_chunked_recompute_path"):
        assert REGION_FIELDS <= set(rb[name]), name
        assert doc["value_check"][name]["ok"] is True
    assert rb["selected_cross_entropy_path"]["branch"] == "hidden"
    assert rb["selected_chunked_recompute_path"]["branch"] == "hidden_chunked"
    for key in ("suffix_slots", "selected_positions_first_last", "suffix_logits_elements", "selected_logits_elements",
                "element_ratio", "suffix_logits_approx_mib_fp32", "selected_logits_approx_mib_fp32",
                "selected_ce_speedup_vs_logsoftmax", "selected_ce_speedup_vs_suffix",
                "selected_ce_memory_ratio_vs_suffix", "selected_chunked_memory_ratio_vs_eager_ce",
                "selected_chunked_time_ratio_vs_eager_ce"):
        assert key in rb, key
    assert rb["suffix_slots"] == 96 - 1 - 4 and rb["selected_positions_first_last"] == [4, 94]
    # every region computes the same loss
    values = {round(rb[n]["value"], 4) for n in ("suffix_path", "selected_logsoftmax_path",
                                                  "selected_cross_entropy_path", "selected_chunked_recompute_path")}
    assert len(values) == 1
    smoke = doc["echo_train_smoke"]
    assert smoke["proof_ok"] is True and smoke["steps"] == 2
    rm = smoke["runtime_metrics"]
    assert rm["local_train_selective_sparse_suffix_skips"] > 0
    assert rm["local_train_selective_hidden_logprob_batches"] > 0
    assert rm["local_train_selective_fallback_logprob_batches"] == 0


def test_bench_echo_compiled_auto_on_cpu_falls_back_with_reason(tmp_path, capsys):
    doc = _run(TINY_ECHO + ["--compile-selective-ce", "auto", "--compile-selective-ce-min-tokens", "1",
                            "--no-smoke", "--skip", "suffix_path"], tmp_path, capsys)
    rb = doc["region_benchmark"]
    assert "suffix_path" not in rb
    compiled = rb["selected_compiled_ce_path"]
    assert compiled["branch"] == "hidden" and compiled["info"]["fallback_reason"] == "non_cuda"
    assert "selected_compiled_ce_speedup_vs_eager_ce" in rb


def _wrong(region):
    def shifted(x):
        out = region(x)
        return er.RegionOut(out.dense + 1e-3 * x.target_mask[:, 1:], out.info)
    return shifted


@pytest.mark.parametrize("name", ["selected_cross_entropy_path", "selected_chunked_recompute_path",
                                  "suffix_path"])
def test_bench_echo_value_check_rejects_a_wrong_region(monkeypatch, capsys, name):
    from quaero.bench import echo

    real = echo.regions

    def faulty(args):
        return [(n, _wrong(r) if n == name else r, b, f) for n, r, b, f in real(args)]

    monkeypatch.setattr(echo, "regions", faulty)
    assert bench_main(TINY_ECHO + ["--no-smoke"]) == 1
    err = capsys.readouterr().err
    assert f"region {name} fails the value check" in err


def test_value_check_rejects_wrong_gradient_and_wrong_branch():
    x = er.make_inputs(seq_len=64, early_target_pos=2, selected_tokens=5, vocab_size=128, hidden_size=16,
                       device=torch.device("cpu"), dtype=torch.float32)
    ref = er.reference(x)

    def detached_weight(x):  # right values, no LM-head gradient
        logits = torch.nn.functional.linear(x.hidden[0, x.positions], x.lm_head.weight.detach())
        lp = torch.log_softmax(logits, -1).gather(-1, x.targets[:, None]).squeeze(-1)
        return er.RegionOut(lp.new_zeros(1, x.hidden.shape[1] - 1).index_put((x.positions * 0, x.positions), lp))

    with pytest.raises(er.BenchValueError, match="LM-head gradient"):
        er.check_region("detached", detached_weight, x, ref)
    with pytest.raises(er.BenchValueError, match="expected 'hidden_chunked'"):
        er.check_region("ce", er.trainer_region(), x, ref, expect_branch="hidden_chunked")
    assert er.check_region("ce", er.trainer_region(), x, ref, expect_branch="hidden")["ok"]


def test_cpu_peak_bytes_sees_the_region_allocations():
    _, peak = cpu_peak_bytes(lambda: torch.ones(1024, 1024).sum())  # one 4 MiB tensor
    assert 4 * 2**20 <= peak < 5 * 2**20


def test_bench_step_fields_and_budget(tmp_path, capsys):
    doc = _run(["step", "--device", "cpu", "--seq-len", "256", "--targets", "8", "--turns", "2",
                "--vocab-size", "512", "--hidden-size", "32", "--steps", "1", "--budget-gb", "0.004",
                "--min-len", "128", "--max-len", "384", "--len-step", "128", "--threads", "1"], tmp_path, capsys)
    cmp = doc["comparison"]
    assert cmp["seq_len"] == 256 and "row_layout" in cmp
    for path in ("full_logits", "selective_ce", "chunked_recompute"):
        r = cmp[path]
        for key in ("resident_mb", "peak_step_mb", "peak_total_mb", "median_step_s", "branch_counters"):
            assert key in r, (path, key)
    assert cmp["full_logits"]["branch_counters"]["local_train_selective_dense_logprob_batches"] == 1
    assert cmp["selective_ce"]["branch_counters"]["local_train_selective_hidden_logprob_batches"] == 1
    assert cmp["chunked_recompute"]["branch_counters"]["local_train_selective_chunked_logprob_batches"] == 1
    assert cmp["selective_ce"]["memory_ratio_vs_full_logits"] > 1
    budget = doc["budget"]
    assert budget["budget_gb"] == 0.004
    for path in ("full_logits", "selective_ce", "chunked_recompute"):
        fit = budget[path]
        assert fit["limited_by"] and fit["probes"]
        fitting = [p["seq_len"] for p in fit["probes"] if p["fits"]]
        assert fit["longest_fit_tokens"] == (max(fitting) if fitting else 0)
    assert budget["full_logits"]["longest_fit_tokens"] <= budget["selective_ce"]["longest_fit_tokens"]
