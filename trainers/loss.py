"""The RL, SFT and ECHO loss terms, read from one shifted log-prob tensor.

All inputs are shifted `[B, L-1]` (column j scores token j + 1). Each term returns the sum over this
microbatch of its per-token losses times the rows' `scale` [B, 1], which already holds the term's
step-wide denominator (trainers/aggregation.py: a token mean, a sequence mean or a constant), so
summing the microbatch values gives the step's loss, gradient accumulation is exact, and adding ECHO
never changes the RL term's effective per-token learning rate (each term has its own denominator).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PolicyStats:
    """Sums over RL tokens (the caller turns them into step means)."""

    tokens: int = 0
    ratio_sum: float = 0.0
    clipped: int = 0

    def add(self, other: PolicyStats) -> None:
        self.tokens += other.tokens
        self.ratio_sum += other.ratio_sum
        self.clipped += other.clipped


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


def policy_gradient_loss(
    logprobs: Tensor,  # [B, L-1] fp32, trainer log-probs (with grad)
    sampler_logprobs: Tensor,  # [B, L-1] fp32, behaviour policy's log-probs of the same tokens
    advantages: Tensor,  # [B, L-1] fp32, group-relative, per token
    mask: Tensor,  # [B, L-1] bool, action tokens with non-zero advantage
    scale: Tensor,  # [B, 1] fp32, each row's token factor (the step's denominator included)
    clip_eps: float | None,
) -> tuple[Tensor, PolicyStats]:
    """Token-level policy gradient with importance ratio r = exp(logp - sampler_logp).

    Per token: -r * A, or with PPO clipping -min(r * A, clip(r, 1 - eps, 1 + eps) * A).
    Aggregation: sum over RL tokens of scale * per-token loss (token_mean: scale = 1 / the step's count
    of action tokens with A != 0; trainers/aggregation.py has the others).
    """
    log_ratio = torch.where(mask, logprobs - sampler_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    per_token = -ratio * advantages
    if clip_eps is not None:
        clipped = -torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
        per_token = torch.maximum(per_token, clipped)
    loss = (torch.where(mask, per_token, torch.zeros_like(per_token)) * scale).sum()
    stats = PolicyStats(tokens=int(mask.sum()))
    if stats.tokens:
        with torch.no_grad():
            r = ratio[mask]
            stats.ratio_sum = float(r.sum())
            if clip_eps is not None:
                stats.clipped = int(((r < 1.0 - clip_eps) | (r > 1.0 + clip_eps)).sum())
    return loss, stats


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
