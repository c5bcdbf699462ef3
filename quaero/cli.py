"""`quaero` command line: train, check, review, export, eval, inspect, bench, env serve, doctor.

Heavy imports (torch models, vLLM, unsloth) happen only inside the command that needs them, so a
bad config fails in well under a second, with one line and exit status 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="TOML config, e.g. envs/toolbench.toml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config field (repeatable), e.g. --set training.steps=3")


def cmd_check(args) -> int:
    from quaero.preflight.check import check

    return check(args)


def say_error(message: str) -> None:
    """`error: MESSAGE` on stderr in one write: the ranks of `--nproc` share one stderr pipe, and a `print`
    (message, then newline) from two ranks at once ran their lines together."""
    line = f"error: {message}\n"
    try:
        fd = sys.stderr.fileno()
    # a stderr without a file (pytest's capsys, an embedding host)
    except (AttributeError, OSError, ValueError):
        sys.stderr.write(line)
        return
    sys.stderr.flush()
    os.write(fd, line.encode())


RANK_SHUTDOWN_TIMEOUT_S = 900  # how long torchrun's agent lets the ranks finish a step after a Ctrl-C
# torchrun (torch.distributed.run) without its `@record` main: a failed rank has said why in its own error
# line (or traceback, for a bug); torchrun's ChildFailedError traceback and failure table after it say nothing
# more. A rank ended by a signal (an OOM kill) printed nothing: that gets one line, unless another rank failed
# with its own error first (torchrun then SIGTERMs the rest: their signal says nothing). The exit status is
# the rank's. A Ctrl-C or SIGTERM to the agent itself ends in its SignalException once the ranks have
# checkpointed and stopped: the ranks said what happened, so the agent exits quietly with the signal's status
# (130 for SIGINT).
_TORCHRUN = """import signal, sys
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run
try:
    run(parse_args(sys.argv[1:]))
except SignalException as e:
    sys.exit(128 + int(e.sigval))
except ChildFailedError as e:
    codes = [f.exitcode for f in e.failures.values()]
    own = next((c for c in codes if c > 0), None)
    for rank, f in sorted(e.failures.items()):
        if f.exitcode < 0 and own is None:
            print(f"error: rank {rank} was ended by {signal.Signals(-f.exitcode).name}", file=sys.stderr)
    sys.exit(own or 1)
"""


def launch_ranks(args, cfg) -> int:
    """`quaero train --nproc N`: this same command under torchrun (torch.distributed.run) on N local
    ranks, one process each; its exit status. A node of a multi-node job is launched by torchrun itself:
    `torchrun --nnodes ... -m quaero.cli train CONFIG`."""
    import signal
    import subprocess

    from quaero.config import ConfigError

    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: the number of ranks must be >= 1")
    if cfg.distributed.strategy == "none":
        raise ConfigError(f"{args.config} [distributed] strategy='none' with --nproc {args.nproc}: set "
                          "strategy = 'ddp' or 'fsdp2' (or --set distributed.strategy=ddp)")
    if "WORLD_SIZE" in os.environ:
        raise ConfigError(f"--nproc {args.nproc} under torchrun already "
                          f"(WORLD_SIZE={os.environ['WORLD_SIZE']}): "
                          "drop --nproc, torchrun started the ranks")
    again = [args.config, *(f"--set={o}" for o in args.overrides), *(["--resume"] if args.resume else []),
             *(["--restart"] if args.restart else [])]
    # A terminal's Ctrl-C reaches this process and torchrun's agent, which forwards it once to every rank
    # (each in a session of its own): the ranks finish the step, checkpoint it and stop. This process
    # waits for them instead of killing the agent (what subprocess.run does on KeyboardInterrupt), and the
    # agent waits for them up to --shutdown-timeout before it kills them.
    cmd = [sys.executable, "-c", _TORCHRUN, "--standalone", f"--nproc-per-node={args.nproc}",
           f"--shutdown-timeout={RANK_SHUTDOWN_TIMEOUT_S}", "-m", "quaero.cli", "train", *again]
    interrupted = False

    def note_interrupt(signum, frame) -> None:
        nonlocal interrupted
        interrupted = True

    previous = signal.signal(signal.SIGINT, note_interrupt)
    try:
        returncode = subprocess.Popen(cmd).wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        print("interrupted", file=sys.stderr)
        return 130
    return returncode


def cmd_train(args) -> int:
    from quaero.config import load_config
    from quaero.preflight.plan import load_checked
    from quaero.recipe.runlock import RunFolderLocked, refuse_if_held

    try:
        # under torchrun, rank 0 takes the lock in train() (the others never do)
        if "WORLD_SIZE" not in os.environ:
            refuse_if_held(load_config(args.config, args.overrides).run_dir)  # at once, before anything loads
    except RunFolderLocked as e:
        say_error(str(e))
        return 1
    cfg = load_checked(args.config, args.overrides)
    if args.nproc is not None:
        return launch_ranks(args, cfg)
    from quaero.recipe.checkpoint import CheckpointError
    from quaero.recipe.model_folder import ExportError
    from quaero.recipe.stop import EmptyRunError, EnvLostError
    from quaero.recipe.train import train
    from quaero.rollout.task_samplers import TaskSamplerError
    from quaero.sampling.server import ServerError

    try:
        train(cfg, resume=args.resume, restart=args.restart, source=args.config)
    except (CheckpointError, RunFolderLocked, EmptyRunError, EnvLostError, TaskSamplerError, ServerError,
            # ServerError: a vLLM server failed, in its words; ExportError: final/ could not be written
            ExportError) as e:
        say_error(str(e))
        return 1
    return 0


def cmd_review(args) -> int:
    from quaero.tools.review_command import main as review_main

    return review_main(args)


def cmd_bench(args) -> int:
    return run_benchmark(args.bench_args)


def run_benchmark(argv: list[str]) -> int:
    """`quaero bench NAME ...` through the benchmarks' registry (benchmarks/__init__.py), imported only here:
    nothing else in quaero/ imports the benchmarks."""
    try:
        import benchmarks
    except ModuleNotFoundError as e:
        if e.name != "benchmarks":
            raise
        say_error("quaero bench: the benchmarks package is not importable here; run it from a quaero "
                  "checkout, or install quaero from one (pip install -e .)")
        return 1
    return benchmarks.main(argv)


def cmd_doctor(args) -> int:
    from quaero.tools.doctor import main as doctor_main

    return doctor_main(args)


def cmd_export(args) -> int:
    from quaero.recipe.model_folder import ExportError
    from quaero.telemetry.runlog import configure
    from quaero.tools.export import export_run

    configure("warning")  # the printed line is the output; warnings still show
    try:
        out = export_run(args.run_dir, args.out, step=args.step, merge=args.merge)
    except ExportError as e:
        say_error(str(e))
        return 1
    print(f"exported {args.run_dir} -> {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


def cmd_eval(args) -> int:
    from quaero.config import load_config
    from quaero.telemetry.runlog import configure
    from quaero.tools.evaluate import EvalError, EvalPlan, evaluate, pooled_line, report_lines

    cfg = load_config(args.config, args.overrides)
    configure("warning", cfg.logging.console)  # the report is the output; warnings still show
    views = cfg.views()
    if args.env is not None and args.env not in views:
        say_error(f"--env {args.env!r}: the config's envs are {', '.join(views)}; name one of them")
        return 1
    outs = {}
    for name, view in views.items():  # a mixture's envs, each on its own eval split (or the one --env names)
        if args.env is not None and name != args.env:
            continue
        out_dir = f"{args.out}/{name}" if args.out and cfg.is_mixture else args.out
        plan = EvalPlan(tasks=args.tasks if args.tasks is not None else (view.training.eval_tasks or 64),
                        split=args.split or view.env.eval_split, seeds=args.seeds, greedy=not args.sample,
                        pass_k=args.pass_k if args.pass_k is not None else view.training.eval_pass_k,
                        out=out_dir)
        try:
            out, summary = evaluate(view, list(args.compare) if args.compare else [args.model], plan)
        except EvalError as e:
            say_error(f"env {name!r}: {e}" if cfg.is_mixture else str(e))
            return 1
        if cfg.is_mixture:
            print(f"── env {name!r}")
        print("\n".join(report_lines(summary, out)))
        outs[name] = out
    if args.compare and len(outs) > 1 and (line := pooled_line(outs, cfg.run.seed)):
        print(f"── all\n{line}")
    return 0


def cmd_inspect_rows(args) -> int:
    from quaero.tools.inspect_rows import main as inspect_main

    return inspect_main(args)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"difficulty\": 1}'")
    return value


def cmd_env_serve(args) -> int:
    from quaero.openenv_client.server import ServeError, serve

    try:
        serve(args.entry, host=args.host, port=args.port, max_concurrent_envs=args.max_concurrent_envs,
              kwargs=args.kwargs, action=args.action)
    except ServeError as e:
        say_error(str(e))
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="quaero", description="RL + ECHO training of LLM agents on OpenEnv")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run the training job a config describes")
    _add_config_args(p)
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true", help="continue from the run's last intact checkpoint "
                       "(also the default when the run folder has checkpoints)")
    start.add_argument("--restart", action="store_true", help="start over at step 1; the run's checkpoints "
                       "folder is renamed aside (checkpoints.before-restart-TIME), not deleted")
    p.add_argument("--nproc", type=int, metavar="N", help="run N ranks on this machine under torchrun "
                   "([distributed] strategy = 'ddp' or 'fsdp2'); rank 0 writes the run folder")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("check", help="validate a config and print the plan, without training")
    _add_config_args(p)
    p.set_defaults(func=cmd_check)

    _add_review(sub)

    p = sub.add_parser("bench", help="benchmarks: `quaero bench echo ...`, `quaero bench step ...`",
                       add_help=False)  # `quaero bench [echo|step] --help` is answered by benchmarks/
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("doctor", help="facts about this machine's stack (torch, CUDA, openenv, engines, "
                       "disk); exit 1 when a problem is found")
    p.add_argument("--json", action="store_true", help="print the facts as JSON")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("export", help="a run's checkpoint as a Hugging Face folder (or PEFT adapter folder)")
    p.add_argument("run_dir", metavar="RUN", help="runs/NAME")
    p.add_argument("out", metavar="OUT", help="the folder to write (must be new or empty)")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest intact one)")
    p.add_argument("--merge", action="store_true", help="LoRA runs: merge the adapter into a full folder")
    p.set_defaults(func=cmd_export)

    _add_eval(sub)

    _add_inspect(sub)

    _add_env(sub)
    return ap



def _add_review(sub) -> None:
    """`quaero review`'s arguments."""
    p = sub.add_parser("review", help="review a run's metrics: table, proofs, plots")
    p.add_argument("run_dir", nargs="?", help="runs/NAME (the folder holding events.jsonl)")
    p.add_argument("--require-proof", action="store_true",
                   help="exit 1 when a required proof that applies to the run fails")
    p.add_argument("--require", action="append", default=[], metavar="CHECK",
                   help="exit 1 unless the named check passes (repeatable; n/a does not pass), "
                        "e.g. --require 'ECHO loss falling'")
    p.add_argument("--plots", metavar="DIR", nargs="?", const=True,
                   help="write PNG plots into DIR (bare --plots: RUN/plots), held-out success ± s.e. "
                   "against step and generated tokens among them")
    p.add_argument("--force", action="store_true", help="let --plots overwrite existing files of those names "
                   "that review did not write (never a link, a special file or a run's own file)")
    p.add_argument("--json", action="store_true", help="print the review as JSON")
    p.add_argument("--compare", nargs=2, metavar=("RUN_A", "RUN_B"), help="two runs side by side")
    p.set_defaults(func=cmd_review)


def _add_eval(sub) -> None:
    """`quaero eval`'s arguments."""
    p = sub.add_parser("eval", help="evaluate a model on the env's eval split; --compare A B, paired")
    _add_config_args(p)
    who = p.add_mutually_exclusive_group()
    who.add_argument("--model", metavar="PATH|RUN", help="a model/adapter folder, a run folder (its final/), "
                     "or a scripted policy package.module:function (default: the config's [model])")
    who.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two models on the same tasks and seeds")
    p.add_argument("--tasks", type=int, help="tasks per seed (default: [training] eval_tasks, else 64)")
    p.add_argument("--split", help="env split (default: [env] eval_split)")
    p.add_argument("--env", help="a mixture's env to evaluate (default: each, on its own eval split)")
    p.add_argument("--seeds", type=int, default=1, help="repeat every task under K seeds")
    p.add_argument("--sample", action="store_true", help="sample at [sampler] temperature instead of greedy")
    p.add_argument("--pass-k", type=int, metavar="K", help="also K episodes per task at [sampler] "
                   "temperature: pass@1 and pass@K (unbiased estimator) with their s.e. (default: "
                   "[training] eval_pass_k, 1 = off)")
    p.add_argument("--out", help="eval folder (default: RUN/eval-TIMESTAMP, or next to the model folder)")
    p.set_defaults(func=cmd_eval)


def _add_inspect(sub) -> None:
    """`quaero inspect rows`'s arguments."""
    inspect = sub.add_parser("inspect",
                             help="look at what a run trained").add_subparsers(dest="inspect_command",
                                                                                     required=True)
    p = inspect.add_parser("rows", help="a run's saved rows ([logging] save_rows), coloured by span kind; "
                           "--verify re-checks them offline (exit 1 on a problem)")
    p.add_argument("run_dir", metavar="RUN", help="runs/NAME")
    p.add_argument("--step", type=int, help="only this step's rows (default: every saved step)")
    p.add_argument("--html", metavar="OUT.html", help="also write a self-contained HTML page")
    p.add_argument("--verify", action="store_true", help="check action ids, special tokens in env text, "
                   "advantage and ECHO placement instead of rendering")
    p.add_argument("--export", nargs=2, metavar=("FORMAT", "OUT.jsonl"),
                   help="write the rows as OpenEnv records instead of rendering: FORMAT 'rfc010' (RFC 010 "
                   "role masks) or 'openenv-trace' (TrainingTrace, validated by OpenEnv's model)")
    p.add_argument("--force", action="store_true", help="let --html/--export overwrite an existing file "
                   "(never a symlink or a file inside a run folder)")
    p.set_defaults(func=cmd_inspect_rows)


def _add_env(sub) -> None:
    """`quaero env serve`'s arguments."""
    env = sub.add_parser("env", help="environment tools").add_subparsers(dest="env_command", required=True)
    p = env.add_parser("serve", help="serve any OpenEnv env (module:Class) on 127.0.0.1")
    p.add_argument("entry", help="package.module:Class (an Environment/MCPEnvironment or factory)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-concurrent-envs", type=int, default=16)
    p.add_argument("--kwargs", type=_json_object, default={}, metavar="JSON",
                   help='keyword arguments for the entry, e.g. \'{"difficulty": 1}\'')
    p.add_argument("--action", metavar="MODULE:CLASS", help="the Action class, for an env whose step takes "
                                                            "the base Action")
    p.set_defaults(func=cmd_env_serve)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        os.getcwd()
    except FileNotFoundError:  # before torch imports: MKL aborts the process (exit 2) in a deleted folder
        say_error("the working directory was deleted; cd to an existing folder and run it again")
        return 1
    from quaero.config import ConfigError
    from quaero.models.base import ModelNotFound

    try:
        if argv[:1] == ["bench"]:  # everything after `bench` belongs to the benchmark's own parser
            return int(run_benchmark(argv[1:]) or 0)
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except (ConfigError, ModelNotFound) as e:
        say_error(str(e))
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    # a path the command had to write or read: a permission, a full disk, a file for a folder
    except OSError as e:
        if not e.filename:
            raise
        say_error(f"{e.filename}: {e.strerror or e}; fix that path (its permissions, free space, or a file "
                  "where a folder belongs) or choose another")
        return 1


if __name__ == "__main__":
    sys.exit(main())
