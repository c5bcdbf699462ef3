"""The two sides of `quaero bench peers-trl`, each in a process of its own (its own peak RSS), stepped in
turns.

A side is `run(setup, conn)`: it builds its framework on the shared `setup` (the same HF model folder, the
same config, tasks, group size, max tokens and turn limit), sends one `ready` message (initial-weight hash,
RSS), then, for each "step" it receives, runs one RL step and sends that step's figures; "stop" ends it.

- quaero: `quaero.recipe.parts.build` + `quaero.recipe.train.run_step` (the recipe `quaero train` runs), rows
  saved and read back.
- TRL: `GRPOTrainer(environment_factory=...)` over the same env served on 127.0.0.1 (benchmarks.trl_env),
  driven by its own `train()`; a callback holds each step until the coordinator sends "step". A subclass
  only observes: it records every sampler call and every batch `_compute_loss` scores, then calls TRL's own.
"""
from __future__ import annotations

import hashlib
import json
import resource
import time
from typing import Any

from transformers import TrainerCallback

from benchmarks.token_drift import generation_drift, saved_row_drift
from quaero.telemetry import names


def rss_mb() -> float:
    """Current resident set size (Linux /proc), MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return round(pages * resource.getpagesize() / 2**20, 1)


def peak_rss_mb() -> float:
    """The process's peak resident set size, MiB (the trainer's own CPU peak reading, trainers/memory.py)."""
    from trainers.memory import process_peak_mb

    return round(process_peak_mb("cpu"), 1)


def weights_sha(model) -> str:
    """sha256 over every parameter (name and fp32 bytes, in name order; a tied weight once)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def optimizer_sha(model, optimizer) -> str:
    """sha256 over each parameter's optimizer settings and state (name order: lr, betas, eps, weight decay,
    then
    step, exp_avg, exp_avg_sq), whatever the optimizer's grouping: two AdamW that start alike hash alike."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        g = group_of[id(p)]
        h.update(json.dumps([name, g["lr"], list(g["betas"]), g["eps"], g["weight_decay"]]).encode())
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            h.update(key.encode())
            h.update(value.detach().float().cpu().reshape(-1).numpy().tobytes())
    return h.hexdigest()[:16]


def start_optimizer(optimizer, setup: dict, cfg) -> None:
    """With `setup["optimizer_from"]` (a quaero checkpoint folder, `--from RUN --from-step N`): load its AdamW
    state into `optimizer` (over the same model's parameters, in the same order), set the RL lr, then start RL
    as `[training] rl_optimizer_start` says (what the main job does after its warm start): `reset_momentum`
    zeroes the first moments and keeps the second moments and step counts, `reset` forgets the state,
    `continue` keeps it. Without it, both sides' AdamW start empty."""
    if not setup.get("optimizer_from"):
        return
    from pathlib import Path

    from quaero.recipe import checkpoint
    from trainers.base import reset_optimizer_state

    saved_run = checkpoint.RunState.from_state(checkpoint.load(Path(setup["optimizer_from"])))
    state = saved_run.trainer["optimizer"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = state["state"]
    if len(params) != sum(len(g["params"]) for g in state["param_groups"]) or any(
            tuple(saved[i]["exp_avg"].shape) != tuple(p.shape) for i, p in enumerate(params) if i in saved):
        raise ValueError(f"{setup['optimizer_from']}: its optimizer state does not fit this model's "
                         "parameters")
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = cfg.backend.lr
    start = cfg.training.rl_optimizer_start
    if start != "continue":  # what the recipe does at the first RL step (quaero/recipe/train.py)
        reset_optimizer_state(optimizer, momentum_only=start == "reset_momentum")


def quaero_config(setup: dict):
    from quaero.config import load_config

    return load_config(setup["config"], setup["overrides"] + [
        f"model.name={json.dumps(setup['model'])}", "echo.enabled=false", "training.warmup_sft_steps=0",
        f"training.steps={setup['steps']}", "training.eval_every=0", "training.eval_tasks=0",
        'logging.save_rows="all"', 'logging.console="none"', "logging.progress=false",
        f"run.output_dir={json.dumps(setup['out'])}", 'run.name="quaero"', f"run.seed={setup['seed']}"])


def save_final(setup: dict, name: str, model) -> dict:
    """With `setup["save_final"]`: the side's weights after its last step as an HF folder (quaero's export
    format, the tokenizer of the shared starting folder), for `quaero eval --compare`."""
    if not setup.get("save_final"):
        return {}
    from pathlib import Path

    from quaero.models.load import load_tokenizer
    from quaero.recipe.model_folder import save_model

    out = save_model(model, load_tokenizer(setup["model"]), Path(setup["save_final"]) / name,
                     base_name=setup["model"])
    return {"final_weights": str(out), "final_weights_sha": weights_sha(model)}


def _ready(conn, model, extra: dict) -> None:
    conn.send({"ready": True, "weights_sha": weights_sha(model), "rss_ready_mb": rss_mb(), **extra})


# ── quaero ───────────────────────────────────────────────────────────────────────────────────────


def run_quaero(setup: dict, conn) -> None:
    import torch

    from quaero.config import SINGLE
    from quaero.openenv_client import open_envs
    from quaero.recipe.parts import build
    from quaero.recipe.progress import RunProgress
    from quaero.recipe.train import run_step
    from quaero.telemetry.runlog import configure

    torch.set_num_threads(setup["threads"])
    cfg = quaero_config(setup)
    configure("warning", "none")
    torch.manual_seed(cfg.run.seed)
    n_sessions = cfg.rollout.tasks_per_step * cfg.rollout.group_size
    with open_envs(cfg.env, n_sessions, log_dir=cfg.run_dir / names.ENV_SERVERS) as pool:
        resets: list[tuple] = []
        for s in pool.sessions:  # record what each episode really resets to
            s.reset = _recording(s.reset, resets)
        c = build(cfg, {SINGLE: pool}, pool.counts)  # a one-env run: its env is named SINGLE
        try:
            start_optimizer(c.trainer.optimizer, setup, cfg)
            _ready(conn, c.trainer.model, {"sampler": type(c.sampler).__name__,
                                           "optimizer_sha": optimizer_sha(c.trainer.model,
                                                                          c.trainer.optimizer)})
            step, progress = 0, RunProgress()
            while conn.recv() == "step":
                step += 1
                resets.clear()
                t0 = time.perf_counter()
                m = run_step(c, progress, step, sft=False)
                total = time.perf_counter() - t0
                conn.send(_quaero_figures(cfg, step, m, total, resets))
            saved = save_final(setup, "quaero", c.trainer.model)
        finally:
            c.sampler.close()
    conn.send({"peak_rss_mb": peak_rss_mb(), **saved})


def _recording(reset, out: list):
    def recorded(seed, split=None, index=None):
        out.append((seed, split, index))
        return reset(seed, split, index)
    return recorded


def _quaero_figures(cfg, step: int, m: dict[str, Any], total: float, resets: list[tuple]) -> dict[str, Any]:
    from quaero.recipe.saved_rows import step_file

    path = step_file(cfg.run_dir, step)
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    rollout = float(m.get("rollout_time_s", 0.0))
    return {
        "step_s": round(total, 3), "rollout_s": round(rollout, 3), "train_s": round(total - rollout, 3),
        "env_s": m.get("env_time_s"), "generate_s": m.get("sampler_time_s"),
        "row_tokens": int(m.get("row_tokens", 0)), "action_tokens": int(m.get("action_tokens", 0)),
        "trained_tokens": sum(len(r["input_ids"]) for r in records if any(r["advantages"])),
        "rows": int(m.get("rows", 0)), "episodes": len(resets), "reward_mean": m.get("reward_mean"),
        "turns_mean": m.get("turns_mean"), "rss_mb": rss_mb(), "peak_rss_mb": peak_rss_mb(),
        "first_prompt_tokens": _first_prompt_tokens(records),
        "tasks": sorted({(s, sp, i) for s, sp, i in resets}), "group_sizes": _group_sizes(resets),
        "drift": saved_row_drift(records).as_dict(), "metrics": {k: v for k, v in m.items() if _scalar(v)},
    }


def _first_prompt_tokens(records: list[dict]) -> int | None:
    starts = [end for kind, _, end, _ in records[0]["spans"] if kind == "prompt"] if records else []
    return min(starts) if starts else None


def _group_sizes(resets: list[tuple]) -> list[int]:
    counts: dict[tuple, int] = {}
    for r in resets:
        counts[r] = counts.get(r, 0) + 1
    return sorted(counts.values())


def _scalar(v) -> bool:
    return isinstance(v, (int, float, str, bool)) or v is None


# ── TRL ─────────────────────────────────────────────────────────────────────────────────────────


# quaero's [loss] aggregation -> TRL's loss_type of the same shape. Each averages over a different
# set:
# quaero over the step's RL tokens (A != 0) or episodes with such tokens, TRL over every completion token or
# completion of the batch (a group with equal rewards adds zeros to the sum and to the count); the constant
# differs too (quaero: tasks x group x max_turns x max_tokens, TRL: batch x max_completion_length).
TRL_LOSS_TYPES = {"token_mean": "dapo", "sequence_mean": "grpo", "constant": "dr_grpo"}


def trl_args(setup: dict, cfg, output_dir: str):
    """GRPOConfig for the job quaero runs: the same group size, tasks per step, per-turn max tokens, turn
    limit, temperature, lr (constant), clip, grad clip; advantages reward - group mean (no std scaling), no
    KL, one optimizer step per generation, fp32 on CPU, no gradient checkpointing (quaero's default)."""
    from trl import GRPOConfig

    t = cfg.rollout
    return GRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, seed=cfg.run.seed, max_steps=setup["steps"],
        per_device_train_batch_size=t.tasks_per_step * t.group_size, gradient_accumulation_steps=1,
        num_generations=t.group_size, shuffle_dataset=False,
        generation_kwargs={"max_new_tokens": cfg.sampler.max_tokens},  # per turn, as quaero's max_tokens
        # the whole episode's budget (TRL's meaning)
        max_completion_length=setup["trl_max_completion_length"],
        max_tool_calling_iterations=cfg.env.max_turns - 1, temperature=cfg.sampler.temperature,
        top_p=cfg.sampler.top_p, learning_rate=cfg.backend.lr, lr_scheduler_type="constant",
        weight_decay=cfg.backend.weight_decay, max_grad_norm=cfg.backend.max_grad_norm,
        adam_beta1=cfg.backend.betas[0], adam_beta2=cfg.backend.betas[1],
        epsilon=getattr(cfg.loss.policy, "clip_eps_low", None) or 0.2,
        scale_rewards="none", loss_type=TRL_LOSS_TYPES[cfg.loss.aggregation], beta=0.0, num_iterations=1,
        gradient_checkpointing=False,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        model_init_kwargs={"dtype": "float32"})


def run_trl(setup: dict, conn) -> None:
    import torch
    from datasets import Dataset
    from trl import GRPOTrainer

    from benchmarks.trl_env import EnvTimes, trl_environment
    from quaero.openenv_client.server import LocalServer
    from quaero.openenv_client.tasks import catalog_over_http
    from quaero.rollout.tasks import task_reset

    torch.set_num_threads(setup["threads"])
    cfg = quaero_config(setup)
    t = cfg.rollout
    server = LocalServer(cfg.env.entry, cfg.env.host,
                         max_concurrent_envs=2 * t.tasks_per_step * t.group_size + 1,
                         kwargs=cfg.env.kwargs, action=cfg.env.action).start()
    try:
        env_cls = trl_environment(server.http_url, timeout_s=cfg.env.step_timeout_s)
        # the env's Task API, as quaero's recipe reads it: a run seed other than 0 orders the train split
        catalog = catalog_over_http(server.http_url, cfg.env.reset_timeout_s)
        tasks = [task_reset(cfg, cfg.env.train_split, i,
                            catalog) for i in range(setup["steps"] * t.tasks_per_step)]
        system = [{"role": "system", "content": env_cls.system_prompt}] if env_cls.system_prompt else []
        data = Dataset.from_list([{"prompt": system + [{"role": "user", "content": ""}],
                                   **task} for task in tasks])
        resets: list[tuple] = []
        env_cls.reset = _recording_trl_reset(env_cls.reset, resets)
        record: dict[str, list] = {"calls": [], "rows": [], "generate_s": [0.0], "rollout_s": [0.0],
                                   "episodes": []}

        class Observed(GRPOTrainer):
            def _generate_single_turn(self, prompt_ids, *args, **kwargs):
                t0 = time.perf_counter()
                completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
                record["generate_s"][0] += time.perf_counter() - t0
                record["calls"] += [(list(p), list(c)) for p, c in zip(prompt_ids, completion_ids)]
                return completion_ids, logprobs

            def _generate_and_score_completions(self, inputs):
                t0 = time.perf_counter()
                out = super()._generate_and_score_completions(inputs)
                record["rollout_s"][0] += time.perf_counter() - t0
                record["episodes"] += [(e.reward, e.tool_calls) for e in self.environments]
                return out

            def _compute_loss(self, model, inputs):
                record["rows"] += _scored_rows(inputs)
                return super()._compute_loss(model, inputs)

        model, optimizers = setup["model"], (None, None)
        if setup.get("optimizer_from"):  # TRL takes a model object and an optimizer over its parameters
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32)
            optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.backend.lr,
                                          betas=tuple(cfg.backend.betas),
                                          weight_decay=cfg.backend.weight_decay)
            start_optimizer(optimizer, setup, cfg)
            optimizers = (optimizer, None)  # TRL's own scheduler (constant) on top of it
        args = trl_args(setup, cfg, f"{setup['out']}/trl")
        if not isinstance(model, str):
            args.model_init_kwargs = None
        trainer = Observed(model=model, args=args, train_dataset=data, environment_factory=env_cls,
                           optimizers=optimizers)
        trainer.add_callback(_Turns(conn, record, resets, env_cls, EnvTimes))
        sha = optimizer_sha(trainer.model, trainer.optimizer) if trainer.optimizer is not None else None
        _ready(conn, trainer.model, {"sampler": "transformers.generate", "optimizer_sha": sha})
        trainer.train()
        if conn.recv() != "stop":
            raise RuntimeError("peers-trl: the coordinator asked for more steps than max_steps")
        saved = save_final(setup, "trl", trainer.accelerator.unwrap_model(trainer.model))
    finally:
        server.stop()
    conn.send({"peak_rss_mb": peak_rss_mb(), **saved})


def _recording_trl_reset(reset, out: list):
    def recorded(self, **row):
        out.append((row["seed"], row["split"], row["index"]))
        return reset(self, **row)
    return recorded


def _scored_rows(inputs: dict) -> list[tuple[list[int], list[bool], bool]]:
    """(ids, action mask, has a non-zero advantage) of each row `_compute_loss` scores: the prompt's real
    tokens, then the completion's, the mask being completion_mask x tool_mask (what TRL's loss reads)."""
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    rows = []
    for p, pm, c, cm, m, a in zip(inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"],
                                  inputs["completion_mask"], mask, inputs["advantages"]):
        prompt = p[pm.bool()].tolist()
        n = int(cm.sum())  # right-padded: the real completion tokens come first
        rows.append((prompt + c[:n].tolist(), [False] * len(prompt) + [bool(x) for x in m[:n].tolist()],
                     bool(a.abs().sum() > 0)))
    return rows


class _Turns(TrainerCallback):
    """Holds each TRL step until the coordinator says "step"; after it, sends the step's figures."""

    def __init__(self, conn, record, resets, env_cls, env_times) -> None:
        self.conn, self.record, self.resets = conn, record, resets
        self.env_cls, self.env_times = env_cls, env_times
        self.t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if self.conn.recv() != "step":
            raise RuntimeError("peers-trl: stopped before TRL's max_steps")
        self.resets.clear()
        self.record.update(calls=[], rows=[], generate_s=[0.0], rollout_s=[0.0], episodes=[])
        self.env_times.take()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        total = time.perf_counter() - self.t0
        env_s, _ = self.env_times.take()
        rows, calls, episodes = self.record["rows"], self.record["calls"], self.record["episodes"]
        rollout = self.record["rollout_s"][0]
        self.conn.send({
            "step_s": round(total, 3), "rollout_s": round(rollout, 3), "train_s": round(total - rollout, 3),
            "env_s": round(env_s, 3), "generate_s": round(self.record["generate_s"][0], 3),
            "row_tokens": sum(len(ids) for ids, _, _ in rows),
            "action_tokens": sum(sum(m) for _, m, _ in rows),
            "trained_tokens": sum(len(ids) for ids, _, signal in rows if signal),
            "rows": len(rows), "episodes": len(self.resets), "rss_mb": rss_mb(), "peak_rss_mb": peak_rss_mb(),
            "reward_mean": sum(r for r, _ in episodes) / len(episodes) if episodes else None,
            "tool_calls_mean": sum(n for _, n in episodes) / len(episodes) if episodes else None,
            "sampler_calls": len(calls), "first_prompt_tokens": len(calls[0][0]) if calls else None,
            "tasks": sorted(set(self.resets)), "group_sizes": _group_sizes(self.resets),
            "drift": generation_drift(calls, [(ids, m) for ids, m, _ in rows]).as_dict(),
        })
