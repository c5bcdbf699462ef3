"""trainers/loss.py: the NLL term's value on known numbers, and the trainer/sampler log-prob gap."""
import math

import pytest
import torch

from trainers.loss import LogprobGap, PolicyStats, logprob_gap, nll_loss

LP = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -1.5]])
MASK = torch.tensor([[True, False, True], [False, True, True]])


def test_nll_is_the_scaled_weighted_sum_of_minus_logp_over_the_mask():
    scale = torch.tensor([[0.5], [0.25]])
    assert nll_loss(LP, MASK, scale).item() == pytest.approx(0.5 * (1 + 3) + 0.25 * (4 + 1.5))
    weights = torch.tensor([[2.0, 9.0, 0.0], [9.0, 1.0, 0.5]])
    got = nll_loss(LP, MASK, scale, weights, coef=0.3).item()
    assert got == pytest.approx(0.3 * (0.5 * 2.0 + 0.25 * (4.0 + 0.75)))


def test_nll_gradient_reaches_only_masked_tokens():
    lp = LP.clone().requires_grad_(True)
    nll_loss(lp, MASK, torch.ones(2, 1)).backward()
    assert torch.equal(lp.grad, -MASK.float())


def test_logprob_gap_reads_only_sampled_tokens_and_adds_up():
    gap = logprob_gap(LP, LP + torch.tensor([[0.1, 7.0, -0.3], [7.0, 0.2, 0.0]]), MASK)
    assert gap.tokens == 4 and gap.total == pytest.approx(0.6) and gap.max == pytest.approx(0.3)
    assert logprob_gap(LP, LP, torch.zeros_like(MASK)) == LogprobGap() and LogprobGap().mean == 0.0
    gap.add(LogprobGap(tokens=1, total=1.4, max=1.4))
    assert gap.mean == pytest.approx(0.4) and gap.max == pytest.approx(1.4)


def test_policy_stats_add_sums_counts_and_keeps_the_extremes():
    a = PolicyStats(tokens=2, clipped=1, is_max=1.5, sequences=1, seq_ratio_min=0.9, seq_ratio_max=1.1)
    a.add(PolicyStats(tokens=3, clipped=2, is_max=1.2, sequences=1, seq_ratio_min=0.8, seq_ratio_max=1.0))
    assert (a.tokens, a.clipped, a.sequences, a.is_max) == (5, 3, 2, 1.5)
    assert (a.seq_ratio_min, a.seq_ratio_max) == (0.8, 1.1)
    assert PolicyStats().seq_ratio_min == math.inf
