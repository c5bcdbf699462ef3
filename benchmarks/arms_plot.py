"""`quaero bench arms`' figure: every arm at every seed in one picture, held-out success ± s.e. against RL's
generated tokens, each curve starting at its seed's warm start (0 RL tokens) and going through every eval the
arm's run logged (quaero/tools/review_command.py `held_out_curves`, the curves `quaero review --plots` draws).
One colour per arm, one marker per seed."""
from __future__ import annotations

from pathlib import Path

from benchmarks.samplers import arm_name, read_run

SOFTWARE = "quaero bench arms"  # the PNG text that marks a figure this wrote (replaced without --force)
MARKERS = "osD^vP*Xhp<>"


def arm_curves(arms: list[tuple[str, str, list[str]]], seeds: list[int], warm: dict[int, dict | None],
               out: Path) -> dict[tuple[str, int], list[tuple[float, float, float]]]:
    """{(arm, seed): [(RL generated tokens, success, s.e.)]}: the seed's warm-start eval (`warm[seed]`, its
    event) at 0 tokens, then the arm's evals after it (`out/NAME/SAMPLER-sS`, as `join` reads them)."""
    from quaero.tools.review import held_out
    from quaero.tools.review_command import held_out_curves

    curves = {}
    for name, sampler, _ in arms:
        for s in seeds:
            start = held_out(warm[s]) if warm.get(s) else {}
            pts = ([(0, start["success"], start["success_se"])]
                   if start.get("success") is not None and start.get("success_se") is not None else [])
            run = read_run(out / name / arm_name(sampler, s), f"arm {name} seed {s}")
            step = warm[s]["step"] if warm.get(s) else -1
            pts += [(tokens, v, se) for st, tokens, v, se in held_out_curves(run).get("success", [])
                    if st > step]
            curves[(name, s)] = pts
    return curves


def write_figure(curves: dict[tuple[str, int], list[tuple[float, float, float]]], path: Path, *,
                 force: bool = False) -> Path:
    """The figure at `path`, checked and written through quaero/tools/outputs.py (never through a link; an
    existing file only if this wrote it, or `force`)."""
    from quaero.tools.outputs import OutputRefused, check_output
    from quaero.tools.review_command import save_png, written_by

    try:
        check_output(path, "--plot", force=force, replaceable=lambda p: written_by(p, SOFTWARE))
    except OutputRefused as e:
        raise SystemExit(f"error: {e}") from None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(dict.fromkeys(a for a, _ in curves))
    seeds = list(dict.fromkeys(s for _, s in curves))
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (arm, seed), pts in curves.items():
        if not pts:
            continue
        tokens, values, errors = zip(*pts)
        ax.errorbar(tokens, values, yerr=errors, color=colours(arms.index(arm) % 10),
                    marker=MARKERS[seeds.index(seed) % len(MARKERS)], ms=4, capsize=3, lw=1,
                    label=f"{arm}, seed {seed}")
    ax.set_xlabel("RL generated tokens")
    ax.set_ylabel("held-out success (± s.e.)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("every arm at every seed, from its warm start")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, ncol=max(1, len(arms) // 4 + 1))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_png(fig, path, plt, software=SOFTWARE)
