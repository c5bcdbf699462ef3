"""`quaero bench`: every reproducible benchmark of quaero lives in this package; this is its CLI.

`main(argv)` is what `quaero bench ...` calls, e.g. `main(["echo", "--seq-len", "4096"])`.
Results and their tables are kept in benchmarks/ (README.md documents every JSON field).
"""
from __future__ import annotations

import importlib
import sys

# name -> (module, one-line description); each module has `main(argv) -> int | None`
BENCHMARKS = {
    "echo": ("quaero.bench.echo", "time and peak memory of each ECHO LM-head/loss region, value-checked first"),
    "step": ("quaero.bench.step", "a whole train step (forward, losses, backward, optimizer) on long rows, per path"),
    "crossover": ("quaero.bench.crossover", "selective LM head vs the peers' chunked one, per density/length/vocab"),
    "rollout": ("quaero.bench.rollout", "toolbench episodes/s and tokens/s per sampler, and the log-prob gap"),
    "smoke": ("quaero.bench.smoke", "one RL + ECHO step of a trainer on sparse agent-trace rows, with its proof"),
    "env-latency": ("quaero.bench.env_latency", "toolbench step latency per env launcher (transport overhead)"),
    "scaling": ("quaero.tools.scaling", "a run's measured costs -> predicted step time and bottleneck per device count"),
    "packing": ("quaero.bench.packing_figure", "trained tokens per episode: packed rows vs one row per transition"),
    "ablation": ("quaero.bench.ablation", "ECHO on vs off (or two arms) over run seeds, paired per task, pooled"),
    "peers-trl": ("quaero.bench.peers_trl", "quaero beside TRL's GRPOTrainer on the same job (the [peers] extra)"),
}

USAGE = "usage: quaero bench {" + ",".join(BENCHMARKS) + "} [options]\n\n" + "\n".join(
    f"  {name:<12} {text}" for name, (_, text) in BENCHMARKS.items()) + (
    "\n\n`quaero bench NAME --help` lists a benchmark's options; benchmarks/README.md documents the fields.")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], list(argv[1:])
    if command not in BENCHMARKS:
        print(f"quaero bench: unknown benchmark {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return importlib.import_module(BENCHMARKS[command][0]).main(rest) or 0
