"""`quaero bench sampler-reuse`: the transformers sampler before/after it reuses what it computed, side by
side in one process on one model (quaero/sampling/kv_reuse.py).

    quaero bench sampler-reuse --models tiny-qwen3 --threads 1
    quaero bench sampler-reuse --models smollm2-135m-instruct --config envs/toolbench_smollm2.toml --threads 1

`before` is the old path: every prompt prefilled whole in one left-padded batch, tokens drawn by
`torch.multinomial` (`[sampler] hf_kv_cache_mib = 0`, `draw_with="multinomial"`); `after` is the default:
KV kept by exact token ids, the inverse-CDF draw. Per model:

- `draw_ms`: one draw from a [B, V] distribution at the model's vocabulary, multinomial vs inverse CDF.
- `decode`: generated tokens/s at batch 1 and 8 (distinct 32-token prompts, 48 tokens each, no stop).
- `group_prefill`: a group of 8 members with one ~400-token prompt (the main job's shape: ~370 tokens of
  system prompt, tools and task), one token each: seconds.
- `rollout`: one group of 8 toolbench episodes (the config's env, `quaero train`'s own driver), greedy (the
  same tokens on both paths: the KV reuse alone) and sampled: seconds, generated tokens/s, the reuse counters
  and the largest sampler-vs-trainer log-prob gap.

The arms alternate (before, after, after, before ...) over `--repeats` rounds (`--rollout-repeats` for the
rollout); medians are reported. Figures on a shared machine move with its load (`load_average_end`).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.measure import emit, environment, load_average, torch_threads

ARMS = ("before", "after")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quaero bench sampler-reuse", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny-qwen3", help="comma-separated model names quaero resolves")
    p.add_argument("--config", default="envs/toolbench.toml", help="the rollout's env and sampler settings")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rollout-repeats", type=int, default=1, help="rounds of the group rollout per arm")
    p.add_argument("--no-rollout", action="store_true", help="skip the toolbench group rollout")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", metavar="PATH")
    return p


def set_arm(sampler, arm: str, kv_bytes: int) -> None:
    """Switch an HFSampler between the old path and the reusing one (the same module, the same weights)."""
    from quaero.sampling.kv_reuse import PrefixKV

    sampler.prefix = PrefixKV(kv_bytes) if arm == "after" else None
    sampler.draw_with = "inverse_cdf" if arm == "after" else "multinomial"


def timed(fn, clock=time.perf_counter) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def alternate(repeats: int, run_arm) -> dict[str, list]:
    """Each arm `repeats` times, in the order before after, after before, ...: load falls on both."""
    out: dict[str, list] = {a: [] for a in ARMS}
    for r in range(repeats):
        for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
            out[arm].append(run_arm(arm))
    return out


def draw_ms(vocab: int, repeats: int) -> dict[str, Any]:
    from quaero.sampling.kv_reuse import draw

    gen = torch.Generator().manual_seed(0)
    out = {}
    for b in (1, 8):
        probs = torch.softmax(torch.randn(b, vocab, generator=gen) * 3, -1)
        arms = {"multinomial": lambda p=probs: torch.multinomial(p, 1, generator=gen),
                "inverse_cdf": lambda p=probs: draw(p, gen)}
        for name, fn in arms.items():
            fn()
            out[f"b{b}_{name}"] = round(statistics.median(timed(fn) for _ in range(10 * repeats)) * 1e3, 3)
        out[f"b{b}_speedup"] = round(out[f"b{b}_multinomial"] / out[f"b{b}_inverse_cdf"], 2)
    return out


def decode_rates(sampler, kv_bytes: int, repeats: int, tokens: int = 48, clock=time.perf_counter
                 ) -> dict[str, dict[str, float]]:
    """Generated tokens per second of `clock` per arm at batch 1 and 8: distinct 32-token prompts, `tokens`
    each (the sampler must not stop early: built with `max_tokens=tokens` and no reachable stop token)."""
    vocab = sampler.model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    out = {}
    for b in (1, 8):
        prompts = [torch.randint(100, vocab, (32,), generator=gen).tolist() for _ in range(b)]

        def run(arm, prompts=prompts):
            set_arm(sampler, arm, kv_bytes)
            seconds = timed(lambda: sampler.generate(prompts, seed=0), clock)
            return len(prompts) * tokens / seconds

        rates = alternate(repeats, run)
        out[f"decode_b{b}_tokens_per_s"] = {a: round(statistics.median(v), 1) for a, v in rates.items()}
        out[f"decode_b{b}_tokens_per_s"]["ratio"] = round(statistics.median(rates["after"])
                                                          / statistics.median(rates["before"]), 2)
    return out


def sampler_figures(name: str, repeats: int) -> dict[str, Any]:
    from quaero.config import SamplerConfig
    from quaero.models.load import load_causal_lm
    from quaero.sampling.hf import HFSampler

    model = load_causal_lm(name, "float32", "cpu").eval()
    vocab = model.config.vocab_size
    s = HFSampler(model, SamplerConfig(max_tokens=48, temperature=1.0), stop_token_ids=[-1])
    kv_bytes = s.prefix.max_bytes if s.prefix is not None else 0
    doc: dict[str, Any] = {"vocab": vocab, "layers": model.config.num_hidden_layers,
                           "kv_reusable": s.prefix is not None, "draw_ms": draw_ms(vocab, repeats)}
    doc.update(decode_rates(s, kv_bytes, repeats))
    gen = torch.Generator().manual_seed(2)
    group = [torch.randint(100, vocab, (400,), generator=gen).tolist()] * 8
    one = HFSampler(model, SamplerConfig(max_tokens=1, temperature=1.0), stop_token_ids=[-1])

    def prefill(arm):
        set_arm(one, arm, kv_bytes)
        return timed(lambda: one.generate(group, seed=0))

    secs = alternate(repeats, prefill)
    doc["group_prefill_s"] = {a: round(statistics.median(v), 3) for a, v in secs.items()}
    before, after = statistics.median(secs["before"]), statistics.median(secs["after"])
    doc["group_prefill_s"]["speedup"] = round(before / after, 2)
    return doc


def rollout_figures(name: str, config: str, repeats: int) -> dict[str, Any]:
    """One group of 8 toolbench episodes per arm and mode through `quaero train`'s components."""
    from benchmarks.rollout import logprob_gap
    from quaero.config import SINGLE, load_config
    from quaero.openenv_client import open_envs
    from quaero.recipe.parts import build
    from quaero.rollout.tasks import task_reset

    cfg = load_config(config, [f"model.name={name}", "sampler.backend=hf", "training.warmup_sft_steps=0"])
    tasks = [task_reset(cfg, cfg.env.train_split, 0)]
    out: dict[str, Any] = {}
    with open_envs(cfg.env, 8) as pool:
        c = build(cfg, {SINGLE: pool}, pool.counts)
        kv_bytes = cfg.sampler.hf_kv_cache_mib * 2**20
        driver = c.envs[0].driver
        for mode in ("greedy", "sampled"):
            def run(arm, mode=mode):
                set_arm(c.sampler, arm, kv_bytes)
                c.counts.snapshot_and_reset()
                seconds = timed(lambda: run.groups.append(driver.run(pool.sessions, tasks, group_size=8,
                                                                     greedy=mode == "greedy", seed=0)))
                eps = [e for e in run.groups[-1][0] if not e.dropped]
                counts = c.counts.snapshot_and_reset()
                rows = [r for e in eps for r in e.rows]
                scored = c.trainer.logprobs(rows, temperature=1.0 if mode == "greedy" else None)
                gap = logprob_gap(rows, scored)
                tokens = sum(len(t.action_ids) for e in eps for t in e.transitions)
                return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                        "turns": sum(e.turns for e in eps), "gap_max": gap["max"],
                        **{k: counts.get(k, 0) for k in ("sampler_prefill_tokens", "sampler_reused_tokens",
                                                         "sampler_prefix_hits")}}
            run.groups = []
            figs = alternate(repeats, run)
            out[mode] = {a: {"seconds": round(statistics.median(f["seconds"] for f in v), 2),
                             "tokens_per_s": round(statistics.median(f["tokens_per_s"] for f in v), 1),
                             "tokens": v[0]["tokens"], "turns": v[0]["turns"],
                             "gap_max": max((f["gap_max"] or 0.0) for f in v),
                             "prefill_tokens": v[0]["sampler_prefill_tokens"],
                             "reused_tokens": v[0]["sampler_reused_tokens"]} for a, v in figs.items()}
            out[mode]["speedup_s"] = round(out[mode]["before"]["seconds"] / out[mode]["after"]["seconds"], 2)
            print(f"  {name} rollout {mode}: {out[mode]}", file=sys.stderr)
        c.sampler.close()
    return out


def run(args) -> dict[str, Any]:
    doc = environment(torch.device("cpu"), torch.float32)
    doc["config"] = {"models": args.models, "config": args.config, "repeats": args.repeats,
                     "rollout_repeats": args.rollout_repeats}
    doc["models"] = {}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        print(f"quaero bench sampler-reuse: {name}", file=sys.stderr)
        figs = sampler_figures(name, args.repeats)
        print(f"  {name}: {figs}", file=sys.stderr)
        if not args.no_rollout:
            figs["rollout_group_of_8"] = rollout_figures(name, args.config, args.rollout_repeats)
        doc["models"][name] = figs
    doc["load_average_end"] = load_average()
    return doc


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from quaero.tools.outputs import bench_output

    bench_output(args.json)  # a path it cannot write is refused before the work, not after
    with torch_threads(args.threads):
        doc = run(args)
    emit(doc, args.json)
    return 0
