"""The run's wired parts, fixed for the whole run: the config, the trainer, the sampler, the renderer, each
env (its sessions, its driver, its task sampler, its warm start's oracle), the counts they all count into and
the mixture that shares a step's groups out over the envs. `build` wires them; `open_pools` starts each env's
sessions. What moves from step to step is `RunProgress` (quaero/recipe/progress.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quaero.config import SINGLE, ConfigError, QuaeroConfig
from quaero.openenv_client.tasks import check_splits
from quaero.recipe import ranks
from quaero.rollout.mixture import Mixture
from quaero.rollout.task_samplers import EnvTasks, SplitView, make_task_sampler
from quaero.rollout.traces import RecordedActions, read_traces, warm_start_rows
from quaero.telemetry import names

if TYPE_CHECKING:
    from quaero.openenv_client import EnvPool
    from quaero.rollout.driver import EpisodeDriver, Policy
    from quaero.rollout.render import RenderAdapter
    from quaero.rows import EchoRow
    from quaero.sampling import Sampler
    from quaero.telemetry.counts import RolloutCounts
    from trainers.base import Trainer


@dataclass(frozen=True)
class EnvRun:
    """One env of the run (a mixture's, or the one `[env]`): its view of the config (quaero/config/
    `views`), its sessions, its driver (its own turn limit and budgets), its task sampler and its warm start's
    oracle."""

    name: str
    cfg: QuaeroConfig
    pool: EnvPool
    driver: EpisodeDriver
    tasks: EnvTasks
    oracle: Policy | None = None
    recorded: RecordedActions | None = None  # [guidance] traces: the guide, instead of the oracle


@dataclass(frozen=True)
class RunParts:
    """What the run is wired from, fixed from `build` to the end (the trainer's weights, the task samplers'
    memory and the mixture's cursor change inside their own objects; which objects they are never does)."""

    cfg: QuaeroConfig
    trainer: Trainer
    sampler: Sampler
    render: RenderAdapter
    envs: list[EnvRun]
    counts: RolloutCounts  # the pools': sessions and drivers count into it
    shares_model: bool  # the sampler samples with the trainer's own module: no weight push ever
    mixture: Mixture
    traces: list[EchoRow] | None = None  # [data] traces: the warm start's rows, instead of the oracle's demos


def build(cfg: QuaeroConfig, pool: EnvPool | dict[str, EnvPool], counts: RolloutCounts | None = None,
          sampler_log_dir: Path | None = None) -> RunParts:
    """The run's parts; `pool`: each env's sessions by name (quaero/config/ `views`), all counting into
    `counts`, or a one-env run's pool (counting into its own)."""
    from quaero.config import settings_of
    from quaero.models.load import load_tokenizer, resolve_device
    from quaero.preflight.plan import check_components, resolve_oracle, trainer_spec
    from quaero.rollout.driver import DriverSettings, EpisodeDriver
    from quaero.rollout.render import RenderAdapter
    from quaero.sampling import make_sampler
    from trainers.registry import trainer_class

    check_components(cfg)  # before any model loads, also when train() is called without the CLI
    pools = pool if isinstance(pool, dict) else {SINGLE: pool}
    counts = counts if counts is not None else next(iter(pools.values())).counts
    t = cfg.training
    views = cfg.views()
    for name, view in views.items():
        where = "config" if not cfg.is_mixture else f"[[envs]] name={name!r}:"
        check_splits(pools[name].tasks, view.env, train=bool(t.steps or t.warmup_sft_steps),
                     evaluate=bool(view.training.eval_tasks), source=where)
    device = resolve_device(cfg.run.device)
    # unsloth is imported first inside
    trainer = trainer_class(cfg.backend.backend)(trainer_spec(cfg), device)
    render = RenderAdapter(load_tokenizer(cfg.model.name), cfg.model)
    # an FSDP2 trainer's module holds shards and gathers them in collectives: sampling, which runs a
    # different number of forwards on each rank, needs a whole model of its own (synced before it samples);
    # so does sampling ahead, which runs while the trainer updates its module
    shared = None if trainer.sharded or cfg.rollout.max_off_policy_steps else trainer.model
    sampler = make_sampler(cfg, model=shared, stop_token_ids=render.stop_token_ids,
                           device=str(trainer.device),
                           log_dir=sampler_log_dir)
    envs = [EnvRun(name, view, pools[name],
                   EpisodeDriver(render, sampler, settings_of(DriverSettings, view), counts),
                   env_tasks(name, view, pools[name]),
                   resolve_oracle(view) if (t.warmup_sft_steps and not cfg.data.traces) or (
                       view.guidance.mode != "none" and not view.guidance.traces) else None,
                   recorded_guide(view))
            for name, view in views.items()]
    traces = warm_start_rows(cfg)[0] if cfg.data.traces else None
    return RunParts(cfg, trainer, sampler, render, envs, counts, getattr(sampler, "shares_model", False),
                    Mixture({e.name: e.ratio for e in cfg.envs} or {SINGLE: 1.0}), traces=traces)


def recorded_guide(view: QuaeroConfig) -> RecordedActions | None:
    """An env's `[guidance] traces` read into its guide (None without them, or without guidance)."""
    g = view.guidance
    if g.mode == "none" or not g.traces:
        return None
    return RecordedActions(read_traces(view, g.traces, "[guidance] traces")[0])


def env_tasks(name: str, view: QuaeroConfig, pool: EnvPool) -> EnvTasks:
    """An env's task sampler over its train split (its spec's keys read through the env's Task API)."""
    split = view.env.train_split
    size = pool.tasks.size(split) if pool.tasks is not None else None
    spec = (lambda index: pool.task_spec(split, index)) if size else None
    return make_task_sampler(SplitView(name, split, size, view.run.seed, view.rollout.group_size,
                                       view.env.tasks, pool.tasks, spec), view.sampler.stop_grace_s)


def open_pools(stack: contextlib.ExitStack, cfg: QuaeroConfig, counts: RolloutCounts) -> dict[str, EnvPool]:
    """Each env's sessions (as many as its groups of a step can use at once on this rank), counting into
    `counts`, closed by `stack`. An env that fails to start is named."""
    from quaero.openenv_client import open_envs

    pools, per_rank = {}, len(ranks.task_share(cfg.rollout.tasks_per_step))
    for name, view in cfg.views().items():
        log_dir = cfg.run_dir / names.ENV_SERVERS
        try:
            pools[name] = stack.enter_context(open_envs(view.env, max(per_rank * view.rollout.group_size, 1),
                                                        counts,
                                                        log_dir=log_dir / name if cfg.is_mixture
                                                        else log_dir))
        except ConfigError as e:
            if not cfg.is_mixture:
                raise
            raise ConfigError(f"[[envs]] name={name!r} failed to start: {e}") from None
    return pools
