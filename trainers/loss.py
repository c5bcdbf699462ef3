"""The SFT and ECHO losses and the RL term's statistics (its loss family: trainers/policy_losses.py), read
from one shifted log-prob tensor.

All inputs are shifted `[B, L-1]` (column j scores token j + 1). Each term returns the sum over this
microbatch of its per-token losses times the rows' `scale` [B, 1], which already holds the term's
step-wide denominator (trainers/aggregation.py: a token mean, a sequence mean or a constant), so
summing the microbatch values gives the step's loss, gradient accumulation is exact, and adding ECHO
never changes the RL term's effective per-token learning rate (each term has its own denominator).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PolicyStats:
    """Sums over RL tokens (the caller turns them into step means)."""

    tokens: int = 0  # the sampled ones (guided tokens have no ratio)
    ratio_sum: float = 0.0
    clipped: int = 0  # the ratio outside the clip range
    clipped_low: int = 0  # below it with A < 0 (the clip binds: no gradient)
    clipped_high: int = 0  # above it with A > 0 (CISPO: the weight truncated)
    # the sampler correction's raw weight exp(lp_old - lp_sampler) over targets, and those truncated/masked
    is_tokens: int = 0
    is_sum: float = 0.0
    is_max: float = 0.0
    is_cut: int = 0
    # the sequence ratio (GSPO) over rows with targets
    sequences: int = 0
    seq_ratio_sum: float = 0.0
    seq_ratio_min: float = math.inf
    seq_ratio_max: float = 0.0
    # guided tokens (a guide's, trained with policy shaping f(π) = π / (π + γ)): their count and f's range
    guided_tokens: int = 0
    shaping_sum: float = 0.0
    shaping_min: float = math.inf
    shaping_max: float = 0.0

    def add(self, other: PolicyStats) -> None:
        for name in ("tokens", "ratio_sum", "clipped", "clipped_low", "clipped_high", "is_tokens", "is_sum",
                     "is_cut", "sequences", "seq_ratio_sum", "guided_tokens", "shaping_sum"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.shaping_min = min(self.shaping_min, other.shaping_min)
        self.shaping_max = max(self.shaping_max, other.shaping_max)
        self.is_max = max(self.is_max, other.is_max)
        self.seq_ratio_min = min(self.seq_ratio_min, other.seq_ratio_min)
        self.seq_ratio_max = max(self.seq_ratio_max, other.seq_ratio_max)


@dataclass
class LogprobGap:
    """|trainer log-prob - sampler log-prob| over sampled action tokens: how far the two engines disagree."""

    tokens: int = 0
    total: float = 0.0
    max: float = 0.0

    def add(self, other: LogprobGap) -> None:
        self.tokens += other.tokens
        self.total += other.total
        self.max = max(self.max, other.max)

    @property
    def mean(self) -> float:
        return self.total / self.tokens if self.tokens else 0.0


@torch.no_grad()
def logprob_gap(
    logprobs: Tensor,  # [B, L-1] fp32, trainer log-probs
    sampler_logprobs: Tensor,  # [B, L-1] fp32, the sampler's log-probs of the same tokens
    mask: Tensor,  # [B, L-1] bool, every sampled action token (whatever its advantage)
) -> LogprobGap:
    gap = (logprobs - sampler_logprobs)[mask].abs()
    if not gap.numel():
        return LogprobGap()
    return LogprobGap(tokens=gap.numel(), total=float(gap.sum()), max=float(gap.max()))


def nll_loss(
    logprobs: Tensor,  # [B, L-1] fp32
    mask: Tensor,  # [B, L-1] bool, tokens to train
    scale: Tensor,  # [B, 1] fp32, each row's token factor (the step's denominator included)
    weights: Tensor | None = None,  # [B, L-1] fp32 per-token weights, or None for 1
    coef: float = 1.0,
) -> Tensor:
    """coef * sum over mask of scale * weights * -logp.

    SFT warm start: weights None, coef 1, scale 1 / the step's action tokens -> mean NLL over them.
    ECHO: weights = the rows' per-token ECHO weights, coef = λ (`[echo] weight` at this step), scale =
    1 / the step's ECHO tokens (a weighted mean over environment-response tokens) or per episode
    (`[echo] normalization = "sequence"`, trainers/aggregation.py).
    """
    per_token = -logprobs if weights is None else -logprobs * weights
    return coef * (torch.where(mask, per_token, torch.zeros_like(per_token)) * scale).sum()
