"""`quaero bench scaling RUN_DIR`: a throughput model built from a finished run's measured component costs,
predicting the RL step time and its bottleneck for given numbers of trainer and sampler devices.

    quaero bench scaling runs/toolbench --trainers 1,2,4,8 --samplers 0,2,4 [--off-policy-steps 1]
        [--allreduce-gb-s 100] [--env-ms-per-step 2.0] [--json PATH]

Measured (from the run's RL `train_step` events, means over its RL steps, on the machine that ran it;
a run of R ranks measures R devices at once, so its throughputs are divided by R):
- sampler generated tokens/s on one device: `rollout_action_tokens / (rollout_time_s - weight_sync_s
  - env time)`, the env time being `env_steps / ranks x --env-ms-per-step` when given (else 0: env latency
    then
  counts as sampling time, which is what the run measured);
- trainer row tokens/s on one device: `row_tokens / (total_step_time_s - rollout_time_s)`;
- weight push seconds per GB: `weight_sync_s / model GB` (the model's size on disk in `final/` or the
  newest checkpoint), only when the run's sampler kept its own copy of the weights (vLLM); a sampler that
  shares the trainer's module (hf) pushes nothing.

Model, for N trainer devices and S sampler devices (S = 0: the sampler is colocated, one per trainer
rank, as `quaero train --nproc N` runs today); the same workload per step (episodes, generated tokens,
row tokens) as the measured run:
- sample_s = generated tokens / (max(S, N if colocated) x sampler tokens/s) + env_steps / (that many
  devices) x env s/step: samplers and env sessions split the step's episodes evenly;
- train_s = row tokens / (N x trainer tokens/s) + all-reduce, the all-reduce of fp32 gradients (4 bytes
  a parameter, parameters = model bytes / the run's bytes per parameter) as a ring: 2 (N-1)/N x
  gradient GB / --allreduce-gb-s (not modelled when the flag is absent: a projection needs the link);
- push_s = model GB x push s/GB: the run's measured push (0 for a sampler sharing the trainer's module),
  or --push-s-per-gb, which separate sampler devices need when the run measured none;
- step_s = sample_s + push_s + train_s with --off-policy-steps 0 (today's loop); with k >= 1 the next
  step's rollouts overlap this step's training: step_s = max(sample_s, push_s + train_s).
The bottleneck is the largest term. With N = the run's ranks and S = 0 (and no env or link flags) the
model returns the measured step. Everything else is a projection: it assumes throughput splits linearly over
devices (perfect batching, no stragglers), which a real fleet only approaches.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from quaero.telemetry import names

GB = 1e9


@dataclass(frozen=True)
class Costs:
    """Component costs measured on one device (one process) of the machine that ran the run."""
    sampler_tokens_per_s: float
    trainer_tokens_per_s: float
    push_s_per_gb: float
    model_gb: float
    bytes_per_param: float


@dataclass(frozen=True)
class Workload:
    """One RL step of the run: episodes, sampled tokens, env steps, trained row tokens (means)."""
    episodes: float
    generated_tokens: float
    env_steps: float
    row_tokens: float
    measured_step_s: float
    measured_ranks: int = 1


def predict(costs: Costs, work: Workload, *, trainers: int, samplers: int, off_policy_steps: int = 0,
            env_s_per_step: float = 0.0, allreduce_gb_s: float | None = None) -> dict[str, float | str]:
    """The modelled step for `trainers` trainer devices and `samplers` sampler devices (0 = colocated)."""
    if trainers < 1 or samplers < 0 or off_policy_steps < 0:
        raise ValueError(f"trainers {trainers} >= 1, samplers {samplers} >= 0 and off-policy steps "
                         f"{off_policy_steps} >= 0 are required")
    sampling = samplers or trainers
    sample_s = (work.generated_tokens / (sampling * costs.sampler_tokens_per_s)
                + work.env_steps / sampling * env_s_per_step)
    allreduce_s = 0.0
    if allreduce_gb_s and trainers > 1:
        grad_gb = costs.model_gb / costs.bytes_per_param * 4
        allreduce_s = 2 * (trainers - 1) / trainers * grad_gb / allreduce_gb_s
    train_s = work.row_tokens / (trainers * costs.trainer_tokens_per_s) + allreduce_s
    if samplers > 0 and costs.push_s_per_gb == 0:
        raise ValueError("sampler devices of their own receive the weights every step, but the run measured "
                         "no weight push (its sampler shared the trainer's module): give --push-s-per-gb")
    push_s = costs.model_gb * costs.push_s_per_gb
    step_s = (sample_s + push_s + train_s) if off_policy_steps == 0 else max(sample_s, push_s + train_s)
    terms = {"sampling": sample_s, "weight push": push_s, "training": train_s - allreduce_s,
             "all-reduce": allreduce_s}
    return {"trainers": trainers, "samplers": samplers, "sample_s": sample_s, "push_s": push_s,
            "train_s": train_s, "allreduce_s": allreduce_s, "step_s": step_s,
            "episodes_per_s": work.episodes / step_s if step_s > 0 else float("nan"),
            "bottleneck": max(terms, key=terms.__getitem__)}


def measure(run_dir: Path, env_s_per_step: float = 0.0) -> tuple[Costs, Workload]:
    """Component costs and the per-step workload, from a run's RL train_step events and its model files."""
    from quaero.telemetry.runlog import read_events

    events, _ = read_events(run_dir / names.EVENTS)
    rl = [e for e in events if e.get("event") == names.TRAIN_STEP_EVENT
          and e.get(names.PHASE) == names.PHASE_RL and e.get(names.ROWS)]
    if not rl:
        raise ValueError(f"{run_dir / names.EVENTS}: no RL train_step with trained rows to measure "
                         "(a run with [training] steps >= 1 is needed)")
    if any(names.ROLLOUT_WAIT_S in e for e in rl):  # logged only when rollouts are sampled ahead
        raise ValueError(f"{run_dir}: its rollouts were sampled while steps trained ([rollout] "
                         "max_off_policy_steps >= 1), so its sampling and training costs cannot be told "
                         "apart; measure a run with max_off_policy_steps = 0 and project k with "
                         "--off-policy-steps")

    def mean(key: str) -> float:
        return statistics.fmean(float(e.get(key) or 0.0) for e in rl)

    # a step's time is its slowest rank's; its counts are all ranks'
    ranks = int(rl[-1].get(names.RANKS) or 1)
    sync, rollout, total = (
        mean(names.WEIGHT_SYNC_S),
        mean(names.ROLLOUT_TIME_S),
        mean(names.TOTAL_STEP_TIME_S),
    )
    env_steps = mean(names.ENV_STEPS)
    sample_s = rollout - sync - env_steps / ranks * env_s_per_step
    train_s = total - rollout
    if sample_s <= 0 or train_s <= 0:
        raise ValueError(f"{run_dir}: the measured sampling ({sample_s:.3f} s) and training ({train_s:.3f} "
                         "s) times must be positive (is --env-ms-per-step larger than the run's env time?)")
    model_bytes, params = _model_size(run_dir)
    costs = Costs(sampler_tokens_per_s=mean(names.ROLLOUT_ACTION_TOKENS) / sample_s / ranks,
                  trainer_tokens_per_s=mean(names.ROW_TOKENS) / train_s / ranks,
                  push_s_per_gb=sync / (model_bytes / GB), model_gb=model_bytes / GB,
                  bytes_per_param=model_bytes / params)
    work = Workload(episodes=mean(names.EPISODES), generated_tokens=mean(names.ROLLOUT_ACTION_TOKENS),
                    env_steps=env_steps,
                    row_tokens=mean(names.ROW_TOKENS), measured_step_s=total, measured_ranks=ranks)
    return costs, work


def _model_size(run_dir: Path) -> tuple[int, int]:
    """(bytes, parameters) of the run's weights: final/, else the newest checkpoint."""
    from safetensors import safe_open

    folders = [run_dir / names.FINAL, *sorted((run_dir / names.CHECKPOINTS).glob("step-*"), reverse=True)]
    for folder in folders:
        files = sorted(folder.glob("*.safetensors"))
        if files:
            params = 0
            for f in files:
                with safe_open(f, framework="pt") as st:
                    # (a safe_open handle is not iterable)
                    params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())  # noqa: SIM118
            return sum(f.stat().st_size for f in files), params
    raise ValueError(f"{run_dir}: no weights in final/ or checkpoints/ to size the weight push")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="quaero bench scaling", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a finished run folder (runs/NAME) with RL steps")
    ap.add_argument("--trainers", type=_ints, default=[1, 2, 4, 8], help="trainer device counts (default "
                                                                         "1,2,4,8)")
    ap.add_argument("--samplers", type=_ints, default=[0], help="sampler device counts; 0 = colocated "
                                                                "(default 0)")
    ap.add_argument("--off-policy-steps", type=int, default=0, help="k of [rollout] max_off_policy_steps")
    ap.add_argument("--env-ms-per-step", type=float, default=0.0,
                    help="env step latency to separate from sampling (e.g. from `quaero bench env-latency`)")
    ap.add_argument("--allreduce-gb-s", type=float, default=None, help="gradient all-reduce bandwidth, GB/s")
    ap.add_argument("--push-s-per-gb", type=float, default=None,
                    help="weight push seconds per GB, instead of the run's (needed when it measured none)")
    ap.add_argument("--json", type=Path, default=None, help="also write the document here")
    args = ap.parse_args(argv)
    try:
        costs, work = measure(args.run_dir, args.env_ms_per_step / 1e3)
        own = predict(costs, work, trainers=work.measured_ranks, samplers=0,
                      env_s_per_step=args.env_ms_per_step / 1e3)["step_s"]
        if args.push_s_per_gb is not None:
            costs = replace(costs, push_s_per_gb=args.push_s_per_gb)
        rows = [predict(costs, work, trainers=n, samplers=s, off_policy_steps=args.off_policy_steps,
                        env_s_per_step=args.env_ms_per_step / 1e3, allreduce_gb_s=args.allreduce_gb_s)
                for n in args.trainers for s in args.samplers]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if abs(own - work.measured_step_s) > 1e-6 * max(1.0, work.measured_step_s):
        print(f"error: the model at the run's own shape gives {own:.6f} s, the run measured "
              f"{work.measured_step_s:.6f} s: the model and measure() disagree", file=sys.stderr)
        return 1
    doc = {"run_dir": str(args.run_dir), "measured": {"costs": asdict(costs), "workload": asdict(work)},
           "own_shape_step_s": own,
           "assumptions": {"off_policy_steps": args.off_policy_steps, "env_ms_per_step": args.env_ms_per_step,
                           "allreduce_gb_s": args.allreduce_gb_s},
           "predictions": rows}
    text = json.dumps(doc, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    print(f"{'trainers':>8} {'samplers':>8} {'sample s':>9} {'push s':>7} {'train s':>8} {'step s':>8} "
          f"{'episodes/s':>10}  bottleneck", file=sys.stderr)
    for r in rows:
        print(f"{r['trainers']:>8} {r['samplers'] or 'coloc':>8} {r['sample_s']:>9.3f} {r['push_s']:>7.3f} "
              f"{r['train_s']:>8.3f} {r['step_s']:>8.3f} {r['episodes_per_s']:>10.3f}  {r['bottleneck']}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
