"""Trained tokens per 8-turn toolbench episode: packed rows vs one row per transition.

    quaero bench packing [--episodes 6] [--turns 8]

Drives the real toolbench env in-process with its scripted oracle, padded to `turns` turns by repeating the
oracle's first lookup, with one line of reasoning per turn (a thinking model's output; Qwen3 keeps non-empty
reasoning inside a tool cycle, so the full render of the next turn extends the row). The same transitions are
laid out both ways; every token of a row goes through the forward pass, so row tokens are the cost.
The last column shows the oracle verbatim (no reasoning): Qwen3 drops an empty <think> block from history,
the next prompt is no extension, and the driver falls back to one row per transition.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def eight_turns(turns: int, reasoning: bool):
    """Oracle policy padded to `turns` assistant turns (the first lookup repeated) with optional reasoning."""
    from envs.toolbench import oracle_policy

    def make(info: dict):
        oracle = oracle_policy(info)
        plan_len = 1
        while oracle([{"role": "assistant"}] * (plan_len - 1))["tool_calls"][0]["function"]["name"] \
                != "submit_answer":  # the oracle plays its k-th planned call at its k-th turn
            plan_len += 1
        extra = max(turns - plan_len, 0)

        def act(messages: list[dict]) -> dict:
            done = sum(1 for m in messages if m["role"] == "assistant")
            msg = oracle([{"role": "assistant"}] * max(done - extra, 0))
            name = msg["tool_calls"][0]["function"]["name"]
            return {**msg, "reasoning_content": f"Next I call {name}." if reasoning else None}
        return act
    return make


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="quaero bench packing", description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=6)
    ap.add_argument("--turns", type=int, default=8)
    args = ap.parse_args(argv)

    from quaero.config import QuaeroConfig, settings_of
    from quaero.models.load import load_tokenizer
    from quaero.openenv_client import open_envs
    from quaero.rollout.driver import DriverSettings, EpisodeDriver
    from quaero.rollout.render import RenderAdapter

    cfg = QuaeroConfig.model_validate({"env": {"entry": "envs.toolbench:ToolBenchEnv",
                                               "launcher": "inprocess",
                                               "max_turns": args.turns}, "rollout": {"strict": True}})
    render = RenderAdapter(load_tokenizer(cfg.model.name), cfg.model)
    tasks = [{"seed": i, "split": "train", "index": i} for i in range(args.episodes)]
    with open_envs(cfg.env, min(args.episodes, 4)) as pool:
        results = {}
        for reasoning in (True, False):
            driver = EpisodeDriver(render, None, settings_of(DriverSettings, cfg), pool.counts)
            groups = driver.run(pool.sessions, tasks, group_size=1, policy=eight_turns(args.turns, reasoning))
            results[reasoning] = ([g[0] for g in groups], pool.counts.snapshot_and_reset())

    eps, counts = results[True]
    plain_eps, plain_counts = results[False]
    width = 48
    top = max(ep.info["trained_tokens_per_transition_layout"] for ep in eps)
    print(f"\nTrained tokens per {args.turns}-turn toolbench episode "
          "(Qwen3 renderer, real Qwen vocabulary)\n")
    print(f"{'episode':>7} {'turns':>5} {'per-transition':>14} {'packed':>7} {'ratio':>6}  "
          f"{'no-reasoning':>12}")
    for ep, plain in zip(eps, plain_eps):
        flat, packed = ep.info["trained_tokens_per_transition_layout"], ep.info["trained_tokens"]
        print(f"{ep.info.get('index', '?'):>7} {ep.turns:>5} {flat:>14} {packed:>7} {flat / packed:>5.2f}x"
              f"  {plain.info['trained_tokens']:>7} ({len(plain.rows)} rows)")
        print(f"{'':>7} per-transition |{'#' * round(width * flat / top):<{width}}|")
        print(f"{'':>7} packed         |{'#' * round(width * packed / top):<{width}}|")
    flat_mean = counts["rollout_row_tokens_per_transition_layout"] / counts["episodes"]
    packed_mean = counts["rollout_row_tokens_per_episode"]
    print(f"\nmean per episode: per-transition {flat_mean:.0f} tokens, packed {packed_mean:.0f} tokens, "
          f"ratio {flat_mean / packed_mean:.2f}x "
          f"({counts['rows_packed']} packed rows, {counts['rows_transition']} per-transition rows, "
          f"prefix mismatches {counts['prefix_mismatches']}, bridge fallbacks {counts['bridge_fallbacks']})")
    print(f"episodes solved: {sum(ep.success for ep in eps)}/{len(eps)}; oracle verbatim (empty thinking): "
          f"{plain_counts['rows_packed']} packed rows, "
          f"{plain_counts['rows_transition']} per-transition rows, "
          f"packing breaks {plain_counts['packing_breaks']}")


if __name__ == "__main__":
    main()
