"""Selective log-probs equal the full log_softmax reference, values and gradients, on every branch."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainers.chunked_ce import LogitTransform
from trainers.selective import SelectiveInfo, choose_branch, full_logprobs, selected_logprobs
from trainers.spec import SelectivePolicy

VALUE_ATOL = 1e-5
GRAD_RTOL = 1e-5  # relative to the gradient's largest entry


def _case(seed, B=None, L=None, V=None, H=None, bias=None, density=None):
    g = torch.Generator().manual_seed(seed)

    def r(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    B, L, V, H = B or r(1, 3), L or r(2, 40), V or [17, 512][r(0, 1)], H or [8, 32][r(0, 1)]
    bias = bool(r(0, 1)) if bias is None else bias
    head = nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    hidden = torch.randn(B, L, H, generator=g)
    ids = torch.randint(0, V, (B, L), generator=g)
    p = torch.rand(1, generator=g).item() if density is None else density
    mask = torch.rand(B, L, generator=g) < p
    mask[:, 0] = False  # token 0 never is a target
    return hidden, head, ids, mask


IDENTITY = LogitTransform()


def _reference(hidden, head, ids, mask, T=1.0, transform=IDENTITY):
    logits = transform.apply(head(hidden).float()) / T
    return full_logprobs(logits, ids, mask)


def _grads(fn, hidden, head, seed=0):
    """Values and grads of sum(lp * w) w.r.t. hidden and the head's parameters."""
    hidden = hidden.clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    lp, info = fn(hidden)
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(seed))
    if lp.requires_grad:
        (lp * w).sum().backward()
    grads = [hidden.grad] + [p.grad for p in head.parameters()]
    return lp.detach(), [torch.zeros_like(x) if gr is None else gr.clone()
                         for gr, x in zip(grads, [hidden, *head.parameters()])], info


def _assert_exact(hidden, head, ids, mask, *, T=1.0, transform=IDENTITY, expect=None, **policy):
    ref, ref_grads, _ = _grads(lambda h: (_reference(h, head, ids, mask, T, transform), None), hidden, head)
    got, got_grads, info = _grads(
        lambda h: selected_logprobs(h, head, ids, mask, temperature=T, logit_transform=transform,
                                    policy=SelectivePolicy(**policy)),
        hidden, head)
    assert got.shape == (ids.shape[0], ids.shape[1] - 1)
    assert (got - ref).abs().max().item() <= VALUE_ATOL if got.numel() else True
    assert torch.all(got[~mask[:, 1:]] == 0)  # exactly 0 where not selected
    for g, r in zip(got_grads, ref_grads):
        scale = r.abs().max().item()
        assert (g - r).abs().max().item() <= GRAD_RTOL * max(scale, 1e-30), (info, scale)
    if expect is not None:
        assert info.branch == expect, info
    return info


BRANCH_KW = {
    "suffix": {"dense_min_density": 1e-9, "suffix_max_bytes": 2**40},
    "hidden": {"suffix_max_bytes": 0},
    "hidden_chunked": {"chunk_size": 3},
    "compiled_fallback": {"compile_mode": "auto"},
}


@pytest.mark.parametrize("branch", list(BRANCH_KW))
@pytest.mark.parametrize("seed", range(6))
def test_every_branch_matches_full_log_softmax(branch, seed):
    hidden, head, ids, mask = _case(seed)
    if not mask[:, 1:].any():
        mask[0, -1] = True
    T = [1.0, 0.7, 1.3][seed % 3]
    expect = {"compiled_fallback": None}.get(branch, branch)
    info = _assert_exact(hidden, head, ids, mask, T=T, expect=expect, **BRANCH_KW[branch])
    if branch == "compiled_fallback":
        assert info.branch in ("suffix", "hidden") and not info.compiled
        if info.branch == "hidden":
            assert info.fallback_reason in ("non_cuda", "below_min_tokens")


@pytest.mark.parametrize("chunk", [1, 2, 7, 8, 9, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_recompute_exact_at_chunk_boundaries(chunk, bias):
    hidden, head, ids, mask = _case(11, B=2, L=10, V=512, H=8, bias=bias, density=1.0)
    mask[:, 1:] = True  # S = 2 * 9 = 18 targets: chunks of 1, 2, 7, 8, 9 (exact divisor) and one big chunk
    info = _assert_exact(hidden, head, ids, mask, T=0.8, chunk_size=chunk, expect="hidden_chunked")
    assert info.chunk_impl == "recompute" and info.selected_tokens == 18


class WrappedHead(nn.Module):
    """A head that is not a plain nn.Linear (as when wrapped by an adapter): the checkpoint route."""

    def __init__(self, linear):
        super().__init__()
        self.inner = linear

    @property
    def weight(self):
        return self.inner.weight

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("seed", range(3))
def test_chunked_checkpoint_route_for_wrapped_head(seed):
    hidden, head, ids, mask = _case(seed + 20, density=0.6)
    mask[0, -1] = True
    info = _assert_exact(hidden, WrappedHead(head), ids, mask, T=1.5, chunk_size=4, expect="hidden_chunked")
    assert info.chunk_impl == "checkpoint"


@pytest.mark.parametrize("branch", list(BRANCH_KW))
@pytest.mark.parametrize("transform", [LogitTransform(scale=0.5), LogitTransform(softcap=3.0),
                                       LogitTransform(scale=2.0, softcap=5.0)])
def test_logit_transforms_applied_on_every_branch(branch, transform):
    hidden, head, ids, mask = _case(5, B=2, L=12, V=64, H=8, bias=True, density=0.5)
    mask[1, 3] = True
    _assert_exact(hidden, head, ids, mask, T=0.9, transform=transform, **BRANCH_KW[branch])
    # and the transform matters: without it the values differ
    policy = SelectivePolicy(**BRANCH_KW[branch])
    plain, _ = selected_logprobs(hidden, head, ids, mask, temperature=0.9, policy=policy)
    transformed, _ = selected_logprobs(hidden, head, ids, mask, temperature=0.9, logit_transform=transform,
                                       policy=policy)
    assert (plain - transformed).abs().max() > 1e-3


@pytest.mark.parametrize("branch", list(BRANCH_KW))
def test_one_target_and_all_targets(branch):
    hidden, head, ids, mask = _case(3, B=3, L=9, V=512, H=8, density=0.0)
    mask[2, 5] = True
    info = _assert_exact(hidden, head, ids, mask, **BRANCH_KW[branch])
    assert info.selected_tokens == 1
    mask[:, 1:] = True
    info = _assert_exact(hidden, head, ids, mask, T=2.0, **BRANCH_KW[branch])
    assert info.selected_tokens == 3 * 8


def test_no_targets_does_no_lm_head_work():
    hidden, head, ids, mask = _case(4, B=2, L=16, V=512, H=8, density=0.0)
    calls = []
    head.register_forward_hook(lambda *a: calls.append(1))
    for kw in BRANCH_KW.values():
        lp, info = selected_logprobs(hidden, head, ids, mask, policy=SelectivePolicy(**kw))
        assert info.branch == "none" and info.selected_tokens == 0 and not info.sparse_suffix_skip
        assert lp.shape == (2, 15) and torch.all(lp == 0)
    assert calls == []


def test_sparse_dense_decision_reads_per_row_density_and_bytes():
    hidden, head, ids, mask = _case(6, B=2, L=33, V=512, H=8, density=0.0)
    mask[0, 17:] = True  # row 0: dense 16-token suffix
    _, info = selected_logprobs(hidden, head, ids, mask)
    # row 1 has no targets: it is left out of the suffix logits instead of diluting the density
    assert info.branch == "suffix" and info.min_row_density == 1.0 and info.suffix_slots == 16
    assert info.suffix_bytes == 1 * 16 * 512 * 4
    mask[1, 17] = True  # row 1 would materialise 16 suffix logits for one target
    _, info = selected_logprobs(hidden, head, ids, mask)
    assert info.branch == "hidden" and info.sparse_suffix_skip and info.min_row_density == 1 / 16
    mask[1, 17:] = True
    _, info = selected_logprobs(hidden, head, ids, mask,
                                policy=SelectivePolicy(suffix_max_bytes=2 * 16 * 512 * 4 - 1))
    assert info.branch == "hidden" and info.sparse_suffix_skip  # dense, but over the byte budget


def test_selected_logits_above_the_budget_run_chunked_and_stay_exact():
    """[S, V] fp32 logits over `hidden_max_bytes` take the chunked branch (AUTO_CHUNK_ROWS rows a chunk when
    `chunk_size` is unset): values and gradients equal the full log_softmax reference."""
    hidden, head, ids, mask = _case(5, B=2, L=40, V=512, H=8, density=0.6)
    S = int(mask[:, 1:].sum())
    info = _assert_exact(hidden, head, ids, mask, T=0.9, suffix_max_bytes=0, hidden_max_bytes=S * 512 * 4 - 1,
                         expect="hidden_chunked")
    assert info.hidden_bytes == S * 512 * 4 and info.chunk_impl == "recompute" and info.sparse_suffix_skip
    info = _assert_exact(hidden, head, ids, mask, T=0.9, suffix_max_bytes=0, hidden_max_bytes=S * 512 * 4,
                         expect="hidden")


def test_chunked_recompute_saves_no_vocab_sized_activation():
    """The chunked path keeps only hidden states and targets for backward; eager CE keeps [S, V]."""
    S_rows, L, V, H = 2, 41, 4096, 8
    hidden, head, ids, mask = _case(7, B=S_rows, L=L, V=V, H=H, bias=True, density=1.0)
    mask[:, 1:] = True
    S = S_rows * (L - 1)

    def saved_numels(**kw):
        sizes = []

        def pack(t):
            sizes.append((t.numel(), isinstance(t, nn.Parameter)))
            return t
        h = hidden.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, _ = selected_logprobs(h, head, ids, mask, policy=SelectivePolicy(suffix_max_bytes=0, **kw))
        lp.sum().backward()
        return [n for n, is_param in sizes if not is_param]

    assert max(saved_numels()) >= S * V  # eager CE saves [S, V] (the test can fail)
    assert max(saved_numels(chunk_size=16)) <= V * H  # chunked: at most the weight-sized buffers


def test_compile_require_fails_closed_on_cpu_and_auto_records_reason():
    hidden, head, ids, mask = _case(8, B=1, L=300, V=64, H=8, density=0.9)
    def run(**policy):
        return selected_logprobs(hidden, head, ids, mask, policy=SelectivePolicy(suffix_max_bytes=0,
                                                                                 **policy))[1]

    with pytest.raises(RuntimeError, match="non_cuda"):
        run(compile_mode="require", compile_min_tokens=1)
    info = run(compile_mode="auto", compile_min_tokens=1)
    assert info.branch == "hidden" and info.fallback_reason == "non_cuda" and not info.compiled
    assert run(compile_mode="auto", compile_min_tokens=10**6).fallback_reason == "below_min_tokens"
    assert run(compile_mode="auto", compile_min_tokens=1, chunk_size=4).branch == "hidden_chunked"
    assert run(compile_mode="off").fallback_reason == ""


def test_full_logprobs_dense_reference_is_exact():
    hidden, head, ids, _ = _case(9, B=2, L=7, V=32, H=8)
    logits = head(hidden)
    want = F.log_softmax(logits[:, :-1] / 0.5, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.equal(full_logprobs(logits, ids, None, temperature=0.5), want)


@pytest.mark.slow
def test_compiled_branch_is_exact_when_compile_runs(monkeypatch):
    """The real torch.compile'd CE (Inductor on CPU; production allows it on CUDA only)."""
    from trainers import compiled_ce

    monkeypatch.setattr(compiled_ce, "compile_unavailable_reason",
                        lambda device, head, selected,
                        min_tokens: "" if selected >= min_tokens else "below_min_tokens")
    hidden, head, ids, mask = _case(12, B=2, L=24, V=64, H=8, bias=True, density=0.7)
    info = _assert_exact(hidden, head, ids, mask, T=0.7, transform=LogitTransform(softcap=4.0),
                         compile_mode="require", compile_min_tokens=1, suffix_max_bytes=0, expect="compiled")
    assert info.compiled and info.fallback_reason == ""


@pytest.mark.hostile
def test_a_target_mask_of_another_shape_is_refused():
    """A shifted [B, L-1] mask would be shifted again and misalign every value: a clear error instead."""
    hidden, head, ids, mask = _case(13, B=2, L=10, V=64, H=8, density=0.5)
    for bad in (mask[:, 1:], mask[:1], mask[:, :, None]):
        with pytest.raises(ValueError, match=r"target_mask \[.*must share \[B, L\]"):
            selected_logprobs(hidden, head, ids, bad)
        with pytest.raises(ValueError, match="not a shifted"):
            full_logprobs(head(hidden), ids, bad)


@pytest.mark.parametrize("policy, figures, branch", [
    (SelectivePolicy(), {"selected_tokens": 0}, "none"),
    # the suffix shortcut only where every suffix slot is a target: below that it computes logits no loss
    # reads, and the CPU crossover (benchmarks/README.md) measured it slower at density 0.5 and 0.75
    (SelectivePolicy(), {"selected_tokens": 8, "min_row_density": 1.0, "suffix_bytes": 64 * 2**20}, "suffix"),
    (SelectivePolicy(), {"selected_tokens": 8, "min_row_density": 0.99, "suffix_bytes": 1}, "hidden"),
    (SelectivePolicy(), {"selected_tokens": 8, "min_row_density": 0.75, "suffix_bytes": 1}, "hidden"),
    (SelectivePolicy(), {"selected_tokens": 8, "min_row_density": 0.5, "suffix_bytes": 1}, "hidden"),
    (SelectivePolicy(dense_min_density=0.5), {"selected_tokens": 8, "min_row_density": 0.5}, "suffix"),
    (SelectivePolicy(dense_min_density=0.5), {"selected_tokens": 8, "min_row_density": 0.49}, "hidden"),
    (SelectivePolicy(), {"selected_tokens": 8, "min_row_density": 1.0, "suffix_bytes": 64 * 2**20 + 1},
     "hidden"),
    (SelectivePolicy(chunk_size=4), {"selected_tokens": 8, "min_row_density": 1.0}, "hidden_chunked"),
    # eager CE until the [S, V] logits pass hidden_max_bytes, then chunked (same values, one chunk's memory):
    # on the CPU crossover chunked time stayed within eager's noise while its peak fell 1.5-10x
    (SelectivePolicy(), {"selected_tokens": 8, "hidden_bytes": 128 * 2**20}, "hidden"),
    (SelectivePolicy(), {"selected_tokens": 8, "hidden_bytes": 128 * 2**20 + 1}, "hidden_chunked"),
    (SelectivePolicy(hidden_max_bytes=2**62), {"selected_tokens": 8, "hidden_bytes": 2**40}, "hidden"),
    (SelectivePolicy(compile_mode="auto"), {"selected_tokens": 8, "min_row_density": 0.1}, "compiled"),
    (SelectivePolicy(compile_mode="auto"), {"selected_tokens": 8, "min_row_density": 1.0}, "suffix"),
])
def test_branch_decision_reads_only_the_policy_and_the_figures(policy, figures, branch):
    assert choose_branch(policy, SelectiveInfo(**figures)) == branch


def test_selective_policy_rejects_bad_values():
    with pytest.raises(ValueError, match="compile_mode='sometimes'"):
        SelectivePolicy(compile_mode="sometimes")
    with pytest.raises(ValueError, match="chunk_size=0"):
        SelectivePolicy(chunk_size=0)
    with pytest.raises(TypeError):
        SelectivePolicy(dense_density=0.1)  # a misspelt threshold is not silently ignored
