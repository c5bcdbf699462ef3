"""Several optimizer steps per rollout batch (`[training] steps_per_generation`, `num_iterations`: TRL's
names): the batch's episodes are split into `steps_per_generation` mini-batches, each one optimizer step
(trainers/step.py `shared_forward_step`, its losses normalised over its own rows), and the pass over them
repeats `num_iterations` times; without them each batch is one step and every ratio is the sampler mismatch
alone, so clipping, GSPO's sequence ratio and CISPO's weight barely act on-policy.

The ratio's lp_old: without a sampler correction it is the sampler's log-prob in every mini-step (PPO
against the behaviour policy: the ratio grows as the mini-steps move the policy); with one, the trainer's own
log-probs are recorded once, before the first mini-step (no grad, at the step's temperature), and every
mini-step's ratio compares with them while the sampler weight corrects the sampler's mismatch against them
(trainers/policy_losses.py). An SFT step is always one step. The KL penalty's reference log-probs
(trainers/reference.py) are computed once per rollout batch, before its first step, and read by every
mini-step: the reference never moves.

The metrics of the mini-steps are merged into one event as each name totals (quaero/telemetry/names.py):
counts summed, peaks the largest, settings the last, per-step figures (losses, grad norm, ratios) their mean
over the mini-steps where measured (`step_time_s` their sum; per-rank lists: the last's); `optimizer_steps`
says how many there were.
"""
from __future__ import annotations

import time
from typing import Any

from quaero.rows import EchoRow
from quaero.telemetry import metrics, names
from trainers.step import TrainerView, audit_logprobs, shared_forward_step, step_temperature, tree_blocker


def mini_batches(rows: list[EchoRow], n: int) -> list[list[int]]:
    """Row indices in `n` mini-batches of whole episodes (rows sharing `meta["episode"]`; a row without one
    is its own), in order, their episode counts differing by at most one; fewer when there are fewer
    episodes."""
    episodes: dict[object, list[int]] = {}
    for i, r in enumerate(rows):
        episodes.setdefault(r.meta.get("episode", ("row", i)), []).append(i)
    groups = list(episodes.values())
    n = max(1, min(n, len(groups)))
    return [[i for g in groups[k * len(groups) // n:(k + 1) * len(groups) // n] for i in g] for k in range(n)]


def merge_metrics(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """One event from the mini-steps' metrics, each name totalled as it totals over a run."""
    out: dict[str, Any] = {}
    for name, last in steps[-1].items():
        values = [m[name] for m in steps if m.get(name) is not None]
        numbers = bool(values) and all(type(v) in (int, float) for v in values)
        total = metrics.total_of(name, last)
        if numbers and (total == metrics.SUM or name == names.STEP_TIME_S):  # the batch's seconds: all steps'
            out[name] = sum(values)
        elif numbers and total == metrics.MAX:
            out[name] = max(values)
        elif numbers and total == metrics.STEP:
            out[name] = sum(values) / len(values)
        else:
            out[name] = last
    return out


def reference_logprobs(trainer: TrainerView, rows: list[EchoRow], *, sft: bool
                       ) -> tuple[list[list[float]] | None, float | None]:
    """The frozen reference's log-probs of an RL batch's KL targets (trainers/reference.py), once for all its
    mini-steps (the reference never moves), and their seconds; (None, None) without a reference."""
    if sft or trainer.reference is None:
        return None, None
    t0 = time.perf_counter()
    ref = trainer.reference.logprobs(trainer.spec, rows, step_temperature(trainer.spec, sft=False),
                                     trainer.device, blocker=tree_blocker(trainer))
    return ref, time.perf_counter() - t0


def rollout_batch_step(trainer: TrainerView, rows: list[EchoRow], *, sft: bool, echo_weight: float | None
                       ) -> dict[str, Any]:
    """The optimizer steps of one rollout batch (one, unless the spec asks for more); its merged metrics."""
    spec = trainer.spec
    ref, ref_seconds = reference_logprobs(trainer, rows, sft=sft)
    if sft or spec.steps_per_generation * spec.num_iterations == 1:
        return shared_forward_step(trainer, rows, sft=sft, echo_weight=echo_weight, ref_logprobs=ref,
                                   reference_seconds=ref_seconds)
    old = (audit_logprobs(trainer, rows, step_temperature(spec, sft=False))
           if spec.sampler_correction != "none" else None)
    chunks = mini_batches(rows, spec.steps_per_generation)
    steps = [shared_forward_step(trainer, [rows[i] for i in chunk], sft=False, echo_weight=echo_weight,
                                 old_logprobs=None if old is None else [old[i] for i in chunk],
                                 ref_logprobs=None if ref is None else [ref[i] for i in chunk],
                                 reference_seconds=ref_seconds if k == 0 else None)  # the batch's, once
             for k, chunk in enumerate(chunk for _ in range(spec.num_iterations) for chunk in chunks)]
    return merge_metrics(steps)
