"""A mixture's schema (quaero/config/ `[[envs]]`): each env's view, and bad input in one line."""
from __future__ import annotations

import pytest

from quaero.config import ConfigError, load_config

MIXTURE = """
[run]
name = "mix"

[[envs]]
name = "easy"
entry = "envs.toolbench:ToolBenchEnv"
kwargs = {{difficulty = 1}}
ratio = {ratio}
max_turns = 3
group_size = 6
echo_weight = 0.0

[envs.tasks]
sampler = "curriculum"
key = "group"

[[envs]]
name = "{second}"
entry = "envs.toolbench:ToolBenchEnv"
kwargs = {{difficulty = 2}}
ratio = 1
eval_tasks = 7

[training]
eval_tasks = 3

[rollout]
group_size = 4

[echo]
weight = 0.1
"""


def write(tmp_path, text):
    p = tmp_path / "mix.toml"
    p.write_text(text)
    return p


def test_each_env_of_a_mixture_reads_as_a_one_env_config_with_its_own_settings(tmp_path):
    cfg = load_config(write(tmp_path, MIXTURE.format(ratio=3, second="hard")))
    views = cfg.views()
    assert list(views) == ["easy", "hard"] and cfg.ratios() == {"easy": 0.75, "hard": 0.25}
    easy, hard = views["easy"], views["hard"]
    assert (easy.env.max_turns, easy.rollout.group_size, easy.training.eval_tasks) == (3, 6, 3)
    assert (hard.env.max_turns, hard.rollout.group_size, hard.training.eval_tasks) == (8, 4, 7)
    # ECHO off on one env
    assert (easy.echo.weight, easy.echo.weight_at(1, 5), hard.echo.weight) == (0.0, 0.0, 0.1)
    assert easy.env.tasks.sampler == "curriculum" and hard.env.tasks.sampler == "sequential"
    assert easy.env.kwargs == {"difficulty": 1} and not easy.envs and easy.run.name == "mix"
    one = load_config("envs/toolbench.toml")
    assert one.views() == {"env": one} and one.ratios() == {"env": 1.0}  # a one-env config is its own view


@pytest.mark.hostile
@pytest.mark.parametrize("text, message", [
    (MIXTURE.format(ratio=0, second="hard"), r"\[\[envs\]\] #1 name='easy' \[envs\] ratio=0: Input should"),
    (MIXTURE.format(ratio=-1, second="hard"), r"name='easy' \[envs\] ratio=-1"),
    (MIXTURE.format(ratio=1, second="easy"), r"name='easy' is used by two \[\[envs\]\]: give each env a"),
    (MIXTURE.format(ratio=1, second="all"), r"name='all' is reserved for the cross-env aggregate"),
    (MIXTURE.format(ratio=1, second="a/b"), r"name='a/b': an env's name is 1-64 letters"),
    (MIXTURE.format(ratio=1, second="hard") + '[env]\nentry = "envs.toolbench:ToolBenchEnv"\n',
     r"set \[env\] \(one env\) or \[\[envs\]\] \(a mixture, each with name and ratio\), not both"),
    ('[run]\nname = "x"\n', r"no env: add an \[env\] section \(or \[\[envs\]\] for a mixture\)"),
    (MIXTURE.format(ratio=1, second="hard") + '[data]\ntraces = "t.jsonl"\n', r"episodes name no env"),
])
def test_bad_mixtures_are_refused_in_one_line(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(write(tmp_path, text))
    assert "\n" not in str(e.value)


def test_a_mixture_envs_own_rule_names_the_env(tmp_path):
    text = MIXTURE.format(ratio=1, second="hard").replace('eval_tasks = 7', 'eval_tasks = 7\ngroup_size = 1')
    with pytest.raises(ConfigError, match=r"\[\[envs\]\] name='hard': \[rollout\] group_size=1 with "):
        load_config(write(tmp_path, text))
    text = MIXTURE.format(ratio=1, second="hard").replace('eval_tasks = 7', 'eval_tasks = 7\nurl = "ws://h:1"')
    with pytest.raises(ConfigError, match=r"\[\[envs\]\] #2 name='hard' \[envs\]: kwargs construct envs"):
        load_config(write(tmp_path, text))


def test_set_overrides_reach_one_env_of_a_mixture_by_name(tmp_path):
    path = write(tmp_path, MIXTURE.format(ratio=3, second="hard"))
    cfg = load_config(path, ["envs.hard.tasks.sampler=difficulty_pools", "envs.easy.ratio=1"])
    assert cfg.views()["hard"].env.tasks.sampler == "difficulty_pools" and cfg.ratios()["easy"] == 0.5
    with pytest.raises(ConfigError, match=r"no \[\[envs\]\] entry is named 'nope'"):
        load_config(path, ["envs.nope.ratio=2"])
    with pytest.raises(ConfigError, match=r"write envs.NAME.key=value"):
        load_config(path, ["envs.ratio=2"])
    one = load_config("envs/toolbench.toml", ["env.tasks.sampler=curriculum", "env.tasks.key=group"])
    assert (one.env.tasks.sampler, one.env.tasks.key) == ("curriculum", "group")


@pytest.mark.hostile
def test_a_mixture_env_whose_task_api_lacks_the_split_is_named_in_one_line(tmp_path):
    from quaero.openenv_client.tasks import check_lines

    cfg = load_config(write(tmp_path, MIXTURE.format(ratio=1, second="hard")), ["envs.hard.eval_split=nope"])
    first = check_lines(cfg.views()["easy"], "mix.toml [[envs]] name='easy':")[0]
    assert first.startswith("tasks       splits")
    with pytest.raises(ConfigError, match=r"^mix.toml \[\[envs\]\] name='hard': \[env\] "
                                          r"eval_split='nope': the env has no such split; its splits: "
                                          r"'train' \(1000000") as e:
        check_lines(cfg.views()["hard"], "mix.toml [[envs]] name='hard':")
    assert "\n" not in str(e.value)
