"""The policy-loss family (trainers/policy_losses.py): each variant's loss AND gradient equal a reference
written here from its paper's formula, token by token in plain loops (fp32, atol 1e-6); the default equals the
loss quaero trained before the family, bit for bit; the statistics count what the formulas say."""
import math

import pytest
import torch

from trainers.policy_losses import CISPO, GSPO, SAPO, Behaviour, PPOClip, policy_loss

B, L = 4, 9
ATOL = 1e-6


def _inputs(seed=0, spread=0.6):
    """Trainer and sampler log-probs that differ by up to `spread` nats (ratios well outside any clip range),
    a ragged target mask with token 0 never a target, one advantage per row (both signs), a token-mean
    scale."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, L, generator=g) * 3 - 0.05
    sampler = lp + (torch.rand(B, L, generator=g) * 2 - 1) * spread
    sampler = torch.clamp(sampler, max=-1e-3)
    lengths = [L, L - 3, 5, 2]
    mask = torch.zeros(B, L, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, 1:n] = True
    row_adv = torch.tensor([1.5, -0.75, 0.5, -2.0])
    adv = torch.where(mask, row_adv[:, None].expand(B, L), torch.zeros(B, L))
    scale = torch.full((B, 1), 1.0 / int(mask.sum()))
    return lp, sampler, adv, mask, scale


def _ours(opts, seed=0, spread=0.6, behaviour=None):
    lp, sampler, adv, mask, scale = _inputs(seed, spread)
    lp = lp.clone().requires_grad_(True)
    loss, stats = policy_loss(lp, sampler, adv, mask, scale, opts, behaviour or Behaviour())
    loss.backward()
    return loss.detach(), lp.grad, stats


def _reference(per_token, seed=0, spread=0.6, sequence=False, correction=None, cap=3.0):
    """sum over targets of scale x per_token(lp_t, lp_old_t, A_t, seq), in loops; lp_old is the sampler's,
    or the trainer's own before the step (sg(lp)) under a correction, whose weight multiplies each token."""
    lp, sampler, adv, mask, scale = _inputs(seed, spread)
    lp = lp.clone().requires_grad_(True)
    total = torch.zeros(())
    for b in range(B):
        targets = [t for t in range(L) if mask[b, t]]
        old = [(lp[b, t].detach() if correction else sampler[b, t]) for t in range(L)]
        seq = torch.exp(sum(lp[b, t] - old[t] for t in targets) / len(targets)) if sequence else None
        seq_w = math.exp(sum(float(lp[b, t]) - float(sampler[b, t]) for t in targets))
        for t in targets:
            term = per_token(lp[b, t], old[t], float(adv[b, t]), seq)
            if correction:
                w = seq_w if correction.startswith("sequence") else math.exp(float(lp[b, t]) -
                                                                              float(sampler[b, t]))
                w = min(w, cap) if correction.endswith("truncate") else (0.0 if w > cap else w)
                term = term * w
            total = total + float(scale[b, 0]) * term
    total.backward()
    return total.detach(), lp.grad


def _ppo(lo, hi):
    def per_token(lp, old, a, seq):  # PPO: -min(r A, clip(r, 1 - εl, 1 + εh) A)
        r = torch.exp(lp - old) if seq is None else seq
        return -torch.minimum(r * a, torch.clamp(r, 1 - lo, 1 + hi) * a)
    return per_token


def _cispo(hi):
    def per_token(lp, old, a, seq):  # MiniMax-M1: -sg(min(r, 1 + εh)) A log π
        r = torch.exp(lp - old) if seq is None else seq
        return -torch.clamp(r, max=1 + hi).detach() * a * lp
    return per_token


def _sapo(tau_pos, tau_neg):
    def per_token(lp, old, a, seq):  # SAPO: -(4 / τ) σ(τ (r - 1)) A
        r = torch.exp(lp - old) if seq is None else seq
        tau = tau_pos if a > 0 else tau_neg
        return -(4.0 / tau) * torch.sigmoid(tau * (r - 1)) * a
    return per_token


def _assert_same(ours, ref):
    (loss, grad, _), (ref_loss, ref_grad) = ours, ref
    assert torch.allclose(loss, ref_loss, atol=ATOL, rtol=0), (loss, ref_loss)
    assert torch.allclose(grad, ref_grad, atol=ATOL, rtol=0), (grad - ref_grad).abs().max()
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("lo,hi", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])
def test_ppo_clip_with_separate_epsilons_equals_its_formula(lo, hi):
    _assert_same(_ours(PPOClip(lo, hi)), _reference(_ppo(lo, hi)))


def test_gspo_equals_the_clipped_length_normalised_sequence_ratio():
    lo, hi = 3e-4, 4e-4  # the GSPO paper's
    ours = _ours(GSPO(lo, hi), spread=1e-3)
    _assert_same(ours, _reference(_ppo(lo, hi), spread=1e-3, sequence=True))
    assert ours[2].sequences == B and ours[2].clipped > 0  # some rows clipped, some not
    assert ours[2].clipped < ours[2].tokens


def test_cispo_equals_its_clipped_stop_gradient_weight_on_every_token():
    ours = _ours(CISPO(0.28))
    _assert_same(ours, _reference(_cispo(0.28)))
    lp, sampler, _, mask, _ = _inputs()
    r = torch.exp(lp - sampler)[mask]
    assert ours[2].clipped_high == int((r > 1.28).sum()) > 0  # truncated weights, still with a gradient
    assert (ours[1][mask] != 0).all()  # no token's gradient is dropped


def test_sapo_equals_its_soft_gate():
    ours = _ours(SAPO(1.0, 1.05))
    _assert_same(ours, _reference(_sapo(1.0, 1.05)))


@pytest.mark.parametrize("variant,per_token", [(PPOClip(0.2, 0.28, "sequence"), _ppo(0.2, 0.28)),
                                               (CISPO(0.28, "sequence"), _cispo(0.28)),
                                               (SAPO(1.0, 1.05, "sequence"), _sapo(1.0, 1.05))])
def test_sequence_level_applies_to_every_variant(variant, per_token):
    _assert_same(_ours(variant, spread=0.05),
                 _reference(per_token, spread=0.05, sequence=True))


@pytest.mark.parametrize("correction", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("variant,per_token", [(PPOClip(0.2, 0.28), _ppo(0.2, 0.28)),
                                               (CISPO(0.28), _cispo(0.28)),
                                               (SAPO(1.0, 1.05), _sapo(1.0, 1.05))])
def test_sampler_correction_weights_each_variant(correction, variant, per_token):
    cap = 1.2  # some tokens and one row (weight 1.75) past it
    ours = _ours(variant, spread=0.3, behaviour=Behaviour(correction, cap))
    _assert_same(ours, _reference(per_token, spread=0.3, correction=correction, cap=cap))
    stats = ours[2]
    assert stats.is_tokens == stats.tokens and 0 < stats.is_cut < stats.tokens  # some past the cap, not all
    lp, sampler, _, mask, _ = _inputs(spread=0.3)
    if correction.startswith("token"):
        raw = torch.exp(lp - sampler)[mask]
        assert stats.is_cut == int((raw > cap).sum()) and math.isclose(stats.is_max, float(raw.max()),
                                                                          rel_tol=1e-6)


def _today(logprobs, sampler_logprobs, advantages, mask, scale, clip_eps):
    """quaero's RL loss before the family (trainers/loss.py `policy_gradient_loss`), verbatim."""
    log_ratio = torch.where(mask, logprobs - sampler_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    per_token = -ratio * advantages
    if clip_eps is not None:
        clipped = -torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
        per_token = torch.maximum(per_token, clipped)
    loss = (torch.where(mask, per_token, torch.zeros_like(per_token)) * scale).sum()
    r = ratio[mask].detach()
    clipped_n = int(((r < 1.0 - clip_eps) | (r > 1.0 + clip_eps)).sum()) if clip_eps is not None else 0
    return loss, float(r.sum()), clipped_n


@pytest.mark.parametrize("clip_eps", [0.2, 0.1, None])
def test_the_default_is_todays_loss_bit_for_bit(clip_eps):
    from trainers.spec import TrainerSpec

    opts = TrainerSpec(policy_loss=PPOClip(clip_eps, clip_eps)).policy_loss
    assert TrainerSpec().policy_loss == PPOClip(0.2, 0.2)
    lp, sampler, adv, mask, scale = _inputs()
    a, b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    loss, stats = policy_loss(a, sampler, adv, mask, scale, opts)
    old, ratio_sum, clipped = _today(b, sampler, adv, mask, scale, clip_eps)
    loss.backward()
    old.backward()
    assert torch.equal(loss, old) and torch.equal(a.grad, b.grad)
    assert stats.ratio_sum == ratio_sum and stats.clipped == clipped
    assert (stats.is_tokens, stats.sequences) == (0, 0)


def test_clip_fractions_count_where_the_clip_binds():
    """One row of four tokens by hand: ratios e^0.5, e^-0.5 with A > 0, then with A < 0."""
    lp = torch.tensor([[0.0, -1.0, -1.0, -1.0, -1.0]], requires_grad=True)
    sampler = torch.tensor([[0.0, -1.5, -0.5, -1.5, -0.5]])
    adv = torch.tensor([[0.0, 1.0, 1.0, -1.0, -1.0]])
    mask = adv != 0
    _, stats = policy_loss(lp, sampler, adv, mask, torch.ones(1, 1), PPOClip(0.2, 0.28))
    # r = 1.65 (A>0: binds high), 0.61 (A>0: outside, not binding), 1.65 (A<0: not binding), 0.61 (A<0: low)
    assert (stats.tokens, stats.clipped, stats.clipped_high, stats.clipped_low) == (4, 4, 1, 1)


def _reference_step_loss(rows, lps, variant, lo, hi, sequence):
    """A step's RL loss by hand from the rows and the trainer's log-probs (token_mean: / all RL tokens)."""
    per_token = {"ppo_clip": _ppo(lo, hi), "gspo": _ppo(lo, hi), "cispo": _cispo(hi),
                 "sapo": _sapo(1.0, 1.05)}[variant]
    terms, n = [], 0
    for row, lp in zip(rows, lps):
        targets = [t for t in range(1, len(row)) if row.advantages[t] != 0.0]
        n += len(targets)
        lp_t = {t: torch.tensor(lp[t]) for t in targets}
        seq = torch.exp(sum(lp_t[t] - row.sampler_logprobs[t] for t in targets) / len(targets)) \
            if sequence else None
        terms += [per_token(lp_t[t], torch.tensor(row.sampler_logprobs[t]), row.advantages[t], seq)
                  for t in targets]
    return float(sum(terms)) / n


@pytest.mark.parametrize("settings", [
    {"policy_loss": CISPO(clip_eps_high=4.0)},
    {"policy_loss": GSPO(clip_eps_low=3e-4, clip_eps_high=4e-4)},
    {"policy_loss": SAPO(importance_sampling_level="sequence")},
    {"policy_loss": PPOClip(clip_eps_high=0.28), "sampler_correction": "token_truncate"},
])
def test_a_trainer_step_trains_the_chosen_loss_and_reports_it(small_model_dir, settings):
    """The real step (tiny model, selective path, ECHO on): its rl_loss is the formula's on the trainer's own
    log-probs of the rows, and the variant's metrics are there."""
    from fixtures.small_model import V, make_spec

    from benchmarks.smoke import sparse_rows
    from trainers.local import LocalTrainer

    rows = sparse_rows(4, vocab=V, context=40)
    trainer = LocalTrainer(make_spec(small_model_dir, **settings), "cpu")
    lps = trainer.logprobs(rows)
    m = trainer.train_step(rows)
    assert m["policy_loss"] == settings["policy_loss"].type and m["optimizer_stepped"]
    assert m["sampler_correction"] == settings.get("sampler_correction", "none")
    if "sampler_correction" in settings:  # r = 1 in value; the sampler's weight is what moves
        assert m["sampler_is_weight_mean"] is not None and m["sampler_is_cut_fraction"] is not None
        assert m["clip_fraction"] == 0.0
    else:
        loss = trainer.spec.policy_loss
        ref = _reference_step_loss(rows, lps, loss.type, getattr(loss, "clip_eps_low", None),
                                   getattr(loss, "clip_eps_high", None), loss.sequence)
        assert math.isclose(m["rl_loss"], ref, rel_tol=1e-5, abs_tol=1e-6), (m["rl_loss"], ref)
        assert m["sampler_is_weight_mean"] is None
    sequence = settings["policy_loss"].sequence
    assert (m["sequence_ratio_mean"] is not None) == sequence
    assert m["clip_low_fraction"] is not None and m["clip_high_fraction"] is not None


# ── extreme settings: refused at config load, or finite at the bounds (issue 44's hostile pass) ───────────

@pytest.mark.hostile
@pytest.mark.parametrize("key, value, says", [
    ("backend.lr", "1e308", "less than or equal to 1"),  # one AdamW step made every weight -inf
    ("training.warmup_sft_lr", "1e30", "less than or equal to 1"),
    ("loss.policy.temperature_pos", "1e-300", "greater than or equal to 0.000001"),  # a -inf loss
    ("loss.policy.temperature_neg", "1e308", "less than or equal to 1000000"),  # the step raised
    ("guidance.gamma", "1e-300", "greater than or equal to 0.000001"),
    ("sampler.temperature", "1e-300", "greater than or equal to 0.00001"),
    ("echo.weight", "1e308", "less than or equal to 1000000"),
    ("echo.rl_weight", "1e308", "less than or equal to 1000000"),
    ("loss.sampler_correction_cap", "1e308", "less than or equal to 1000000"),
    ("loss.policy.clip_eps_high", "1e308", "less than or equal to 1000000"),
    ("loss.policy.clip_eps_low", "nan", "finite number"),
])
def test_a_loss_setting_no_float32_step_survives_is_refused_at_load_naming_it(key, value, says):
    from quaero.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config("envs/toolbench.toml", [f"{key}={value}"]
                    + (["loss.policy.type='sapo'"] if "temperature" in key else []))
    section, name = key.rsplit(".", 1)
    assert f"[{section}] {name}=" in str(e.value) and says in str(e.value)


@pytest.mark.hostile
@pytest.mark.parametrize("tau", [1e-6, 1e6])
@pytest.mark.parametrize("gamma", [1e-6, 1e6])
def test_at_the_bounds_sapo_and_policy_shaping_give_a_finite_loss_and_gradient(tau, gamma):
    torch.manual_seed(0)
    lp = (torch.randn(2, 6) * 3 - 100).requires_grad_()  # probabilities that underflow float32
    sampler = lp.detach().clone()
    sampler[0, :3] += 5.0
    adv = torch.tensor([[1.0, -1, 1, 0, 1, -1], [-1, 1, 1, -1, 0.5, 1]])
    guided = torch.zeros(2, 6, dtype=torch.bool)
    guided[1, 3:] = True
    loss, _ = policy_loss(lp, sampler, adv, adv != 0, torch.ones(2, 1), SAPO(tau, tau),
                          Behaviour(gamma=gamma), guided=guided)
    loss.backward()
    assert math.isfinite(float(loss)) and torch.isfinite(lp.grad).all()
