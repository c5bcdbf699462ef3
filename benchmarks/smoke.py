"""A trainer smoke: one RL + ECHO train step on sparse agent-trace rows, printing its proof metrics.

    quaero bench smoke --backend local      # or unsloth (imported first, before transformers)

Rows look like packed tool traces: two short actions and two short environment responses inside a
long context, so the selected targets are sparse in a long suffix (the sparse ECHO case).
"""
from __future__ import annotations

import argparse
import json
import random

from quaero.rows import EchoRow, Span
from quaero.telemetry import names
from quaero.telemetry.proofs import STEP_PROOF_METRICS
from trainers.spec import TrainerSpec

# the step's proof metrics (quaero/telemetry/proofs.py), then the figures a smoke reader wants next to them
SMOKE_KEYS = (*STEP_PROOF_METRICS, names.LOSS, names.RL_LOSS, names.ECHO_LOSS, names.ACTION_TOKENS,
              names.ECHO_TOKENS,
              names.ROW_TOKENS, names.GRAD_NORM, names.SAMPLER_LOGPROB_GAP_MAX, names.PEAK_MEM_MB,
              names.PEAK_MEM_SOURCE, names.STEP_TIME_S)


def sparse_row(seed: int, advantage: float, *, vocab: int = 151936, context: int = 240) -> EchoRow:
    """[prompt 32][action 8][env 8][context `context`][action 6][env 14]: 36 targets over ~300 slots."""
    rng = random.Random(seed)
    layout = [("prompt", 32), ("action", 8), ("env", 8), ("prompt", context), ("action", 6), ("env", 14)]
    spans, ids, adv, echo = [], [], [], []
    for kind, n in layout:
        spans.append(Span(kind, len(ids), len(ids) + n))
        ids += [rng.randrange(vocab) for _ in range(n)]
        adv += [advantage if kind == "action" else 0.0] * n
        echo += [1.0 if kind == "env" else 0.0] * n
    sampler_lp = [-rng.uniform(5.0, 15.0) if kind == "action" else 0.0
                  for kind, n in layout for _ in range(n)]
    return EchoRow(ids, spans, adv, echo, sampler_lp)


def sparse_rows(n: int = 4, **kw) -> list[EchoRow]:
    """A group of n rows with group-relative advantages (+/-), all carrying ECHO targets."""
    return [sparse_row(i, 1.0 if i % 2 else -1.0, **kw) for i in range(n)]


def smoke_spec(*, lora: bool = False) -> TrainerSpec:
    """The smoke's trainer spec: the default config's (tiny-qwen3), one or two rows per microbatch."""
    from benchmarks.trainstep import config_spec  # torch: after `run` has imported unsloth

    return config_spec({"backend": {"micro_batch_tokens": 700, "lora": lora}})


def run(trainer_name: str, steps: int = 1, *, lora: bool = False) -> dict:
    """`steps` train steps of `trainer_name` on `sparse_rows()`; the last step's metrics, every key."""
    if trainer_name == "unsloth":
        import trainers.unsloth_trainer  # noqa: F401 - unsloth before transformers
    from trainers.registry import trainer_class

    trainer = trainer_class(trainer_name)(smoke_spec(lora=lora), "cpu")
    rows = sparse_rows()
    for _ in range(steps):
        metrics = trainer.train_step(rows)
    return metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="quaero bench smoke", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="local", choices=["local", "unsloth"])
    p.add_argument("--lora", action="store_true")
    args = p.parse_args(argv)
    metrics = run(args.backend, lora=args.lora)
    print(json.dumps({k: metrics[k] for k in SMOKE_KEYS}))


if __name__ == "__main__":
    main()
