"""Tree training vs per-row training on RL-shaped rows: tokens, step time and peak memory, side by side.

    quaero bench tree [--models tiny-qwen3,smollm2-135m-instruct] [--groups 1] [--members 8] [--prompt 370]
                      [--row-len 450] [--steps 3] [--lora] [--micro-batch-tokens 4096]
                      [--arms off,on,on-padded] [--json PATH]

The rows are the main job's RL shape: `groups` groups of `members` rows, each group's rows sharing a
`prompt`-token prefix (system prompt, tool list, task; the groups share nothing), then per member an action
(RL advantage +/-1) and an environment response (ECHO weight 1) to about `row_len` tokens. Each model trains
the same rows with `train_tree_packing` "off" (the rows) and "on" (their trie, trainers/tree.py), each arm in
a fresh process from the same weights: the first step's loss and gradient norm must agree (the exactness
check), then the median of `steps` timed steps after one warm-up, in wall seconds and in the process's CPU
seconds (the fair figure on a machine other work shares), and the steps' peak RSS (the process's, the
model included: `peak_mem_mb`, source `rss_since_reset`). The arm "on-padded" packs too but plans its
microbatches on the padded rows' tokens (how packing planned them before trainers/batch.py
`plan_tree_microbatches`): where the padded rows of a group exceed `micro_batch_tokens`, its trie holds only
the rows a padded microbatch does, and the group's prompt is forwarded once per microbatch.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ARMS = ("off", "on", "on-padded")


def rl_rows(groups: int, members: int, prompt: int, row_len: int, vocab: int, seed: int = 0):
    """`groups` x `members` rows; each group's rows share their first `prompt` tokens."""
    from benchmarks.trainstep import row_with_targets

    rng = random.Random(seed)
    rows = []
    for _ in range(groups):
        shared = [rng.randrange(vocab) for _ in range(prompt)]
        for m in range(members):
            tail = row_len - prompt + rng.randrange(-8, 9)  # members' replies differ in length
            action = tail // 2  # then the env response to the row's end
            ids = shared + [rng.randrange(vocab) for _ in range(tail)]
            rows.append(row_with_targets(ids, list(range(prompt + action, prompt + tail)),
                                         list(range(prompt, prompt + action)),
                                         advantage=1.0 if m % 2 else -1.0))
    return rows


def arm(args) -> dict:
    """One arm in this process: the first step's figures, then the timed steps'."""
    import dataclasses
    import time

    import torch

    from benchmarks.trainstep import config_spec, make_trainer
    from quaero.models.load import resolve_model

    resolve_model(args.model)  # built before the seeded load (a build draws from the RNG)
    options = {"train_tree_packing": args.arm.split("-")[0]}
    if args.mmap_threshold:
        options["train_cpu_mmap_threshold"] = args.mmap_threshold
    spec = config_spec({"model": {"name": args.model, "max_seq_len": 4 * args.row_len},
                        "backend": {"micro_batch_tokens": args.micro_batch_tokens, "lora": args.lora,
                                    "options": options},
                        "echo": {"weight": 0.2}})
    trainer = make_trainer(spec, torch.device("cpu"))
    if args.arm == "on-padded":  # packed, planned as before the trie planner: on the padded rows
        trainer.spec = dataclasses.replace(trainer.spec, tree_plan="padded")
    vocab = trainer.parts.lm_head.weight.shape[0]
    rows = rl_rows(args.groups, args.members, args.prompt, args.row_len, vocab)
    walls, cpus, metrics = [], [], []
    for _ in range(args.steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        metrics.append(trainer.train_step(rows))
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    first = metrics[0]
    return {"arm": args.arm, "loss": first["loss"], "grad_norm": first["grad_norm"],
            "row_tokens": first["row_tokens"], "microbatches": first["microbatches"],
            "unique_tokens": first.get("local_train_tree_unique_tokens") or None,
            "tree_batches": first["local_train_tree_batches"],
            "fallback": first["local_train_tree_fallback_reason"],
            "step_s": statistics.median(walls[1:]), "step_cpu_s": statistics.median(cpus[1:]),
            "peak_mem_mb": max(m["peak_mem_mb"] for m in metrics),
            "peak_mem_source": first["peak_mem_source"]}


def run_arm(args, model: str, which: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.tree", "--arm", which, "--model", model, "--groups",
           str(args.groups), "--members", str(args.members), "--prompt", str(args.prompt), "--row-len",
           str(args.row_len), "--steps", str(args.steps), "--micro-batch-tokens",
           str(args.micro_batch_tokens), "--mmap-threshold", str(args.mmap_threshold),
           *(["--lora"] if args.lora else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"arm {which} of {model} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(args, model: str) -> dict:
    arms = {which: run_arm(args, model, which) for which in args.arms.split(",")}
    off = arms["off"]
    out = {"model": model, "rows": args.groups * args.members, "row_tokens": off["row_tokens"],
           "microbatches": off["microbatches"], "step_s_rows": round(off["step_s"], 3),
           "step_cpu_s_rows": round(off["step_cpu_s"], 3), "peak_mem_mb_rows": off["peak_mem_mb"],
           "loss_rows": off["loss"]}
    for which, on in arms.items():
        if which == "off":
            continue
        def ratio(key: str, on: dict = on) -> float:
            return round(on[key] / off[key], 3)

        out[which] = {
            "unique_tokens": on["unique_tokens"],
            "token_ratio": round(on["unique_tokens"] / off["row_tokens"], 4),
            "microbatches": on["microbatches"], "tree_batches": on["tree_batches"],
            "fallback": on["fallback"],
            "step_s": round(on["step_s"], 3), "speedup": round(1 / ratio("step_s"), 2),
            "step_cpu_s": round(on["step_cpu_s"], 3), "cpu_speedup": round(1 / ratio("step_cpu_s"), 2),
            "peak_mem_mb": on["peak_mem_mb"], "peak_mem_ratio": ratio("peak_mem_mb"),
            "loss": on["loss"], "loss_diff": abs(off["loss"] - on["loss"]),
            "grad_norm_rel_diff": abs(off["grad_norm"] - on["grad_norm"]) / max(off["grad_norm"], 1e-12),
            "peak_mem_source": on["peak_mem_source"]}
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="quaero bench tree", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-qwen3,smollm2-135m-instruct")
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=370)
    ap.add_argument("--row-len", type=int, default=450)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--micro-batch-tokens", type=int, default=4096,
                    help="`[backend] micro_batch_tokens` (the default 4096 holds a group of 8 x 450 in one)")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--arms", default="off,on",
                    help="arms, 'off' first: off (the rows), on (the trie, planned on its unique tokens), "
                         "on-padded (the trie, planned on the padded rows)")
    ap.add_argument("--mmap-threshold", type=int, default=0,
                    help="`train_cpu_mmap_threshold` (0: unset); the SmolLM2 recipes set 131072")
    ap.add_argument("--json", metavar="PATH", help="also write the rows of the table here")
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in its own process
    ap.add_argument("--model", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.arm:
        print(json.dumps(arm(args)))
        return 0
    header = (f"{args.groups} group(s) x {args.members} rows, {args.prompt}-token shared prompt, "
              f"~{args.row_len}-token rows, micro_batch_tokens {args.micro_batch_tokens}, "
              f"{'LoRA' if args.lora else 'full'}, "
              f"median of {args.steps} steps after a warm-up, each arm in a fresh process; "
              f"torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}")
    print(header)
    print(f"{'model, arm':<34}{'row tok':>8}{'uniq tok':>9}{'ratio':>7}{'mbs':>5}{'rows s':>8}{'tree s':>8}"
          f"{'speedup':>8}{'rows cpu s':>11}{'tree cpu s':>11}{'cpu speedup':>12}{'rows MB':>9}{'tree MB':>9}"
          f"{'loss diff':>11}")
    failed, results = False, []
    for model in args.models.split(","):
        r = compare(args, model)
        for which in args.arms.split(",")[1:]:
            t = r[which]
            print(f"{model + ', ' + which:<34}{r['row_tokens']:>8}{t['unique_tokens']:>9}"
                  f"{t['token_ratio']:>7.3f}"
                  f"{t['microbatches']:>5}{r['step_s_rows']:>8.3f}{t['step_s']:>8.3f}{t['speedup']:>7.2f}x"
                  f"{r['step_cpu_s_rows']:>11.3f}{t['step_cpu_s']:>11.3f}{t['cpu_speedup']:>11.2f}x"
                  f"{r['peak_mem_mb_rows']:>9.0f}{t['peak_mem_mb']:>9.0f}{t['loss_diff']:>11.2e}")
            failed |= t["tree_batches"] != t["microbatches"] or t["grad_norm_rel_diff"] > 1e-4
        print(json.dumps(r))
        results.append(r)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"header": header, "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
