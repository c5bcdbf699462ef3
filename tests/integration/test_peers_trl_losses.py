"""The policy-loss family against TRL 1.16's own loss: `GRPOTrainer._compute_loss`, called on the same
log-probs, advantages and masks (its model forward replaced by those log-probs, its trainer state by the few
attributes the loss reads), gives the loss and the gradient quaero's trainers/policy_losses.py gives.

What is compared, TRL name -> quaero's:
- loss_type "dapo" / "bnpo" (a token mean) -> loss_aggregation "token_mean"; "grpo" (per sequence, then over
  sequences) -> "sequence_mean"; "dr_grpo" (/ B x max_completion_length) -> "constant" with that constant;
- epsilon / epsilon_high -> clip_eps_low / clip_eps_high; importance_sampling_level "sequence" -> GSPO;
- loss_type "cispo" (a token mean) with epsilon_high = 1 + clip_eps_high (TRL's CISPO cap is the ratio's bound
  itself, quaero's is 1 + clip_eps_high as in the MiniMax-M1 paper);
- loss_type "sapo" (TRL averages it per sequence) -> policy_loss "sapo" with "sequence_mean";
- vLLM importance-sampling correction: TRL computes its weight inside `_generate_and_score_completions` (no
  function of its own); the test hands `_compute_loss` that weight computed by TRL's formula (its lines
  2586-2630 at 1.16.0: exp of the masked difference, per token or summed per sequence, clamped or masked past
  the cap) and compares the weighted loss; quaero computes its weight itself.
The old log-probs TRL reads are quaero's sampler log-probs (no correction), or none (TRL then uses the
detached current log-probs, as quaero does under a correction).
- beta with the reference's log-probs (TRL's k3 KL, added per token before its aggregation) -> `[loss]
  beta` with kl_estimator "k3": trainers/reference.py `kl_penalty` over the same targets with the RL term's
  scales."""
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from trainers import aggregation
from trainers.policy_losses import CISPO, GSPO, LOSSES, SAPO, Behaviour, PPOClip, policy_loss
from trainers.reference import kl_penalty

pytestmark = [pytest.mark.peers]
trl = pytest.importorskip("trl", minversion="1.16.0", reason='needs TRL >= 1.16; pip install -e ".[peers]"')

B, T = 4, 10
MAX_COMPLETION = 16


def _inputs(spread=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3 - 0.05
    sampler = torch.clamp(lp + (torch.rand(B, T, generator=g) * 2 - 1) * spread, max=-1e-3)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate([T, 7, 3, 5]):
        mask[b, :n] = True
    adv = torch.tensor([1.5, -0.75, 0.5, -2.0])
    return lp, sampler, adv, mask


def _trl(lp, old, adv, mask, *, loss_type, eps_low, eps_high, level="token", is_ratio=None, beta=0.0,
         ref=None):
    from trl.trainer.grpo_trainer import GRPOTrainer

    lp = lp.clone().requires_grad_(True)
    accelerator = SimpleNamespace(num_processes=1, sync_gradients=True, gather=lambda x: x,
                                  gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x)
    args = SimpleNamespace(delta=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                           use_bias_correction_kl=False, steps_per_generation=1)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=eps_low,
        epsilon_high=eps_high, args=args, use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=accelerator, max_completion_length=MAX_COMPLETION,
        _metrics=defaultdict(lambda: defaultdict(list)), _entropy_bonus_enabled=False)
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long),
              "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "num_items_in_batch": mask.sum()}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.detach(), lp.grad


def _quaero(lp, sampler, adv, mask, opts, aggregation_name, beta=0.0, ref=None, behaviour=None):
    lp = lp.clone().requires_grad_(True)
    rows = [SimpleNamespace(meta={"episode": b}) for b in range(B)]
    scales = aggregation.rl_scales(rows, mask.sum(-1).tolist(), sft=False, aggregation=aggregation_name,
                                   constant=B * MAX_COMPLETION)
    loss, _ = policy_loss(lp, sampler, adv[:, None].expand(B, T) * mask, mask,
                          torch.tensor(scales)[:, None], opts, behaviour or Behaviour())
    if ref is not None:  # the KL term's targets are the same tokens here: its own scales are the RL term's
        loss = loss + kl_penalty(lp, ref, mask, torch.tensor(scales)[:, None], beta, "k3")[0]
    loss.backward()
    return loss.detach(), lp.grad


def _same(a, b):
    assert torch.allclose(a[0], b[0], atol=1e-6, rtol=0), (a[0], b[0])
    assert torch.allclose(a[1], b[1], atol=1e-6, rtol=0), (a[1] - b[1]).abs().max()


@pytest.mark.parametrize("loss_type,agg", [("dapo", "token_mean"), ("bnpo", "token_mean"),
                                           ("grpo", "sequence_mean"), ("dr_grpo", "constant")])
@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_clip_and_dapo_clip_higher_equal_trls(loss_type, agg, eps_low, eps_high):
    lp, sampler, adv, mask = _inputs()
    _same(_quaero(lp, sampler, adv, mask, PPOClip(eps_low, eps_high), agg),
          _trl(lp, sampler, adv, mask, loss_type=loss_type, eps_low=eps_low, eps_high=eps_high))


@pytest.mark.parametrize("loss_type,agg", [("dapo", "token_mean"), ("grpo", "sequence_mean")])
def test_gspo_equals_trls_sequence_level(loss_type, agg):
    lp, sampler, adv, mask = _inputs(spread=2e-3)
    _same(_quaero(lp, sampler, adv, mask, GSPO(3e-4, 4e-4), agg),
          _trl(lp, sampler, adv, mask, loss_type=loss_type, eps_low=3e-4, eps_high=4e-4, level="sequence"))


def test_cispo_equals_trls():
    lp, sampler, adv, mask = _inputs()
    _same(_quaero(lp, sampler, adv, mask, CISPO(0.28), "token_mean"),
          _trl(lp, sampler, adv, mask, loss_type="cispo", eps_low=0.2, eps_high=1.28))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sapo_equals_trls(level):
    lp, sampler, adv, mask = _inputs(spread=0.2)
    _same(_quaero(lp, sampler, adv, mask, SAPO(importance_sampling_level=level), "sequence_mean"),
          _trl(lp, sampler, adv, mask, loss_type="sapo", eps_low=0.2, eps_high=0.2, level=level))


def _trl_is_weight(old, sampler, mask, mode, cap):
    """TRL 1.16's vLLM importance-sampling weight (grpo_trainer.py `_generate_and_score_completions`)."""
    diff = (old - sampler) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, max=cap)
    return ratio.masked_fill(ratio > cap, 0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("variant,loss_type,eps_high", [("ppo_clip", "dapo", 0.28), ("cispo", "cispo", 1.28)])
def test_sampler_correction_equals_trls_vllm_importance_sampling(mode, variant, loss_type, eps_high):
    lp, sampler, adv, mask = _inputs(spread=0.3)
    cap = 1.2
    weight = _trl_is_weight(lp, sampler, mask, mode, cap)
    opts = PPOClip(0.2, 0.28) if variant == "ppo_clip" else LOSSES[variant](0.28)
    _same(_quaero(lp, sampler, adv, mask, opts, "token_mean", behaviour=Behaviour(mode, cap)),
          _trl(lp, None, adv, mask, loss_type=loss_type, eps_low=0.2, eps_high=eps_high, is_ratio=weight))


@pytest.mark.parametrize("loss_type,agg", [("dapo", "token_mean"), ("grpo", "sequence_mean"),
                                           ("dr_grpo", "constant")])
def test_the_kl_penalty_equals_trls_beta(loss_type, agg):
    lp, sampler, adv, mask = _inputs()
    ref = lp + (torch.rand(B, T, generator=torch.Generator().manual_seed(7)) * 2 - 1) * 0.4
    _same(_quaero(lp, sampler, adv, mask, PPOClip(0.2, 0.28), agg, beta=0.04, ref=ref),
          _trl(lp, sampler, adv, mask, loss_type=loss_type, eps_low=0.2, eps_high=0.28, beta=0.04, ref=ref))
