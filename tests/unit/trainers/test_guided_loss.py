"""Guided tokens (`EchoRow.guided`, `[guidance] mode`): in a real trainer step on a random Qwen3, a guided
token's loss and gradient are LUFFY's policy shaping -A f(π), f(p) = p / (p + γ), π from the same forward,
with no ratio and no clip, while the sampled tokens beside it keep the ratio's loss; a reference written here
from the formula, in fp32 loops (1e-6)."""
from dataclasses import replace

import pytest
import torch
from fixtures.small_model import V, make_spec

from benchmarks.smoke import sparse_row
from quaero.rows import EchoRow, RowError, Span
from trainers import step
from trainers.local import LocalTrainer
from trainers.policy_losses import LOSSES, Behaviour, policy_loss

GAMMA = 0.25  # not the default: the test would pass with a hard-coded 0.1 otherwise
ATOL = 1e-6


def _rows(trainer):
    """A guided row (the oracle's: its action tokens' sampler log-probs 0, every one marked guided) and a
    sampled row whose sampler log-probs are the trainer's own (ratio 1, inside the clip)."""
    guided = sparse_row(0, 1.5, vocab=V, context=40)
    guided = replace(guided, sampler_logprobs=[0.0] * len(guided)).as_guided()
    sampled = sparse_row(1, -0.75, vocab=V, context=40)
    own = trainer.logprobs([sampled])[0]
    sampled = replace(sampled, sampler_logprobs=[lp if a else 0.0 for lp, a in zip(own, sampled.action_mask)])
    return [guided, sampled]


def _reference(model, rows):
    """sum over every RL target of (1 / the step's RL targets) x its loss: -A π / (π + γ) on a guided token,
    -A exp(lp - lp_sampler) on a sampled one; with its gradient, and f(π) of every guided token."""
    targets = sum(sum(1 for a in r.advantages if a != 0.0) for r in rows)
    total, shaping = torch.zeros(()), []
    for r in rows:
        ids = torch.tensor([r.input_ids])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        for i in range(1, len(r)):
            a = r.advantages[i]
            if a == 0.0:
                continue
            lp = logp[i - 1, r.input_ids[i]]
            if r.guided_mask[i]:
                p = torch.exp(lp)
                f = p / (p + GAMMA)
                shaping.append(float(f.detach()))
                term = -a * f
            else:
                term = -a * torch.exp(lp - r.sampler_logprobs[i])
            total = total + term / targets
    total.backward()
    return float(total.detach()), shaping


def _step_equals_the_formula(b, rows, monkeypatch):
    """One real train step on `rows`: its loss and every parameter's accumulated gradient (before clipping
    and the optimizer step) equal `_reference`'s, the formula written out; (the step's metrics, the guided
    tokens' shaping weights)."""
    b.model.zero_grad(set_to_none=True)
    want, shaping = _reference(b.model, rows)
    want_grads = {n: p.grad.clone() for n, p in b.model.named_parameters() if p.grad is not None}
    b.model.zero_grad(set_to_none=True)
    seen = {}
    real = step.optimizer_step

    def spy(trainer):
        seen.update({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return real(trainer)

    monkeypatch.setattr(step, "optimizer_step", spy)
    m = b.train_step(rows)
    assert m["rl_loss"] == pytest.approx(want, abs=ATOL)
    assert set(seen) == set(want_grads)
    for n, g in want_grads.items():
        torch.testing.assert_close(seen[n], g, atol=ATOL, rtol=0, msg=n)
    return m, shaping


def test_a_guided_tokens_loss_and_gradient_are_policy_shaping_in_a_real_step(small_model_dir, monkeypatch):
    b = LocalTrainer(make_spec(small_model_dir, echo_weight=0.0, guidance_gamma=GAMMA), "cpu")
    rows = _rows(b)
    m, shaping = _step_equals_the_formula(b, rows, monkeypatch)
    assert m["guided_action_tokens"] == 14 and m["onpolicy_action_tokens"] == 14 and m["action_tokens"] == 28
    assert m["guidance_shaping_mean"] == pytest.approx(sum(shaping) / len(shaping), abs=ATOL)
    assert m["guidance_shaping_min"] == pytest.approx(min(shaping), abs=ATOL)
    assert m["guidance_shaping_max"] == pytest.approx(max(shaping), abs=ATOL)
    # the ratio's figures are the sampled tokens' only (ratio 1 there; the guided ones have none)
    assert m["importance_ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m["clip_fraction"] == 0.0
    assert m["sampler_logprob_gap_max"] < 1e-5  # the guided tokens' missing log-probs are no gap


def _prefix_row(trainer):
    """A `prefix` member's row: its first action (8 tokens) a guide's (log-prob 0, marked guided), its second
    (6 tokens) the policy's continuation, sampled (the trainer's own log-probs: ratio 1)."""
    row = sparse_row(2, 0.8, vocab=V, context=40)
    first = next(s for s in row.spans if s.kind == "action")
    guided = [first.start <= i < first.end for i in range(len(row))]
    own = trainer.logprobs([row])[0]
    lps = [0.0 if g else (lp if a else 0.0) for lp, a, g in zip(own, row.action_mask, guided)]
    return replace(row, sampler_logprobs=lps, guided=guided)


def test_a_prefix_rows_guide_tokens_get_the_shaping_loss_and_its_continuation_the_policy_loss(
        small_model_dir, monkeypatch):
    b = LocalTrainer(make_spec(small_model_dir, echo_weight=0.0, guidance_gamma=GAMMA), "cpu")
    rows = [_prefix_row(b)]
    assert sum(rows[0].guided) == 8 and rows[0].num_action_tokens == 14
    m, shaping = _step_equals_the_formula(b, rows, monkeypatch)
    assert m["guided_action_tokens"] == 8 and m["onpolicy_action_tokens"] == 6 and len(shaping) == 8
    assert m["guidance_shaping_mean"] == pytest.approx(sum(shaping) / 8, abs=ATOL)
    assert m["importance_ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m["clip_fraction"] == 0.0


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo", "sapo"])
def test_guided_tokens_are_shaped_whatever_the_variant_and_never_clipped(name):
    """A guided token far off the ratio's clip range (its sampler log-prob 0: r = π) trains -A f(π) under
    every variant, with a sampler correction too; the sampled tokens' loss is the variant's own."""
    g = torch.Generator().manual_seed(3)
    lp = (-torch.rand(2, 6, generator=g) * 4 - 0.05).requires_grad_(True)
    mask = torch.ones(2, 6, dtype=torch.bool)
    guided = torch.zeros(2, 6, dtype=torch.bool)
    guided[0] = True
    adv = torch.tensor([[2.0] * 6, [-1.0] * 6])
    sampler = torch.where(guided, torch.zeros(2, 6), lp.detach())
    scale = torch.full((2, 1), 1 / 12)
    opts, behaviour = LOSSES[name](), Behaviour("token_truncate", gamma=GAMMA)
    loss, stats = policy_loss(lp, sampler, adv, mask, scale, opts, behaviour, guided=guided)
    alone, _ = policy_loss(lp, sampler, adv, mask & ~guided, scale, opts, behaviour)
    p = torch.exp(lp[0].detach())
    shaped = float((-2.0 * p / (p + GAMMA)).sum() / 12)
    assert float(loss.detach()) == pytest.approx(float(alone.detach()) + shaped, abs=ATOL)
    assert stats.tokens == 6 and stats.guided_tokens == 6 and stats.clipped == 0
    loss.backward()
    torch.testing.assert_close(lp.grad[0], -2.0 * GAMMA * p / (p + GAMMA) ** 2 / 12, atol=ATOL, rtol=0)


def test_a_guided_flag_outside_the_action_tokens_is_refused():
    ids = list(range(6))
    spans = [Span("prompt", 0, 3), Span("action", 3, 5), Span("env", 5, 6)]
    zeros = [0.0] * 6
    EchoRow(ids, spans, zeros, zeros, zeros, guided=[False] * 3 + [True] * 2 + [False])
    with pytest.raises(RowError, match="guided on a prompt token"):
        EchoRow(ids, spans, zeros, zeros, zeros, guided=[False, False, True, True, True, False])
    with pytest.raises(RowError, match="guided has 2 entries"):
        EchoRow(ids, spans, zeros, zeros, zeros, guided=[True, True])
    row = EchoRow(ids, spans, zeros, zeros, zeros).as_guided()
    assert EchoRow.from_dict(row.to_dict()).guided == row.guided == row.action_mask
