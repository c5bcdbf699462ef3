"""`quaero review RUN_DIR`, the command: the summary's table (quaero/tools/review.py reads the run), the
checks of quaero/telemetry/proofs.py, and `--plots DIR`'s PNGs; `--compare` and `--json` print the same
summary side by side or as JSON."""
from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

from quaero.telemetry import names, proofs
from quaero.tools.display import MAX_LINE, clip, dump_json
from quaero.tools.review import (
    ReviewError,
    changed_line,
    env_line,
    eval_outcomes,
    finite_number,
    guidance_line,
    load_run,
    render_table,
    sft_span,
    summarize,
)

PLOT_SERIES = {
    "reward": [names.REWARD_MEAN, names.EVAL_REWARD],
    "losses": [names.RL_LOSS, names.ECHO_LOSS, names.SFT_LOSS],
    "memory": [names.PEAK_MEM_MB, names.ROLLOUT_PEAK_MEM_MB, names.PROCESS_PEAK_MEM_MB],
    "branches": list(proofs.BRANCH_COUNTERS),
}


def plot_points(run: dict, key: str) -> list[tuple[int, float]]:
    """(step, value) of one plotted series. The warm start's `reward_mean` is the oracle's demonstrations'
    reward (always the oracle's), not what the policy earned: the train-reward series is RL steps only."""
    records = run["steps"] + run["evals"]
    if key == names.REWARD_MEAN:
        records = [r for r in run["steps"] if r.get(names.PHASE, names.PHASE_RL) == names.PHASE_RL]
    return sorted((r["step"], v) for r in records if (v := finite_number(r.get(key))) is not None)


def eval_success_intervals(run: dict) -> list[tuple[int, float, float, float]]:
    """(step, success rate, Wilson 95% low, high) of each eval with a known episode count."""
    from quaero.tools.significance import wilson_interval

    out = []
    for e in run["evals"]:
        rate, n = finite_number(e.get(names.EVAL_SUCCESS_RATE)), finite_number(e.get(names.EVAL_EPISODES))
        if rate is not None and 0 <= rate <= 1 and n and n > 0:
            low, high = wilson_interval(round(rate * n), int(n))
            out.append((e["step"], rate, low, high))
    return out


def eval_reward_intervals(run: dict) -> list[tuple[int, float, float, float]]:
    """(step, mean eval reward, normal 95% low, high) of each eval that logged its per-task results."""
    from quaero.tools.significance import Z_95

    out = []
    for e in run["evals"]:
        rewards = [r for _, r in (eval_outcomes(e) or {}).values()]
        if len(rewards) >= 2:
            mean, half = statistics.fmean(rewards), Z_95 * statistics.stdev(rewards) / math.sqrt(len(rewards))
            out.append((e["step"], mean, mean - half, mean + half))
    return out


PLOT_SOFTWARE = "quaero review"  # the PNG text that marks a plot review wrote (replaced without --force)


def _review_plot(path: Path) -> bool:
    """Whether `path` is a PNG this command wrote earlier (its Software text chunk says so)."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and b"tEXtSoftware\x00" + PLOT_SOFTWARE.encode() in head


def check_plots(out_dir: str | Path, *, force: bool = False) -> list[Path]:
    """The plot files `--plots DIR` writes, each checked (quaero/tools/outputs.py) before any is written: no
    link, special file or run's own file; an existing file only if review wrote it or `force`."""
    from quaero.tools.outputs import check_output

    out = Path(out_dir)
    return [check_output(out / f"{name}.png", "--plots", force=force, in_runs=True, replaceable=_review_plot)
            for name in PLOT_SERIES]


def write_plots(run: dict, out_dir: str | Path, *, force: bool = False) -> list[Path]:
    from quaero.tools.outputs import OutputRefused, saving_to

    out = Path(out_dir)
    try:
        check_plots(out, force=force)
    except OutputRefused as e:
        raise ReviewError(str(e)) from None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    span = sft_span(run)
    written = []
    for name, keys in PLOT_SERIES.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        if span:
            ax.axvspan(span[0] - 0.5, span[1] + 0.5, color="0.9", label="warm start (SFT)")
        for key in keys:
            pts = plot_points(run, key)
            if pts:
                label = "train reward (RL steps)" if key == names.REWARD_MEAN else proofs.short(key)
                ax.plot(*zip(*pts), marker="o", ms=3, label=label)
        if name == "reward":
            for step, mean, low, high in eval_reward_intervals(run):
                ax.errorbar([step], [mean], yerr=[[mean - low], [high - mean]], fmt="D", ms=4, capsize=3,
                            color="tab:purple", label="eval reward (95%, per-task results)")
            for step, rate, low, high in eval_success_intervals(run):
                ax.errorbar([step], [rate], yerr=[[rate - low], [high - rate]], fmt="s", ms=4, capsize=3,
                            color="tab:green", label="eval success (Wilson 95%)")
        ax.set_xlabel("step")
        ax.set_title(name)
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            unique = dict(zip(labels, handles))  # one legend entry per series (eval points repeat theirs)
            ax.legend(unique.values(), unique.keys(), fontsize=7)
        fig.tight_layout()
        path = out / f"{name}.png"
        tmp, commit = saving_to(path)  # renamed onto the name: never written through what was there
        fig.savefig(tmp, dpi=90, format="png", metadata={"Software": PLOT_SOFTWARE})
        commit()
        plt.close(fig)
        written.append(path)
    return written


_TAGS = {proofs.PASS: "PASS", proofs.NA: "N/A"}


def _tag(check: dict) -> str:
    return _TAGS.get(check["status"], "FAIL" if check["required"] else "WARN")

def main(args) -> int:
    require = list(args.require)
    unknown = [n for n in require if n not in proofs.CHECKS]
    if unknown:
        print(f"error: --require {unknown[0]!r} is not a check; valid: "
              + ", ".join(repr(n) for n in proofs.CHECKS), file=sys.stderr)
        return 1
    try:
        return _review(args, require)
    except ReviewError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _review(args, require: list[str]) -> int:
    if args.compare:
        if require or args.require_proof:
            raise ReviewError("--require/--require-proof judge one run; drop them or --compare")
        a, b = (summarize(load_run(d)).to_dict() for d in args.compare)
        if args.json:
            print(dump_json({"a": a, "b": b}))
        else:
            print(render_table([(k, [v, b.get(k)]) for k, v in a.items() if not isinstance(v, dict)],
                               ["metric", *args.compare]))
        return 0
    if not args.run_dir:
        raise ReviewError("quaero review RUN_DIR (or --compare RUN_A RUN_B)")
    run = load_run(args.run_dir)
    s = summarize(run)
    checks = proofs.run_checks(s)
    plots = ([str(p) for p in write_plots(run, args.plots, force=getattr(args, "force", False))]
             if args.plots else [])
    if s.unreadable_lines:
        print(f"warning: {run['path']}: {s.unreadable_lines} line(s) could not be read (not UTF-8, not a "
              "JSON object, or a step that is not an integer) and are left out", file=sys.stderr)
    if args.json:
        print(dump_json({"summary": s.to_dict(), "checks": checks, "plots": plots}))
    else:
        print(f"run {args.run_dir} ({'finished' if s.finished else 'INCOMPLETE: no run_end event'})")
        print(render_table([(k, [v]) for k, v in s.table_rows()], ["metric", "value"]))
        print()
        for c in checks:
            print(clip(f"[{_tag(c)}] {c['name']}: {c['detail']}", MAX_LINE))
        # a mixture's; the checks above judge the pooled run
        for env, figures in s.per_env.items():
            print(env_line(env, figures))
        if s.guidance is not None:
            print(guidance_line(s.guidance, s.rl_vs_warm_start))
        for step, resumed in s.resumed_with_changed_config.items():
            print(changed_line(step, resumed))
        for p in plots:
            print(f"plot {p}")
    missed = proofs.unmet(checks, require_proof=args.require_proof, names=require)
    for line in missed:
        print(f"error: required check {line}", file=sys.stderr)
    return 1 if missed else 0
