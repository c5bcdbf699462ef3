"""Real train steps for the benchmarks: a tiny Qwen3 of a chosen shape, sparse target rows.

Both `echo_train_smoke` (quaero bench echo) and `quaero bench step` run the `local` trainer's own
`train_step` (trainers/step.py: one forward, RL + ECHO losses, one backward, AdamW), built from the
`TrainerSpec` that `quaero train` builds from the same settings (`config_spec`), on a random-init Qwen3 saved
once into `$QUAERO_CACHE/bench/` (2 layers, head_dim 16, untied LM head), so what is measured is what
`quaero train` runs.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.measure import sync
from quaero.rows import EchoRow, Span
from trainers.spec import TrainerSpec


def bench_model_dir(vocab_size: int, hidden_size: int, layers: int = 2, seed: int = 0) -> Path:
    """A random-init Qwen3 folder (vocab, hidden, `layers`; head_dim 16, untied LM head), built once."""
    from quaero.models.cache import cache_dir, materialize_folder
    from quaero.models.qwen3 import random_qwen3

    def build(out: Path) -> None:
        random_qwen3(vocab_size, hidden_size, layers=layers, seed=seed).save_pretrained(out)

    return materialize_folder(cache_dir() / "bench" / f"qwen3-v{vocab_size}-h{hidden_size}-l{layers}-s{seed}",
                              build)


def row_with_targets(input_ids: list[int], env_targets: list[int], action_targets: list[int], *,
                     advantage: float = 1.0, echo_weight: float = 1.0) -> EchoRow:
    """An EchoRow whose ECHO targets are `env_targets` and RL targets `action_targets` (token indices);
    runs of one kind become spans, everything between them is prompt."""
    kind = ["prompt"] * len(input_ids)
    for i in env_targets:
        kind[i] = "env"
    for i in action_targets:
        kind[i] = "action"
    spans, start = [], 0
    for i in range(1, len(kind) + 1):
        if i == len(kind) or kind[i] != kind[start]:
            spans.append(Span(kind[start], start, i))
            start = i
    adv = [advantage if k == "action" else 0.0 for k in kind]
    echo = [echo_weight if k == "env" else 0.0 for k in kind]
    sampler_lp = [-10.0 if k == "action" else 0.0 for k in kind]  # ~ log(1/V): a plausible sampled token
    return EchoRow(list(input_ids), spans, adv, echo, sampler_lp)


TRACE_LAYOUT = ("one row of L token ids; {turns} turns spread evenly over it, each an action of {a} tokens "
                "(RL advantage +1) followed by an environment response of {e} tokens (ECHO weight 1); "
                "every other token is prompt/context (no loss)")


def trace_row(length: int, targets: int, vocab_size: int, *, turns: int = 4, seed: int = 0) -> tuple[EchoRow,
                                                                                                     str]:
    """A long tool-trace row with `targets` loss tokens (a quarter actions, the rest env responses)."""
    turns = max(1, min(turns, targets))
    per_turn = targets // turns
    a = max(1, per_turn // 4)
    e = per_turn - a
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (length,), generator=gen).tolist()
    env, act = [], []
    gap = length // turns
    for t in range(turns):
        end = length if t == turns - 1 else (t + 1) * gap  # turns end at the row's end, spread evenly
        start = end - per_turn
        act += list(range(start, start + a))
        env += list(range(start + a, end))
    if min(act + env) < 1:
        raise SystemExit(f"row of {length} tokens cannot hold {targets} targets in {turns} turns")
    return row_with_targets(ids, env, act), TRACE_LAYOUT.format(turns=turns, a=a, e=e)


def config_spec(settings: dict[str, Any], *, logprob_fn: str = "") -> TrainerSpec:
    """The trainer spec `quaero train` builds from a config with these settings
    (`quaero.preflight.plan.trainer_spec`,
    the one place a config becomes a spec), e.g. `{"backend": {"lora": True}}`; `logprob_fn`: the trainer's
    log-prob hook (benchmarks/peers.py), a spec field no config key sets."""
    from quaero.config import QuaeroConfig
    from quaero.preflight.plan import trainer_spec

    # a config names an env; a trainer never reads it (no env starts here)
    spec = trainer_spec(QuaeroConfig.model_validate({"env": {"entry": "envs.toolbench:ToolBenchEnv"},
                                                     **settings}))
    return dataclasses.replace(spec, logprob_fn=logprob_fn) if logprob_fn else spec


def bench_spec(model_dir: Path, *, seq_len: int, dtype: str = "float32", selective: bool = True,
               chunk_size: int | None = None, compile_mode: str = "off", compile_min_tokens: int = 128,
               temperature: float = 1.0, logprob_fn: str = "") -> TrainerSpec:
    """The trainer spec of a benchmark step, configured as a user would: one microbatch per row of `seq_len`,
    ECHO weight 0.2, the selective path's `[backend.options]`."""
    return config_spec({
        "model": {"name": str(model_dir), "dtype": dtype, "max_seq_len": max(64, seq_len)},
        "sampler": {"temperature": temperature},
        "backend": {"micro_batch_tokens": max(seq_len, 1), "options": {
            "train_selective_suffix_logits": selective, "train_logprob_chunk_size": chunk_size,
            "train_compile_selective_ce": compile_mode,
            "train_compile_selective_ce_min_tokens": compile_min_tokens}},
        "echo": {"weight": 0.2}}, logprob_fn=logprob_fn)


def make_trainer(spec: TrainerSpec, device: torch.device):
    from trainers.local import LocalTrainer

    return LocalTrainer(spec, str(device))


def timed_steps(trainer, rows: list[EchoRow], steps: int, device: torch.device) -> tuple[list[float],
                                                                                         list[dict]]:
    """Run `steps` train steps; seconds per step and the metrics each returned."""
    times, metrics = [], []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        metrics.append(trainer.train_step(rows))
        sync(device)
        times.append(time.perf_counter() - t0)
    return times, metrics


def cumulative(metrics: list[dict]) -> dict[str, Any]:
    """The trainer's `local_train_*` metrics accumulated over the steps (counters summed, strings/bools
    latest)."""
    from quaero.telemetry.runlog import Cumulative

    totals = Cumulative()
    for m in metrics:
        totals.add({k: v for k, v in m.items() if k.startswith("local_train_")})
    return totals.totals
