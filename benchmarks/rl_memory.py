"""A config's warm-start step and first RL step, in the trainer alone, against `quaero check`'s memory plan.

    quaero bench rl-memory --config envs/toolbench_smollm2.toml --rl-rows 3 --rl-len 1900
    quaero bench rl-memory --set backend.options.train_cpu_mmap_threshold=0

The trainer `quaero train` builds from the config (`quaero.preflight.plan.trainer_spec`: its dtype, LoRA,
selective logits, ECHO weights, micro_batch_tokens, policy loss, mini-steps) runs one SFT step on
demonstration-length rows and then, after the optimizer reset the config asks for, one RL step on rollout-
length rows, laid out as a tool-calling episode: a prompt, then per turn a few template tokens, a sampled
action (RL targets where the advantage is not 0; the sampler gap reads them always) and an environment
response (ECHO targets). No sampler and no env run, so what is measured is the trainer's own memory. Per
phase: seconds, the process's peak RSS over it (VmHWM, reset before it) and its RSS after it; with
`--profile`, torch's CPU allocator count over the RL step (benchmarks/real_shape.py `phase_peaks`: the tensors
alone, without what malloc keeps). The plan is the memory plan of the RL step's own microbatch (its rows,
tokens and targets), and `quaero check`'s for the config's longest row beside it.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from benchmarks.measure import emit
from quaero.tools.outputs import bench_output

GIB = 2**30


def episode_row(length: int, *, prompt: int, turns: int, action: int, advantage: float, vocab: int,
                seed: int):
    """A rollout-shaped row: `prompt` tokens, then `turns` turns of 3 template tokens, an action of up to
    `action` tokens, 5 template tokens and an environment response filling the turn."""
    from benchmarks.trainstep import row_with_targets

    per = (length - prompt) // turns
    action = max(1, min(action, per // 3))
    if per < action + 9:
        raise SystemExit(f"a row of {length} tokens cannot hold a {prompt}-token prompt and {turns} turns")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
    act, env = [], []
    for t in range(turns):
        start = prompt + t * per
        end = length if t == turns - 1 else start + per
        act += range(start + 3, start + 3 + action)
        env += range(start + 3 + action + 5, end)
    row = row_with_targets(ids, env, act, advantage=advantage)
    row.meta["episode"] = seed
    return row


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**10
    return 0.0


def measured(key: str, fn, out: dict[str, Any]):
    from trainers.memory import peak_mem_mb, reset_peak

    gc.collect()
    reset_peak("cpu")
    t0 = time.perf_counter()
    result = fn()
    out[key] = {"s": round(time.perf_counter() - t0, 1),
                "rss_peak_gib": round(peak_mem_mb("cpu")[0] / 2**10, 2),
                "rss_after_gib": round(rss_mb() / 2**10, 2)}
    print(key, json.dumps(out[key]), file=sys.stderr, flush=True)
    return result


def plans(cfg, rl_len: int, targets_per_row: int) -> dict[str, Any]:
    """The plan of the RL step's microbatch as measured here, and `quaero check`'s (the longest row)."""
    from quaero.models.load import config_fields
    from quaero.preflight.memory_lines import step_shape
    from quaero.preflight.memory_plan import ModelDims, plan

    dims = ModelDims.from_fields(config_fields(cfg.model.name))
    checked, note, _ = step_shape(cfg, "cpu")
    rows = max(1, min(cfg.rollout.tasks_per_step * cfg.rollout.group_size,
                      cfg.backend.micro_batch_tokens // rl_len))
    here = replace(checked, tokens=rows * rl_len, targets=rows * targets_per_row,
                   target_span=rows * targets_per_row, rows=rows)
    p, q = plan(dims, here), plan(dims, checked)
    return {"plan_rl_microbatch_gib": round(p.peak / GIB, 2), "plan_rl_microbatch_rows": rows,
            "plan_parts_gib": {k: round(getattr(p, k) / GIB, 3)
                               for k in ("weights", "optimizer", "gradients", "activations", "head_peak")},
            "plan_check_gib": round(q.peak / GIB, 2), "plan_check_shape": note}


def run(args) -> dict[str, Any]:
    from benchmarks.real_shape import phase_peaks, resident_bytes
    from quaero.config.load import load_config
    from quaero.models.load import config_fields
    from quaero.preflight.plan import trainer_spec
    from trainers.registry import trainer_class

    cfg = load_config(args.config, args.set)
    spec = trainer_spec(cfg)
    vocab = config_fields(cfg.model.name)["vocab_size"]
    out: dict[str, Any] = {"config": args.config, "set": args.set, "model": cfg.model.name,
                           "dtype": spec.dtype,
                           "lora": spec.lora, "micro_batch_tokens": spec.micro_batch_tokens,
                           "cpu_mmap_threshold": spec.memory.cpu_mmap_threshold, "threads": args.threads,
                           "date": time.strftime("%Y-%m-%d"), "phases": {}}
    phases = out["phases"]
    trainer = measured("load", lambda: trainer_class(cfg.backend.backend)(spec, "cpu"), phases)
    shape = {"prompt": args.prompt, "turns": args.turns, "action": args.action, "vocab": vocab}
    sft = [episode_row(args.sft_len, advantage=0.0, seed=i, **{**shape, "prompt": args.sft_prompt})
           for i in range(args.sft_rows)]
    if sft:
        measured("sft_step", lambda: trainer.train_step(sft, sft=True), phases)
        if cfg.training.rl_optimizer_start != "continue":
            trainer.reset_optimizer(momentum_only=cfg.training.rl_optimizer_start == "reset_momentum")
    rl = [episode_row(args.rl_len, advantage=args.advantage * (1 if i % 2 else -1), seed=100 + i, **shape)
          for i in range(args.rl_rows)]
    metrics: dict[str, Any] = {}
    if args.profile:
        gc.collect()
        resident = resident_bytes(trainer)

        def profiled():
            peak, _, _ = phase_peaks(lambda: metrics.update(trainer.train_step(rl)))
            out["rl_torch_peak_gib"] = round((resident + peak) / GIB, 2)

        measured("rl_step", profiled, phases)
    else:
        measured("rl_step", lambda: metrics.update(trainer.train_step(rl)), phases)
    out["rl_rows"], out["rl_row_tokens"] = len(rl), args.rl_len
    out["rl_microbatches"] = metrics.get("microbatches")
    targets = sum(1 for w, a in zip(rl[0].echo_weights, rl[0].action_mask) if w > 0 or a)
    out.update(plans(cfg, args.rl_len, targets))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="quaero bench rl-memory", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="envs/toolbench_smollm2.toml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    p.add_argument("--sft-rows", type=int, default=2, help="warm-start rows (0: no SFT step)")
    p.add_argument("--sft-len", type=int, default=485)
    p.add_argument("--sft-prompt", type=int, default=200)
    p.add_argument("--rl-rows", type=int, default=8)
    p.add_argument("--rl-len", type=int, default=1900)
    p.add_argument("--prompt", type=int, default=350, help="prompt tokens of an RL row")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--action", type=int, default=48, help="tokens of one action ([sampler] max_tokens)")
    p.add_argument("--advantage", type=float, default=0.0,
                   help="the RL rows' advantages (+-A alternating; 0: every episode failed alike)")
    p.add_argument("--profile", action="store_true", help="torch's CPU allocator count over the RL step too")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    bench_output(args.json)  # a path it cannot write is refused before the work, not after
    torch.set_num_threads(args.threads)
    doc = run(args)
    emit(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
