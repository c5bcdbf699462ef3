"""Step latency of toolbench per launcher, so quaero's transport overhead is known.

    quaero bench env-latency [--steps 500] [--sessions 1] [--json]

Each launcher runs the full ChatEnv path (tool-call validation, CallToolAction, the env's MCP tool,
rendering of the tool message) on one `calculate` call per step; the figure is the median (and p90)
over --steps steps after a warm-up. `remote` is a server started by `quaero env serve` in a subprocess.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # envs.toolbench is importable from the repo root

from quaero.config import EnvConfig
from quaero.openenv_client import open_envs

ENTRY = "envs.toolbench:ToolBenchEnv"
ACTION = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "12.5*3"}}}]}


def _serve_remote(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "quaero.cli", "env", "serve", ENTRY, "--port", str(port)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("quaero env serve did not become healthy in 60 s")


def bench(cfg: EnvConfig, steps: int, warmup: int) -> dict:
    began = time.perf_counter()
    with open_envs(cfg, 1) as pool:
        open_s = time.perf_counter() - began
        env, times = pool.sessions[0], []
        env.reset(seed=0)
        for i in range(warmup + steps):
            t = time.perf_counter()
            step = env.step(ACTION)
            if i >= warmup:
                times.append((time.perf_counter() - t) * 1e3)
            assert step.messages[0]["content"] == "37.5" and not step.malformed
        counts = pool.counts.snapshot_and_reset()
    times.sort()
    return {"launcher": cfg.launcher, "median_ms": statistics.median(times),
            "p90_ms": times[int(0.9 * len(times))],
            "open_s": open_s, "steps": steps, "retries": counts["env_retries"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="quaero bench env-latency", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="print one JSON object per launcher")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    common = {"reset_kwargs": {"max_steps": 10**9}}  # one long episode (sessions set no turn limit)
    rows = [bench(EnvConfig(entry=ENTRY, launcher="inprocess", **common), args.steps, args.warmup),
            bench(EnvConfig(entry=ENTRY, launcher="local-server", **common), args.steps, args.warmup)]
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _serve_remote(port)
    try:
        rows.append(bench(EnvConfig(url=f"ws://127.0.0.1:{port}", **common), args.steps, args.warmup))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"toolbench step latency, ChatEnv.step with one calculate call, {args.steps} steps after "
          f"{args.warmup} warm-up")
    print(f"{'launcher':<14}{'median ms':>10}{'p90 ms':>9}{'open s':>9}")
    for r in rows:
        print(f"{r['launcher']:<14}{r['median_ms']:>10.3f}{r['p90_ms']:>9.3f}{r['open_s']:>9.2f}")
    base = rows[0]["median_ms"]
    print(f"transport overhead over in-process: local-server {rows[1]['median_ms'] - base:+.3f} ms, "
          f"remote {rows[2]['median_ms'] - base:+.3f} ms per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
