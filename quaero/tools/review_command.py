"""`quaero review RUN_DIR`, the command: the summary's table (quaero/tools/review.py reads the run), the
checks of quaero/telemetry/proofs.py, and `--plots DIR`'s PNGs; `--compare` and `--json` print the same
summary side by side or as JSON."""
from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

from quaero.telemetry import names, proofs
from quaero.telemetry.summary import RunRecord
from quaero.tools.display import MAX_LINE, clip, dump_json
from quaero.tools.review import (
    ReviewError,
    changed_line,
    env_line,
    env_names,
    eval_outcomes,
    finite_number,
    guidance_line,
    held_out,
    held_out_by,
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


def plot_points(run: RunRecord, key: str) -> list[tuple[int, float]]:
    """(step, value) of one plotted series. The warm start's `reward_mean` is the oracle's demonstrations'
    reward (always the oracle's), not what the policy earned: the train-reward series is RL steps only."""
    records = run.steps + run.evals
    if key == names.REWARD_MEAN:
        records = [r for r in run.steps if r.get(names.PHASE, names.PHASE_RL) == names.PHASE_RL]
    return sorted((r["step"], v) for r in records if (v := finite_number(r.get(key))) is not None)


def eval_success_intervals(run: RunRecord) -> list[tuple[int, float, float, float]]:
    """(step, success rate, Wilson 95% low, high) of each eval with a known episode count."""
    from quaero.tools.significance import wilson_interval

    out = []
    for e in run.evals:
        rate, n = finite_number(e.get(names.EVAL_SUCCESS_RATE)), finite_number(e.get(names.EVAL_EPISODES))
        if rate is not None and 0 <= rate <= 1 and n and n > 0:
            low, high = wilson_interval(round(rate * n), int(n))
            out.append((e["step"], rate, low, high))
    return out


def eval_reward_intervals(run: RunRecord) -> list[tuple[int, float, float, float]]:
    """(step, mean eval reward, normal 95% low, high) of each eval that logged its per-task results."""
    from quaero.tools.significance import Z_95

    out = []
    for e in run.evals:
        rewards = [r for _, r in (eval_outcomes(e) or {}).values()]
        if len(rewards) >= 2:
            mean, half = statistics.fmean(rewards), Z_95 * statistics.stdev(rewards) / math.sqrt(len(rewards))
            out.append((e["step"], mean, mean - half, mean + half))
    return out


HELD_OUT_PLOT = "heldout"  # success ± s.e. against the RL step and against RL's generated tokens


def held_out_curves(run: RunRecord) -> dict[str, list[tuple[int, int | float, float, float]]]:
    """The held-out curves: {label: [(eval step, RL generated tokens by then, value, standard error)]}, the
    pooled success ("success"), a mixture's each env's ("success, env NAME"), each task group's and tier's
    where the evals name more than one ("success, group G", "success, tier D": `eval_task_groups`) and pass@k
    where the evals sampled it ("pass@K"); an eval without the figure is no point of that curve."""
    rl = [s for s in run.steps if s.get(names.PHASE, names.PHASE_RL) == names.PHASE_RL]
    curves: dict[str, list] = {}
    for e in run.evals:
        tokens = sum(v for s in rl if s["step"] <= e["step"]
                     and (v := finite_number(s.get(names.GENERATED_TOKENS))) is not None)
        picks = [("success", held_out(e))] + [(f"success, env {env}", held_out(e, env))
                                              for env in env_names(run)]
        for label, h in picks:
            if h.get("success") is not None and h.get("success_se") is not None:
                curves.setdefault(label, []).append((e["step"], tokens, h["success"], h["success_se"]))
        for which, word in (("group", "group"), ("difficulty", "tier")):
            parts = held_out_by(e, which)
            for value, (rate, se) in sorted(parts.items(), key=str) if len(parts) > 1 else ():
                curves.setdefault(f"success, {word} {value}", []).append((e["step"], tokens, rate, se))
        h = picks[0][1]
        if h.get("pass_at_k") is not None and h.get("pass_at_k_se") is not None:
            curves.setdefault(f"pass@{h['pass_k']}", []).append((e["step"], tokens, h["pass_at_k"],
                                                                h["pass_at_k_se"]))
    return curves


def _held_out_figure(run: RunRecord, plt):
    """Two panels, held-out success ± s.e. against the step (the warm start shaded) and against RL's
    generated tokens."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    span = sft_span(run)
    if span:
        axes[0].axvspan(span[0] - 0.5, span[1] + 0.5, color="0.9", label="warm start (SFT)")
    for label, pts in held_out_curves(run).items():
        steps, tokens, values, errors = zip(*pts)
        for ax, xs in zip(axes, (steps, tokens)):
            ax.errorbar(xs, values, yerr=errors, marker="o", ms=3, capsize=3, label=label)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("RL generated tokens")
    axes[0].set_ylabel("held-out (± s.e.)")
    axes[0].set_ylim(-0.05, 1.05)
    fig.suptitle("held-out success")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


PLOT_SOFTWARE = "quaero review"  # the PNG text that marks a plot review wrote (replaced without --force)


def written_by(path: Path, software: str = PLOT_SOFTWARE) -> bool:
    """Whether `path` is a PNG `software` wrote earlier (its Software text chunk says so)."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and b"tEXtSoftware\x00" + software.encode() in head


def _review_plot(path: Path) -> bool:
    return written_by(path)


def check_plots(out_dir: str | Path, *, force: bool = False) -> list[Path]:
    """The plot files `--plots DIR` writes, each checked (quaero/tools/outputs.py) before any is written: no
    link, special file or run's own file; an existing file only if review wrote it or `force`."""
    from quaero.tools.outputs import check_output

    out = Path(out_dir)
    return [check_output(out / f"{name}.png", "--plots", force=force, in_runs=True, replaceable=_review_plot)
            for name in [*PLOT_SERIES, HELD_OUT_PLOT]]


def write_plots(run: RunRecord, out_dir: str | Path, *, force: bool = False) -> list[Path]:
    from quaero.tools.outputs import OutputRefused

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
        written.append(save_png(fig, out / f"{name}.png", plt))
    written.append(save_png(_held_out_figure(run, plt), out / f"{HELD_OUT_PLOT}.png", plt))
    return written


def save_png(fig, path: Path, plt, software: str = PLOT_SOFTWARE) -> Path:
    """`fig` as a PNG at `path` marked as `software`'s (its Software text), through a temporary file renamed
    onto the name: never written through what was there (quaero/tools/outputs.py)."""
    from quaero.tools.outputs import saving_to

    tmp, commit = saving_to(path)
    fig.savefig(tmp, dpi=90, format="png", metadata={"Software": software})
    commit()
    plt.close(fig)
    return path


def last_evals_paired(a: RunRecord, b: RunRecord) -> dict | None:
    """Two runs' last evals on their shared tasks: the tasks A solves and B does not (fixed) and the reverse
    (regressed); None where either has no per-task results."""
    from quaero.tools.significance import fixed_and_regressed

    outcomes = [eval_outcomes(r.evals[-1]) if r.evals else None for r in (a, b)]
    if not all(outcomes):
        return None
    fixed, regressed = fixed_and_regressed(*outcomes)
    return {"pairs": sum(k in outcomes[1] for k in outcomes[0]), "fixed": fixed, "regressed": regressed}


def held_out_lines(s) -> list[str]:
    """The last eval's held-out figures and RL's fixed / regressed tasks, as lines (empty where none)."""
    from quaero.tools.evaluate import pass_line, tasks_text

    e, lines = s.eval_last, []
    if e.get("eval_success_se_last") is not None and s.eval_success_last is not None:
        se = e["eval_success_se_last"]
        parts = [f"held-out success (last eval) {s.eval_success_last:.3f} ± {se:.3f} s.e."]
        if e.get("eval_format_failures_last") is not None:
            parts.append(f"failures: {e['eval_format_failures_last']:.3f} format (a malformed action), "
                         f"{e['eval_wrong_answers_last']:.3f} wrong answers (every action well formed)")
        lines.append("; ".join(parts))
    if e.get("eval_pass_k"):
        figures = {key: e.get(f"eval_{key}_last") for key in ("pass_at_1", "pass_at_k", "pass_at_k_se")}
        figures.update(k=e["eval_pass_k"], tasks=e.get("eval_pass_tasks_last"))
        lines.append("last eval's " + pass_line(figures))
    c = s.rl_vs_warm_start
    if not c.why and c.fixed is not None:
        lines.append(clip(f"RL over warm start per task: fixed {tasks_text(c.fixed)}; regressed "
                          f"{tasks_text(c.regressed)}", MAX_LINE))
    return lines


_TAGS = {proofs.PASS: "PASS", proofs.NA: "N/A"}


def _tag(check: proofs.Check) -> str:
    return _TAGS.get(check.status, "FAIL" if check.required else "WARN")

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
        runs = [load_run(d) for d in args.compare]
        a, b = (summarize(r).to_dict() for r in runs)
        tasks = last_evals_paired(*runs)
        if args.json:
            print(dump_json({"a": a, "b": b, **({"last_evals": tasks} if tasks else {})}))
        else:
            print(render_table([(k, [v, b.get(k)]) for k, v in a.items() if not isinstance(v, dict)],
                               ["metric", *args.compare]))
            if tasks:
                from quaero.tools.evaluate import tasks_text

                print(clip(f"last evals per task (B -> A, {tasks['pairs']} shared tasks): fixed (A only) "
                           f"{tasks_text(tasks['fixed'])}; regressed (B only) "
                           f"{tasks_text(tasks['regressed'])}", MAX_LINE))
        return 0
    if not args.run_dir:
        raise ReviewError("quaero review RUN_DIR (or --compare RUN_A RUN_B)")
    run = load_run(args.run_dir)
    s = summarize(run)
    checks = proofs.run_checks(s)
    folder = Path(run.path).parent / "plots" if args.plots is True else args.plots  # bare: RUN/plots
    plots = ([str(p) for p in write_plots(run, folder, force=getattr(args, "force", False))]
             if args.plots else [])
    if s.unreadable_lines:
        print(f"warning: {run.path}: {s.unreadable_lines} line(s) could not be read (not UTF-8, not a "
              "JSON object, or a step that is not an integer) and are left out", file=sys.stderr)
    if args.json:
        print(dump_json({"summary": s.to_dict(), "checks": [c.to_dict() for c in checks], "plots": plots}))
    else:
        print(f"run {args.run_dir} ({'finished' if s.finished else 'INCOMPLETE: no run_end event'})")
        print(render_table([(k, [v]) for k, v in s.table_rows()], ["metric", "value"]))
        print()
        for c in checks:
            print(clip(f"[{_tag(c)}] {c.name}: {c.detail}", MAX_LINE))
        # a mixture's; the checks above judge the pooled run
        for env, figures in s.per_env.items():
            print(env_line(env, figures))
        if s.guidance is not None:
            print(guidance_line(s.guidance, s.rl_vs_warm_start))
        for line in held_out_lines(s):
            print(line)
        for step, resumed in s.resumed_with_changed_config.items():
            print(changed_line(step, resumed))
        for p in plots:
            print(f"plot {p}")
    missed = proofs.unmet(checks, require_proof=args.require_proof, names=require)
    for line in missed:
        print(f"error: required check {line}", file=sys.stderr)
    return 1 if missed else 0
