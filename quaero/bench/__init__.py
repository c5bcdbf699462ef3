"""`quaero bench`: reproducible benchmarks (`echo`: the LM-head/loss regions; `step`: a whole train step).

`main(argv)` is what `quaero bench ...` calls, e.g. `main(["echo", "--seq-len", "4096"])`.
"""
from __future__ import annotations

import sys

USAGE = """usage: quaero bench {echo,step} [options]

  echo   the seed's ECHO LM-head/loss-region benchmark (+ quaero's chunked-recompute path)
  step   a whole train step (forward, losses, backward, optimizer) on long rows, per logprob path

`quaero bench echo --help` / `quaero bench step --help` list the options; benchmarks/README.md
documents every JSON field."""


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], list(argv[1:])
    if command == "echo":
        from quaero.bench.echo import main as echo_main

        return echo_main(rest)
    if command == "step":
        from quaero.bench.step import main as step_main

        return step_main(rest)
    print(f"quaero bench: unknown benchmark {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2
