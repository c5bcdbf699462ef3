"""The KL penalty against a frozen reference model (`[loss] beta` > 0, `kl_estimator`): the reference,
its log-probs, and the penalty's per-token estimators.

The reference is the policy's weights at the first RL step (after a warm start, the warm start's weights),
taken once by `Trainer.take_reference` and frozen. Full fine-tuning keeps a copy of the model (the memory plan
counts it: quaero/preflight/memory_plan.py); its weights go into every checkpoint, so a resume restores the
reference the run started RL with rather than re-deriving it from weights that have moved since. A LoRA run's
reference is the base model: the policy's own model with its adapter disabled (no second copy; the base never
trains, so nothing needs saving).

The reference's log-probs are computed once per rollout batch (trainers/mini_steps.py), before its first
optimizer step, in no_grad and eval mode, on the selective path (trainers/step.py `MicrobatchForward` over the
reference's parts) at the KL term's targets only: every sampled action token of an RL step (TRL's completion
mask; guided tokens were not sampled from π and get none), at the step's temperature.

Per target token, with d = lp - lp_ref (log π - log π_ref; Schulman, "Approximating KL divergence", 2020):
- k1: d (unbiased, can go negative; its gradient is ∇lp, zero in expectation on-policy)
- k2: d^2 / 2 (low variance, biased; its gradient is d ∇lp, the reverse KL's on-policy)
- k3: exp(-d) + d - 1 (unbiased, always >= 0; TRL's and DeepSeekMath's GRPO estimator)
The term's loss is β times the estimate, averaged over its targets with the RL term's `loss_aggregation` (its
own denominator: trainers/aggregation.py). With every sampled token an RL target (non-zero advantage) the RL
term plus this one is TRL's `per_token_loss + beta * per_token_kl` under the same aggregation.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from quaero.rows import EchoRow
from trainers.batch import build_microbatches
from trainers.forward import CausalLMParts, causal_lm_of
from trainers.spec import TrainerSpec
from trainers.tree import choose_tree, planner_cost


def kl_targets(row: EchoRow) -> list[float]:
    """The KL term's targets in `row` (weight 1): its sampled action tokens, guided ones excluded."""
    return [1.0 if a and not g else 0.0 for a, g in zip(row.action_mask, row.guided_mask)]


def per_token_kl(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:  # each [B, L-1] fp32
    """The estimate of KL(π || π_ref) at every token (the module docstring has each formula)."""
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(-d) + d - 1.0
    raise ValueError(f"kl_estimator={estimator!r}: use 'k1', 'k2' or 'k3'")


@dataclass
class KLStats:
    """The per-token KL estimate over the KL term's targets: their count, sum and maximum."""

    tokens: int = 0
    total: float = 0.0
    max: float = -float("inf")

    def add(self, other: KLStats) -> None:
        self.tokens += other.tokens
        self.total += other.total
        self.max = max(self.max, other.max)


def kl_penalty(
    logprobs: Tensor,  # [B, L-1] fp32, the policy's (with grad)
    ref_logprobs: Tensor,  # [B, L-1] fp32, the reference's (no grad)
    mask: Tensor,  # [B, L-1] bool, the KL term's targets
    scale: Tensor,  # [B, 1] fp32, each row's token factor (its step-wide denominator included)
    beta: float,
    estimator: str,
) -> tuple[Tensor, KLStats]:
    """β x sum over `mask` of scale x the per-token KL estimate, and its statistics."""
    kl = per_token_kl(logprobs, ref_logprobs.detach(), estimator)
    kl = torch.where(mask, kl, torch.zeros_like(kl))
    loss = beta * (kl * scale).sum()
    stats = KLStats()
    if bool(mask.any()):
        with torch.no_grad():
            picked = kl[mask]
            stats = KLStats(int(picked.numel()), float(picked.sum()), float(picked.max()))
    return loss, stats


class Reference:
    """The frozen reference's forward: `parts` (a copy's, or the policy's own under `adapter_off`) and the
    selective log-prob forward over them (`forward`: trainers/step.py `MicrobatchForward`)."""

    def __init__(self, parts: CausalLMParts, forward: Callable[..., Any],
                 adapter_off: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        self.parts, self.forward, self.adapter_off = parts, forward, adapter_off
        self.packed_batches = 0

    @property
    def is_base(self) -> bool:
        """The LoRA base (the policy's own model, adapter disabled) rather than a copy."""
        return self.adapter_off is not None

    @staticmethod
    def frozen_copy(model: nn.Module) -> nn.Module:
        """A copy of the causal LM's current weights that never trains."""
        ref = copy.deepcopy(causal_lm_of(model))
        ref.requires_grad_(False)
        return ref.eval()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of it: the copy's weights, or only that it is the LoRA base."""
        if self.is_base:
            return {"kind": "lora_base"}
        return {"kind": "copy", "model": {k: v.detach().cpu().clone()
                                          for k, v in self.parts.model.state_dict().items()}}

    @torch.no_grad()
    def logprobs(self, spec: TrainerSpec, rows: list[EchoRow], temperature: float, device: torch.device,
                 *, blocker: str = "") -> list[list[float]]:
        """Per row, per token (EchoRow convention), the reference's log-prob at every KL target, 0.0
        elsewhere: one no-grad forward per microbatch, on the selective path at those targets only, over the
        microbatch's trie where `train_tree_packing` packs the policy's (trainers/tree.py; `blocker`: why this
        trainer cannot pack at all). `packed_batches`: how many microbatches the last call packed."""
        model = self.parts.model
        was_training = model.training
        model.eval()
        out = [[0.0] * len(r) for r in rows]
        self.packed_batches = 0
        try:
            mbs, _ = build_microbatches(rows, micro_batch_tokens=spec.micro_batch_tokens,
                                        weights={"kl": [kl_targets(r) for r in rows]}, device=device,
                                        by_prefix=spec.tree_packing != "off",
                                        trie_cost=planner_cost(spec.tree_packing, self.parts,
                                                               max((len(r) for r in rows), default=0),
                                                               blocker=blocker))
            with self.adapter_off() if self.adapter_off else contextlib.nullcontext():
                for mb in mbs:
                    if not mb.trains:
                        continue
                    tree, _ = choose_tree(spec.tree_packing, self.parts, mb.input_ids, mb.attention_mask,
                                          blocker=blocker)
                    self.packed_batches += tree is not None
                    lp, _ = self.forward(mb.input_ids, mb.attention_mask, mb.target_mask, temperature, tree)
                    for b, i in enumerate(mb.row_index):
                        out[i] = [0.0] + lp[b, :len(rows[i]) - 1].float().tolist()
        finally:
            model.train(was_training)
            self.parts.counter.take()  # the reference's forwards are no step's shared forward
        return out
