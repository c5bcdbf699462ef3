"""The memory plan as `quaero check` prints it, for a config on a device: the step's shape read from the
config (`step_shape`), tree packing's expected trie of it (`TreeEstimate`), the device's room
(`device_capacity`), the sampler's share of it beside the step (`sampler_share`), and the lines
(`plan_lines`, `memory_lines`). The arithmetic is quaero/preflight/memory_plan.py.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from types import SimpleNamespace

from quaero.models.config import SUPPORTED_MODEL_TYPES
from quaero.preflight.memory_plan import (
    GIB,
    KNOB_VALUES,
    MemoryPlan,
    ModelDims,
    StepShape,
    _bytes,
    fitting_knob,
    plan,
)

# vLLM's CPU engine beside the step: its own copy of the weights, its KV cache (VLLM_CPU_KVCACHE_SPACE GiB,
# quaero's default 1) and the engine's runtime above both. Measured (RSS of an in-process engine, loaded and
# sampling 32 x 48 tokens): 1.0 GiB above weights and KV cache at tiny-qwen3, 1.6 at qwen3-0.6b-shape, the
# larger taken (benchmarks/README.md, "Fourth pass")
VLLM_CPU_RUNTIME = int(1.6 * GIB)
# What a run's process holds on a CPU host before its first step, beside the step's tensors: Python, torch,
# transformers, quaero and the env client imported, the model's files mapped, the trainer built (less its
# weights, which the plan counts). Measured (VmRSS after the trainer is built, less its weights): 0.38 GiB
# without vLLM, 0.47 GiB with vllm-cpu installed, the larger rounded up (`quaero bench soak --stages`).
# Stated, not derived: it is the runtime's, not the model's, so it is one figure for every model.
PROCESS_BASELINE_CPU = int(0.5 * GIB)


@dataclass(frozen=True)
class SamplerShare:
    """What the sampler takes from the step's device, and how it was counted (one phrase)."""

    bytes: int
    how: str


def sampler_share(cfg, device: str, dims: ModelDims, capacity: int | None) -> SamplerShare:
    """The sampler's memory on `device` beside the train step: `hf` shares the trainer's module and keeps
    up to `hf_kv_cache_mib` of KV between calls (quaero/sampling/kv_reuse.py; freed at each weight change,
    and malloc's cache keeps the freed memory for the next fill); vLLM in process, or `vllm serve`
    processes quaero starts on this host or device, holds per
    engine `gpu_memory_utilization` of a CUDA device, or on a CPU its weights, KV cache and runtime."""
    from quaero.sampling import CPU_KV_CACHE_ENV, CPU_KV_CACHE_GIB, resolve_backend

    s = cfg.sampler
    backend = resolve_backend(s.backend, device)
    if backend != "vllm":
        kv = s.hf_kv_cache_mib * 2**20 if backend == "hf" else 0
        return SamplerShare(kv, f"{backend} shares the trainer's weights"
                            + (f"; its KV reuse store, hf_kv_cache_mib {s.hf_kv_cache_mib}" if kv else ""))
    if s.mode == "server" and s.urls:
        return SamplerShare(0, "vLLM servers at [sampler] urls, not counted")
    engines = 1 if s.mode == "colocated" else s.servers
    if device.startswith("cuda") and s.mode == "server" and s.server_devices:  # on this device only
        index = int(device.partition(":")[2] or 0)
        engines = sum(1 for d in s.server_devices[:s.servers] if d == index)
    where = "in process" if s.mode == "colocated" else f"{engines} local `vllm serve`"
    if device.startswith("cuda"):
        share = int(engines * s.gpu_memory_utilization * (capacity or 0))
        return SamplerShare(share, f"vLLM {where}: {engines} x gpu_memory_utilization "
                                   f"{s.gpu_memory_utilization:g} of the device")
    kv = int(float(os.environ.get(CPU_KV_CACHE_ENV) or CPU_KV_CACHE_GIB) * GIB)
    weights = dims.params() * _bytes(cfg.model.dtype, dims)
    each = (f"weights {gib(weights)} + KV cache {gib(kv)} ({CPU_KV_CACHE_ENV}) + runtime "
            f"{gib(VLLM_CPU_RUNTIME)}")
    return SamplerShare(engines * (weights + kv + VLLM_CPU_RUNTIME),
                        f"vLLM {where}: " + (f"{engines} x ({each})" if engines > 1 else each))


@dataclass(frozen=True)
class TreeEstimate:
    """`train_tree_packing`'s expected trie of the plan's microbatch, from the plan's own row figures: the
    rows come from ceil(rows / group) groups (packing orders rows by prefix, trainers/batch.py
    `plan_tree_microbatches`), each group's members share its prompt (the reset observation, the plan's
    first-turn observation bound) and hold the rest of their row alone. Where it packs, the microbatch holds
    as many rows as the trie's cost (trainers/tree.py `packed_cost`: its unique tokens, the rows' gathered
    hidden states, the mask) keeps within `micro_batch_tokens`, as the planner cuts them; else as many as
    the padded rows' tokens do. `pays`: trainers/tree.py `trie_pays` at that shape (what `auto` decides)."""

    mode: str
    rows: int
    row: int
    prompt: int
    group: int
    pays: bool
    padded_rows: int = 0  # rows a microbatch holds on its padded tokens (the plan without packing)

    @property
    def unique(self) -> int:
        groups = -(-self.rows // self.group)
        return groups * self.prompt + self.rows * (self.row - self.prompt)

    @property
    def row_tokens(self) -> int:
        return self.rows * self.row

    @property
    def packs(self) -> bool:
        return self.mode == "on" or (self.mode == "auto" and self.pays)

    def line(self) -> str:
        from trainers.tree import AUTO_MAX_COST

        groups = -(-self.rows // self.group)
        pays = "packs" if self.pays else "keeps the rows"
        ratio = f"{self.unique:,}/{self.row_tokens:,} = {self.unique / self.row_tokens:.2f}"
        held = (f"; planned on the trie's tokens, {self.rows} row(s) to a microbatch where padded rows fit "
                f"{self.padded_rows}" if self.packs and self.rows != self.padded_rows else "")
        return (f"  tree packing {self.mode!r}: expected unique/row tokens {ratio} ({self.rows} row(s) of "
                f"{self.row} from {groups} group(s) of {self.group}, a group sharing its prompt of <= "
                f"{self.prompt} tokens, the first observation's limit); auto {pays} at this shape "
                f"(tree_pays: the trie's FLOPs {'<=' if self.pays else '>'} {AUTO_MAX_COST:g} of the rows')"
                + held + ("" if self.packs else "; activations planned on the rows"))


def tree_estimate(cfg, rows: int, row: int, prompt: int, group: int, fields: dict | None, *, most: int = 0
                  ) -> TreeEstimate | None:
    """The expected trie of a microbatch of rows of `row` tokens where `train_tree_packing` is on or auto
    (None: off): `rows` of them padded; where the trie packs, up to `most` while its cost fits
    `micro_batch_tokens` (trainers/batch.py's planner). `fields`: the model's config fields `trie_pays` and
    `packed_cost` read (none known: their fallbacks)."""
    mode = cfg.backend.options.train_tree_packing
    if mode == "off":
        return None
    from trainers.tree import packed_cost, trie_pays

    config = SimpleNamespace(**(fields or {}))

    def at(n: int) -> TreeEstimate:
        est = TreeEstimate(mode, n, row, prompt, group, pays=False, padded_rows=rows)
        return replace(est, pays=trie_pays(est.unique, est.row_tokens, config, (n, row)))

    best = at(rows)
    for n in range(rows + 1, most + 1):
        est = at(n)
        if not est.packs or packed_cost(est.unique, (n, row), config) > cfg.backend.micro_batch_tokens:
            break
        best = est
    return best


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _activation_knobs(s: StepShape) -> str:
    """The memory knobs a step's activations are planned with, in words."""
    knobs = []
    if s.gradient_checkpointing:
        knobs.append("gradient_checkpointing")
    if s.context_tokens:
        knobs.append(f"context crop {s.context_tokens}")
    if s.save_on_cpu:
        knobs.append("save_on_cpu" + ("" if s.device.startswith("cuda") else " (no-op on cpu)"))
    if s.unique_tokens:
        knobs.append(f"tree packing: backbone over {s.unique_tokens} unique tokens, the rows' hidden states "
                     "and the ancestor mask beside")
    return ", ".join(knobs) or "no knobs"


def _head_words(s: StepShape) -> str:
    """How the LM head runs: full logits, or the selective path (chunked)."""
    if not s.selective:
        return "full logits"
    return f"selective, {min(s.targets, s.chunk_size)}-row chunks" if s.chunk_size else "selective"


def plan_lines(p: MemoryPlan, *, capacity: int | None, capacity_source: str, row_note: str,
               sampler: SamplerShare | None = None, baseline: int = 0) -> list[str]:
    """The plan as `quaero check` prints it: the figures, then one line if it does not fit (the step's peak
    against the device less the sampler's share and, on a CPU host, the process's `baseline`)."""
    sampler = sampler or SamplerShare(0, "")
    beside = (f" + sampler {gib(sampler.bytes)}" if sampler.bytes else "") + (
        f" + process baseline {gib(baseline)}" if baseline else "")
    s, d = p.step, p.dims
    dtype = d.dtype if s.dtype == "auto" else s.dtype
    lines = [
        (
            f"memory plan {d.params() / 1e9:.3f}B params ({'tied' if d.tied else 'untied'} embeddings), "
            f"{dtype}, "
            f"{s.device}; microbatch {s.tokens} tokens, {s.targets} targets {row_note}"
        ),
        (
            f"  weights {gib(p.weights)}, gradients {gib(p.gradients)}, AdamW m+v {gib(p.optimizer)}"
            + (f" (LoRA r={s.lora_r}: {d.lora_params(s.lora_r) / 1e6:.1f}M trainable)" if s.lora else "")
            + (f", KL reference {gib(p.reference_weights)} (a frozen copy)" if p.reference_weights
               else ", KL reference: the base, adapter disabled (no copy)" if s.reference else "")
        ),
        (
            f"  activations {gib(p.activations)} ({_activation_knobs(s)}; exact full context "
            "without "
            f"knobs {gib(p.activations_exact)}"
            + (f"; {gib(p.host_activations)} on host" if p.host_activations else "")
            + ")"
        ),
        (
            f"  LM head {gib(p.lm_head)} ({_head_words(s)}; full logits [{s.tokens}, {d.vocab}] "
            f"{gib(p.lm_head_full)}, selective [{s.targets}, {d.vocab}] {gib(p.lm_head_selective)})"
        ),
        (
            f"  peak {gib(p.peak)}"
            + beside
            + (f" of {gib(capacity)} {capacity_source}" if capacity else "")
            + f" (forward+backward {gib(p.fwd_bwd)}, update: gradients + AdamW temporaries {gib(p.update)})"
        ),
    ]
    if sampler.how:
        lines.insert(-1, f"  sampler {gib(sampler.bytes)} beside the step ({sampler.how})")
    if baseline:  # what a CPU run's RSS should reach: malloc keeps the step's peak for the next step
        lines.append(f"  process {gib(p.peak + sampler.bytes + baseline)} expected RSS: peak + sampler + "
                     f"baseline {gib(baseline)} (Python, torch, transformers, quaero imported, the trainer "
                     "built: measured, not derived)")
    room = capacity - sampler.bytes - baseline if capacity else None
    if room is not None and p.peak > room:
        found = fitting_knob(d, s, room) if room > 0 else None
        fix = (
            f"set {found[0]} = {KNOB_VALUES[found[0]]} (plan {gib(found[1].peak)})"
            if found
            else "no single knob makes it fit: a shorter [model] max_seq_len, a smaller micro_batch_tokens "
            "or a smaller model" + (", or the sampler elsewhere" if sampler.bytes else "")
        )
        lines.append(
            f"memory plan exceeds the device: peak {gib(p.peak)}{beside} > {gib(capacity)} {capacity_source}"
            f"; {fix}"
        )
    return lines


def step_shape(cfg, device: str, fields: dict | None = None
               ) -> tuple[StepShape, str, TreeEstimate | None]:
    """The microbatch a config's longest row makes, how the row was bounded (for the printout), and tree
    packing's expected trie of it (None: `train_tree_packing` off); `fields`: the model's config fields.

    Longest row: min([model] max_seq_len, max_turns x (max_tokens + the observation limit)); rows of it pack
    `micro_batch_tokens // row` to a microbatch (at least one, at most a step's rows); targets per row: the
    sampled tokens, plus the env's when ECHO trains on them. Where packing packs, the microbatch holds the
    rows whose trie fits `micro_batch_tokens` (`TreeEstimate`) and the backbone runs over the trie's unique
    tokens (`StepShape.unique_tokens`)."""
    from trainers.selective import AUTO_CHUNK_ROWS
    from trainers.spec import SelectivePolicy

    s, b, o = cfg.sampler, cfg.backend, cfg.backend.options

    def longest(view) -> tuple[int, int, int, int, int]:
        """(row tokens, targets per row, group size, turns, observation limit) of one env's longest row."""
        turns, obs = view.env.max_turns, view.observation_token_limit
        row = min(view.model.max_seq_len, turns * (s.max_tokens + obs))
        per_row = min(row, turns * s.max_tokens + (turns * obs if view.echo.enabled else 0))
        return row, per_row, view.rollout.group_size, turns, obs

    # a mixture's longest row (one env's view for a one-env config)
    row, per_row, group, turns, obs = max(longest(view) for view in cfg.views().values())
    most = cfg.rollout.tasks_per_step * group
    rows = max(1, min(most, b.micro_batch_tokens // row))
    tree = tree_estimate(cfg, rows, row, min(row, obs), group, fields, most=most)
    if tree and tree.packs:  # the planner costs a packed microbatch on its trie (trainers/batch.py)
        rows = tree.rows
    shape = StepShape(
        tokens=rows * row,
        targets=rows * per_row,
        target_span=rows * per_row,
        dtype=cfg.model.dtype,
        lora=b.lora,
        lora_r=b.lora_r,
        gradient_checkpointing=b.gradient_checkpointing,
        selective=o.train_selective_suffix_logits,
        chunk_size=o.train_logprob_chunk_size,
        hidden_max_bytes=SelectivePolicy().hidden_max_bytes,
        auto_chunk_rows=AUTO_CHUNK_ROWS,
        save_on_cpu=o.train_save_on_cpu,
        context_tokens=o.train_supervised_context_tokens,
        device=device,
        rows=rows,
        reference=cfg.loss.beta > 0,
        unique_tokens=tree.unique if tree and tree.packs else 0,
    )
    note = (
        f"({rows} row(s) of {row}: min(max_seq_len {cfg.model.max_seq_len}, max_turns {turns} x "
        f"(max_tokens {s.max_tokens} + observation limit {obs})))"
    )
    return shape, note, tree


def device_capacity(device: str) -> tuple[int | None, str]:
    """Bytes one step may use: a CUDA device's memory, or the host's available RAM."""
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index or 0
        return torch.cuda.get_device_properties(index).total_memory, f"on {device}"
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "RAM available"
    except OSError:
        pass
    return None, ""


def memory_lines(cfg, device: str) -> list[str]:
    """`quaero check`'s memory plan for `cfg` on `device` (one line when the model's shape is unknown)."""
    from quaero.models.load import config_fields

    fields = config_fields(cfg.model.name)
    if fields is None:
        return [
            (
                f"memory plan none: {cfg.model.name!r} has no config.json here (not a folder, not in the hub "
                "cache); it is read once the model is downloaded"
            )
        ]
    if fields.get("model_type") not in SUPPORTED_MODEL_TYPES:
        return [
            (
                f"memory plan none: model_type {fields.get('model_type')!r} (the plan knows "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        ]
    dims = ModelDims.from_fields(fields)
    step, note, tree = step_shape(cfg, device, fields)
    capacity, source = device_capacity(device)
    lines = plan_lines(plan(dims, step), capacity=capacity, capacity_source=source, row_note=note,
                       sampler=sampler_share(cfg, device, dims, capacity), baseline=process_baseline(device))
    return lines[:1] + ([tree.line()] if tree else []) + lines[1:]


def process_baseline(device: str) -> int:
    """The process's own memory beside the step where the step's memory is the host's (a CPU device); on
    an accelerator the plan is the device's memory, which the host process's runtime does not take."""
    return PROCESS_BASELINE_CPU if device == "cpu" else 0


def expected_rss(cfg, device: str = "cpu") -> dict[str, int] | None:
    """The plan's parts of a CPU run's RSS, in bytes (`peak`, `sampler`, `baseline` and their sum `process`),
    as `quaero check` prints them; None where the model's shape is unknown (`quaero bench soak` reads it)."""
    from quaero.models.load import config_fields

    fields = config_fields(cfg.model.name)
    if fields is None or fields.get("model_type") not in SUPPORTED_MODEL_TYPES:
        return None
    dims = ModelDims.from_fields(fields)
    peak = plan(dims, step_shape(cfg, device, fields)[0]).peak
    sampler = sampler_share(cfg, device, dims, device_capacity(device)[0]).bytes
    baseline = process_baseline(device)
    return {"peak": peak, "sampler": sampler, "baseline": baseline, "process": peak + sampler + baseline}
