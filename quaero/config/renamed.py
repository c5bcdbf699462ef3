"""Old spellings of config keys, still read for one release: `migrate` rewrites them to today's in the TOML
(after `--set`), before validation, with one line per old key naming its new spelling (`quaero check` prints
them: `QuaeroConfig.deprecations`).
"""
from __future__ import annotations

import json
from typing import Any

from quaero.config.base import ConfigError

# [training]'s keys of other roles, by their new section and key (the rollout's, guided episodes', the loss's)
MOVED = {
    **{k: ("rollout", k) for k in ("tasks_per_step", "group_size", "packing", "strict",
                                   "max_off_policy_steps", "dynamic_sampling", "dynamic_sampling_max_groups",
                                   "advantage",
                                   "scale_rewards", "positive_advantage_weight", "all_fail_advantage")},
    "guidance": ("guidance", "mode"), "guided_members": ("guidance", "members"),
    "guidance_until_step": ("guidance", "until_step"), "guidance_prefix_turns": ("guidance", "prefix_turns"),
    "guide_timeout_s": ("guidance", "timeout_s"), "guidance_traces": ("guidance", "traces"),
    "guidance_gamma": ("guidance", "gamma"),
    **{k: ("loss", k) for k in ("sampler_correction", "sampler_correction_cap", "beta", "kl_estimator")},
    "loss_aggregation": ("loss", "aggregation"),
}
# [training]'s policy-loss keys, now `[loss.policy]`'s: `type` and the variant's own knobs
POLICY_KEYS = ("policy_loss", "clip_eps", "clip_eps_low", "clip_eps_high", "importance_sampling_level",
               "sapo_temperature_pos", "sapo_temperature_neg")
# each variant's knobs, by the old key that set it
_KNOBS = {
    "ppo_clip": {"clip_eps_low": "clip_eps_low", "clip_eps_high": "clip_eps_high",
                 "importance_sampling_level": "importance_sampling_level"},
    "gspo": {"clip_eps_low": "clip_eps_low", "clip_eps_high": "clip_eps_high"},
    "cispo": {"clip_eps_high": "clip_eps_high", "importance_sampling_level": "importance_sampling_level"},
    "sapo": {"sapo_temperature_pos": "temperature_pos", "sapo_temperature_neg": "temperature_neg",
             "importance_sampling_level": "importance_sampling_level"},
}


def migrate(data: dict[str, Any], source: str, *, dump: bool = False) -> list[str]:
    """Rewrite the old keys of `data` (the parsed TOML) to today's, in place; one deprecation line each.
    `dump`: `data` is an old run's config.json (every key, unset ones None, GSPO's level "token" by default):
    rewritten without judging it, so a resume compares like with like (quaero/recipe/run_state.py)."""
    training = data.get("training")
    if not isinstance(training, dict):
        return []
    notes = _moved(data, training, source)
    if not any(k in training for k in POLICY_KEYS):
        return notes
    old = {k: training.pop(k) for k in POLICY_KEYS if k in training}
    if dump and old.get("policy_loss") == "gspo":
        old.pop("importance_sampling_level", None)
    return notes + _policy_loss(data, old, source)


def _moved(data: dict[str, Any], training: dict[str, Any], source: str) -> list[str]:
    """[training]'s keys of the rollout, guided episodes and the loss -> [rollout], [guidance], [loss]."""
    notes = []
    for key in [k for k in training if k in MOVED]:
        section, new = MOVED[key]
        into = data.setdefault(section, {})
        if not isinstance(into, dict):
            return notes  # the schema says what is wrong with that section
        if new in into:
            raise ConfigError(f"{source} [training] {key} and [{section}] {new} are both set: the key is "
                              f"[{section}]'s now; keep [{section}] {new}")
        into[new] = training.pop(key)
        notes.append(f"{source} [training] {key} is deprecated: write [{section}] {new} = {_toml(into[new])}")
    return notes


def _toml(value: Any) -> str:
    return json.dumps(value)


def _policy_loss(data: dict[str, Any], old: dict[str, Any], source: str) -> list[str]:
    """[training] policy_loss, clip_eps* , importance_sampling_level, sapo_temperature_* -> [loss.policy]."""
    loss = data.setdefault("loss", {})
    if not isinstance(loss, dict):
        return []  # the schema says what is wrong with [loss]
    if "policy" in loss:
        raise ConfigError(f"{source} [training] {', '.join(old)} and [loss.policy] are both set: those keys "
                          "are [loss.policy]'s now (type and its knobs); move them there")
    kind = old.get("policy_loss", "ppo_clip")
    if kind not in _KNOBS:
        raise ConfigError(f"{source} [training] policy_loss={kind!r}: use 'ppo_clip', 'gspo', 'cispo' or "
                          "'sapo', now written [loss.policy] type = \"...\"")
    if kind == "gspo" and old.get("importance_sampling_level") == "token":
        raise ConfigError(f"{source} [training] policy_loss='gspo' with importance_sampling_level='token': "
                          "GSPO is the sequence ratio; drop the level, or use policy_loss='ppo_clip' (a "
                          "token ratio)")
    knobs = _KNOBS[kind]
    new: dict[str, Any] = {"type": kind}
    notes = []

    def note(key: str, spelled: str) -> None:
        notes.append(f"{source} [training] {key} is deprecated: {spelled}")

    if "policy_loss" in old:
        note("policy_loss", f"write [loss.policy] type = {_toml(kind)}")
    for key in ("clip_eps_low", "clip_eps_high"):  # each side: its own key, else the symmetric clip_eps
        if key in knobs and (key in old or "clip_eps" in old):
            new[key] = old[key] if old.get(key) is not None else old.get("clip_eps", 0.2)
    if "clip_eps" in old:
        sides = [k for k in ("clip_eps_low", "clip_eps_high") if k in knobs and k not in old]
        written = " and ".join(f"[loss.policy] {k} = {_toml(old['clip_eps'])}" for k in sides)
        note("clip_eps", f"write {written}" if sides
             else f"it has no effect with [loss.policy] type = {_toml(kind)}; remove it")
    for key, value in old.items():
        if key in ("policy_loss", "clip_eps"):
            continue
        if key in knobs:
            new.setdefault(knobs[key], value)  # a clip end is set above (unset: clip_eps's)
            note(key, f"write [loss.policy] {knobs[key]} = {_toml(new[knobs[key]])}")
        else:
            note(key, f"it has no effect with [loss.policy] type = {_toml(kind)}; remove it")
    loss["policy"] = new
    return notes
