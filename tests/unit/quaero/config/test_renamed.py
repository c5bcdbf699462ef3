"""Old spellings still load for one release (quaero/config/renamed.py): every renamed key of an old TOML is
rewritten to today's, with one deprecation line per key naming its new spelling, which `quaero check`
prints; the old and the new spelling give the same config and trainer spec. [training]'s keys of the
rollout, guided episodes and the loss moved to [rollout], [guidance] and [loss]; the policy loss's to
[loss.policy]."""
import json
from pathlib import Path

import pytest

from quaero.config import ConfigError, load_config
from quaero.config.renamed import MOVED
from quaero.preflight.plan import trainer_spec
from trainers.policy_losses import CISPO, GSPO, SAPO, PPOClip

MAIN = "envs/toolbench.toml"


def _old(tmp_path, training: str):
    """envs/toolbench.toml with these lines added to its [training]."""
    text = Path(MAIN).read_text(encoding="utf-8").replace("[training]\n", f"[training]\n{training}\n", 1)
    path = tmp_path / "old.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _old_dump(dumped: dict) -> dict:
    """A `model_dump(mode="json")` as a run written before [rollout], [guidance] and [loss] saved it: their
    keys in [training] under the old names, no [loss.policy] (the caller adds [training]'s loss keys)."""
    old = {**dumped, "training": dict(dumped["training"])}
    for key, (section, new) in MOVED.items():
        old["training"][key] = dumped[section][new]
    for section in ("rollout", "guidance", "loss"):
        old.pop(section)
    return old


# every moved key, at a value other than its default, in the old and the new spelling
OLD_TRAINING = {"tasks_per_step": 3, "group_size": 6, "packing": False, "strict": True,
                "max_off_policy_steps": 0, "dynamic_sampling": True, "dynamic_sampling_max_groups": 2.0,
                "advantage": "rloo", "scale_rewards": "group", "positive_advantage_weight": 0.5,
                "all_fail_advantage": -0.5, "guidance": "episode", "guided_members": 2,
                "guidance_until_step": 6, "guidance_prefix_turns": 2, "guide_timeout_s": 5.0,
                "guidance_traces": "r.jsonl", "guidance_gamma": 0.2, "sampler_correction": "token_truncate",
                "sampler_correction_cap": 2.0, "beta": 0.01, "kl_estimator": "k2",
                "loss_aggregation": "token_mean"}


def test_every_moved_training_key_loads_as_its_new_section_with_a_line_each(tmp_path):
    assert set(OLD_TRAINING) == set(MOVED)  # the test covers every moved key
    text = Path(MAIN).read_text(encoding="utf-8")
    for block in ("[rollout]\ntasks_per_step = 4\ngroup_size = 8\n",
                  "[loss]\naggregation = \"sequence_mean\"\n"):
        assert block in text
        text = text.replace(block, "")  # the main config's own keys of those sections, written the old way
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in OLD_TRAINING.items())
    path = tmp_path / "old.toml"
    path.write_text(text.replace("[training]\n", f"[training]\n{lines}", 1), encoding="utf-8")
    cfg = load_config(path)
    new = load_config(MAIN, [f"{MOVED[k][0]}.{MOVED[k][1]}={json.dumps(v)}" for k, v in OLD_TRAINING.items()])
    assert cfg.model_dump() == new.model_dump() and new.deprecations == []
    assert trainer_spec(cfg) == trainer_spec(new)
    assert len(cfg.deprecations) == len(MOVED)
    for key, line in zip(OLD_TRAINING, cfg.deprecations):
        section, spelled = MOVED[key]
        assert line == (f"{path} [training] {key} is deprecated: write [{section}] {spelled} = "
                        f"{json.dumps(OLD_TRAINING[key])}")


# the old policy-loss keys, every one, for a variant that reads three of them (the others: "no effect")
OLD_POLICY = {"policy_loss": "sapo", "clip_eps": 0.2, "clip_eps_low": 0.2, "clip_eps_high": 0.28,
              "importance_sampling_level": "sequence", "sapo_temperature_pos": 0.9,
              "sapo_temperature_neg": 1.1}


def test_quaero_check_passes_an_old_toml_with_every_renamed_key_printing_a_line_each(tmp_path, capsys):
    """The real `quaero check` on envs/toolbench.toml written the old way, every key renamed since it was
    spelled in [training] (renamed.py MOVED and POLICY_KEYS): one `deprecated` line per key after the config
    line, then the plan, and "config OK"."""
    from quaero import cli
    from quaero.config.renamed import POLICY_KEYS

    assert set(OLD_POLICY) == set(POLICY_KEYS)
    recorded = tmp_path / "recorded.jsonl"  # one exact RFC 010 record: the guide's recording
    recorded.write_text(json.dumps({"input_ids": [1, 2, 3, 4], "action_mask": [0, 1, 1, 0],
                                    "obs_mask": [0, 0, 0, 1], "warning_mask": [0] * 4}) + "\n")
    old = {**OLD_TRAINING, "max_off_policy_steps": 0, "guidance_traces": str(recorded), **OLD_POLICY}
    text = Path(MAIN).read_text(encoding="utf-8")
    for block in ("[rollout]\ntasks_per_step = 4\ngroup_size = 8\n",
                  "[loss]\naggregation = \"sequence_mean\"\n"):
        text = text.replace(block, "")
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in old.items())
    path = tmp_path / "old.toml"
    path.write_text(text.replace("[training]\n", f"[training]\n{lines}", 1), encoding="utf-8")
    assert cli.main(["check", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    deprecated = [line for line in out if line.startswith("deprecated  ")]
    assert out[0] == f"config      {path}" and out[1:1 + len(old)] == deprecated and out[-1] == "config OK"
    assert [line.split()[3] for line in deprecated] == list(old)  # each old key once, in the file's order
    assert all(" is deprecated: write [" in line or "; remove it" in line for line in deprecated)
    assert f"deprecated  {path} [training] guided_members is deprecated: write [guidance] members = 2" in out
    assert any(line.startswith("loss        sapo ") for line in out)


def test_a_moved_key_set_the_old_way_on_the_command_line_loads_with_its_line():
    cfg = load_config(MAIN, ["training.guided_members=3", "training.guidance='prefix'"])
    assert (cfg.guidance.members, cfg.guidance.mode) == (3, "prefix")
    assert cfg.deprecations == [
        f"{MAIN} [training] guided_members is deprecated: write [guidance] members = 3",
        f"{MAIN} [training] guidance is deprecated: write [guidance] mode = \"prefix\""]
    with pytest.raises(ConfigError, match=r"\[training\] group_size and \[rollout\] group_size are both set"):
        load_config(MAIN, ["training.group_size=3"])  # envs/toolbench.toml sets [rollout] group_size


@pytest.mark.parametrize("old, new, loss", [
    ("policy_loss = 'ppo_clip'\nclip_eps = 0.3\nclip_eps_high = 0.28",
     ["loss.policy.clip_eps_low=0.3", "loss.policy.clip_eps_high=0.28"], PPOClip(0.3, 0.28)),
    (("policy_loss = 'gspo'\nclip_eps_low = 3e-4\nclip_eps_high = 4e-4\n"
     "importance_sampling_level = 'sequence'"),
     ["loss.policy.type='gspo'", "loss.policy.clip_eps_low=3e-4", "loss.policy.clip_eps_high=4e-4"],
     GSPO(3e-4, 4e-4)),
    ("policy_loss = 'cispo'\nclip_eps = 0.5\nimportance_sampling_level = 'sequence'",
     ["loss.policy.type='cispo'", "loss.policy.clip_eps_high=0.5",
      "loss.policy.importance_sampling_level='sequence'"], CISPO(0.5, "sequence")),
    ("policy_loss = 'sapo'\nsapo_temperature_pos = 0.9\nsapo_temperature_neg = 1.1",
     ["loss.policy.type='sapo'", "loss.policy.temperature_pos=0.9", "loss.policy.temperature_neg=1.1"],
     SAPO(0.9, 1.1)),
])
def test_an_old_toml_loads_as_its_new_spelling_with_a_line_per_old_key(tmp_path, old, new, loss):
    path = _old(tmp_path, old)
    cfg = load_config(path)
    assert trainer_spec(cfg) == trainer_spec(load_config(MAIN, new))
    assert trainer_spec(cfg).policy_loss == loss
    keys = [line.split("=")[0].strip() for line in old.splitlines()]
    assert len(cfg.deprecations) == len(keys)
    for key, line in zip(keys, cfg.deprecations):
        assert line.startswith(f"{path} [training] {key} is deprecated: ") and "\n" not in line
        assert "[loss.policy]" in line
    assert load_config(MAIN, new).deprecations == []


def test_a_key_the_variant_has_no_use_for_is_named_so():
    cfg = load_config(MAIN, ["training.policy_loss='sapo'", "training.clip_eps_high=0.28"])
    assert cfg.deprecations[-1] == (f"{MAIN} [training] clip_eps_high is deprecated: it has no effect with "
                                    "[loss.policy] type = \"sapo\"; remove it")
    assert trainer_spec(cfg).policy_loss == SAPO()


def test_old_keys_and_the_new_table_together_or_an_old_bad_value_are_one_error():
    with pytest.raises(ConfigError, match=r"\[training\] clip_eps and \[loss.policy\] are both set"):
        load_config(MAIN, ["training.clip_eps=0.3", "loss.policy.clip_eps_high=0.3"])
    with pytest.raises(ConfigError, match=r"\[training\] policy_loss='ppo': use 'ppo_clip'"):
        load_config(MAIN, ["training.policy_loss='ppo'"])
    with pytest.raises(ConfigError, match="GSPO is the sequence ratio"):
        load_config(MAIN, ["training.policy_loss='gspo'", "training.importance_sampling_level='token'"])


def test_check_prints_the_deprecations_after_the_config_line(tmp_path):
    from quaero.preflight.check import plan_lines

    path = _old(tmp_path, "clip_eps_high = 0.28")
    lines = plan_lines(load_config(path), str(path))
    assert lines[0] == f"config      {path}"
    assert lines[1] == (f"deprecated  {path} [training] clip_eps_high is deprecated: write [loss.policy] "
                        "clip_eps_high = 0.28")


@pytest.mark.parametrize("variant", ["ppo_clip", "gspo", "cispo", "sapo"])
def test_an_old_runs_config_json_compares_equal_to_its_new_spelling(variant):
    """A resume of a run written before [loss.policy] (its config.json has [training]'s old keys, every one,
    unset ones null) sees no changed key (quaero/recipe/run_state.py `note_changed_config`)."""
    from quaero.config import changed_keys
    from quaero.config.renamed import migrate

    now = load_config(MAIN, [f"loss.policy.type='{variant}'"]).model_dump(mode="json")
    old = _old_dump(now)
    before = {**old, "training": {**old["training"], "policy_loss": variant, "clip_eps": 0.2,
                                  "clip_eps_low": None, "clip_eps_high": None,
                                  "importance_sampling_level": "sequence" if variant == "gspo" else "token",
                                  "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}}
    migrate(before, "config.json", dump=True)
    assert changed_keys(before, now) == {}


def test_quaero_export_reads_an_old_runs_config_json(tmp_path):
    """`quaero export`'s `run_config` validated an old run's config.json without the renames: a run trained
    before [loss.policy] was "not a quaero run config"."""
    import json

    from quaero.tools.export import run_config

    now = load_config(MAIN, ["loss.policy.type='sapo'", "loss.policy.temperature_pos=0.9"])
    dumped = _old_dump(now.model_dump(mode="json"))
    before = {**dumped, "training": {**dumped["training"], "policy_loss": "sapo", "clip_eps": 0.2,
                                     "clip_eps_low": None, "clip_eps_high": None,
                                     "importance_sampling_level": "token", "sapo_temperature_pos": 0.9,
                                     "sapo_temperature_neg": 1.05}}
    (tmp_path / "config.json").write_text(json.dumps(before), encoding="utf-8")
    assert trainer_spec(run_config(tmp_path)).policy_loss == SAPO(0.9, 1.05)
