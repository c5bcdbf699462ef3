"""The policy-loss family (`[training] policy_loss`): each RL token's loss from the trainer's log-prob `lp`
(with grad), a behaviour log-prob `lp_old` and the advantage A, each variant its paper's formula.

The ratio r = exp(lp - lp_old). Without a `sampler_correction`, lp_old is the sampler's log-prob (quaero's
default: the ratio covers the sampler/trainer mismatch and an off-policy rollout's lag at once). With one,
lp_old is the trainer's own log-prob before the rollout batch's first optimizer step (TRL's
`old_per_token_logps`: sg(lp) with one step per batch, recorded once with several,
trainers/mini_steps.py), and the sampler mismatch is corrected apart by a weight
w = exp(lp_old - lp_sampler), per token or per row (summed over its targets), truncated at `cap` or
masked (set to 0) past it (TRL's `vllm_importance_sampling_mode`; Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training").

`importance_sampling_level = "sequence"` (GSPO, Zheng et al. 2025, arXiv 2507.18071): one ratio per row,
s = exp(mean over the row's targets of (lp - lp_old)), read by every target of the row (a row is one
episode's transcript, or its part after a prefix break).

Per target token (εl, εh = `clip_eps_low`, `clip_eps_high`; sg = stop-gradient):
- ppo_clip: -min(r A, clip(r, 1 - εl, 1 + εh) A) (PPO; εh > εl is DAPO's clip-higher, arXiv 2503.14476)
- gspo: ppo_clip on the sequence ratio s
- cispo: -sg(min(r, 1 + εh)) A lp (MiniMax-M1, arXiv 2506.13585: REINFORCE with a clipped, stop-gradient
  importance weight; no token's gradient is dropped)
- sapo: -(4 / τ) σ(τ (r - 1)) A, τ = τ_pos where A > 0 else τ_neg (SAPO, arXiv 2511.20347: a soft gate
  instead of the hard clip; its gradient is r-weighted, peaks at r = 1, fades smoothly off-policy)
then times w (with a correction) and the row's scale (its step-wide denominator, trainers/aggregation.py),
summed.

Guided tokens (`EchoRow.guided`: a guide, the env's oracle, chose them; `[training] guidance`) were never
sampled: they have no behaviour log-prob, so no ratio. Whatever the variant, each trains with LUFFY's policy
shaping (Yan et al. 2025, arXiv 2504.14945): -f(π) A with f(p) = p / (p + γ), π = exp(lp) the current
policy's probability of the token from the same forward, γ = `guidance_gamma` (0.1, LUFFY's); no clipping,
no sampler weight. Its gradient is -A γ / (π + γ)^2 ∇π: a low-probability expert token's ∇π is weighted by
up to 1 / γ and a likely one's by about γ, where the plain ratio π / 1 (the expert's probability taken as 1)
would give ∇π itself, vanishing with π. The ratio statistics count on-policy tokens only; f(π) is measured
on the guided ones.

The default (ppo_clip, token, no correction, εl = εh = `clip_eps`) is quaero's loss before this
family, operation for operation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainers.loss import PolicyStats
from trainers.spec import TrainerSpec


@dataclass(frozen=True)
class PolicyLoss:
    """The variant and its settings, from the spec (trainers/spec.py holds their defaults)."""

    name: str = "ppo_clip"  # ppo_clip | gspo | cispo | sapo
    clip_low: float | None = 0.2  # None: no lower bound
    clip_high: float | None = 0.2  # None: no upper bound (CISPO: no cap)
    sequence: bool = False  # one ratio per row (GSPO)
    correction: str = "none"  # none | token_truncate | token_mask | sequence_truncate | sequence_mask
    cap: float = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    gamma: float = 0.1  # policy shaping's γ on guided tokens

    @classmethod
    def of(cls, spec: TrainerSpec) -> PolicyLoss:
        low, high = spec.clip_range
        return cls(spec.policy_loss, low, high,
                   spec.policy_loss == "gspo" or spec.importance_sampling_level == "sequence",
                   spec.sampler_correction, spec.sampler_correction_cap, spec.sapo_temperature_pos,
                   spec.sapo_temperature_neg, spec.guidance_gamma)


def _zero_outside(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros_like(x))


@torch.no_grad()
def sampler_weight(
    old_logprobs: Tensor,  # [B, L-1] fp32, the trainer's log-probs before the step (no grad)
    sampler_logprobs: Tensor,  # [B, L-1] fp32
    mask: Tensor,  # [B, L-1] bool, RL targets
    correction: str,
    cap: float,
) -> tuple[Tensor, Tensor, Tensor]:  # each [B, L-1]: the weight, the raw ratio, whether it was cut
    """The sampler-mismatch weight w of every target: exp(lp_old - lp_sampler) per token, or per row
    exp(sum over its targets), truncated at `cap` (`*_truncate`) or 0 past it (`*_mask`)."""
    diff = _zero_outside(old_logprobs - sampler_logprobs, mask)
    if correction.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True).expand_as(diff)
    raw = torch.exp(diff)
    cut = raw > cap
    if correction.endswith("truncate"):
        weight = torch.clamp(raw, max=cap)
    elif correction.endswith("mask"):
        weight = raw.masked_fill(cut, 0.0)
    else:
        raise ValueError(f"sampler_correction={correction!r}: use 'none', 'token_truncate', 'token_mask', "
                         "'sequence_truncate' or 'sequence_mask'")
    return weight, raw, cut


def policy_loss(
    logprobs: Tensor,  # [B, L-1] fp32, trainer log-probs (with grad)
    sampler_logprobs: Tensor,  # [B, L-1] fp32, the sampler's log-probs of the same tokens
    advantages: Tensor,  # [B, L-1] fp32, per token
    mask: Tensor,  # [B, L-1] bool, action tokens with non-zero advantage
    scale: Tensor,  # [B, 1] fp32, each row's token factor (the step's denominator included)
    opts: PolicyLoss,
    old_logprobs: Tensor | None = None,  # [B, L-1] fp32, recorded before the batch's first step, or None
    guided: Tensor | None = None,  # [B, L-1] bool, tokens a guide chose (policy shaping), or None: none
) -> tuple[Tensor, PolicyStats]:
    """The step's RL loss over this microbatch (sum over targets of scale x per-token loss) and its
    statistics; the module docstring has each variant's formula, and the guided tokens' shaping. With a
    correction, lp_old is `old_logprobs` where recorded (several optimizer steps per rollout batch), else
    sg(lp)."""
    full = mask
    mask = mask if guided is None else mask & ~guided  # the sampled targets: the ratio's
    weight = None
    if opts.correction == "none":
        old = sampler_logprobs
    else:
        old = logprobs.detach() if old_logprobs is None else old_logprobs
        weight, raw, cut = sampler_weight(old, sampler_logprobs, mask, opts.correction, opts.cap)
    log_ratio = _zero_outside(logprobs - old, mask)
    if opts.sequence:
        seq_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
        ratio = torch.exp(seq_log_ratio).expand_as(logprobs)
    else:
        ratio = torch.exp(log_ratio)
    low = None if opts.clip_low is None else 1.0 - opts.clip_low
    high = None if opts.clip_high is None else 1.0 + opts.clip_high
    if opts.name in ("ppo_clip", "gspo"):
        per_token = -ratio * advantages
        if low is not None or high is not None:
            clipped = -torch.clamp(ratio, low, high) * advantages
            per_token = torch.maximum(per_token, clipped)
    elif opts.name == "cispo":
        per_token = -torch.clamp(ratio, max=high).detach() * advantages * logprobs
    elif opts.name == "sapo":
        tau = torch.where(advantages > 0, opts.tau_pos, opts.tau_neg)
        per_token = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * advantages
    else:
        raise ValueError(f"policy_loss={opts.name!r}: use 'ppo_clip', 'gspo', 'cispo' or 'sapo'")
    if weight is not None:
        per_token = per_token * weight
    shaping = None
    if guided is not None:
        guide = full & guided
        prob = torch.exp(logprobs)
        shaping = prob / (prob + opts.gamma)  # f(π), with π's gradient: no ratio, no clip, no weight
        per_token = torch.where(guide, -shaping * advantages, per_token)
    loss = (_zero_outside(per_token, full) * scale).sum()
    stats = PolicyStats(tokens=int(mask.sum()))
    if shaping is not None and bool(guide.any()):
        with torch.no_grad():
            f = shaping[guide]
            stats.guided_tokens, stats.shaping_sum = int(f.numel()), float(f.sum())
            stats.shaping_min, stats.shaping_max = float(f.min()), float(f.max())
    if stats.tokens:
        with torch.no_grad():
            r, a = ratio[mask], advantages[mask]
            stats.ratio_sum = float(r.sum())
            if opts.name in ("ppo_clip", "gspo", "cispo") and (low is not None or high is not None):
                below = r < low if low is not None else torch.zeros_like(r, dtype=torch.bool)
                above = r > high if high is not None else torch.zeros_like(r, dtype=torch.bool)
                stats.clipped = int((below | above).sum())
                if opts.name == "cispo":  # the weight truncated, whatever A's sign (no lower bound)
                    stats.clipped = stats.clipped_high = int(above.sum())
                else:  # where the clip binds: the token's gradient is 0 (TRL's clip_ratio/low, /high)
                    stats.clipped_low = int((below & (a < 0)).sum())
                    stats.clipped_high = int((above & (a > 0)).sum())
            if weight is not None:
                raw_r = raw[mask]
                stats.is_tokens, stats.is_sum = int(raw_r.numel()), float(raw_r.sum())
                stats.is_max, stats.is_cut = float(raw_r.max()), int(cut[mask].sum())
            if opts.sequence:
                rows = mask.any(-1)
                seq = ratio[:, 0][rows]
                stats.sequences, stats.seq_ratio_sum = int(seq.numel()), float(seq.sum())
                stats.seq_ratio_min, stats.seq_ratio_max = float(seq.min()), float(seq.max())
    return loss, stats
