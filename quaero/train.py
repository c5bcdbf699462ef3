"""The main job, as a recipe: rollout -> rows -> backend step -> weight sync -> checkpoint -> log.

Step numbering is global: steps 1..W are warm-start SFT on the environment's oracle demonstrations
(when `[training] warmup_sft_steps = W`), steps W+1..W+N are RL + ECHO. Evaluation (greedy, eval
split) runs before the first step (the untrained baseline) and every `eval_every` steps.

Determinism: the sampler seed of step k and the tasks of step k are functions of (run seed, k), so
a run interrupted after step k and resumed from its checkpoint reproduces step k+1 exactly.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from quaero import checkpoint
from quaero.config import QuaeroConfig
from quaero.metrics import Cumulative, RunLog, configure, get_logger, set_step

log = get_logger(__name__)


def group_advantages(rewards: list[float]) -> list[float]:
    """Group-relative advantages: reward minus the group mean (no std scaling, so a group whose
    rewards are nearly equal is not blown up into a large signal). All-equal groups give zeros:
    their rows still train ECHO."""
    mean = statistics.fmean(rewards)
    return [r - mean for r in rewards]


@dataclass
class Components:
    cfg: QuaeroConfig
    backend: object
    sampler: object
    render: object
    driver: object
    audit: object
    pool: object
    shares_model: bool
    oracle: object = None
    cumulative: Cumulative = field(default_factory=Cumulative)
    cursor: int = 0  # next train task index


def _task(cfg: QuaeroConfig, split: str, index: int) -> dict:
    return {"seed": cfg.run.seed * 1_000_003 + index, "split": split, "index": index}


def build(cfg: QuaeroConfig, pool) -> Components:
    from quaero.model import load_tokenizer, resolve_device
    from quaero.render import RenderAdapter
    from quaero.rollout import EpisodeDriver, ExactnessAudit
    from quaero.sampling import make_sampler
    from trainers.registry import backend_class

    device = resolve_device(cfg.run.device)
    backend = backend_class(cfg.backend.backend)(cfg, device)  # unsloth is imported first inside, if chosen
    render = RenderAdapter(load_tokenizer(cfg.model.name), cfg.model)
    sampler = make_sampler(cfg, model=backend.model, stop_token_ids=render.stop_token_ids, device=device)
    audit = ExactnessAudit(strict=cfg.training.strict)
    driver = EpisodeDriver(render, sampler, cfg, audit)
    oracle = None
    if cfg.training.warmup_sft_steps:
        oracle = _oracle_for(cfg)
    return Components(cfg, backend, sampler, render, driver, audit, pool,
                      shares_model=getattr(sampler, "shares_model", False), oracle=oracle)


def _oracle_for(cfg: QuaeroConfig):
    """The env package's `oracle_policy(info)`, found next to the env entry point."""
    import importlib

    module = importlib.import_module((cfg.env.entry or "").partition(":")[0])
    policy = getattr(module, "oracle_policy", None)
    if policy is None:
        from quaero.config import ConfigError

        raise ConfigError(f"[training] warmup_sft_steps={cfg.training.warmup_sft_steps}: env module "
                          f"{module.__name__!r} has no oracle_policy(info); set warmup_sft_steps = 0")
    return policy


def _collect(c: Components, step: int, *, sft: bool):
    """Run one batch of groups; return (rows, episode stats)."""
    cfg = c.cfg
    n_tasks = cfg.training.tasks_per_step
    tasks = [_task(cfg, cfg.env.train_split, c.cursor + i) for i in range(n_tasks)]
    c.cursor += n_tasks
    groups = c.driver.run(c.pool.sessions, tasks, group_size=1 if sft else cfg.training.group_size,
                          policy=c.oracle if sft else None, seed=cfg.run.seed * 7919 + step)
    rows, rewards, successes, dropped = [], [], [], 0
    for group in groups:
        kept = [e for e in group if not e.dropped]
        dropped += len(group) - len(kept)
        if not kept:
            continue
        advs = [1.0] * len(kept) if sft else group_advantages([e.reward for e in kept])
        for ep, adv in zip(kept, advs):
            rows.extend(r.with_advantage(adv) for r in ep.rows)
            rewards.append(ep.reward)
            successes.append(float(ep.success))
    stats = {"episodes": sum(len(g) for g in groups), "episodes_dropped": dropped,
             "reward_mean": statistics.fmean(rewards) if rewards else None,
             "success_rate": statistics.fmean(successes) if successes else None,
             "turns_mean": statistics.fmean([e.turns for g in groups for e in g if not e.dropped] or [0])}
    return rows, stats


def evaluate(c: Components, step: int) -> None:
    cfg = c.cfg
    if not cfg.training.eval_tasks:
        return
    t0 = time.perf_counter()
    tasks = [_task(cfg, cfg.env.eval_split, i) for i in range(cfg.training.eval_tasks)]
    groups = c.driver.run(c.pool.sessions, tasks, group_size=1, greedy=True, seed=cfg.run.seed)
    eps = [e for g in groups for e in g if not e.dropped]
    reward = statistics.fmean([e.reward for e in eps]) if eps else None
    success = statistics.fmean([float(e.success) for e in eps]) if eps else None
    sample = [_brief(m) for m in eps[0].messages[1:]] if eps else []  # what the model does, for humans
    # eval's own exactness and env counters, kept out of the next train step's
    audit, env = c.audit.snapshot_and_reset(), c.pool.counters.snapshot_and_reset()
    log.info("eval", eval_reward=reward, eval_success_rate=success, eval_episodes=len(eps),
             eval_dropped=sum(len(g) for g in groups) - len(eps), eval_time_s=round(time.perf_counter() - t0, 2),
             prefix_mismatches=audit.get("prefix_mismatches", 0), bridge_fallbacks=audit.get("bridge_fallbacks", 0),
             env_retries=env.get("env_retries", 0), env_episodes_dropped=env.get("env_episodes_dropped", 0),
             sample_transcript=sample)


def _brief(message: dict, limit: int = 160) -> str:
    calls = [f"{c['function']['name']}({c['function'].get('arguments')})" for c in message.get("tool_calls") or []]
    text = " ".join(filter(None, [message.get("content") or "", *calls]))
    return f"{message.get('role')}: {text[:limit]}"


def train_step(c: Components, step: int, *, sft: bool) -> dict:
    t0 = time.perf_counter()
    rows, stats = _collect(c, step, sft=sft)
    t_rollout = time.perf_counter() - t0
    metrics = {"phase": "sft" if sft else "rl", **stats, "rows": len(rows), "rollout_time_s": round(t_rollout, 3)}
    if rows:
        c.backend.set_lr(c.cfg.lr_for(sft=sft))
        metrics.update(c.backend.train_step(rows, sft=sft))
        if not c.shares_model:
            t_sync = time.perf_counter()
            c.sampler.update_weights(c.backend.export_weights())
            metrics.update(weights_pushed=1, weight_sync_s=round(time.perf_counter() - t_sync, 3))
    metrics.update(c.pool.counters.snapshot_and_reset())
    metrics.update(c.audit.snapshot_and_reset())
    total = time.perf_counter() - t0
    metrics["total_step_time_s"] = round(total, 3)
    metrics["tokens_per_s"] = round(metrics.get("row_tokens", 0) / total, 1) if total > 0 else 0.0
    return metrics


def _save(c: Components, step: int) -> Path:
    state = {"step": step, "cursor": c.cursor, "backend": c.backend.state_dict(),
             "rng": checkpoint.rng_state(), "cumulative": c.cumulative.totals}
    path = checkpoint.save(c.cfg.run_dir / "checkpoints", step, state, keep=c.cfg.training.keep_checkpoints)
    log.info("checkpoint_saved", path=str(path))
    return path


def _resume(c: Components) -> int:
    found = checkpoint.load_latest(c.cfg.run_dir / "checkpoints")
    if found is None:
        return 0
    path, state = found
    c.backend.load_state_dict(state["backend"])
    if not c.shares_model:
        c.sampler.update_weights(c.backend.export_weights())
    checkpoint.set_rng_state(state["rng"])
    c.cursor = state["cursor"]
    c.cumulative = Cumulative(state["cumulative"])
    log.info("resumed", path=str(path), step=state["step"])
    return state["step"]


class StopRequest:
    """First Ctrl-C: finish the current step, checkpoint it, stop cleanly. Second Ctrl-C: abort now
    (the last periodic checkpoint stays the resume point: a half-done step is never saved)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("stop_requested", note="finishing this step, then checkpointing; Ctrl-C again aborts")

    def __exit__(self, *exc) -> None:
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _loop(c: Components, stop: StopRequest, tqdm, run_id: str) -> None:
    cfg = c.cfg
    start = _resume(c)
    total = cfg.training.warmup_sft_steps + cfg.training.steps
    if start == 0 and cfg.training.eval_every:
        evaluate(c, 0)
    bar = tqdm(range(start + 1, total + 1), initial=start, total=total, desc="train", unit="step",
               disable=not cfg.logging.progress or not sys.stderr.isatty())  # no bar in a log file
    for step in bar:
        set_step(step)
        m = train_step(c, step, sft=step <= cfg.training.warmup_sft_steps)
        log.info("train_step", **m, cumulative=c.cumulative.add(m))
        bar.set_postfix(reward=m.get("reward_mean"), echo=m.get("echo_loss"), rl=m.get("rl_loss"))
        if step % cfg.training.checkpoint_every == 0 or step == total or stop.requested:
            _save(c, step)
        if stop.requested:
            log.info("run_end", status="interrupted", steps=step, run_id=run_id)
            raise KeyboardInterrupt
        if cfg.training.eval_every and (step % cfg.training.eval_every == 0 or step == total):
            evaluate(c, step)
    from quaero.export import save_final

    save_final(c.backend, cfg)  # runs/NAME/final/: the model a user takes away, a standard HF folder
    log.info("run_end", status="finished", steps=total, run_id=run_id)


def train(cfg: QuaeroConfig, *, resume: bool = False, source: str = "config") -> Path:
    """Run the job; returns the run folder. Ctrl-C finishes the step, checkpoints, shuts down env servers
    and the sampler, and raises KeyboardInterrupt (the CLI exits 130)."""
    if cfg.backend.backend == "unsloth":
        from trainers.registry import backend_class

        backend_class("unsloth")  # unsloth must be imported before transformers to patch it
    import torch
    from tqdm.auto import tqdm

    from quaero.openenv_client import open_envs

    configure(cfg.logging.level, cfg.logging.console)
    run_dir = cfg.run_dir
    has_ckpt = any((run_dir / "checkpoints").glob("step-*"))
    if has_ckpt and not resume:
        log.info("auto_resume", run_dir=str(run_dir), note="existing checkpoints found; resuming "
                 "(use a new [run] name or delete the folder to start over)")
    torch.manual_seed(cfg.run.seed)
    if cfg.backend.options.train_supervised_context_tokens:
        log.warning("approximation", option="train_supervised_context_tokens",
                    value=cfg.backend.options.train_supervised_context_tokens,
                    note="rows are cropped before their first target: not exact full-context training")
    n_sessions = cfg.training.tasks_per_step * cfg.training.group_size
    with RunLog(run_dir) as run, open_envs(cfg.env, max(n_sessions, 1)) as pool, StopRequest() as stop:
        (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
        log.info("run_start", source=source, run_dir=str(run_dir), config=cfg.model_dump(mode="json"))
        c = build(cfg, pool)
        try:
            _loop(c, stop, tqdm, run.run_id)
        finally:
            c.sampler.close()
    return run_dir
