"""The rules across sections, in one place: each a function of the whole config (or a mixture env's view,
`QuaeroConfig.view`) returning what is wrong, or None. A rule on one section's own settings is that
section's validator instead (quaero/config/loop.py, rollout.py, guidance.py, loss.py, sections.py, envs.py);
what depends on the installed components (a known trainer, CUDA, vLLM) is quaero/preflight/plan.py's.
"""
from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

from quaero.config.base import ConfigError
from quaero.config.errors import format_error
from quaero.config.schema import QuaeroConfig

# the sections a mixture env's view may hold settings of its own in (QuaeroConfig.view): judged again there
PER_ENV_SECTIONS = ("training", "rollout", "guidance", "echo")


def _traces_train_as_warm_start(cfg: QuaeroConfig) -> str | None:
    if cfg.data.traces and not cfg.training.warmup_sft_steps:
        return (f"[data] traces={cfg.data.traces!r} with [training] warmup_sft_steps=0: recorded episodes "
                "train as warm-start steps; set warmup_sft_steps >= 1 (each takes tasks_per_step rows) or "
                "remove traces")
    return None


def _warm_start_has_demos(cfg: QuaeroConfig) -> str | None:
    t = cfg.training
    if t.warmup_sft_steps and not (t.oracle or cfg.env.entry or cfg.data.traces):
        return (f"[training] warmup_sft_steps={t.warmup_sft_steps} with a remote env: quaero finds "
                "oracle_policy next to [env] entry, and there is none; set [training] oracle = "
                "\"package.module:oracle_policy\" (importable here), or warmup_sft_steps = 0")
    return None


def _guidance_has_a_guide(cfg: QuaeroConfig) -> str | None:
    g = cfg.guidance
    if g.mode != "none" and not (cfg.training.oracle or cfg.env.entry or g.traces):
        return (f"[guidance] mode={g.mode!r} with a remote env and no oracle: the guide is the env's "
                "oracle_policy(info), found beside [env] entry, and there is none; set [training] oracle = "
                "\"package.module:oracle_policy\" (importable here), [guidance] traces = \"recorded.jsonl\", "
                "or mode = 'none'")
    return None


def _members_a_group_has(cfg: QuaeroConfig) -> str | None:
    g, group = cfg.guidance, cfg.rollout.group_size
    if g.mode != "none" and g.members > group:
        return (f"[guidance] members={g.members} > [rollout] group_size={group}: a group has only group_size "
                "members to guide; use members <= group_size")
    return None


def _groups_that_learn(cfg: QuaeroConfig) -> str | None:
    steps, group = cfg.training.steps, cfg.rollout.group_size
    if steps and group < 2:
        return (f"[rollout] group_size={group} with [training] steps={steps}: a group of one episode has "
                "advantage 0 (reward minus its own mean), so RL learns nothing; use group_size >= 2 (or "
                "steps = 0 for a warm start only)")
    return None


def _unbiased_ratio(cfg: QuaeroConfig) -> str | None:
    if cfg.training.steps and cfg.sampler.top_p < 1:
        return (f"[sampler] top_p={cfg.sampler.top_p} with [training] steps={cfg.training.steps}: the "
                "sampler's log-probs are renormalised over the nucleus and the trainer's are not, so the "
                "importance ratio is biased; use top_p = 1 for RL (top_p < 1 is fine for eval)")
    return None


def _sharded_lora(cfg: QuaeroConfig) -> str | None:
    if cfg.distributed.strategy == "fsdp2" and cfg.backend.lora:
        return ("[distributed] strategy='fsdp2' with [backend] lora=true: sharded LoRA checkpoints and "
                "exports are not built; use strategy = 'ddp' (the adapter is small: replicating it costs "
                "little) or lora = false")
    return None


def _sharded_reference(cfg: QuaeroConfig) -> str | None:
    if cfg.loss.beta > 0 and cfg.distributed.strategy == "fsdp2":
        return (f"[loss] beta={cfg.loss.beta:g} with [distributed] strategy='fsdp2': the KL penalty's "
                "reference is a frozen copy of the model (trainers/reference.py) and a sharded model has "
                "none yet; use strategy = 'ddp', or beta = 0")
    return None


def _room_for_a_prompt(cfg: QuaeroConfig) -> str | None:
    # a turn starts only when its prompt leaves room for max_tokens (quaero/rollout/driver.py)
    tokens, ctx = cfg.sampler.max_tokens, cfg.model.max_seq_len
    if tokens >= ctx:
        return (f"[sampler] max_tokens={tokens} >= [model] max_seq_len={ctx}: no room is left for a prompt; "
                "set max_tokens well below max_seq_len")
    return None


def _observation_fits(cfg: QuaeroConfig) -> str | None:
    limit, ctx = cfg.env.max_observation_tokens, cfg.model.max_seq_len
    if limit is not None and limit >= ctx:
        return (f"[env] max_observation_tokens={limit} >= [model] max_seq_len={ctx}: one observation would "
                "fill the context; set it well below max_seq_len or remove it (default: half of max_seq_len)")
    return None


# judged on a one-env config, or on each env's view of a mixture
RULES: tuple[Callable[[QuaeroConfig], str | None], ...] = (
    _traces_train_as_warm_start, _warm_start_has_demos, _guidance_has_a_guide, _members_a_group_has,
    _groups_that_learn, _unbiased_ratio, _sharded_lora, _sharded_reference, _room_for_a_prompt,
    _observation_fits)


def check_rules(cfg: QuaeroConfig, source: str = "config") -> None:
    """Raise ConfigError (one line) for the first rule the config breaks; a mixture's, for each env's view
    (its name in the message), the sections it sets per env judged again on its own settings."""
    if not cfg.envs:
        return _judge(cfg, source)
    if cfg.data.traces:
        raise ConfigError(f"{source} [data] traces={cfg.data.traces!r} with [[envs]]: recorded episodes name "
                          "no env of the mixture; use traces with a one-env [env] config, or remove traces")
    for e in cfg.envs:
        where = f"{source} [[envs]] name={e.name!r}:"
        view = cfg.view(e)
        for name in PER_ENV_SECTIONS:
            section = getattr(view, name)
            try:
                type(section).model_validate(section.model_dump())
            except ValidationError as error:
                err = error.errors()[0]
                raise ConfigError(format_error(where, {}, {**err, "loc": (name, *err["loc"])})) from None
        _judge(view, where)
    return None


def _judge(cfg: QuaeroConfig, source: str) -> None:
    for rule in RULES:
        if (problem := rule(cfg)) is not None:
            raise ConfigError(f"{source} {problem}")
