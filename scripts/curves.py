"""Held-out learning curves of several runs, paired, in one table and one figure: a recipe's runs at several
seeds and arms (benchmarks/README.md "The learning curve on SmolLM2"), where `quaero bench arms` cannot train
them (a mixture, or runs made by hand from one warm start's copied checkpoint).

    python scripts/curves.py --warm-step 10 --plot arms.png \\
        --run 'ECHO off' 2 runs/s2-off --run 'ECHO on in RL' 2 runs/s2-on

Each `--run ARM SEED PATH` is a run folder or its events.jsonl. A seed's warm start is the eval at
`--warm-step` in the first of its runs that logged one (an arm started from a copied checkpoint logs none).
For every eval after it, each run prints held-out success ± s.e. (pooled and per env), the share of
well-formed episodes and the success among them, and two paired comparisons on the same tasks (McNemar exact
on the discordant tasks, the paired bootstrap of the reward): against its seed's warm start and against the
seed's first arm at the same step. Then success per task template at the warm start and at the run's last
eval. The figure: every run's curve against RL generated tokens from its seed's warm start
(benchmarks/arms_plot.py, the figure `quaero bench arms` draws).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, run from a checkout


def pair_text(a: dict, b: dict) -> str:
    from quaero.tools.significance import paired_outcomes

    p = paired_outcomes(a, b)
    return f"+{p['a_only']}/-{p['b_only']} p {p['mcnemar_p']:.2g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", nargs=3, action="append", required=True, metavar=("ARM", "SEED", "PATH"))
    p.add_argument("--warm-step", type=int, required=True, help="the warm start's step (its checkpoint)")
    p.add_argument("--plot", type=Path, help="write the figure here (PNG)")
    p.add_argument("--force", action="store_true", help="let --plot replace a file this did not write")
    args = p.parse_args(argv)

    from benchmarks import arms_plot
    from quaero.tools.review import env_names, eval_formats, eval_outcomes, held_out, held_out_by, load_run
    from quaero.tools.review_command import held_out_curves
    from quaero.tools.significance import format_and_task

    runs = [(arm, int(seed), load_run(path)) for arm, seed, path in args.run]
    warm: dict[int, dict] = {}
    for _, seed, run in runs:
        found = [e for e in run.evals if e["step"] == args.warm_step]
        if found and seed not in warm:
            warm[seed] = found[0]
    baseline = {}
    for arm, seed, run in runs:
        baseline.setdefault(seed, (arm, {e["step"]: e for e in run.evals}))
    curves = {}
    for arm, seed, run in runs:
        w = warm.get(seed)
        envs = env_names(run)
        print(f"== {arm}, seed {seed} ({run.path}); warm start: step {args.warm_step}"
              f"{'' if w else ' (none logged for this seed)'}")
        print("step  RL tokens  held-out ± s.e.  " + "  ".join(f"{e:>6}" for e in envs)
              + "  well-formed  task|well  vs warm start       vs " + baseline[seed][0])
        success = held_out_curves(run).get("success", [])  # (step, RL tokens, success, s.e.) per eval
        tokens = {st: tok for st, tok, _, _ in success}
        for e in run.evals:
            if e["step"] < args.warm_step or (e["step"] == args.warm_step and e is not w):
                continue
            h, out = held_out(e), eval_outcomes(e) or {}
            formats = eval_formats(e)
            split = format_and_task(out, out, formats, formats) or {}  # one eval's own well-formed share
            task = split.get("a_task_success")
            versus_warm = pair_text(out, eval_outcomes(w) or {}) if w and e is not w else ""
            other = baseline[seed][1].get(e["step"]) if baseline[seed][0] != arm else None
            versus_base = pair_text(out, eval_outcomes(other) or {}) if other else ""
            per_env = "  ".join(f"{held_out(e, env).get('success', float('nan')):6.3f}" for env in envs)
            print(f"{e['step']:4d} {tokens.get(e['step'], 0):10,d}  {h['success']:.3f} ± "
                  f"{h['success_se']:.3f}  {per_env}  {split.get('a_well_formed', float('nan')):11.3f}  "
                  f"{float('nan') if task is None else task:9.3f}  {versus_warm:18s}  {versus_base}")
        last = run.evals[-1] if run.evals else None
        for label, e in (("warm start", w), (f"step {last['step'] if last else '-'}", last)):
            groups = held_out_by(e, "group") if e else {}
            print(f"  by template, {label}: "
                  + ", ".join(f"{g} {v:.2f}" for g, (v, _) in sorted(groups.items())))
        start = held_out(w) if w else {}
        pts = [(0, start["success"], start["success_se"])] if start.get("success") is not None else []
        curves[(arm, seed)] = pts + [(tok, v, se) for st, tok, v, se in success if st > args.warm_step]
    if args.plot:
        print(f"figure {arms_plot.write_figure(curves, args.plot, force=args.force)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
