"""A policy loss of your own, trained from TOML without editing quaero (docs/reference.md, "Your own policy
loss"): a frozen dataclass subclassing `PolicyLoss`, its fields its knobs (the TOML's `kwargs`), and
`token_loss`, each target token's loss. quaero computes lp_old (the sampler's log-probs, or the trainer's
own with a `sampler_correction`), the ratio, the guided tokens' shaping, each row's scale and the sum.

    [loss.policy]
    type = "custom"
    import_path = "my_loss:Reinforce"   # importable where quaero runs (PYTHONPATH, or an installed package)
    kwargs = { coef = 2.0 }
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from trainers.policy_losses import PolicyLoss


@dataclass(frozen=True)
class Reinforce(PolicyLoss):
    """REINFORCE without a ratio: -coef A lp per token (its gradient -coef A ∇lp: on-policy, the ratio 1,
    PPO-clip's gradient times coef; off-policy, no importance correction at all)."""

    coef: float = 1.0

    def token_loss(self, lp: Tensor, lp_old: Tensor, ratio: Tensor, advantages: Tensor, mask: Tensor
                   ) -> Tensor:  # [B, L-1]
        return -self.coef * advantages * lp

    def describe(self, r: str) -> str:  # `quaero check`'s loss line
        return f"-{self.coef:g} A log pi (REINFORCE, no ratio)"


def rank_baseline(rewards: list[float]) -> list[float]:
    """An advantage estimator of your own (`[rollout] advantage = "my_loss:rank_baseline"`): each member's
    rank among its group's rewards, centred (ties share their mean rank): a group's advantages from its
    rewards, before quaero's `scale_rewards` and `positive_advantage_weight`."""
    order = sorted(rewards)
    ranks = [(order.index(r) + len(order) - 1 - order[::-1].index(r)) / 2 for r in rewards]
    mean = sum(ranks) / len(ranks)
    return [r - mean for r in ranks]
