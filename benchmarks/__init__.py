"""`quaero bench`: quaero's reproducible benchmarks, kept beside their results (README.md, FIELDS.md,
HISTORY.md, results/ here).

They drive quaero through its public API and documented hooks only (a trainer's `TrainerSpec.logprob_fn`,
the recipe's `build`/`run_step`), so nothing in `quaero/` or `trainers/` imports them: the one arrow in is the
CLI's `quaero bench`, which imports this registry when a benchmark is asked for. `main(argv)` is what
`quaero bench ...` calls, e.g. `main(["echo", "--seq-len", "4096"])`.

A new benchmark is a module here with `main(argv) -> int | None`, one line in `BENCHMARKS`, its method and
fields in benchmarks/FIELDS.md, its current figure and command in benchmarks/README.md (earlier passes move to
benchmarks/HISTORY.md).
"""
from __future__ import annotations

import importlib
import sys

# name -> (module, one-line description); each module has `main(argv) -> int | None`
BENCHMARKS = {
    "echo": ("benchmarks.echo", "time and peak memory of each ECHO LM-head/loss region, value-checked first"),
    "step": ("benchmarks.step",
             "a whole train step (forward, losses, backward, optimizer) on long rows, per path"),
    "crossover": ("benchmarks.crossover",
                  "selective LM head vs the peers' chunked one, per density/length/vocab"),
    "rollout": ("benchmarks.rollout", "toolbench episodes/s and tokens/s per sampler, and the log-prob gap"),
    "sampler-reuse": ("benchmarks.sampler_reuse",
                      "the transformers sampler before/after KV reuse and the inverse-CDF draw"),
    "smoke": ("benchmarks.smoke",
              "one RL + ECHO step of a trainer on sparse agent-trace rows, with its proof"),
    "env-latency": ("benchmarks.env_latency", "toolbench step latency per env launcher (transport overhead)"),
    # a user tool (it reads a run of theirs), listed here so `quaero bench scaling` keeps its name
    "scaling": ("quaero.tools.scaling",
                "a run's measured costs -> predicted step time and bottleneck per device count"),
    "tree": ("benchmarks.tree",
             "tree training vs per-row training on RL-shaped rows: tokens, step time, peak memory"),
    "packing": ("benchmarks.packing", "trained tokens per episode: packed rows vs one row per transition"),
    "bridge-cost": ("benchmarks.bridge_cost",
                    "the template renderer's prompt and bridge cost per turn vs renderers' Qwen3Renderer"),
    "ablation": ("benchmarks.ablation",
                 "ECHO on vs off (or two arms) over run seeds, paired per task, pooled"),
    "peers-trl": ("benchmarks.peers_trl",
                  "quaero beside TRL's GRPOTrainer on the same job (the [peers] extra)"),
    "samplers": ("benchmarks.samplers",
                 "task samplers from one warm start at equal generated tokens, per env, paired"),
    "arms": ("benchmarks.arms",
             "RL arms by --set, each from its seed's own warm start, at equal generated tokens, paired"),
    "real-shape": ("benchmarks.real_shape",
                   "real-shape train steps (qwen3-0.6b-shape...) per memory knob against the plan"),
    "rl-memory": ("benchmarks.rl_memory",
                  "a config's warm-start and first RL step, trainer alone: peak RSS per phase vs the plan"),
    "soak": ("benchmarks.soak", "a config's run of N SFT + M RL steps: its RSS every K steps vs the plan"),
    "rl-step": ("benchmarks.rl_step",
                "the whole RL step (rollout + train) before/after tree + sampler reuse, vs the limits"),
    "machine": ("benchmarks.machine",
                "this machine's matmul peak and memory bandwidth, and a run's efficiency against them"),
}

USAGE = "usage: quaero bench {" + ",".join(BENCHMARKS) + "} [options]\n\n" + "\n".join(
    f"  {name:<12} {text}" for name, (_, text) in BENCHMARKS.items()) + (
    "\n\n`quaero bench NAME --help` lists a benchmark's options; benchmarks/FIELDS.md documents the fields.")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], list(argv[1:])
    if command not in BENCHMARKS:
        print(f"quaero bench: unknown benchmark {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return importlib.import_module(BENCHMARKS[command][0]).main(rest) or 0
