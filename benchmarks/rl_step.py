"""`quaero bench rl-step`: the whole RL step (rollout + train) before/after tree training and the transformers
sampler's reuse, side by side in one process, and each phase against this machine's limits.

    quaero bench rl-step envs/toolbench.toml --threads 1
    quaero bench rl-step envs/toolbench_smollm2.toml --threads 1

`before`: `[backend.options] train_tree_packing = "off"` and the sampler without reuse (`[sampler]
hf_kv_cache_mib = 0`, tokens drawn by `torch.multinomial`); `after`: tree packing `--after-tree` ("on", or
"auto") and the reuse on (the config's `hf_kv_cache_mib`, the inverse-CDF draw). One process builds the
config's parts once (`quaero train`'s own `build`: trainer, renderer, the hf sampler on the trainer's module,
episode driver; no warm start). Each of `--steps` rounds draws one RL step's tasks (`tasks_per_step` groups of
`group_size`) and runs both arms on them in turns (before after, then after before), each from the same
weights and optimizer state (restored before every arm): the recipe's rollout (`roll_out`) then the trainer
step on its rows. Per arm: wall and CPU seconds of rollout and train (CPU: this process's, every thread; the
fair figure on a shared core; the env server's own process is not in it), generated and row tokens, the
trie's unique tokens, the sampler's prefilled/reused tokens, the loss. The rollouts sample (as RL steps do),
and the arms draw differently (multinomial vs inverse CDF, the same distribution), so their rows differ: the
token counts are beside the seconds. (`quaero bench tree` checks the train step's exactness on equal rows.)

An untrained model's groups all fail alike (every advantage 0: the step would train nothing), so a row
without advantage is given +1 or -1 in turns (`rows_given_advantage`): the train step costs what a step of
groups with reward spread costs.

Then, on the same model: decode tokens per CPU second at batch 1 and 8 per arm (`bench sampler-reuse`'s
`decode_rates`), and this machine's limits per CPU second measured in the same process
(`bench machine`'s `cpu_time_limits`: matmul peak, bandwidth), against which each arm's train step
(`FlopParams.train_flops` over its train CPU seconds) and decoding (the weights a decode step reads, over
its CPU time) are rated. CPU seconds throughout: other work on a shared core lengthens wall time, not them.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks import machine
from benchmarks.measure import emit, environment, load_average, torch_threads
from benchmarks.sampler_reuse import ARMS, decode_rates, set_arm
from quaero.telemetry import names
from quaero.tools.outputs import bench_output


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quaero bench rl-step", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default="envs/toolbench.toml")
    p.add_argument("--steps", type=int, default=1, help="RL steps per arm (rounds, arms in turns)")
    p.add_argument("--after-tree", default="on", choices=["on", "auto"],
                   help="the after arm's train_tree_packing")
    p.add_argument("--decode-repeats", type=int, default=2, help="rounds of the batch-1/8 decode per arm")
    p.add_argument("--no-machine", action="store_true", help="skip the machine's limits and efficiencies")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override, as in quaero train (repeatable)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", metavar="PATH")
    return p


class Arms:
    """The run's parts switched between the arms, each arm starting from the same weights and optimizer."""

    def __init__(self, parts, after_tree: str):
        self.parts, self.after_tree = parts, after_tree
        self.kv_bytes = parts.cfg.sampler.hf_kv_cache_mib * 2**20
        trainer = parts.trainer
        self.weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        self.optimizer = copy.deepcopy(trainer.optimizer.state_dict())

    def enter(self, arm: str) -> None:
        trainer = self.parts.trainer
        trainer.model.load_state_dict(self.weights)
        trainer.optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        tree = self.after_tree if arm == "after" else "off"
        trainer.spec = dataclasses.replace(trainer.spec, tree_packing=tree)
        set_arm(self.parts.sampler, arm, self.kv_bytes)


def clocked(fn) -> tuple[Any, float, float]:
    """fn()'s result, wall seconds, this process's CPU seconds."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def rl_step(parts, arms: Arms, arm: str, step: int, picks: list) -> dict[str, Any]:
    """One RL step of `arm` on `picks`: the recipe's rollout, then the trainer step on its rows."""
    from quaero.recipe.groups import echo_scale, roll_out

    arms.enter(arm)
    parts.counts.snapshot_and_reset()
    (collected, _), roll_s, roll_cpu = clocked(lambda: roll_out(parts, step, picks, sft=False))
    counts = parts.counts.snapshot_and_reset()
    rows, spread = with_spread([row for row, _ in collected])
    parts.trainer.set_lr(parts.cfg.lr_for(sft=False))
    m, train_s, train_cpu = clocked(lambda: parts.trainer.train_step(
        rows, sft=False, echo_weight=echo_scale(parts, step, False)[0]))
    return {"rollout_s": roll_s, "rollout_cpu_s": roll_cpu, "train_s": train_s, "train_cpu_s": train_cpu,
            "step_cpu_s": roll_cpu + train_cpu, "rows": len(rows), "rows_given_advantage": spread,
            "generated_tokens": sum(r.num_action_tokens for r in rows),
            "row_tokens": m[names.ROW_TOKENS], "computed_tokens": machine.computed_tokens(m),
            "head_tokens": machine.head_positions(m), "microbatches": m[names.MICROBATCHES],
            "tree_batches": m[names.TREE_BATCHES], "tree_fallback_reason": m[names.TREE_FALLBACK_REASON],
            "prefill_tokens": counts.get(names.SAMPLER_PREFILL_TOKENS, 0),
            "reused_tokens": counts.get(names.SAMPLER_REUSED_TOKENS, 0), "loss": m["loss"],
            "grad_norm": m["grad_norm"]}


def with_spread(rows: list) -> tuple[list, int]:
    """The rows, a row with no advantage given +1 or -1 in turns (and how many were): an untrained model's
    groups all fail alike, so every advantage is 0 and the step would train nothing; the step's cost is that
    of groups with reward spread."""
    out, given = [], 0
    for row in rows:
        if row.num_action_tokens and not any(row.advantages):
            row = row.with_advantage(1.0 if given % 2 else -1.0)
            given += 1
        out.append(row)
    return out, given


def progress_line(s: dict[str, Any]) -> str:
    return (f"rollout {s['rollout_s']:7.2f} s ({s['rollout_cpu_s']:7.2f} cpu)  train {s['train_s']:7.2f} s "
            f"({s['train_cpu_s']:7.2f} cpu)  rows {s['row_tokens']} tok, computed {s['computed_tokens']}  "
            f"load {load_average()}")


def median_arm(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the timings over rounds, the first round's counts, every round's losses."""
    out = dict(steps[0])
    for k in ("rollout_s", "rollout_cpu_s", "train_s", "train_cpu_s", "step_cpu_s"):
        out[k] = round(statistics.median(s[k] for s in steps), 3)
    out["losses"] = [s["loss"] for s in steps]
    return out


def efficiencies(doc: dict[str, Any], parts, fp: machine.FlopParams) -> None:
    """Each arm's training efficiency and decoding efficiency at batch 1 and 8, against `doc`'s limits."""
    dtype = next(parts.trainer.model.parameters()).dtype
    peak = doc["machine"]["float32" if dtype == torch.float32 else "bfloat16"]["peak_gflops"] * 1e9
    bandwidth = doc["machine"]["bandwidth_gb_s"] * 1e9
    weight_bytes = fp.decode_params * dtype.itemsize
    for arm in ARMS:
        a = doc["arms"][arm]
        flops = fp.train_flops(a["computed_tokens"], a["head_tokens"])
        a["train_flops"] = flops
        a["training_efficiency"] = round(machine.training_efficiency(flops=flops, step_s=a["train_cpu_s"],
                                                                     peak_flops=peak), 4)
        for b in (1, 8):  # a decode step serves b sequences: steps/s = tokens/s / b
            rate = doc["decode"][f"decode_b{b}_tokens_per_s"][arm]
            doc["decode"][f"decode_b{b}_efficiency"] = doc["decode"].get(f"decode_b{b}_efficiency", {})
            doc["decode"][f"decode_b{b}_efficiency"][arm] = round(machine.decoding_efficiency(
                weight_bytes=weight_bytes, decode_steps=rate / b, decode_s=1.0,
                bandwidth_bytes_per_s=bandwidth), 4)
    doc["decode"]["weight_bytes_per_step"] = weight_bytes


def run(args) -> dict[str, Any]:
    from quaero.config import SINGLE, SamplerConfig, load_config
    from quaero.openenv_client import open_envs
    from quaero.recipe.groups import draw
    from quaero.recipe.parts import build
    from quaero.sampling.hf import HFSampler

    cfg = load_config(args.config, [*args.overrides, "sampler.backend=hf", "training.warmup_sft_steps=0",
                                    "training.max_off_policy_steps=0"])
    t = cfg.rollout
    doc = environment(torch.device("cpu"), getattr(torch, cfg.model.dtype, torch.float32))
    doc["config"] = {"config": args.config, "overrides": args.overrides, "model": cfg.model.name,
                     "lora": cfg.backend.lora, "tasks_per_step": t.tasks_per_step, "group_size": t.group_size,
                     "max_turns": cfg.env.max_turns, "max_tokens": cfg.sampler.max_tokens,
                     "steps": args.steps, "after_tree": args.after_tree,
                     "hf_kv_cache_mib": cfg.sampler.hf_kv_cache_mib}
    print(f"quaero bench rl-step: {cfg.model.name}, {t.tasks_per_step} x {t.group_size} episodes a step",
          file=sys.stderr)
    with open_envs(cfg.env, t.tasks_per_step * t.group_size) as pool:
        parts = build(cfg, {SINGLE: pool}, pool.counts)
        try:
            arms = Arms(parts, args.after_tree)
            steps: dict[str, list] = {a: [] for a in ARMS}
            for r in range(args.steps):
                picks = draw(parts, r + 1, t.tasks_per_step)
                for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                    s = rl_step(parts, arms, arm, r + 1, picks)
                    steps[arm].append(s)
                    print(f"  step {r + 1} {arm:6s} " + progress_line(s), file=sys.stderr)
            doc["arms"] = {a: median_arm(v) for a, v in steps.items()}
            arms.enter("before")
            model = parts.sampler.model
            probe = HFSampler(model, SamplerConfig(max_tokens=48, temperature=1.0), stop_token_ids=[-1])
            doc["decode"] = decode_rates(probe, arms.kv_bytes, args.decode_repeats, clock=time.process_time)
            fp = machine.FlopParams.of(model)
            doc["flop_params"] = dataclasses.asdict(fp)
        finally:
            parts.sampler.close()
    compare(doc)
    if not args.no_machine:
        doc["machine"] = machine.cpu_time_limits([512, 1024], 256, 3)
        efficiencies(doc, parts, fp)
    doc["load_average_end"] = load_average()
    return doc


def compare(doc: dict[str, Any]) -> None:
    """before / after ratios of the CPU seconds (>1: after is faster), and the after arm's token ratio."""
    b, a = doc["arms"]["before"], doc["arms"]["after"]
    doc["speedup_cpu"] = {k: round(b[k] / a[k], 2) if a[k] else None
                          for k in ("rollout_cpu_s", "train_cpu_s", "step_cpu_s")}
    doc["token_ratio"] = round(a["computed_tokens"] / a["row_tokens"], 4) if a["row_tokens"] else None


def report(doc: dict[str, Any]) -> None:
    print(f"{'arm':<8}{'rollout s':>10}{'cpu':>8}{'train s':>9}{'cpu':>8}{'step cpu':>9}{'gen tok':>8}"
          f"{'row tok':>8}{'computed':>9}{'train eff':>10}", file=sys.stderr)
    for arm in ARMS:
        a = doc["arms"][arm]
        print(f"{arm:<8}{a['rollout_s']:>10.2f}{a['rollout_cpu_s']:>8.2f}{a['train_s']:>9.2f}"
              f"{a['train_cpu_s']:>8.2f}{a['step_cpu_s']:>9.2f}{a['generated_tokens']:>8}{a['row_tokens']:>8}"
              f"{a['computed_tokens']:>9}{a.get('training_efficiency', float('nan')):>10.3f}",
              file=sys.stderr)
    print(f"speedup (cpu s, before/after): {doc['speedup_cpu']}  decode: "
          + "  ".join(f"b{b} {doc['decode'][f'decode_b{b}_tokens_per_s']}" for b in (1, 8)), file=sys.stderr)
    for b in (1, 8):
        if f"decode_b{b}_efficiency" in doc["decode"]:
            print(f"decode b{b} efficiency {doc['decode'][f'decode_b{b}_efficiency']}", file=sys.stderr)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    bench_output(args.json)  # a path it cannot write is refused before the work, not after
    with torch_threads(args.threads):
        doc = run(args)
    report(doc)
    emit(doc, args.json)
    return 0
