"""Real-shape train steps against `quaero check`'s memory plan (quaero/preflight/memory_plan.py).

    quaero bench real-shape --model qwen3-0.6b-shape --phases --rows 2 --seq-len 256
    quaero bench real-shape --model qwen3-0.6b-shape --layers 2 --seq-len 8192 --targets 64 \
        --cases selective,chunked,checkpointing,crop

A named real shape (`quaero.models.qwen3.NAMED_SHAPES`, random init, built offline) trains with the `local`
trainer's own `train_step` (trainers/step.py), built from a `TrainerSpec` in code. `--layers N` keeps the
shape's width, vocabulary and head but only N decoder layers (a long row at full depth does not fit 2 CPU
cores' time): per-layer and LM-head memory are the real shape's, and the plan is asked about the same
model. Every case reports:

- `measured_gib`: resident state after a warm-up step (parameters, buffers, AdamW m+v, by storage) plus
  the next step's peak of torch allocations (benchmarks/measure.py `cpu_peak_bytes`), and the process's
  peak RSS over that step (`rss_peak_gib`, /proc/self/status VmHWM, reset before the step);
- `plan_gib` and `plan_error`: the memory plan's peak for the same model, dtype, row and knobs, and
  (plan - measured) / measured;
- `step_s`: the warm-up step's wall time (no profiler; none where `--warmup-seq-len` made it shorter), and
  `measured_step_s`: the measured step's, under the memory profiler;
- `reference_forward_s`: with the KL penalty (case `kl`: `[loss] beta` > 0, its frozen copy in the
  resident state; `lora+kl`: the base, no copy), the reference's no-grad forward inside the measured step.

`--phases` also times what a real run does around a step at full depth: load, one train step (its AdamW
update timed apart), checkpoint write and read (quaero/recipe/checkpoint.py), export
(quaero/recipe/model_folder.py), and the weights folder a vLLM server reloads from (`saved_weights`).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.measure import emit
from quaero.telemetry import names
from quaero.tools.outputs import bench_output
from trainers.memory import peak_mem_mb, process_peak_mb, reset_peak

GIB = 2**30
CASES = {  # name -> (TrainerSpec overrides, memory-plan StepShape overrides)
    "full": ({"selective_logits": False}, {"selective": False}),
    "selective": ({}, {}),
    "chunked": ({"chunk_size": 256}, {"chunk_size": 256}),
    "checkpointing": ({"gradient_checkpointing": True}, {"gradient_checkpointing": True}),
    "crop": ({"context_tokens": 1024}, {"context_tokens": 1024}),
    "lora": ({"lora": True, "lora_r": 16}, {"lora": True, "lora_r": 16}),
    # the KL penalty's frozen reference (trainers/reference.py): a copy of the weights, none with `lora+kl`
    "kl": ({"beta": 0.04}, {"reference": True}),
}


def rss_peak() -> int:
    """Bytes: the process's peak RSS since the last reset."""
    return round(peak_mem_mb("cpu")[0] * 2**20)


def model_folder(name: str, layers: int | None) -> tuple[str, dict]:
    """The model to train (a named shape, at `layers` decoder layers when given) and its config fields."""
    from quaero.models.cache import cache_dir, materialize_folder
    from quaero.models.load import resolve_model
    from quaero.models.qwen3 import NAMED_SHAPES

    if layers is None:
        path = resolve_model(name)
        return str(path), json.loads((path / "config.json").read_text())
    shape = replace(NAMED_SHAPES[name], num_hidden_layers=layers)
    path = materialize_folder(
        cache_dir() / "bench" / f"{name}-l{layers}-{shape.version}", lambda out: shape.build(out, name)
    )
    return str(path), json.loads((path / "config.json").read_text())


def tail_span(targets: int, span: int) -> int:
    """Tokens from a `tail_row`'s first target to its end (what a context crop keeps after its K tokens)."""
    return span // 2 + targets // 2


def tail_row(length: int, targets: int, span: int, vocab: int, seed: int = 0):
    """A row of `length` tokens whose `targets` loss tokens lie in its last `span` tokens: two turns, each an
    action (a quarter, RL advantage 1) then an env response (ECHO weight 1); the rest is context."""
    from benchmarks.trainstep import row_with_targets

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
    per_turn = targets // 2
    act, env = [], []
    for t in range(2):
        end = length - (1 - t) * (span // 2)
        start = end - per_turn
        a = max(1, per_turn // 4)
        act += list(range(start, start + a))
        env += list(range(start + a, end))
    return row_with_targets(ids, env, act)


def resident_bytes(trainer) -> int:
    seen, total = set(), 0
    tensors = list(trainer.model.parameters()) + list(trainer.model.buffers())
    if trainer.reference is not None:  # the KL reference's copy (with LoRA: the model itself, counted once)
        ref = trainer.reference.parts.model
        tensors += list(ref.parameters()) + list(ref.buffers())
    for state in trainer.optimizer.state.values():
        tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


OPTIMIZER_MARK = "benchmarks.real_shape.optimizer_step"


def phase_peaks(fn) -> tuple[int, int, int]:
    """Run `fn` (a train step) under the profiler: peak net torch CPU-allocator bytes over the whole step,
    before the optimizer's update (forward + backward) and from it on (the update), as measure.py
    `cpu_peak_bytes` replays them; the update is the `OPTIMIZER_MARK` range."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.measure import _quiet_stderr

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
    with _quiet_stderr():
        prof.start()
    try:
        fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    cpu = torch._C._autograd.DeviceType.CPU
    events = list(prof.profiler.kineto_results.events())
    marks = [e.start_ns() for e in events if e.name() == OPTIMIZER_MARK]
    split = min(marks) if marks else None
    current = peak = before = after = 0
    for e in sorted(
        (e for e in events if e.name() == "[memory]" and e.device_type() == cpu), key=lambda e: e.start_ns()
    ):
        current += e.nbytes()
        peak = max(peak, current)
        if split is None or e.start_ns() < split:
            before = max(before, current)
        else:
            after = max(after, current)
    return peak, before, after


def mark_optimizer(trainer) -> None:
    """Wrap the trainer's AdamW step in a profiler range (`phase_peaks` splits the step there)."""
    step = trainer.optimizer.step

    def marked(*a, **kw):
        with torch.profiler.record_function(OPTIMIZER_MARK):
            return step(*a, **kw)

    trainer.optimizer.step = marked


def make_trainer(model: str, args, spec_kw: dict):
    from trainers.registry import trainer_class
    from trainers.spec import MemoryPolicy, SelectivePolicy, TrainerSpec

    spec = TrainerSpec(
        model=model,
        dtype=args.dtype,
        max_seq_len=max(64, args.seq_len),
        micro_batch_tokens=args.rows * args.seq_len,
        echo_weight=0.2,
        selective_logits=spec_kw.get("selective_logits", True),
        gradient_checkpointing=spec_kw.get("gradient_checkpointing", False),
        selective=SelectivePolicy(chunk_size=spec_kw.get("chunk_size")),
        memory=MemoryPolicy(supervised_context_tokens=spec_kw.get("context_tokens", 0)),
        lora=spec_kw.get("lora", False),
        lora_r=spec_kw.get("lora_r", 16),
        beta=spec_kw.get("beta", 0.0),
    )
    trainer = trainer_class(args.backend)(spec, args.device)
    trainer.take_reference()  # with beta > 0, as the recipe's first RL step does
    return trainer


def planned(fields: dict, args, plan_kw: dict):
    from quaero.preflight.memory_plan import ModelDims, StepShape, plan

    step = StepShape(
        tokens=args.rows * args.seq_len,
        targets=args.rows * args.targets,
        target_span=args.rows * tail_span(args.targets, args.span),
        rows=args.rows,
        dtype=args.dtype,
        device=args.device,
        **plan_kw,
    )
    return plan(ModelDims.from_fields(fields), step)


def case_settings(name: str) -> tuple[dict, dict]:
    """A case's TrainerSpec and StepShape overrides; `a+b` combines cases (e.g. `full+checkpointing`)."""
    spec_kw: dict = {}
    plan_kw: dict = {}
    for part in name.split("+"):
        if part not in CASES:
            raise SystemExit(f"error: --cases {name!r}: no case {part!r}; choose from {', '.join(CASES)}, "
                             "or join them with '+'")
        spec_kw.update(CASES[part][0])
        plan_kw.update(CASES[part][1])
    return spec_kw, plan_kw


def measure_case(name: str, model: str, fields: dict, args) -> dict[str, Any]:
    spec_kw, plan_kw = case_settings(name)
    rows = [
        tail_row(args.seq_len, args.targets, args.span, fields["vocab_size"], seed=i)
        for i in range(args.rows)
    ]
    trainer = make_trainer(model, args, spec_kw)
    warm = rows
    if args.warmup_seq_len and args.warmup_seq_len < args.seq_len:  # a short row makes the same AdamW state
        span = max(args.targets, args.warmup_seq_len // 4)
        warm = [tail_row(args.warmup_seq_len, args.targets, span, fields["vocab_size"], seed=i)
                for i in range(args.rows)]
    t0 = time.perf_counter()
    trainer.train_step(warm)  # warm-up: AdamW state exists from here on
    step_s = time.perf_counter() - t0
    gc.collect()
    resident = resident_bytes(trainer)
    mark_optimizer(trainer)
    reset_peak("cpu")  # the trainer's own window (trainers/memory.py: VmHWM reset on Linux)
    profiled_s = None
    if args.device.startswith("cuda"):  # the allocator's own peak over the step (not split at the update)
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        metrics = trainer.train_step(rows)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - resident
        fwd_bwd = update = 0
    else:
        t0 = time.perf_counter()
        metrics: dict = {}
        peak, fwd_bwd, update = phase_peaks(lambda: metrics.update(trainer.train_step(rows)))
        profiled_s = time.perf_counter() - t0
    rss = rss_peak()
    p = planned(fields, args, plan_kw)
    measured = resident + peak
    plan_fwd_bwd = p.fwd_bwd
    out = {
        "case": name,
        "seq_len": args.seq_len,
        "rows": args.rows,
        "targets": args.targets,
        "resident_gib": round(resident / GIB, 3),
        "step_peak_gib": round(peak / GIB, 3),
        "measured_gib": round(measured / GIB, 3),
        "rss_peak_gib": round(rss / GIB, 3),
        "plan_gib": round(p.peak / GIB, 3),
        "plan_error": round((p.peak - measured) / measured, 3),
        "fwd_bwd_peak_gib": round(fwd_bwd / GIB, 3),
        "plan_fwd_bwd_gib": round(plan_fwd_bwd / GIB, 3),
        "plan_fwd_bwd_error": round((plan_fwd_bwd - fwd_bwd) / max(fwd_bwd, 1), 3),
        "update_peak_gib": round(update / GIB, 3),
        "plan_update_gib": round(p.update / GIB, 3),
        "plan_parts_gib": {
            k: round(getattr(p, k) / GIB, 3)
            for k in ("weights", "optimizer", "gradients", "activations", "lm_head", "head_grad")
        },
        "step_s": round(step_s, 1) if warm is rows else None,
        "measured_step_s": round(profiled_s, 1) if profiled_s is not None else None,
        # the KL reference's no-grad forward over the rows, inside that step (None without one)
        "reference_forward_s": metrics.get(names.REFERENCE_FORWARD_S),
    }
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def phases(model: str, fields: dict, args) -> dict[str, Any]:
    """Load, step (AdamW apart), checkpoint write/read, export and the server's weights folder, timed."""
    from quaero.models.load import load_tokenizer
    from quaero.recipe import checkpoint
    from quaero.recipe.model_folder import save_model
    from quaero.sampling.vllm import saved_weights

    out: dict[str, Any] = {}

    def timed(key: str, fn):
        reset_peak("cpu")
        t0 = time.perf_counter()
        result = fn()
        out[key] = {"s": round(time.perf_counter() - t0, 1), "rss_peak_gib": round(rss_peak() / GIB, 2)}
        print(key, out[key], file=sys.stderr, flush=True)
        return result

    rows = [
        tail_row(args.seq_len, args.targets, args.span, fields["vocab_size"], seed=i)
        for i in range(args.rows)
    ]
    trainer = timed("load", lambda: make_trainer(model, args, {}))
    opt_s = []
    step = trainer.optimizer.step

    def timed_step(*a, **kw):
        t0 = time.perf_counter()
        r = step(*a, **kw)
        opt_s.append(time.perf_counter() - t0)
        return r

    trainer.optimizer.step = timed_step
    timed("train_step_first", lambda: trainer.train_step(rows))
    for _ in range(args.phase_steps - 1):
        timed("train_step", lambda: trainer.train_step(rows))
    out["optimizer_step_s"] = [round(s, 1) for s in opt_s]
    print("optimizer_step_s", out["optimizer_step_s"], file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="quaero-real-shape-", dir=args.scratch) as tmp:
        root = Path(tmp) / "checkpoints"
        path = timed(
            "checkpoint_write", lambda: checkpoint.save(root, 1, {"step": 1, "trainer": trainer.state_dict()})
        )
        out["checkpoint_gib"] = round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / GIB, 2)
        state = timed("checkpoint_read", lambda: checkpoint.load(path))
        timed("checkpoint_restore", lambda: trainer.load_state_dict(state["trainer"]))
        state = None
        gc.collect()
        tok = load_tokenizer(args.model)
        timed("export", lambda: save_model(trainer.model, tok, Path(tmp) / "export", base_name=args.model))

        def push():
            with saved_weights(trainer.model.state_dict(), parent=tmp) as folder:
                return round(sum(f.stat().st_size for f in Path(folder).iterdir()) / GIB, 2)

        out["weights_folder_gib"] = timed("weight_push_file_write", push)
    out["process_peak_rss_gib"] = round(process_peak_mb("cpu") / 2**10, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="quaero bench real-shape", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-0.6b-shape")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument(
        "--targets", type=int, default=64, help="loss tokens per row (a quarter RL, the rest ECHO)"
    )
    p.add_argument(
        "--span",
        type=int,
        default=None,
        help="the targets lie in the row's last SPAN tokens (default: a quarter of the row)",
    )
    p.add_argument(
        "--cases",
        default="selective",
        help=f"comma-separated, from {', '.join(CASES)}, or joined with '+' ('' for none)",
    )
    p.add_argument(
        "--phases", action="store_true", help="time load, step, checkpoint, export, weights folder"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (CUDA: the allocator's peak, not split)")
    p.add_argument(
        "--phase-steps", type=int, default=2, help="train steps --phases times (the first one apart)"
    )
    p.add_argument("--backend", default="local", choices=("local", "unsloth"),
                   help="the trainer ([backend] backend); unsloth loads the shape through FastLanguageModel")
    p.add_argument("--warmup-seq-len", type=int, default=None,
                   help="the warm-up step's row length (default --seq-len): a short one creates the same "
                        "AdamW state, so a long row at full depth costs one step, not two")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--scratch", default=None, help="folder for checkpoint/export files (default: the temp dir)"
    )
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    bench_output(args.json)  # a path it cannot write is refused before the work, not after
    args.span = args.span or max(args.targets, args.seq_len // 4)
    torch.set_num_threads(args.threads)
    if args.backend == "unsloth":  # unsloth patches transformers on import, so it goes first
        from trainers.registry import trainer_class

        trainer_class("unsloth")
    model, fields = model_folder(args.model, args.layers)
    doc: dict[str, Any] = {
        "model": args.model,
        "layers": fields["num_hidden_layers"],
        "dtype": args.dtype,
        "backend": args.backend,
        "threads": args.threads,
        "date": time.strftime("%Y-%m-%d"),
        "argv": sys.argv[1:],
    }
    if args.phases:
        doc["phases"] = phases(model, fields, args)
        gc.collect()  # its trainer is gone before the cases' load
    if args.cases:
        doc["cases"] = []
        for case in (c.strip() for c in args.cases.split(",") if c.strip()):
            doc["cases"].append(measure_case(case, model, fields, args))
            gc.collect()  # the case's trainer is gone before the next loads
    emit(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
