"""Join `quaero bench samplers` reports of one warm start whose arms differ only by `--set` (a policy loss, an
advantage option, guidance), one report folder per variant, into one markdown table.

    python scripts/arms_table.py bench_out/arms/base bench_out/arms/dapo ... [--json OUT.json]

The first folder is the baseline. Per variant and RL seed: RL steps, generated tokens, groups with signal and
per 1,000 generated tokens, held-out success paired against the warm start (from the report) and against the
baseline's arm of the same seed (McNemar exact p, paired bootstrap of the reward difference), and the mean
per RL step of the loss's own figures (clip fractions, the KL to the reference, guided members). Then each
variant pooled over seeds, and its held-out success per spec group (toolbench's templates).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.ablation import final_outcomes
from quaero.telemetry import names
from quaero.tools.review import load_run
from quaero.tools.significance import paired_outcomes

MEANS = ("clip_fraction", "clip_high_fraction", "kl_mean", "sequence_ratio_mean")  # per RL step
SUMS = ("groups_guided", "guided_members", "guided_members_succeeded")  # over RL steps


def step_figures(run_dir: Path) -> dict:
    """Means (over RL steps that report them) and sums of an arm's train_step figures."""
    steps = [e for e in load_run(run_dir)["steps"] if e.get(names.PHASE, "rl") == "rl"]
    out: dict = {}
    for key in MEANS:
        values = [e[key] for e in steps if isinstance(e.get(key), (int, float))]
        out[key] = statistics.fmean(values) if values else None
    for key in SUMS:
        out[key] = sum(e.get(key) or 0 for e in steps)
    return out


def pm(c: dict | None) -> str:
    if not c:
        return "n/a"
    low, high = c["reward_diff_ci95"]
    return (f"+{c['a_only']}/-{c['b_only']}, p {c['mcnemar_p']:.2g}, {c['reward_diff']:+.3f} "
            f"[{low:+.3f}, {high:+.3f}]")


def f3(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    reports = {f.name: json.loads((f / "samplers.json").read_text()) for f in args.folders}
    base_name = args.folders[0].name
    outcomes = {(f.name, row["seed"]): final_outcomes(f / f"sequential-s{row['seed']}")
                for f in args.folders for row in reports[f.name]["envs"]["None"]["rows"]}
    head = ("| variant | seed | RL steps | tokens | groups with signal (per 1k) | held-out | vs warm start | "
            f"vs {base_name} | clip | clip high | KL | guided (succeeded) |")
    lines = [head, "|---" * 12 + "|"]
    pooled: dict = {}
    for f in args.folders:
        v, env = f.name, reports[f.name]["envs"]["None"]
        pool = {"end": {}, "base": {}, "tokens": 0, "signal": 0}
        for row in env["rows"]:
            seed = row["seed"]
            mine, base = outcomes[(v, seed)], outcomes.get((base_name, seed))
            vs_base = paired_outcomes(mine, base, seed=seed) if v != base_name and base else None
            s = step_figures(f / f"sequential-s{seed}")
            lines.append(f"| {v} | {seed} | {row['rl_steps']} | {row['tokens']:,} | {row['signal']} of "
                         f"{row['groups']} ({f3(row['signal_per_1k'])}) | {f3(row['success'])} | "
                         f"{pm(row['vs_warm_start'])} | {pm(vs_base)} | {f3(s['clip_fraction'])} | "
                         f"{f3(s['clip_high_fraction'])} | {f3(s['kl_mean'])} | {s['guided_members']} "
                         f"({s['guided_members_succeeded']}) |")
            pool["tokens"] += row["tokens"]
            pool["signal"] += row["signal"]
            pool["end"].update({(seed, k): o for k, o in mine.items()})
            if base:
                pool["base"].update({(seed, k): o for k, o in base.items()})
        pooled[v] = {"tokens": pool["tokens"], "signal": pool["signal"],
                     "signal_per_1k": 1000 * pool["signal"] / pool["tokens"] if pool["tokens"] else None,
                     "vs_warm_start": env["pooled"]["sequential"]["vs_warm_start"],
                     "vs_base": paired_outcomes(pool["end"], pool["base"]) if v != base_name else None,
                     "eval_by_group": env["pooled"]["sequential"]["eval_by_group"]}
    head = (f"| variant (pooled) | tokens | signal per 1k | vs warm start | vs {base_name} | held-out by "
            "template (solved / tasks) |")
    lines += ["", head, "|---" * 6 + "|"]
    for v, c in pooled.items():
        groups = ", ".join(f"{g} {s}/{n}" for g, (s, n) in sorted(c["eval_by_group"].items()))
        lines.append(f"| {v} | {c['tokens']:,} | {f3(c['signal_per_1k'])} | {pm(c['vs_warm_start'])} | "
                     f"{pm(c['vs_base'])} | {groups} |")
    warm = next(iter(reports.values()))["envs"]["None"]
    lines.append(f"\nwarm start: {f3(warm['warm_start_success'])} held-out; by template "
                 + ", ".join(f"{g} {s}/{n}" for g, (s, n) in sorted(warm["warm_start_by_group"].items())))
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"pooled": pooled}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
