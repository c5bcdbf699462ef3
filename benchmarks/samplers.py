"""`quaero bench samplers CONFIG --from RUN`: task samplers side by side from one warm start, at equal
generated tokens, over several RL seeds, per env (OpenEnv RFC 013's question: does a sampler buy more groups
with a learning signal per generated token, and does it cost held-out success?).

Each arm is a real `quaero train CONFIG --set run.seed=S --set env.tasks.sampler=X ...` (a mixture: every
env's `envs.NAME.tasks.sampler`) in a process of its own, resumed from RUN's checkpoint of `--from-step`, with
`[training] rl_token_budget` set, so every arm stops after the RL step that spends the budget. Per arm and
env, from its events: RL steps, generated tokens, groups and groups with spread (`task_outcomes`), per 1,000
generated tokens; per spec group (e.g. toolbench's template): groups, groups with spread, RL successes; the
last eval paired per task against the warm start's eval (RUN's eval at `--from-step`) and against the
`sequential` arm of the same seed (McNemar exact p), and its success per spec group where the env's Task API
(`get_task`) names one. Pooled over seeds per sampler at the end.

    quaero bench samplers envs/toolbench.toml --from runs/toolbench-s2 --from-step 500 --seeds 0,1,2 \
        --budget 24000 --set training.steps=24 --set training.eval_every=1000 \
        --set training.checkpoint_every=1000

An arm whose run folder already holds a finished run of the same command is read, not re-run (`--rerun` to
train it again), so a long comparison survives an interrupted session.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.ablation import arm_folder_problem, refuse_owned_sets, start_checkpoint, train_arm
from quaero.telemetry import names
from quaero.telemetry.summary import RunRecord
from quaero.tools.significance import paired_outcomes

LEARNERS = ("curriculum", "difficulty_pools")  # the samplers whose draws read outcomes (and so `--key`)
MARKER = "bench_samplers_arm.json"  # the arm's command, once its run finished: read instead of rerun
USER_CLASS = re.compile(r"[A-Za-z0-9_.]+:[A-Za-z0-9_.]+")  # a sampler of the user's, "package.module:Class"


def arm_samplers(text: str) -> list[str]:
    """`--samplers`: quaero's task samplers or user classes ("package.module:Class", imported here), each
    once; SystemExit in one line for anything else (an arm's name becomes its folder's name: no path)."""
    import inspect

    from quaero.config import TASK_SAMPLERS
    from quaero.resolve import Unresolved, resolve_name

    out = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not out:
        raise SystemExit("error: --samplers names no sampler; e.g. --samplers sequential,curriculum")
    for sampler in out:
        if sampler not in TASK_SAMPLERS and not USER_CLASS.fullmatch(sampler):
            raise SystemExit(f"error: --samplers {sampler!r}: not one of {', '.join(TASK_SAMPLERS)} nor a "
                             "class 'package.module:Class' (letters, digits, _ and . only: an arm's name is "
                             "its folder's name in --out)")
        if sampler not in TASK_SAMPLERS:
            try:
                resolve_name(sampler, "--samplers", want=inspect.isclass, wanted="a class")
            except Unresolved as e:
                raise SystemExit(f"error: {e}") from None
    return out


def arm_name(sampler: str, seed: int) -> str:
    """An arm's run name (its folder in --out): a user class's colon becomes '+', which run names take."""
    return f"{sampler.replace(':', '+')}-s{seed}"


def seed_list(text: str) -> list[int]:
    try:
        seeds = list(dict.fromkeys(int(s) for s in text.split(",") if s.strip()))
    except ValueError:
        raise SystemExit(f"error: --seeds {text!r}: expected integers, comma-separated, e.g. 0,1,2") from None
    if not seeds or any(s < 0 for s in seeds):
        raise SystemExit(f"error: --seeds {text!r}: expected at least one seed, each >= 0, e.g. 0,1,2")
    return seeds


def arm_sets(views: dict[str, Any], mixture: bool, sampler: str, key: str) -> list[str]:
    """The `--set`s that give every env of the config `sampler` (and, for a learning sampler, `key`)."""
    out = []
    for env in views:
        prefix = f"envs.{env}.tasks" if mixture else "env.tasks"
        out.append(f"{prefix}.sampler={sampler}")
        if sampler in LEARNERS:
            out.append(f"{prefix}.key={key}")
    return out


def run_sets(sets: list[str], from_step: int, budget: int) -> list[str]:
    """Every arm's `--set`s: the user's, then the resume point and the generated-token budget."""
    return [*sets, f"training.warmup_sft_steps={from_step}", f"training.rl_token_budget={budget}"]


def arm_command(config: str, source: Path, from_step: int, seed: int, common: list[str],
                arm: list[str]) -> list[str]:
    """An arm's command as its marker records it (`common`: `run_sets`; `arm`: its sampler's sets): what
    decides whether a finished run is this arm's."""
    return [config, str(source), str(from_step), str(seed), *common, *arm]


def same_arm(recorded: Any, command: list[str]) -> bool:
    """Whether a marker's command is `command`: equal, or the same `--set`s in another order where the order
    cannot matter (each key set once, none inside another's table: `a.b=1` then `a={...}` stays ordered)."""
    if recorded == command:
        return True
    if not isinstance(recorded, list) or len(recorded) != len(command) or recorded[:4] != command[:4]:
        return False
    from quaero.config import ConfigError
    from quaero.config.load import parse_override

    def settings(sets: list[Any]) -> dict[tuple[str, ...], Any] | None:
        try:
            parsed = [parse_override(s) for s in sets]
        except (ConfigError, TypeError, AttributeError):
            return None
        keys = [tuple(k) for k, _ in parsed]
        if len(set(keys)) != len(keys) or any(a != b and a == b[:len(a)] for a in keys for b in keys):
            return None
        return {tuple(k): json.dumps(v, sort_keys=True, default=str) for k, v in parsed}

    mine = settings(command[4:])
    return mine is not None and settings(recorded[4:]) == mine


def finished(run_dir: Path, command: list[str]) -> bool:
    """Whether `run_dir` holds a finished run that this same arm command made (its `--set`s in any order
    where the order cannot matter: `same_arm`)."""
    marker = run_dir / MARKER
    if not marker.is_file() or not (run_dir / names.EVENTS).is_file():
        return False
    from quaero.tools.review import ReviewError, load_run

    try:  # a marker or log that is not what the bench wrote: the arm trains again
        return same_arm(json.loads(marker.read_text()), command) and load_run(run_dir).ended
    except (OSError, ValueError, RecursionError, ReviewError):
        return False


def eval_groups(view: Any, split_indices: list[int]) -> dict[int, Any]:
    """{eval task index: its spec's `group`} through the env's own Task API (`get_task`), for an env quaero
    can build in process from its `entry`; {} where it cannot."""
    from quaero.resolve import resolve_name

    env = view.env
    if not env.entry or not split_indices:
        return {}
    try:
        instance = resolve_name(env.entry, "env.entry")(**env.kwargs)
        get_task = instance.get_task
    except Exception:  # noqa: BLE001 - a figure we can do without, never a reason to lose the comparison
        return {}
    out = {}
    for i in split_indices:
        try:
            out[i] = group_key((get_task(env.eval_split, i) or {}).get("group"))
        except Exception:  # noqa: BLE001
            return {}
    return out


def group_key(group: Any) -> Any:
    """A spec's `group` as a key: a scalar as it is, anything else (an RFC 013 group nested in lists or
    dicts) as its JSON text."""
    if group is None or isinstance(group, (str, int, float, bool)):
        return group
    try:
        return json.dumps(group, sort_keys=True, default=str)[:200]
    except (ValueError, RecursionError):
        return str(type(group).__name__)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**53


def outcome_groups(run: RunRecord, env: str | None) -> list[tuple]:
    """The `task_outcomes` groups of a run (of one env): (env, task, spec group, successes, episodes, spread,
    tokens), each read as the run log writes it; a group of another shape (a hand-edited or foreign log) is
    left out."""
    out = []
    for e in run.of_kind(names.TASK_OUTCOMES_EVENT):
        if not isinstance(e.get("groups"), list):
            continue
        for g in e["groups"]:
            if not (isinstance(g, list) and len(g) == 7 and all(_count(v) for v in (g[3], g[4], g[6]))):
                continue
            if env is None or g[0] == env:
                out.append((g[0], g[1], group_key(g[2]), g[3], g[4], bool(g[5]), g[6]))
    return out


def arm_figures(run: RunRecord, env: str | None) -> dict[str, Any]:
    """An arm's RL figures for one env (None: a one-env run): steps, tokens, groups, with spread; per spec
    group: groups, with spread, successes and episodes."""
    rl_steps = {s["step"] for s in run.steps if s.get(names.PHASE, names.PHASE_RL) == names.PHASE_RL}
    groups = outcome_groups(run, env)
    by_group: dict[Any, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for _env, _task, spec_group, successes, episodes, spread, _tokens in groups:
        row = by_group[spec_group]
        row[0] += 1
        row[1] += int(bool(spread))
        row[2] += successes
        row[3] += episodes
    tokens = sum(g[6] for g in groups)
    signal = sum(bool(g[5]) for g in groups)
    return {"rl_steps": len(rl_steps), "tokens": tokens, "groups": len(groups), "signal": signal,
            "signal_per_1k": 1000 * signal / tokens if tokens else None, "by_group": dict(by_group)}


def read_run(run_dir: Path, what: str) -> RunRecord:
    """`load_run`, its error one line naming `what` (the `--from` run, an arm)."""
    from quaero.tools.review import ReviewError, load_run

    try:
        return load_run(run_dir)
    except ReviewError as e:
        raise SystemExit(f"error: {what}: {e}") from None


def success_rate(outcomes: dict | None) -> float | None:
    return sum(s for s, _ in outcomes.values()) / len(outcomes) if outcomes else None


def compare(a: dict | None, b: dict | None, seed: int = 0) -> dict | None:
    return paired_outcomes(a, b, seed=seed) if a and b else None


def _f3(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _pm(c: dict | None) -> str:
    return f"+{c['a_only']}/-{c['b_only']}, p {c['mcnemar_p']:.2g}" if c else "n/a"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="quaero bench samplers", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--from", dest="source", type=Path, required=True,
                   help="the run whose checkpoint every arm starts from (the shared warm start)")
    p.add_argument("--from-step", type=int, required=True,
                   help="that run's checkpoint (and eval) of this step")
    p.add_argument("--samplers", default="sequential,uniform,curriculum,difficulty_pools")
    p.add_argument("--seeds", default="0,1,2", help="RL run seeds, comma-separated")
    p.add_argument("--budget", type=int, required=True, help="[training] rl_token_budget of every arm")
    p.add_argument("--key", default="group", choices=("task", "group", "difficulty"),
                   help="what the learning samplers pool outcomes by (default: the spec's group)")
    p.add_argument("--set", dest="common", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--out", type=Path, default=Path("bench_out/samplers"))
    p.add_argument("--rerun", action="store_true", help="train arms again even where a finished run is there")
    args = p.parse_args(argv)

    from quaero.config import load_config
    from quaero.tools.outputs import write_replacing
    from quaero.tools.review import eval_outcomes

    if args.budget <= 0:
        raise SystemExit(f"error: --budget {args.budget}: every arm's generated-token budget must be > 0, "
                         "e.g. --budget 24000")
    refuse_owned_sets(args.common)
    seeds, samplers = seed_list(args.seeds), arm_samplers(args.samplers)
    cfg = load_config(args.config, args.common)  # a bad config or --set fails here, before any arm runs
    views = cfg.views()
    envs = list(views) if cfg.is_mixture else [None]
    start_checkpoint(args.source, args.from_step)  # one line if the warm start is not there
    warm = next((e for e in read_run(args.source, "--from").evals if e["step"] == args.from_step), None)
    if warm is None:
        raise SystemExit(f"error: --from {args.source}: no eval at step {args.from_step} to pair against; "
                         f"choose a step its [training] eval_every evaluated")
    common = run_sets(args.common, args.from_step, args.budget)
    if args.out.exists() and not args.out.is_dir():
        raise SystemExit(f"error: --out {args.out}: a file, not a folder; name a folder for the arms")
    commands = {}
    for seed in seeds:
        for sampler in samplers:
            arm = arm_sets(views, cfg.is_mixture, sampler, args.key)
            commands[(seed, sampler)] = (arm, arm_command(args.config, args.source, args.from_step, seed,
                                                          common, arm))
            run_dir = args.out / arm_name(sampler, seed)
            # every arm's folder judged before any is emptied (a `--from` run or a user's folder under an
            # arm's name is refused, never deleted)
            if (args.rerun or not finished(run_dir, commands[(seed, sampler)][1])) and (
                    problem := arm_folder_problem(run_dir, args.out, args.source)):
                raise SystemExit(f"error: {problem}")
    args.out.mkdir(parents=True, exist_ok=True)

    results: dict[tuple[int, str], dict] = {}
    for seed in seeds:
        for sampler in samplers:
            name = arm_name(sampler, seed)
            arm, command = commands[(seed, sampler)]
            run_dir = args.out / name
            if args.rerun or not finished(run_dir, command):
                train_arm(args.config, args.out, name, seed, arm, common, args.source, args.from_step)
                write_replacing(run_dir / MARKER, json.dumps(command))
            run = read_run(run_dir, f"arm {name}")
            if not run.evals:
                raise SystemExit(f"error: {run_dir}: the arm ran no eval; leave [training] eval_tasks > 0")
            results[(seed, sampler)] = {str(env): {**arm_figures(run, env),
                                                   "eval": eval_outcomes(run.evals[-1], env)}
                                        for env in envs}

    report: dict[str, Any] = {"config": args.config, "from": str(args.source), "from_step": args.from_step,
                              "budget": args.budget, "key": args.key, "seeds": seeds, "samplers": samplers,
                              "common": args.common, "envs": {}}
    for env in envs:
        tag = str(env)
        warm_eval = eval_outcomes(warm, env)
        view = views[env] if env is not None else next(iter(views.values()))
        spec_groups = eval_groups(view, sorted(warm_eval or {}))
        rows, pooled = [], {}
        for sampler in samplers:
            pool = {"tokens": 0, "signal": 0, "groups": 0, "end": {}, "warm": {}, "seq": {},
                    "by_group": defaultdict(lambda: [0, 0, 0, 0]),
                    "eval_by_group": defaultdict(lambda: [0, 0])}
            for seed in seeds:
                f = results[(seed, sampler)][tag]
                seq = results.get((seed, "sequential"), {}).get(tag, {}).get("eval")
                row = {"seed": seed, "sampler": sampler,
                       **{k: f[k] for k in ("rl_steps", "tokens", "groups", "signal", "signal_per_1k")},
                       "success": success_rate(f["eval"]),
                       "vs_warm_start": compare(f["eval"], warm_eval, seed),
                       "vs_sequential": compare(f["eval"], seq, seed) if sampler != "sequential" else None,
                       "by_group": {str(k): v for k, v in f["by_group"].items()}}
                rows.append(row)
                for k in ("tokens", "signal", "groups"):
                    pool[k] += f[k]
                for k, v in f["by_group"].items():
                    pool["by_group"][k] = [a + b for a, b in zip(pool["by_group"][k], v)]
                for task, outcome in (f["eval"] or {}).items():
                    pool["end"][(seed, task)] = outcome
                    if warm_eval and task in warm_eval:
                        pool["warm"][(seed, task)] = warm_eval[task]
                    if seq and task in seq:
                        pool["seq"][(seed, task)] = seq[task]
                    if task in spec_groups:
                        pool["eval_by_group"][spec_groups[task]][0] += outcome[0]
                        pool["eval_by_group"][spec_groups[task]][1] += 1
            pooled[sampler] = {
                "tokens": pool["tokens"], "groups": pool["groups"], "signal": pool["signal"],
                "signal_per_1k": 1000 * pool["signal"] / pool["tokens"] if pool["tokens"] else None,
                "vs_warm_start": compare(pool["end"], pool["warm"]),
                "vs_sequential": compare(pool["end"], pool["seq"]) if sampler != "sequential" else None,
                "by_group": {str(k): v for k, v in pool["by_group"].items()},
                "eval_by_group": {str(k): v for k, v in pool["eval_by_group"].items()}}
        warm_by_group: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for task, (success, _) in (warm_eval or {}).items():
            if task in spec_groups:
                warm_by_group[str(spec_groups[task])][0] += success
                warm_by_group[str(spec_groups[task])][1] += 1
        report["envs"][tag] = {"rows": rows, "pooled": pooled, "warm_start_by_group": dict(warm_by_group),
                               "warm_start_success": success_rate(warm_eval)}
    write_replacing(args.out / "samplers.json", json.dumps(report, indent=2, default=str))
    print(render(report))
    return 0


def render(report: dict) -> str:
    """The report as markdown tables: per env, each arm, then each sampler pooled over seeds, then per spec
    group."""
    out = []
    for env, r in report["envs"].items():
        title = f"env {env}" if env != "None" else "the env"
        base = {row["seed"]: row["signal_per_1k"] for row in r["rows"] if row["sampler"] == "sequential"}
        out.append(f"### {title}: warm start {_f3(r['warm_start_success'])} held-out (step "
                   f"{report['from_step']}), budget {report['budget']} generated tokens an arm\n")
        out.append("| seed | sampler | RL steps | generated tokens | groups | with signal | signal groups "
                   "per 1k tokens (x sequential) | held-out | vs warm start | vs sequential |\n"
                   + "|---" * 10 + "|")
        for row in r["rows"]:
            per = row["signal_per_1k"]
            ratio = f" ({per / base[row['seed']]:.2f}x)" if per and base.get(row["seed"]) else ""
            out.append(f"| {row['seed']} | {row['sampler']} | {row['rl_steps']} | {row['tokens']:,} | "
                       f"{row['groups']} | {row['signal']} | {per or 0:.3f}{ratio} | "
                       f"{_f3(row['success'])} | "
                       f"{_pm(row['vs_warm_start'])} | {_pm(row['vs_sequential'])} |")
        seq = r["pooled"].get("sequential", {}).get("signal_per_1k")
        out.append("\nPooled over seeds:\n\n| sampler | generated tokens | groups | with signal | per 1k "
                   "tokens (x sequential) | held-out | vs warm start | vs sequential |\n" + "|---" * 8 + "|")
        for sampler, pl in r["pooled"].items():
            per = pl["signal_per_1k"]
            ratio = f" ({per / seq:.2f}x)" if per and seq else ""
            success = pl["vs_warm_start"]["a_success"] if pl["vs_warm_start"] else None
            out.append(f"| {sampler} | {pl['tokens']:,} | {pl['groups']} | {pl['signal']} | "
                       f"{per or 0:.3f}{ratio} | {_f3(success)} | {_pm(pl['vs_warm_start'])} | "
                       f"{_pm(pl['vs_sequential'])} |")
        keys = sorted({k for pl in r["pooled"].values() for k in pl["by_group"]}
                      | set(r["warm_start_by_group"]))
        if keys:
            warm = ", ".join(f"{k} {s}/{n}" for k, (s, n) in sorted(r["warm_start_by_group"].items()))
            out.append(f"\nPer spec group (pooled over seeds; the warm start's one held-out eval: "
                       f"{warm or 'n/a'}):\n\n"
                       "| sampler | group | RL groups | with signal | RL successes / episodes | "
                       "held-out solved |\n" + "|---" * 6 + "|")
            for sampler, pl in r["pooled"].items():
                for k in keys:
                    g, s, wins, eps = pl["by_group"].get(k, [0, 0, 0, 0])
                    solved, n = pl["eval_by_group"].get(k, [0, 0])
                    out.append(f"| {sampler} | {k} | {g} | {s} | {wins} / {eps} | "
                               f"{f'{solved}/{n}' if n else 'n/a'} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
