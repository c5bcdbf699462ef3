"""`[training]`: the loop's settings (its steps and warm start, evaluation, checkpoints, when it stops), each
written once by its `option(...)` in `LoopSettings` (trainers/spec.py's mechanism: key, default, meaning,
bounds); `TrainingConfig` is the section those options make, with the trainer's own `[training]` options
(`steps_per_generation`, `num_iterations`). The rollout's settings are quaero/config/rollout.py's, guided
episodes' quaero/config/guidance.py's, the loss's quaero/config/loss.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import model_validator

from quaero.config.base import Located, _Section, with_trainer_options
from quaero.resolve import split_name
from trainers.spec import option


@dataclass(frozen=True)
class LoopSettings:
    """The training loop: small first-run defaults (`quaero check` prints the work they mean)."""

    steps: int = option(5, "training.steps", ge=0, about="RL steps (after the warm start)")
    warmup_sft_steps: int = option(
        0, "training.warmup_sft_steps", ge=0,
        about="warm-start SFT steps on the env's oracle demos, before RL")
    oracle: str | None = option(
        None, "training.oracle",
        about="the warm start's demonstrator `package.module:function` (unset: `oracle_policy` beside the "
              "entry); required for a warm start against url/urls servers")
    warmup_sft_lr: float | None = option(
        None, "training.warmup_sft_lr", gt=0, le=1,  # as [backend] lr's bound
        about="the warm start's learning rate (unset: `[backend] lr`, which the RL steps always use)")
    # AdamW's moments after a warm start: kept, its momentum keeps moving the weights along the SFT gradient
    # for ~10 RL steps (beta1 0.9)
    rl_optimizer_start: Literal["continue", "reset_momentum", "reset"] = option(
        "continue", "training.rl_optimizer_start",
        about="AdamW's state at the first RL step after a warm start: `continue`, `reset_momentum` (first "
              "moment zeroed) or `reset` (both moments zeroed)")
    checkpoint_every: int = option(
        5, "training.checkpoint_every", ge=1, about="checkpoint every this many steps (and at the end)")
    keep_checkpoints: int = option(
        2, "training.keep_checkpoints", ge=1, about="checkpoints kept; older ones are pruned")
    eval_every: int = option(
        5, "training.eval_every", ge=0,
        about="evaluate every this many steps (0: never); also before the first and after the last step")
    eval_tasks: int = option(4, "training.eval_tasks", ge=0, about="held-out tasks per evaluation (greedy)")
    eval_pass_k: int = option(
        1, "training.eval_pass_k", ge=1,
        about="pass@k at each evaluation: k > 1 also samples k episodes per eval task at the sampler's "
              "temperature (k times the greedy episodes; `quaero eval --pass-k` too); 1 = off")
    max_empty_steps: int = option(
        3, "training.max_empty_steps", ge=1,
        about="this many consecutive steps without a trained row end the run (exit 1)")
    rl_token_budget: int | None = option(
        None, "training.rl_token_budget", gt=0,
        about="RL's budget of generated tokens (kept episodes' action tokens, resumes included): RL ends "
              "after the step that reaches it (`steps` its bound; an `rl_token_budget_spent` line); what "
              "comparisons of task samplers hold equal")
    # a lost episode is never trained; "stop" keeps the last checkpoint as the resume point
    on_env_loss: Literal["continue", "stop"] = option(
        "continue", "training.on_env_loss",
        about="an RL step whose env lost episodes (a dead server, timeouts past the retries; never trained): "
              "`continue` (counted per env) or `stop` the run before it trains, naming the env")


@with_trainer_options("training", LoopSettings)
class TrainingConfig(_Section):
    """The loop, with the trainer's `steps_per_generation` and `num_iterations` (optimizer steps per rollout
    batch)."""

    @model_validator(mode="after")
    def _an_import_path(self) -> TrainingConfig:
        if self.oracle is not None:  # judged by its shape; quaero check imports it (preflight/plan.py)
            split_name(self.oracle, "oracle", error=Located, example="my_env.oracle:oracle_policy")
        return self
