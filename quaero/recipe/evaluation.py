"""Evaluation: greedy episodes on an env's eval split. `eval_episodes` is the one loop, played by training
(`evaluate_at`, before the first step and every `eval_every` steps: one `eval` event) and by `quaero eval`
(quaero/tools/evaluate.py, each contestant and repeat): task i of the split under run seed s is the same
episode in both, so `quaero eval` at s = the run's seed reproduces the run's own eval events."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from quaero.openenv_client.tasks import eval_indices
from quaero.recipe import ranks
from quaero.recipe.weight_sync import sync_sampler
from quaero.rollout.tasks import spec_label, task_reset
from quaero.telemetry import names
from quaero.telemetry.counts import drop_reasons
from quaero.telemetry.heldout import held_out_figures, pass_figures
from quaero.telemetry.runlog import get_logger
from trainers.memory import peak_mem_mb, reset_peak

if TYPE_CHECKING:
    from quaero.config import QuaeroConfig
    from quaero.openenv_client import EnvPool
    from quaero.recipe.parts import EnvRun, RunParts
    from quaero.recipe.progress import RunProgress
    from quaero.rollout.driver import Episode, EpisodeDriver, Policy

log = get_logger(__name__)


def eval_episodes(view: QuaeroConfig, driver: EpisodeDriver, pool: EnvPool, split: str, count: int, *,
                  seed: int, greedy: bool = True, policy: Policy | None = None, rank_share: bool = False,
                  report_as: str | None = None, samples: int = 1) -> tuple[list[dict], list[list[Episode]]]:
    """`samples` episodes (1, or pass@k's k sampled ones) on each of the first `count` tasks of `split`
    (never past its end), reset under `view`'s run seed and sampled from `seed`: each task's reset arguments
    and its group. `rank_share`: this rank's share of the tasks (training under torchrun); `report_as`: the
    event its progress is logged as."""
    indices = eval_indices(pool.tasks, split, count)  # the env's split, with a Task API
    if rank_share:
        indices = [indices[i] for i in ranks.task_share(len(indices))]
    tasks = [task_reset(view, split, i) for i in indices]
    groups = driver.run(pool.sessions, tasks, group_size=samples, greedy=greedy, policy=policy, seed=seed,
                        on_group_done=_progress(report_as, len(tasks)) if report_as else None)
    return tasks, groups


def evaluate_at(parts: RunParts, progress: RunProgress, step: int) -> None:
    """The evaluation at `step` (0: the untrained baseline): greedy episodes on each env's eval split's first
    `eval_tasks` tasks ([training]'s, or the env's in a mixture), logged as one `eval` event, pooled; a
    mixture's also holds each env's figures (`eval_by_env`) and names each result's env."""
    if not any(e.cfg.training.eval_tasks for e in parts.envs):
        return
    synced = sync_sampler(parts, progress)
    t0 = time.perf_counter()
    reset_peak(parts.trainer.device)
    eps, results, formats, groups, by_env = [], [], [], [], {}
    for e in parts.envs:
        if e.cfg.training.eval_tasks:
            env_eps, env_results, env_formats, env_groups, figures = _evaluate_env(parts.cfg, e)
            eps += env_eps
            results += env_results
            formats += env_formats
            groups += env_groups
            if parts.cfg.is_mixture:
                by_env[e.name] = figures
    sample = [_brief(m) for m in eps[0].messages[1:]] if eps else []  # what the model does, for humans
    s = ranks.rollout_snapshot(parts.counts)  # eval's own counts, kept out of the next train step's
    passes = _pass_at_k(parts)
    figures = held_out_figures([r[1] for r in results], [f[1] for f in formats])
    log.info(
        names.EVAL_EVENT,
        **{
            names.EVAL_REWARD: s[names.REWARD_MEAN],
            names.EVAL_SUCCESS_RATE: s[names.SUCCESS_RATE],
            names.EVAL_EPISODES: ranks.total(len(eps)),
            names.EVAL_DROPPED: s[names.EPISODES_DROPPED],
            names.EVAL_TRUNCATED: s[names.EPISODES_TRUNCATED],
            # measured, not assumed: the review judges RL over the warm start on unguided evals only
            names.EVAL_GUIDED_TOKENS: ranks.total(sum(sum(r.guided_mask) for ep in eps for r in ep.rows)),
            names.EVAL_TIME_S: round(time.perf_counter() - t0, 2),
            names.EVAL_PEAK_MEM_MB: round(peak_mem_mb(parts.trainer.device)[0], 1),
            names.EVAL_SUCCESS_SE: _round(figures["success_se"]),
            names.EVAL_FORMAT_FAILURES: _round(figures["format_failures"]),
            names.EVAL_WRONG_ANSWERS: _round(figures["wrong_answers"]),
            # the sampled episodes' exactness counts too (the greedy ones' other counts stand alone)
            names.PREFIX_MISMATCHES: s[names.PREFIX_MISMATCHES] + passes.pop(names.PREFIX_MISMATCHES, 0),
            names.BRIDGE_FALLBACKS: s[names.BRIDGE_FALLBACKS] + passes.pop(names.BRIDGE_FALLBACKS, 0),
            names.ENV_RETRIES: s[names.ENV_RETRIES],
            names.EVAL_DROP_REASONS: drop_reasons(s),
            names.EVAL_RESULTS: results,
            names.EVAL_FORMATS: formats,
            names.EVAL_WELL_FORMED: _mean([int(f[1] == 0) for f in formats]),
            names.SAMPLE_TRANSCRIPT: sample,
            **synced,
            **passes,
            **({names.EVAL_TASK_GROUPS: groups} if groups else {}),
            **({names.EVAL_BY_ENV: by_env} if by_env else {}),
        },
    )


def _evaluate_env(cfg: QuaeroConfig, e: EnvRun
                  ) -> tuple[list[Episode], list[list], list[list], list[list], dict[str, Any]]:
    """One env's evaluation on this rank: its kept episodes, every rank's results (per task, for paired
    comparisons of two evaluations, quaero review: [index, success, reward(, env in a mixture)]), formats
    ([index, malformed actions, actions(, env)]) and task groups ([index, group, difficulty(, env)], from the
    env's Task API; none without one), and its figures for `eval_by_env`."""
    tasks, played = eval_episodes(e.cfg, e.driver, e.pool, e.cfg.env.eval_split, e.cfg.training.eval_tasks,
                                  seed=ranks.rank_seed(cfg.run.seed), rank_share=True,
                                  report_as=names.EVAL_PROGRESS_EVENT)
    tag = [e.name] if cfg.is_mixture else []
    kept = ranks.gather_rows([[t["index"], int(ep.success), ep.reward, ep.malformed, ep.turns]
                              for t, g in zip(tasks, played) for ep in g if not ep.dropped])
    results = [[index, success, reward, *tag] for index, success, reward, _, _ in kept]
    formats = [[index, malformed, turns, *tag] for index, _, _, malformed, turns in kept]
    specs = [(t["index"], e.pool.task_spec(t["split"], t["index"])) for t in tasks]
    groups = ranks.gather_rows([[index, spec_label(spec.get("group")), spec_label(spec.get("difficulty")),
                                 *tag] for index, spec in specs if spec])
    figures = {names.EVAL_SUCCESS_RATE: _mean([r[1] for r in results]),
               names.EVAL_REWARD: _mean([r[2] for r in results]),
               names.EVAL_EPISODES: len(results),
               names.EVAL_DROPPED: ranks.total(sum(ep.dropped for g in played for ep in g))}
    return [ep for g in played for ep in g if not ep.dropped], results, formats, groups, figures


def _pass_at_k(parts: RunParts) -> dict[str, Any]:
    """pass@k ([training] eval_pass_k = k > 1): k episodes per eval task sampled at the sampler's
    temperature, each env's eval tasks as the greedy eval's; the eval event's pass@k fields, plus the
    sampled episodes' exactness counts (added to the event's). {} when k is 1."""
    k = parts.cfg.training.eval_pass_k
    if k <= 1:
        return {}
    rows = []
    for e in parts.envs:
        if not e.cfg.training.eval_tasks:
            continue
        view = e.cfg
        tasks, groups = eval_episodes(view, e.driver, e.pool, view.env.eval_split, view.training.eval_tasks,
                                      seed=ranks.rank_seed(parts.cfg.run.seed), rank_share=True,
                                      report_as=names.EVAL_PROGRESS_EVENT, greedy=False, samples=k)
        tag = [e.name] if parts.cfg.is_mixture else []
        rows += [[t["index"], sum(int(ep.success) for ep in g if not ep.dropped),
                  sum(not ep.dropped for ep in g), *tag] for t, g in zip(tasks, groups)]
    rows = ranks.gather_rows(rows)
    s = ranks.rollout_snapshot(parts.counts)  # kept out of the greedy figures and the next step's
    p = pass_figures([(c, n) for _, c, n, *_ in rows], k)
    return {names.EVAL_PASS_K: k, names.EVAL_PASS_AT_1: _round(p["pass_at_1"]),
            names.EVAL_PASS_AT_K: _round(p["pass_at_k"]), names.EVAL_PASS_AT_K_SE: _round(p["pass_at_k_se"]),
            names.EVAL_PASS_RESULTS: rows, names.PREFIX_MISMATCHES: s[names.PREFIX_MISMATCHES],
            names.BRIDGE_FALLBACKS: s[names.BRIDGE_FALLBACKS]}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 6) if values else None


def _progress(event: str, total: int, every_s: float = 5.0):
    """A driver callback logging `event` now (0 done), at the first finished group, every `every_s` seconds
    and at the last: a long CPU rollout is never silent."""
    t0 = last = time.perf_counter()
    log.info(event, done=0, tasks=total, elapsed_s=0.0)

    def report(done: int, tasks: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if done in (1, tasks) or now - last >= every_s:
            last = now
            log.info(event, done=done, tasks=tasks, elapsed_s=round(now - t0, 1))

    return report


def _brief(message: dict, limit: int = 160) -> str:
    calls = [f"{c['function']['name']}({c['function'].get('arguments')})" for c in message.get("tool_calls")
             or []]
    text = " ".join(filter(None, [message.get("content") or "", *calls]))
    return f"{message.get('role')}: {text[:limit]}"
