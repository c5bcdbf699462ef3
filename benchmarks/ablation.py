"""`quaero bench ablation CONFIG`: ECHO on vs off (or any two arms) over several run seeds, each pair of runs
compared on the identical held-out tasks of their last evaluation, then pooled.

Each arm is a real `quaero train CONFIG --set run.seed=S ...` in a process of its own. The two runs of a seed
evaluate the same tasks greedily at their last step (`eval_results` in their events), so they pair per task;
per seed: McNemar exact p on success, paired bootstrap 95% interval of the reward difference (A - B); pooled:
the same over every (seed, task) pair. `--from RUN` starts every arm from RUN's latest checkpoint (a shared
warm start), so the arms differ only after it: the RL phase, where the ECHO paper measures its effect.

    quaero bench ablation envs/toolbench.toml --seeds 0,1,2 --out bench_out/ablation
    quaero bench ablation my_env.toml --arm-a echo.enabled=true --arm-b echo.enabled=false \
        --set training.steps=40
    quaero bench ablation envs/toolbench.toml --from runs/toolbench --from-step 400 \
        --set training.warmup_sft_steps=400 --set training.steps=12 ...   # the RL phase only
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from quaero.tools.significance import paired_outcomes


def final_outcomes(run_dir: Path) -> dict[int, tuple[int, float]]:
    """{task index: (success, reward)} of the run's last evaluation."""
    from quaero.tools.review import eval_outcomes, load_run

    evals = load_run(run_dir).evals
    outcomes = eval_outcomes(evals[-1]) if evals else None
    if not outcomes:
        raise SystemExit(f"error: {run_dir}: its last eval has no per-task results; "
                         "set [training] eval_tasks > 0")
    return outcomes


def start_checkpoint(source: Path, step: int | None) -> tuple[Path, int]:
    """`--from RUN [--from-step N]` (this bench and `bench peers-trl`): the folder and step of `source`'s
    checkpoint of `step`, else of its newest intact one; a bad choice exits in one line before anything
    runs."""
    from quaero.recipe import checkpoint

    if step is None:
        found = checkpoint.load_latest(checkpoint.run_checkpoints(source))
        if found is None:
            raise SystemExit(f"error: --from {source}: no checkpoint to start from; train it first")
        return found[0], found[1]["step"]
    path = checkpoint.run_checkpoint(source, step)
    problem = checkpoint.verify(path) if path.is_dir() else "no such folder"
    if problem:
        raise SystemExit(f"error: --from {source} --from-step {step}: {path} is unusable ({problem})")
    return path, step


ARM_MARKER = ".quaero-bench-arm"  # in every arm folder a bench made: the only folders it may empty again
OLD_MARKERS = ("bench_samplers_arm.json",)  # what `bench samplers` marked its arms with before ARM_MARKER


def arm_folder_problem(run_dir: Path, out: Path, source: Path | None) -> str | None:
    """Why the bench may not empty and reuse `run_dir` (an arm's folder, `out/NAME`), judged on resolved paths
    before anything is removed; None when it may: a folder directly in `out` (not a link elsewhere), not the
    `--from` run, not inside it and not holding it, and either absent, empty or marked as an arm a bench
    made."""
    where, home = run_dir.resolve(), out.resolve()
    if where.parent != home:
        return f"{run_dir} resolves to {where}, outside --out {out}; remove the link or choose another --out"
    if source is not None:
        src = source.resolve()
        if src == where or where in src.parents or src in where.parents:
            return (f"{run_dir} is (or holds, or lies in) the --from run {source}; an arm's folder is "
                    "emptied before it trains: choose another --out")
    if run_dir.is_symlink() or (run_dir.exists() and not run_dir.is_dir()):
        return f"{run_dir} is a file or a link, not an arm's folder; move it or choose another --out"
    if run_dir.is_dir() and any(run_dir.iterdir()) and not any(
            (run_dir / m).is_file() for m in (ARM_MARKER, *OLD_MARKERS)):
        return (f"{run_dir} holds files no bench wrote (no {ARM_MARKER}); an arm's folder is emptied before "
                "it trains: move them or choose another --out")
    return None


def _seed_start(source: Path, run_dir: Path, step: int | None) -> None:
    """Put `source`'s checkpoint of `step` (else its latest) into a fresh run folder: the run resumes
    from it. The folder is emptied first only if `arm_folder_problem` allows it."""
    from quaero.recipe import checkpoint

    path, _ = start_checkpoint(source, step)
    if problem := arm_folder_problem(run_dir, run_dir.parent, source):
        raise SystemExit(f"error: {problem}")
    shutil.rmtree(run_dir, ignore_errors=True)
    checkpoint.run_checkpoints(run_dir).mkdir(parents=True)
    (run_dir / ARM_MARKER).write_text("a folder `quaero bench` made for one arm; it empties it to rerun it\n")
    shutil.copytree(path, checkpoint.run_checkpoints(run_dir) / path.name)


# what `train_arm` sets for each arm: its run folder (--out/NAME) and its seed. A user's --set of one would
# move the arm into another run (a user's: its events, checkpoints and final/ written over), so each is
# refused, and the bench's own come last besides
BENCH_OWNED = (("run", "name"), ("run", "output_dir"), ("run", "seed"))


def owned_set(sets: list[str], owned: tuple[tuple[str, ...], ...]) -> str | None:
    """The first of `sets` that sets a key of `owned`, or a table holding one (`run = {...}`); None where
    none does. A malformed set passes (it is `load_config`'s to name)."""
    from quaero.config import ConfigError
    from quaero.config.load import parse_override

    for text in sets:
        try:
            keys, _ = parse_override(text)
        except ConfigError:
            continue
        if any(tuple(keys) == key[:len(keys)] or tuple(keys[:len(key)]) == key for key in owned):
            return text
    return None


def refuse_owned_sets(sets: list[str], flag: str = "--set") -> None:
    """One line (SystemExit) for a set of a key the bench owns (`BENCH_OWNED`); other sets pass."""
    text = owned_set(sets, BENCH_OWNED)
    if text is not None:
        raise SystemExit(f"error: {flag} {text!r}: run.name, run.output_dir and run.seed are the bench's "
                         "own (each arm is its own run in --out, seeded from --seeds); drop the set and "
                         "choose the folder with --out, the seeds with --seeds")


def train_arm(config: str, out: Path, name: str, seed: int, arm: list[str], common: list[str],
              source: Path | None, from_step: int | None = None) -> Path:
    run_dir = out / name
    if source is not None:
        _seed_start(source, run_dir, from_step)
    sets = ["logging.console=none", *common, *arm, f"run.name={name}", f"run.output_dir={out}",
            f"run.seed={seed}"]
    cmd = [sys.executable, "-m", "quaero.cli", "train", config] + [x for s in sets for x in ("--set", s)]
    print("$ " + " ".join(cmd[2:]), file=sys.stderr, flush=True)
    code = subprocess.run(cmd, check=False).returncode
    if code:
        raise SystemExit(f"error: arm {name}: `quaero train` exited {code} (its error is above); fix what it "
                         "names and run the bench again")
    return run_dir


def table(rows: list[tuple[str, dict]], a: str, b: str) -> str:
    head = (f"| seed | pairs | success A ({a}) | success B ({b}) | A only | B only | McNemar p | "
            "reward A - B [95% CI] |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for label, c in rows:
        low, high = c["reward_diff_ci95"]
        lines.append(f"| {label} | {c['pairs']} | {c['a_success']:.3f} | {c['b_success']:.3f} | "
                     f"{c['a_only']} | {c['b_only']} | {c['mcnemar_p']:.3g} | "
                     f"{c['reward_diff']:+.3f} [{low:+.3f}, {high:+.3f}] |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="quaero bench ablation", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--seeds", default="0,1,2", help="run seeds, comma-separated (default 0,1,2)")
    p.add_argument("--arm-a", action="append", default=None, metavar="SECTION.KEY=VALUE",
                   help="arm A's overrides (default echo.enabled=true)")
    p.add_argument("--arm-b", action="append", default=None, metavar="SECTION.KEY=VALUE",
                   help="arm B's overrides (default echo.enabled=false)")
    p.add_argument("--set", dest="common", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="overrides for both arms")
    p.add_argument("--from", dest="source", type=Path,
                   help="start every arm from this run's latest checkpoint")
    p.add_argument("--from-step", type=int, help="with --from: that run's checkpoint of this step instead")
    p.add_argument("--out", type=Path, default=Path("bench_out/ablation"))
    args = p.parse_args(argv)
    # as bench peers-trl: never train from scratch silently
    if args.from_step is not None and args.source is None:
        raise SystemExit("error: --from-step needs --from RUN")
    arm_a, arm_b = args.arm_a or ["echo.enabled=true"], args.arm_b or ["echo.enabled=false"]
    for flag, sets in (("--set", args.common), ("--arm-a", arm_a), ("--arm-b", arm_b)):
        refuse_owned_sets(sets, flag)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    per_seed, pooled_a, pooled_b = [], {}, {}
    for seed in seeds:
        runs = [train_arm(args.config, args.out, f"{tag}-s{seed}", seed, arm, args.common, args.source,
                          args.from_step)
                for tag, arm in (("a", arm_a), ("b", arm_b))]
        a, b = (final_outcomes(r) for r in runs)
        per_seed.append((str(seed), paired_outcomes(a, b, seed=seed)))
        pooled_a.update({(seed, k): v for k, v in a.items()})
        pooled_b.update({(seed, k): v for k, v in b.items()})
    rows = per_seed + [("pooled", paired_outcomes(pooled_a, pooled_b))]
    result = {"config": args.config, "arm_a": arm_a, "arm_b": arm_b, "common": args.common,
              "from": str(args.source) if args.source else None, "seeds": seeds, "rows": dict(rows)}
    from quaero.tools.outputs import write_replacing

    write_replacing(args.out / "ablation.json", json.dumps(result, indent=2))  # never through a link there
    print(table(rows, " ".join(arm_a), " ".join(arm_b)))
    return 0
