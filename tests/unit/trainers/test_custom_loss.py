"""A policy loss of the user's own (`[loss.policy] type = "custom"`, trainers/policy_losses.py `PolicyLoss`):
examples/custom_loss's module, named in its TOML, trains a real step of the tiny model through the real
trainer; its loss is its own formula on the trainer's log-probs, and its gradient is coef times PPO-clip's
where the ratio is 1. Bad custom settings fail at config load in one line."""
import math
from dataclasses import replace
from pathlib import Path

import pytest
from fixtures.small_model import V, make_spec

from quaero.config import ConfigError, load_config
from quaero.preflight.plan import trainer_spec
from trainers.policy_losses import PPOClip

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "custom_loss"
TOML = EXAMPLE / "train.toml"


@pytest.fixture
def my_loss(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))  # what the example's PYTHONPATH gives a user
    return TOML


def _on_policy_rows(trainer):
    """Rows whose sampler log-probs are the trainer's own: every ratio is 1."""
    from benchmarks.smoke import sparse_rows

    rows = sparse_rows(4, vocab=V, context=40)
    lps = trainer.logprobs(rows)
    return [replace(r, sampler_logprobs=[lp if a else 0.0 for lp, a in zip(own, r.action_mask)])
            for r, own in zip(rows, lps)], lps


def test_a_users_loss_named_in_toml_trains_a_real_step_with_its_own_formula(my_loss, small_model_dir):
    from trainers.local import LocalTrainer

    loss = trainer_spec(load_config(my_loss)).policy_loss
    assert (type(loss).__qualname__, loss.coef, loss.name) == ("Reinforce", 2.0, "my_loss:Reinforce")
    figures = {}
    for name, policy in (("mine", loss), ("ppo", PPOClip())):
        trainer = LocalTrainer(make_spec(small_model_dir, policy_loss=policy, echo=False), "cpu")
        rows, lps = _on_policy_rows(trainer)
        figures[name] = m = trainer.train_step(rows)
        assert m["optimizer_stepped"]
        targets = [(r.advantages[t], lp[t]) for r, lp in zip(rows, lps) for t in range(1, len(r))
                   if r.advantages[t] != 0.0]
        per_token = [-2.0 * a * lp if name == "mine" else -a for a, lp in targets]
        figures[name]["formula"] = sum(per_token) / len(per_token)
    mine, ppo = figures["mine"], figures["ppo"]
    assert mine["policy_loss"] == "my_loss:Reinforce" and ppo["policy_loss"] == "ppo_clip"
    # its loss is -coef A lp (token mean), not PPO's -r A (r = 1: the mean of -A)
    for m in (mine, ppo):
        assert math.isclose(m["rl_loss"], m["formula"], rel_tol=1e-5, abs_tol=1e-6)
    assert abs(mine["rl_loss"] - ppo["rl_loss"]) > 0.01
    # at r = 1 PPO's gradient is -A ∇lp: the user's is coef (2) times it, through the same step
    assert mine["grad_norm"] == pytest.approx(2.0 * ppo["grad_norm"], rel=1e-4)


def test_the_check_line_names_the_users_loss(my_loss):
    from quaero.preflight.check import policy_loss_line

    assert policy_loss_line(load_config(my_loss)).startswith(
        "loss        my_loss:Reinforce -2 A log pi (REINFORCE, no ratio)")


@pytest.mark.parametrize("settings, says", [
    (["loss.policy.import_path='my_loss'"], "expected 'package.module:Name'"),
    (["loss.policy.import_path='no_such_module:X'"], "cannot import module 'no_such_module'"),
    (["loss.policy.import_path='my_loss:Missing'"], "module 'my_loss' has no attribute 'Missing'"),
    (["loss.policy.import_path='my_loss:dataclass'"], "'dataclass' is a function, not a PolicyLoss subclass"),
    (["loss.policy.kwargs={coeff = 1.0}"], "unexpected keyword argument 'coeff'"),
    (["loss.policy.clip_eps_high=0.3"], "[loss.policy] clip_eps_high: unknown key"),
])
def test_bad_custom_settings_fail_at_load_in_one_line(my_loss, settings, says):
    with pytest.raises(ConfigError) as e:
        load_config(my_loss, settings)
    assert says in str(e.value) and "[loss.policy]" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.hostile
def test_a_custom_loss_whose_constructor_raises_is_one_line_at_load(my_loss, tmp_path, monkeypatch):
    """A user's class that raises anything else than TypeError (here RuntimeError in __post_init__) was a
    traceback out of `quaero check`."""
    (tmp_path / "raising_loss.py").write_text(
        "from dataclasses import dataclass\n"
        "from trainers.policy_losses import PolicyLoss\n\n"
        "@dataclass(frozen=True)\n"
        "class Raising(PolicyLoss):\n"
        "    def __post_init__(self):\n"
        "        raise RuntimeError('no GPU in this loss')\n\n"
        "    def token_loss(self, lp, lp_old, ratio, advantages, mask):\n"
        "        return -advantages * lp\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as e:
        load_config(my_loss, ["loss.policy.import_path='raising_loss:Raising'", "loss.policy.kwargs={}"])
    assert "Raising(...) raised RuntimeError: no GPU in this loss" in str(e.value)
    assert "[loss.policy]" in str(e.value) and "\n" not in str(e.value)
