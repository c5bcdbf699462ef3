"""The template renderer's cost per turn against renderers' hand-written Qwen3 renderer, on the main job.

    quaero bench bridge-cost [--episodes 8] [--turns 8] [--repeat 3]

Drives the real toolbench env in-process with its scripted oracle (the main job's env, tiny-qwen3's real
Qwen vocabulary), padded to `turns` turns as `quaero bench packing` does, once per renderer: renderers'
Qwen3Renderer (what `[model] renderer = "auto"` picks for Qwen3 models) and quaero's TemplateRenderer over
Qwen3's own chat template (TRL's copy, when TRL is installed; else the tokenizer's template). Every turn's
sampling prompt (`prompt_ids`) and bridge (`bridge`: the env response appended, its content attributed by
re-bridging) is timed; the figures are the median over `repeat` runs of the mean per turn. The rows of both
are compared token for token. Then one sampled turn of tiny-qwen3 (hf sampler, the toolbench prompt, up to 64
new tokens) gives the scale: the render work as a share of a turn whose tokens a model samples.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _timed(render):
    """`render` with its prompt_ids and bridge timed into `render.seconds`."""
    render.seconds = {"prompt_ids": [], "bridge": []}
    for name in ("prompt_ids", "bridge"):
        real = getattr(render, name)

        def timed(*a, _real=real, _name=name, **kw):
            t = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                render.seconds[_name].append(time.perf_counter() - t)
        setattr(render, name, timed)
    return render


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="quaero bench bridge-cost", description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)

    import importlib.util
    from pathlib import Path

    from benchmarks.packing import eight_turns
    from quaero.config import ModelConfig, QuaeroConfig, settings_of
    from quaero.models.load import load_tokenizer
    from quaero.openenv_client import open_envs
    from quaero.rollout.driver import DriverSettings, EpisodeDriver
    from quaero.rollout.render import RenderAdapter

    env = {"entry": "envs.toolbench:ToolBenchEnv", "launcher": "inprocess", "max_turns": args.turns}
    cfg = QuaeroConfig.model_validate({"env": env, "rollout": {"strict": True}})
    tok = load_tokenizer(cfg.model.name)
    trl = importlib.util.find_spec("trl")
    template, source = None, "the tokenizer's own template"
    if trl and trl.submodule_search_locations:
        path = Path(next(iter(trl.submodule_search_locations))) / "chat_templates" / "qwen3.jinja"
        template, source = path.read_text(encoding="utf-8"), "Qwen3's template (TRL's copy)"
    options = {"chat_template": template} if template else {}
    arms = {"renderers Qwen3Renderer": ModelConfig(renderer="qwen3"),
            "quaero TemplateRenderer": ModelConfig(renderer="template", renderer_options=options)}
    tasks = [{"seed": i, "split": "train", "index": i} for i in range(args.episodes)]
    per_turn: dict[str, dict[str, list[float]]] = {a: {"prompt_ids": [], "bridge": []} for a in arms}
    rows: dict[str, list[list[int]]] = {}
    with open_envs(cfg.env, min(args.episodes, 4)) as pool:
        for _ in range(args.repeat):
            for arm, model_cfg in arms.items():
                render = _timed(RenderAdapter(tok, model_cfg))
                driver = EpisodeDriver(render, None, settings_of(DriverSettings, cfg), pool.counts)
                groups = driver.run(pool.sessions, tasks, group_size=1, policy=eight_turns(args.turns, True))
                counts = pool.counts.snapshot_and_reset()
                assert counts["bridge_fallbacks"] == 0 and counts["prefix_mismatches"] == 0, (arm, counts)
                rows[arm] = [r.input_ids for g in groups for r in g[0].rows]
                for name, secs in render.seconds.items():
                    per_turn[arm][name].append(sum(secs) / max(counts["turns"], 1))
        turns = counts["turns"]

    from quaero.models.load import load_causal_lm
    from quaero.sampling.hf import HFSampler

    model = load_causal_lm(cfg.model.name).eval()
    sampler = HFSampler(model, cfg.sampler.model_copy(update={"max_tokens": 64}), stop_token_ids=[151643])
    render = RenderAdapter(tok, arms["renderers Qwen3Renderer"])
    with open_envs(cfg.env, 1) as pool:
        reset = pool.sessions[0].reset(seed=0, split="train", index=0)
        prompt = render.prompt_ids(list(reset.messages), pool.sessions[0].tools)
    sampler.generate([prompt], n=1, seed=0)  # warm
    t = time.perf_counter()
    new = len(sampler.generate([prompt], n=1, seed=1)[0][0].token_ids)
    sampled = time.perf_counter() - t

    same = rows["renderers Qwen3Renderer"] == rows["quaero TemplateRenderer"]
    print(f"\nRender cost per turn on toolbench ({args.episodes} episodes x {args.turns} turns = {turns} "
          f"turns, oracle with reasoning, median of {args.repeat}); template: {source}\n")
    print(f"{'renderer':<26} {'prompt_ids ms':>14} {'bridge ms':>10} {'total ms':>9}")
    totals = {}
    for arm in arms:
        p, b = (statistics.median(per_turn[arm][k]) * 1e3 for k in ("prompt_ids", "bridge"))
        totals[arm] = p + b
        print(f"{arm:<26} {p:>14.2f} {b:>10.2f} {p + b:>9.2f}")
    extra = totals["quaero TemplateRenderer"] - totals["renderers Qwen3Renderer"]
    n = sum(map(len, rows["quaero TemplateRenderer"]))
    print(f"\nrows identical token for token: {same} ({n:,} tokens)")
    share = 100 * extra / (sampled * 1e3)
    print(f"template renderer adds {extra:.2f} ms a turn; one sampled turn of tiny-qwen3 (hf, {len(prompt)}-"
          f"token prompt, {new} new tokens) takes {sampled * 1e3:.0f} ms: {share:.1f}% of it")
    return 0 if same else 1


if __name__ == "__main__":
    main()
