"""`quaero bench arms CONFIG --from RUN --arm NAME[: SET ...] ...`: RL arms that differ by `--set`s (a policy
loss, an advantage option, guidance, a task sampler), each from its run seed's own warm start, at equal
generated tokens, paired per held-out task, per seed and pooled.

Each arm at each seed is one `quaero bench samplers` arm (a real `quaero train` in a process of its own,
resumed from the seed's warm start at `--from-step`, `[training] rl_token_budget` set), so a finished arm is
read, not re-run, and an interrupted comparison resumes. The first `--arm` is the baseline. Per arm and seed:
RL steps, generated tokens, groups with signal (per 1,000 generated tokens), held-out success paired against
the warm start and against the baseline (McNemar exact p, paired bootstrap of the reward difference), the
change split into format and task (quaero/tools/significance.py `format_and_task`: well-formed episodes, and
success among them), held-out success per spec group (toolbench's templates) and the loss's own figures
(clip fractions, KL to the reference, guided members) as means over RL steps. Pooled over seeds per arm,
then each arm's verdict on the question "does RL beat its own warm start at every seed?".

    quaero bench arms envs/toolbench.toml --from 'runs/toolbench-s{seed}' --from-step 500 --seeds 0,1,2,3,4 \\
        --budget 26000 --set training.steps=40 --set training.eval_every=1000 \\
        --set training.checkpoint_every=1000 --arm base \\
        --arm 'episode: guidance.mode=episode guidance.members=2 guidance.until_step=8'

The figure (`--plot`, default OUT/arms.png) draws every arm at every seed: held-out success ± s.e. against
RL's generated tokens from the seed's warm start (benchmarks/arms_plot.py).

`--from` is a run folder shared by every seed, a template with `{seed}`, or `SEED=RUN` (repeatable; it wins
over a template for its seed). An arm's `env.tasks.sampler=X` set picks the task sampler (its runs are then
named `X-sS`, as `bench samplers` names them).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.ablation import refuse_owned_sets
from benchmarks.samplers import arm_figures, arm_name, eval_groups, read_run, seed_list, success_rate
from quaero.telemetry import names
from quaero.telemetry.summary import RunRecord
from quaero.tools.display import finite_number
from quaero.tools.outputs import bench_output, write_bench_output
from quaero.tools.significance import format_and_task, paired_outcomes

ARM = re.compile(r"^([A-Za-z0-9_+-]{1,64})(?:\s*:\s*(.*))?$", re.DOTALL)
SAMPLER_SET = "env.tasks.sampler="
MEANS = ("clip_fraction", "clip_high_fraction", "kl_mean", "sequence_ratio_mean")  # per RL step
SUMS = ("groups_guided", "guided_members", "guided_members_succeeded")  # over RL steps
SIGNIFICANT = 0.05


def parse_arm(text: str) -> tuple[str, str, list[str]]:
    """`NAME` or `NAME: SECTION.KEY=VALUE ...` -> (name, task sampler, the other sets); one line if not."""
    m = ARM.match(text.strip())
    if not m:
        raise SystemExit(f"error: --arm {text!r}: expected NAME or 'NAME: SECTION.KEY=VALUE ...' (a name of "
                         "letters, digits, _, + and -: it names the arm's folder)")
    sets = (m.group(2) or "").split()
    bad = [s for s in sets if "=" not in s]
    if bad:
        raise SystemExit(f"error: --arm {text!r}: {bad[0]!r} is not SECTION.KEY=VALUE")
    samplers = [s[len(SAMPLER_SET):] for s in sets if s.startswith(SAMPLER_SET)]
    return m.group(1), (samplers[-1] if samplers else "sequential"), [
        s for s in sets if not s.startswith(SAMPLER_SET)]


def sources(values: list[str], seeds: list[int]) -> dict[int, Path]:
    """Each seed's warm-start run from `--from` (a folder, a `{seed}` template, or SEED=RUN)."""
    shared, own = None, {}
    for v in values:
        seed, eq, path = v.partition("=")
        if eq and seed.strip().isdigit():
            own[int(seed)] = Path(path)
        else:
            shared = v
    out = {}
    for s in seeds:
        if s in own:
            out[s] = own[s]
        elif shared is not None:
            out[s] = Path(shared.replace("{seed}", str(s)))
        else:
            raise SystemExit(f"error: --seeds has {s} but no --from names its warm start; add --from {s}=RUN "
                             "or a template with {seed}")
    return out


def step_figures(run: RunRecord) -> dict[str, Any]:
    """Means (over the RL steps that report them) and sums of an arm's train_step figures."""
    steps = [e for e in run.steps if e.get(names.PHASE, names.PHASE_RL) == names.PHASE_RL]
    out: dict[str, Any] = {}
    for key in MEANS:  # a field that is no finite number (a crafted or damaged event) is not a value
        values = [v for e in steps if (v := finite_number(e.get(key))) is not None]
        out[key] = statistics.fmean(values) if values else None
    for key in SUMS:
        out[key] = sum(finite_number(e.get(key)) or 0 for e in steps)
    return out


def _eval_at(run: RunRecord, step: int | None) -> dict | None:
    evals = run.evals
    if step is None:
        return evals[-1] if evals else None
    return next((e for e in evals if e["step"] == step), None)


def _by_group(outcomes: dict | None, groups: dict) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for task, (success, _) in (outcomes or {}).items():
        key = task[1] if isinstance(task, tuple) else task
        if key in groups:
            out[str(groups[key])][0] += success
            out[str(groups[key])][1] += 1
    return dict(out)


def _keyed(seed: int, d: dict | None) -> dict:
    return {(seed, k): v for k, v in (d or {}).items()}


def join(arms: list[tuple[str, str, list[str]]], seeds: list[int], warm: dict[int, dict], out: Path,
         groups: dict) -> dict[str, Any]:
    """The report from the arms' finished runs (`out/NAME/SAMPLER-sS`) and each seed's warm-start eval
    (`warm[seed]`: its outcomes and formats)."""
    from quaero.tools.review import eval_formats, eval_outcomes

    base = arms[0][0]
    runs = {}
    for name, sampler, _ in arms:
        for s in seeds:
            run = read_run(out / name / arm_name(sampler, s), f"arm {name} seed {s}")
            last = _eval_at(run, None)
            runs[(name, s)] = {"run": run, "eval": eval_outcomes(last) if last else None,
                               "formats": eval_formats(last) if last else None}
    report: dict[str, Any] = {"baseline": base, "seeds": seeds, "rows": [], "pooled": {}, "warm_start": {
        str(s): {"success": success_rate(w["eval"]), "by_group": _by_group(w["eval"], groups)}
        for s, w in warm.items()}}
    for name, sampler, sets in arms:
        pool: dict[str, dict] = {k: {} for k in ("end", "warm", "base", "fmt", "warm_fmt")}
        tokens = signal = 0
        wins = losses = 0
        for s in seeds:
            r, w, b = runs[(name, s)], warm[s], runs[(base, s)]
            f = arm_figures(r["run"], None)
            vs_warm = paired_outcomes(r["eval"], w["eval"], seed=s) if r["eval"] and w["eval"] else None
            vs_base = (paired_outcomes(r["eval"], b["eval"], seed=s)
                       if name != base and r["eval"] and b["eval"] else None)
            split = (format_and_task(r["eval"], w["eval"], r["formats"], w["formats"])
                     if r["formats"] and w["formats"] else None)
            if vs_warm and vs_warm["mcnemar_p"] < SIGNIFICANT:
                wins += vs_warm["a_only"] > vs_warm["b_only"]
                losses += vs_warm["a_only"] < vs_warm["b_only"]
            report["rows"].append({
                "arm": name, "seed": s, "sampler": sampler, "sets": sets,
                **{k: f[k] for k in ("rl_steps", "tokens", "groups", "signal", "signal_per_1k")},
                "success": success_rate(r["eval"]), "vs_warm_start": vs_warm, "vs_baseline": vs_base,
                "format_task_vs_warm_start": split, "by_group": _by_group(r["eval"], groups),
                **step_figures(r["run"])})
            tokens, signal = tokens + f["tokens"], signal + f["signal"]
            for key, d in (("end", r["eval"]), ("warm", w["eval"]), ("base", b["eval"]),
                           ("fmt", r["formats"]), ("warm_fmt", w["formats"])):
                pool[key].update(_keyed(s, d))
        fmt_ok = all(runs[(name, s)]["formats"] and warm[s]["formats"] for s in seeds)
        report["pooled"][name] = {
            "tokens": tokens, "signal": signal, "signal_per_1k": 1000 * signal / tokens if tokens else None,
            "success": success_rate(pool["end"]),
            "vs_warm_start": paired_outcomes(pool["end"], pool["warm"]) if pool["warm"] else None,
            "vs_baseline": paired_outcomes(pool["end"], pool["base"]) if name != base else None,
            "format_task_vs_warm_start": (format_and_task(pool["end"], pool["warm"], pool["fmt"],
                                                          pool["warm_fmt"]) if fmt_ok else None),
            "by_group": _by_group(pool["end"], groups), "seeds_won": wins, "seeds_lost": losses}
    warm_groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for w in report["warm_start"].values():
        for g, (solved, n) in w["by_group"].items():
            warm_groups[g][0] += solved
            warm_groups[g][1] += n
    report["warm_start_by_group"] = dict(warm_groups)
    return report


def _f3(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _pm(c: dict | None) -> str:
    if not c:
        return "n/a"
    low, high = c["reward_diff_ci95"]
    return (f"+{c['a_only']}/-{c['b_only']}, p {c['mcnemar_p']:.2g}, {c['reward_diff']:+.3f} "
            f"[{low:+.3f}, {high:+.3f}]")


def _split(c: dict | None) -> str:
    if not c:
        return "n/a"
    return (f"{_f3(c['b_well_formed'])} -> {_f3(c['a_well_formed'])} / {_f3(c['b_task_success'])} -> "
            f"{_f3(c['a_task_success'])}")


def _groups(by: dict) -> str:
    return ", ".join(f"{g} {s}/{n}" for g, (s, n) in sorted(by.items())) or "-"


def render(report: dict) -> str:
    base = report["baseline"]
    head = (f"| arm | seed | RL steps | tokens | groups with signal (per 1k) | held-out | vs warm start | "
            f"vs {base} | well-formed / task success (warm start -> arm) | held-out by template | clip | "
            "clip high | KL | guided (succeeded) |")
    lines = [head, "|---" * 14 + "|"]
    for r in report["rows"]:
        lines.append(f"| {r['arm']} | {r['seed']} | {r['rl_steps']} | {r['tokens']:,} | {r['signal']} of "
                     f"{r['groups']} ({_f3(r['signal_per_1k'])}) | {_f3(r['success'])} | "
                     f"{_pm(r['vs_warm_start'])} | {_pm(r['vs_baseline'])} | "
                     f"{_split(r['format_task_vs_warm_start'])} | {_groups(r['by_group'])} | "
                     f"{_f3(r['clip_fraction'])} | {_f3(r['clip_high_fraction'])} | {_f3(r['kl_mean'])} | "
                     f"{r['guided_members']} ({r['guided_members_succeeded']}) |")
    n = len(report["seeds"])
    head = (f"| arm (pooled over {n} seeds) | tokens | signal per 1k | held-out | vs warm start | vs {base} "
            "| well-formed / task success | held-out by template | seeds won / lost vs warm start "
            "(p < 0.05) |")
    lines += ["", head, "|---" * 9 + "|"]
    for name, c in report["pooled"].items():
        lines.append(f"| {name} | {c['tokens']:,} | {_f3(c['signal_per_1k'])} | {_f3(c['success'])} | "
                     f"{_pm(c['vs_warm_start'])} | {_pm(c['vs_baseline'])} | "
                     f"{_split(c['format_task_vs_warm_start'])} | {_groups(c['by_group'])} | "
                     f"{c['seeds_won']} / {c['seeds_lost']} |")
    warm = ", ".join(f"s{s} {_f3(w['success'])}" for s, w in report["warm_start"].items())
    lines.append(f"\nwarm starts (held-out): {warm}; by template, pooled: "
                 f"{_groups(report['warm_start_by_group'])}")
    for name, c in report["pooled"].items():
        every = c["seeds_won"] == n
        lines.append(f"- {name}: beats its warm start at every seed: {'yes' if every else 'no'} "
                     f"({c['seeds_won']} of {n} significant gains, {c['seeds_lost']} significant losses)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="quaero bench arms", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--from", dest="sources", action="append", required=True, metavar="RUN|TEMPLATE|SEED=RUN",
                   help="each seed's warm-start run: a folder, a template with {seed}, or SEED=RUN")
    p.add_argument("--from-step", type=int, required=True, help="the warm starts' checkpoint (and eval)")
    p.add_argument("--seeds", default="0,1,2", help="RL run seeds, comma-separated")
    p.add_argument("--budget", type=int, required=True, help="[training] rl_token_budget of every arm")
    p.add_argument("--arm", dest="arms", action="append", required=True, metavar="'NAME: SET ...'",
                   help="an arm: its name and --sets (the first is the baseline); repeatable")
    p.add_argument("--key", default="group", choices=("task", "group", "difficulty"))
    p.add_argument("--set", dest="common", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--out", type=Path, default=Path("bench_out/arms"))
    p.add_argument("--rerun", action="store_true", help="train arms again even where a finished run is there")
    p.add_argument("--no-train", action="store_true",
                   help="only read: every arm must be finished with this very command (its --sets, in "
                        "any order where the order cannot change a value)")
    p.add_argument("--json", type=Path, help="also write the report here")
    p.add_argument("--plot", type=Path, help="the figure of every arm and seed, held-out success ± s.e. vs "
                   "RL generated tokens (default: OUT/arms.png)")
    p.add_argument("--force", action="store_true", help="let --plot replace a file this did not write")
    args = p.parse_args(argv)

    from benchmarks import arms_plot, samplers
    from quaero.config import load_config
    from quaero.tools.review import eval_formats, eval_outcomes

    seeds = seed_list(args.seeds)
    arms = [parse_arm(a) for a in args.arms]
    refuse_owned_sets(args.common)
    for text, (_, _, sets) in zip(args.arms, arms, strict=True):
        refuse_owned_sets(sets, f"--arm {text!r}:")
    bench_output(args.json)  # before any arm trains
    if len({a[0] for a in arms}) != len(arms):
        raise SystemExit("error: --arm names repeat; give each arm its own name")
    cfg = load_config(args.config, args.common)
    if cfg.is_mixture:
        raise SystemExit(f"error: {args.config}: a mixture; bench arms compares one-env configs (bench "
                         "samplers compares task samplers on mixtures)")
    for _, _, sets in arms:
        load_config(args.config, [*args.common, *sets])  # a bad --set fails here, before any arm runs
    warm_runs = sources(args.sources, seeds)
    if args.no_train:
        def command(seed: int, sampler: str, sets: list[str]) -> list[str]:  # as bench samplers marks it
            return samplers.arm_command(args.config, warm_runs[seed], args.from_step, seed,
                                        samplers.run_sets([*args.common, *sets], args.from_step, args.budget),
                                        samplers.arm_sets(cfg.views(), False, sampler, args.key))

        unfinished = [f"{name} seed {seed}" for seed in seeds for name, sampler, sets in arms
                      if not samplers.finished(args.out / name / arm_name(sampler, seed),
                                               command(seed, sampler, sets))]
        if unfinished:
            raise SystemExit(f"error: --no-train: {len(unfinished)} arm(s) not finished with this command "
                             f"(the same --from, --set and arm sets): {', '.join(unfinished[:5])}; "
                             "run without --no-train to train them")
    for seed in ([] if args.no_train else seeds):  # seed-major: an interrupted comparison leaves whole seeds
        for name, sampler, sets in arms:
            argv_ = [args.config, "--from", str(warm_runs[seed]), "--from-step", str(args.from_step),
                     "--samplers", sampler, "--seeds", str(seed), "--budget", str(args.budget),
                     "--key", args.key,
                     *[x for s in [*args.common, *sets] for x in ("--set", s)], "--out", str(args.out / name),
                     *(["--rerun"] if args.rerun else [])]
            with contextlib.redirect_stdout(io.StringIO()):  # its one-arm table; ours joins them all
                samplers.main(argv_)
    warm, warm_events = {}, {}
    for seed, run_dir in warm_runs.items():
        e = warm_events[seed] = _eval_at(read_run(run_dir, f"--from {run_dir}"), args.from_step)
        warm[seed] = {"eval": eval_outcomes(e) if e else None, "formats": eval_formats(e) if e else None}
    indices = sorted({k for w in warm.values() for k in (w["eval"] or {})})
    report = join(arms, seeds, warm, args.out, eval_groups(next(iter(cfg.views().values())), indices))
    report.update(config=args.config, from_step=args.from_step, budget=args.budget, common=args.common,
                  sources={str(s): str(r) for s, r in warm_runs.items()})
    print(render(report))
    plot = arms_plot.write_figure(arms_plot.arm_curves(arms, seeds, warm_events, args.out),
                                  args.plot or args.out / "arms.png", force=args.force)
    print(f"figure {plot}")
    if args.json:
        write_bench_output(args.json, json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
