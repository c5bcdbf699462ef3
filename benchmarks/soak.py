"""A config's run, N warm-start SFT steps and M RL steps, in a process of its own, with its RSS read every K
steps against the memory plan: does the process's memory stay flat?

    quaero bench soak --sft-steps 500 --rl-steps 12 --every 25
    quaero bench soak --config envs/toolbench_smollm2.toml --sft-steps 500 --rl-steps 0 --every 50
    quaero bench soak --stages   # where the memory goes before the first step (benchmarks/soak_stages.py)

It runs `quaero train CONFIG` (the main job by default) with `[training] warmup_sft_steps = N`, `steps = M`,
`eval_every` (`--eval-every`, 0: no eval) and a run folder of its own in a temporary directory (`--set`
adds to the config; the run's name and folder are the bench's), and reads the run's process from outside:
each time the run's events reach a multiple of K steps, its RSS (/proc/PID/status VmRSS, with its anonymous
and file-backed parts) and its thread count. Beside them: `quaero check`'s memory plan for the config: the
step's peak, the sampler's share (vLLM's engine; the hf sampler's KV reuse store) and the process baseline
(the runtime: stated, measured by `--stages`), whose sum is the RSS the plan expects.

Verdict: flat when every reading from `--reference-step` on (after warm-up: the allocator's caches filled,
the sampler built) is within `--tolerance` (10%) of the reading at that step, and the largest reading is
within the plan's expected RSS plus `--margin-gib` (fragments malloc's cache keeps, the sampler's transient
batch). The exit status is 1 when it is not flat.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.ablation import owned_set
from benchmarks.measure import emit

GIB = 2**30
THREADS_SLACK = 32  # threads a phase may start past the reference reading (a sampler's, an env pool's)
# the bench's own: a user's --set may not point its run into a user's run folder
OWN_KEYS = ("run.output_dir", "run.name", "training.warmup_sft_steps", "training.steps",
            "training.eval_every")
STAGES_TIMEOUT_S = 1800


STATUS_BYTES = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file"}  # kB fields of /proc/PID/status


def proc_status(pid: int) -> dict[str, int] | None:
    """VmRSS and its anonymous (heap, tensors, malloc's cache) and file-backed (mapped libraries and model
    files) parts, in bytes, and Threads, of a live process; None once it has gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                key = line.split(maxsplit=1)[0] if line.strip() else ""
                if key in STATUS_BYTES:
                    out[STATUS_BYTES[key]] = int(line.split()[1]) * 1024
                elif key == "Threads:":
                    out["threads"] = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return out if "rss" in out else None


def new_steps(events: Path, seen: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's train_step events written since the last call (`seen` keeps the file offset); a line being
    written is read whole next time."""
    from quaero.telemetry import names

    if not events.exists():
        return []
    out = []
    with open(events, "rb") as f:
        f.seek(seen.get("offset", 0))
        for line in f:
            if not line.endswith(b"\n"):
                break
            seen["offset"] = seen.get("offset", 0) + len(line)
            if names.TRAIN_STEP_EVENT.encode() in line:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == names.TRAIN_STEP_EVENT:
                    out.append(event)
    return out


def plan_gib(config: str, sets: list[str]) -> dict[str, float] | None:
    """`quaero check`'s memory plan for the config on a CPU, in GiB: the step's `peak`, the `sampler`'s share,
    the process `baseline` and the RSS they add up to (`process`); None where the model's shape is unknown."""
    from quaero.config.load import load_config
    from quaero.preflight.memory_lines import expected_rss

    parts = expected_rss(load_config(config, sets), "cpu")
    return None if parts is None else {k: round(v / GIB, 3) for k, v in parts.items()}


def verdict(readings: list[dict[str, Any]], *, reference_step: int, tolerance: float,
            ceiling_gib: float | None) -> dict[str, Any]:
    """Flat or not, from the readings (each `step`, `rss_gib`, `threads`): within `tolerance` of the reading
    at `reference_step` (the first at or after it) from there on, under `ceiling_gib`, and threads that do
    not keep multiplying (at most `tolerance` + THREADS_SLACK more at the last reading)."""
    after = [r for r in readings if r["step"] >= reference_step]
    if not after:
        return {"flat": None, "why": f"no reading at or after step {reference_step}"}
    ref = after[0]
    worst = max(after, key=lambda r: abs(r["rss_gib"] - ref["rss_gib"]))
    drift = (worst["rss_gib"] - ref["rss_gib"]) / ref["rss_gib"]
    peak = max(r["rss_gib"] for r in readings)
    within = abs(drift) <= tolerance
    under = ceiling_gib is None or peak <= ceiling_gib
    # a process whose threads keep multiplying leaks, whatever its RSS so far (each thread's stack and state
    # stay; a thread per oracle call grew the RSS by ~0.2 MiB a step, too slowly for 10% in a few hundred)
    counts = [(r["step"], r["threads"]) for r in after if isinstance(r.get("threads"), int)]
    threads_ok = len(counts) < 2 or counts[-1][1] <= counts[0][1] * (1 + tolerance) + THREADS_SLACK
    why = [] if within else [(f"RSS at step {worst['step']} is {drift:+.0%} from step {ref['step']}'s "
                              f"(tolerance {tolerance:.0%})")]
    if not under:
        why.append(f"its peak {peak} GiB is above the plan's expected RSS plus the margin "
                   f"({ceiling_gib} GiB)")
    if not threads_ok:
        why.append(f"its threads grew {counts[0][1]} -> {counts[-1][1]} (steps {counts[0][0]} -> "
                   f"{counts[-1][0]})")
    return {"flat": within and under and threads_ok, "reference_step": ref["step"],
            "reference_rss_gib": ref["rss_gib"],
            "largest_drift": round(drift, 3), "largest_drift_step": worst["step"], "rss_peak_gib": peak,
            "ceiling_gib": ceiling_gib,
            "why": "; ".join(why)}


def reading(event: dict[str, Any], step: int, sft_steps: int, pid: int | None, seconds: float,
            plan: float | None) -> dict[str, Any]:
    """One step's reading, printed as it comes: the run's own RSS at the step's end (`process_rss_mb`; the
    process's RSS now where the run logs none), and the process's threads and RSS's anonymous and
    file-backed parts now."""
    from quaero.telemetry import names

    st = proc_status(pid) if pid is not None else None
    rss = event.get(names.PROCESS_RSS_MB)
    rss_gib = rss / 1024 if isinstance(rss, (int, float)) else (st or {}).get("rss", 0) / GIB
    r = {"step": step, "phase": "sft" if step <= sft_steps else "rl", "rss_gib": round(rss_gib, 3),
         "threads": (st or {}).get("threads"), "s": round(seconds, 1)}
    if st:
        r.update(anon_gib=round(st.get("anon", 0) / GIB, 3), file_gib=round(st.get("file", 0) / GIB, 3))
    print(f"step {step:>5} {r['phase']:<3} rss {r['rss_gib']:.3f} GiB (anon {r.get('anon_gib')}, file "
          f"{r.get('file_gib')})  threads {r['threads']}  plan {plan} GiB", file=sys.stderr, flush=True)
    return r


def soak(args) -> dict[str, Any]:
    clash = owned_set(args.set, tuple(tuple(k.split(".")) for k in OWN_KEYS))
    if clash is not None:
        raise SystemExit(f"quaero bench soak: --set {clash!r}: the bench sets {', '.join(OWN_KEYS)} "
                         "itself (use --sft-steps and --rl-steps)")
    planned = plan_gib(args.config, args.set)
    plan = None if planned is None else planned["process"]
    with tempfile.TemporaryDirectory(prefix="quaero-soak-") as tmp:
        own = [f"run.output_dir={tmp}", "run.name=soak", f"training.warmup_sft_steps={args.sft_steps}",
               f"training.steps={args.rl_steps}", f"training.eval_every={args.eval_every}"]
        cmd = [sys.executable, "-m", "quaero.cli", "train", args.config,
               *[a for s in [*args.set, *own] for a in ("--set", s)]]
        log = open(Path(tmp) / "train.log", "w", encoding="utf-8")  # noqa: SIM115 - closed below
        t0, readings, seen = time.monotonic(), [], {}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        events = Path(tmp) / "soak" / "events.jsonl"
        # the first step, the warm start's last and the run's last, whatever --every
        marks = (1, args.sft_steps, args.sft_steps + args.rl_steps)
        try:
            while True:
                running = proc.poll() is None
                for event in new_steps(events, seen):
                    n = event.get("step")
                    if isinstance(n, int) and (n % args.every == 0 or n in marks):
                        readings.append(reading(event, n, args.sft_steps, proc.pid if running else None,
                                                time.monotonic() - t0, plan))
                if not running:
                    break
                time.sleep(args.poll_s)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
            log.close()
        tail = (Path(tmp) / "train.log").read_text(encoding="utf-8").splitlines()[-5:]
    ceiling = None if plan is None else round(plan + args.margin_gib, 3)
    return {"config": args.config, "set": args.set, "sft_steps": args.sft_steps, "rl_steps": args.rl_steps,
            "every": args.every, "returncode": proc.returncode, "seconds": round(time.monotonic() - t0, 1),
            "plan_peak_gib": None if planned is None else planned["peak"], "plan_gib": planned,
            "margin_gib": args.margin_gib, "tolerance": args.tolerance,
            "date": time.strftime("%Y-%m-%d"), "readings": readings,
            "verdict": verdict(readings, reference_step=args.reference_step, tolerance=args.tolerance,
                               ceiling_gib=ceiling),
            **({"log_tail": tail} if proc.returncode else {})}


def probe(args) -> dict[str, Any]:
    """`--probe`: the main job's allocation pattern without a model or an env, in this process: per step
    the tied embedding's gradient and two temporaries (vocab x hidden float32 blocks, tiny-qwen3's shape)
    allocated and freed, and `--calls` oracle-like calls through `bounded_call`, whose results are kept (as a
    step's rows keep the oracle's actions). `--leak-threads` leaves each call's thread waiting forever, as a
    CallWorker made per call did: under the malloc cache what the threads allocate lands among the freed
    blocks, so a freed block is not reused and the heap grows by whole blocks."""
    from quaero.bounded import bounded_call
    from trainers.memory import keep_cpu_malloc_cache

    cached = keep_cpu_malloc_cache("cpu", not args.no_cache)
    forever, kept, readings = threading.Event(), [], []
    vocab, hidden = 151936, 128

    def oracle() -> dict:  # an action and a few strings past pymalloc's 512 bytes (they come from malloc)
        return {"name": "lookup", "arguments": {"key": "k" * 600}, "text": ["t" * 700 for _ in range(3)]}

    def leaked(call) -> Any:  # the CallWorker made per call: a thread that runs the call, then waits forever
        out, done = [], threading.Event()

        def run() -> None:
            out.append(call())
            done.set()
            forever.wait()

        threading.Thread(target=run, daemon=True).start()
        done.wait()
        return out[0]

    t0 = time.monotonic()
    for step in range(1, args.probe + 1):
        grad = torch.ones(vocab, hidden)
        tmp = grad * 2.0
        tmp2 = tmp + grad
        for _ in range(args.calls):
            kept.append(leaked(oracle) if args.leak_threads
                        else bounded_call(oracle, "oracle", timeout_s=30, bound="probe"))
        del grad, tmp, tmp2
        if step % args.every == 0 or step == 1:
            st = proc_status(os.getpid()) or {}
            readings.append({"step": step, "phase": "probe", "rss_gib": round(st.get("rss", 0) / GIB, 3),
                             "threads": st.get("threads"), "s": round(time.monotonic() - t0, 1)})
            print(f"step {step:>5} rss {readings[-1]['rss_gib']:.3f} GiB  threads {st.get('threads')}",
                  file=sys.stderr, flush=True)
    forever.set()
    block = round(vocab * hidden * 4 / GIB, 3)
    return {"probe": args.probe, "calls": args.calls, "leak_threads": args.leak_threads,
            "malloc_cache": cached, "block_gib": block, "date": time.strftime("%Y-%m-%d"),
            "readings": readings,
            "verdict": verdict(readings, reference_step=args.reference_step, tolerance=args.tolerance,
                               ceiling_gib=None)}


def stages(args) -> dict[str, Any]:
    """`--stages`: benchmarks/soak_stages.py in a fresh process (this one has torch imported already), its
    readings beside the plan's process baseline."""
    from quaero.preflight.memory_lines import PROCESS_BASELINE_CPU

    cmd = [sys.executable, "-m", "benchmarks.soak_stages", args.config, *args.set]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=STAGES_TIMEOUT_S,
                          env={**os.environ})
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        print(json.dumps(row), file=sys.stderr)
    return {"config": args.config, "set": args.set, "returncode": done.returncode, "stages": rows,
            "plan_process_baseline_gib": round(PROCESS_BASELINE_CPU / GIB, 3),
            "date": time.strftime("%Y-%m-%d"),
            **({"stderr_tail": done.stderr.splitlines()[-5:]} if done.returncode else {})}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="quaero bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="envs/toolbench.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a config override for the run (not its name, folder or step counts)")
    p.add_argument("--sft-steps", type=int, default=500, help="warm-start SFT steps")
    p.add_argument("--rl-steps", type=int, default=12, help="RL steps after them")
    p.add_argument("--every", type=int, default=25, help="read the RSS every K steps")
    p.add_argument("--reference-step", type=int, default=100,
                   help="the reading the later ones are compared with (after warm-up)")
    p.add_argument("--tolerance", type=float, default=0.10, help="largest drift from the reference reading")
    p.add_argument("--margin-gib", type=float, default=0.5,
                   help="what the process may hold above the plan's expected RSS (malloc's fragments)")
    p.add_argument("--eval-every", type=int, default=0, help="the run's [training] eval_every (0: no eval)")
    p.add_argument("--stages", action="store_true",
                   help="instead of a run: the process's RSS stage by stage up to the sampler's first calls")
    p.add_argument("--poll-s", type=float, default=0.2)
    p.add_argument("--json", metavar="PATH", help="also write the document here")
    p.add_argument("--probe", type=int, default=0, metavar="STEPS",
                   help="instead of a run: the main job's allocation pattern, STEPS steps, in this process")
    p.add_argument("--calls", type=int, default=14, help="--probe: oracle calls a step (the main job's ~14)")
    p.add_argument("--leak-threads", action="store_true",
                   help="--probe: each call leaves its thread waiting forever (the leak that was)")
    p.add_argument("--no-cache", action="store_true", help="--probe: without train_cpu_malloc_cache")
    args = p.parse_args(argv)
    from quaero.tools.outputs import bench_output

    bench_output(args.json)  # a path it cannot write is refused before the soak's run, not an hour after
    if args.stages:
        out = stages(args)
        emit(out, args.json)
        return 0 if out["returncode"] == 0 else 1
    if args.probe:
        out = probe(args)
        emit(out, args.json)
        return 0 if out["verdict"].get("flat") else 1
    if min(args.sft_steps, args.rl_steps) < 0 or args.sft_steps + args.rl_steps < 1 or args.every < 1:
        p.error("--sft-steps and --rl-steps: 0 or more, at least one step in all; --every: 1 or more")
    out = soak(args)
    emit(out, args.json)
    print(json.dumps({"verdict": out["verdict"]}), file=sys.stderr)
    return 0 if out["verdict"].get("flat") and out["returncode"] == 0 else 1
