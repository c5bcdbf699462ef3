"""CUDA-only checks (run by scripts/gpu_check.sh): every selective branch exact on the GPU, the
compiled CE path really compiled under `require`, and a trainer step proving the branch that ran."""
import pytest
import torch

from trainers.selective import full_logprobs, selected_logprobs
from trainers.spec import SelectivePolicy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run "
                                                                       "scripts/gpu_check.sh)")]


def _case(seed, B=2, L=300, V=4096, H=64, density=0.05):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
        head.bias.copy_(torch.randn(V, generator=g))
    hidden = torch.randn(B, L, H, generator=g)
    ids = torch.randint(0, V, (B, L), generator=g)
    mask = torch.rand(B, L, generator=g) < density
    mask[:, 0] = False
    return hidden.cuda(), head.cuda(), ids.cuda(), mask.cuda()


def _values_and_grads(fn, hidden, head):
    hidden = hidden.clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    lp, info = fn(hidden)
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1)).cuda()
    (lp * w).sum().backward()
    return lp.detach(), [hidden.grad, head.weight.grad, head.bias.grad], info


@pytest.mark.parametrize("kw, branch", [
    ({"suffix_max_bytes": 0}, "hidden"),
    ({"chunk_size": 64}, "hidden_chunked"),
    ({"compile_mode": "require", "compile_min_tokens": 1}, "compiled"),
    ({"dense_min_density": 1e-9, "suffix_max_bytes": 2**40}, "suffix"),
])
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_selective_branches_exact_on_cuda(kw, branch, T):
    hidden, head, ids, mask = _case(0)
    ref, ref_g, _ = _values_and_grads(
        lambda h: (full_logprobs(head(h).float(), ids, mask, temperature=T), None), hidden, head)
    got, got_g, info = _values_and_grads(
        lambda h: selected_logprobs(h, head, ids, mask, temperature=T,
                                    policy=SelectivePolicy(**kw)), hidden, head)
    assert info.branch == branch and info.compiled == (branch == "compiled")
    assert (got - ref).abs().max().item() <= 1e-4  # TF32/fused-kernel tolerance on GPU
    for g, r in zip(got_g, ref_g):
        assert (g - r).abs().max().item() <= 1e-4 * r.abs().max().item()


def test_compiled_auto_below_threshold_records_reason_on_cuda():
    hidden, head, ids, mask = _case(1, density=0.01)
    _, info = selected_logprobs(hidden, head, ids, mask, policy=SelectivePolicy(
        compile_mode="auto", compile_min_tokens=10**6, suffix_max_bytes=0))
    assert info.branch == "hidden" and info.fallback_reason == "below_min_tokens"


def test_bench_echo_compiled_require_proof_on_cuda(tmp_path):
    import json

    from benchmarks import main as bench_main

    out = tmp_path / "echo.json"
    rc = bench_main(["echo", "--device", "cuda:0", "--seq-len", "512", "--early-target-pos", "16",
                     "--selected-tokens", "128", "--vocab-size", "4096", "--hidden-size", "64", "--repeats",
                     "3",
                     "--compile-selective-ce", "require", "--compile-selective-ce-min-tokens", "1",
                     "--json", str(out)])
    assert rc == 0
    metrics = json.loads(out.read_text())["echo_train_smoke"]["runtime_metrics"]
    assert metrics["local_train_selective_compiled_ce_batches"] > 0
    assert metrics["local_train_compile_selective_ce_fallback_reason"] == ""
