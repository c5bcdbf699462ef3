"""Mixture ratios and task-sampler settings that cannot draw: shares normalised so their sum cannot overflow
(and what `quaero check` prints is what `Mixture` draws), settings whose weights cannot be finite refused at
load naming the setting, a drawing sampler on an env without a Task API refused at check."""
from __future__ import annotations

import pytest

from quaero import cli
from quaero.config import ConfigError, EnvConfig, load_config
from quaero.openenv_client.tasks import check_splits
from quaero.preflight import check
from quaero.rollout.mixture import Mixture

pytestmark = pytest.mark.hostile

MIX = "envs/toolbench_mixture.toml"


@pytest.mark.parametrize("d1,d2,want", [(1e308, 1e308, (0.5, 0.5)), (1.7e308, 1.0, (1.0, 0.0)),
                                        (3.0, 1.0, (0.75, 0.25)), (5e-324, 5e-324, (0.5, 0.5))])
def test_shares_never_overflow_and_the_printed_shares_are_what_is_drawn(d1, d2, want):
    """1e308:1e308 summed to inf: every share was 0, check printed 0.0% and "train 0 episodes", and the
    round robin split evenly whatever the ratios said."""
    cfg = load_config(MIX, [f"envs.d1.ratio={d1!r}", f"envs.d2.ratio={d2!r}"])
    shares = cfg.ratios()
    assert shares == pytest.approx(dict(zip(("d1", "d2"), want)), abs=1e-12) and sum(shares.values()) == 1
    mixture = Mixture({e.name: e.ratio for e in cfg.envs})  # as the recipe builds it
    assert mixture.shares == shares
    drawn = mixture.allocate(1000)
    assert all(abs(drawn[n] - shares[n] * 1000) <= 1 for n in shares), drawn
    mixture_line = check.env_lines(cfg)[-1]
    for name, share in shares.items():
        assert f"{name} {share:.1%}" in mixture_line
    assert "train 0 episodes" not in check.work_line(cfg)


def test_three_envs_of_1e308_1e308_1():
    m = Mixture({"a": 1e308, "b": 1e308, "c": 1.0})
    assert m.shares["a"] == m.shares["b"] == 0.5 and 0 <= m.shares["c"] < 1e-300
    assert m.allocate(10) == {"a": 5, "b": 5, "c": 0}


@pytest.mark.parametrize("setting,value,says", [
    ("ratio", "inf", "ratio=inf: Input should be a finite number"),
    ("ratio", "nan", "ratio=nan: Input should be"),
    ("tasks.epsilon", "1e308", "epsilon=1e+308: Input should be less than or equal to 1000000"),
    ("tasks.epsilon", "inf", "epsilon=inf: Input should be a finite number"),
    ("tasks.hard_weight", "1e300", "hard_weight=1e+300: Input should be less than or equal to 1000000"),
    ("tasks.unseen_weight", "inf", "unseen_weight=inf: Input should be a finite number"),
])
def test_settings_that_cannot_give_finite_weights_are_refused_naming_them(setting, value, says):
    with pytest.raises(ConfigError) as e:
        load_config(MIX, [f"envs.d1.{setting}={value}"])
    assert says in str(e.value) and "name='d1'" in str(e.value) and "\n" not in str(e.value)


def test_difficulty_pools_that_overlap_or_weigh_nothing_are_refused():
    pools = ["envs.d1.tasks.sampler='difficulty_pools'"]
    with pytest.raises(ConfigError, match=r"hard_max=0.8 >= easy_min=0.5: the hard and easy pools overlap"):
        load_config(MIX, [*pools, "envs.d1.tasks.hard_max=0.8", "envs.d1.tasks.easy_min=0.5"])
    zero = [f"envs.d1.tasks.{k}_weight=0" for k in ("hard", "normal", "easy", "unseen")]
    with pytest.raises(ConfigError, match="are all 0: no task has a weight to be drawn by"):
        load_config(MIX, [*pools, *zero])
    load_config(MIX, [*pools, *zero[:3]])  # one pool with a weight draws


@pytest.mark.parametrize("sampler", ["uniform", "curriculum", "difficulty_pools"])
def test_a_drawing_sampler_on_an_env_without_a_task_api_is_refused_at_check(sampler):
    """It passed check and failed only once the trainer had loaded."""
    env = EnvConfig(entry="fixtures.guess:GuessEnv", tasks={"sampler": sampler})
    says = rf"q.toml \[env.tasks\] sampler='{sampler}': draws from the split's tasks, and the env has no Task"
    with pytest.raises(ConfigError, match=says):
        check_splits(None, env, train=True, evaluate=True, source="q.toml")
    check_splits(None, env, train=False, evaluate=True)  # an eval draws nothing
    check_splits(None, EnvConfig(entry="fixtures.guess:GuessEnv"), train=True, evaluate=True)  # sequential


@pytest.mark.slow
def test_check_refuses_a_learning_sampler_on_an_env_without_a_task_api(tmp_path, capsys):
    path = tmp_path / "q.toml"
    path.write_text(f'[env]\nentry = "fixtures.guess:GuessEnv"\n[env.tasks]\nsampler = "curriculum"\n'
                    f'[run]\noutput_dir = "{tmp_path}"\n')
    assert cli.main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[env.tasks] sampler='curriculum': draws from the split's tasks" in err
