"""What a trainer is told: the model, the optimizer, the step's options. Nothing about environments.

Each trainer option is written once, here: `option(default, "section.key", bounds)` names the config key
that sets it. quaero/config.py gives that section the key (type, default and bounds read from here; see
`options`), `quaero check` prints it (quaero/cli.py), and the recipe's spec reads every option back at its
key (`spec_from`, called by quaero/recipe/plan.py `trainer_spec`): adding an option is its field here, the
code that reads it, and a test. Tests and benchmarks build a `TrainerSpec` directly. Plain frozen dataclasses
without torch, so a bad config still fails before torch is imported.
"""
from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal


def option(default: Any, key: str, **bounds: Any) -> Any:
    """A trainer option: its default, the config key that sets it ("backend.lr" is `[backend] lr`) and the
    bounds the config checks (pydantic's gt, ge, lt, le)."""
    return field(default=default, metadata={"key": key, "bounds": bounds})


@dataclass(frozen=True)
class Option:
    """One trainer option, as `options` lists it."""

    path: tuple[str, ...]  # where the spec holds it: ("selective", "chunk_size") is spec.selective.chunk_size
    key: str  # where the config holds it: "backend.options.train_logprob_chunk_size"
    type: Any
    default: Any
    bounds: dict[str, Any]

    @property
    def section(self) -> str:
        return self.key.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.key.rpartition(".")[2]

CompileMode = Literal["off", "auto", "require"]


@dataclass(frozen=True)
class SelectivePolicy:
    """How `selected_logprobs` chooses its branch (trainers/selective.py).

    The suffix shortcut runs only when every row's targets fill at least `dense_min_density` of the
    suffix they span AND the fp32 suffix logits take at most `suffix_max_bytes`; `chunk_size` forces
    the selected-hidden path, `chunk_size` rows of logits at a time; `compile_mode` tries the
    `torch.compile`d CE on at least `compile_min_tokens` selected rows ("require" fails closed).

    `hidden_max_bytes`: when the selected-hidden path's fp32 `[S, V]` logits would take more, it runs
    chunked (`chunk_size` rows at a time, 256 when unset) with recompute in backward: the same values,
    memory O(chunk x V) instead of O(S x V). The default sits above every logits block where chunking
    cost time in `quaero bench crossover`, and chunks from S > 220 targets at the default model's
    vocabulary (151,936), where chunking cut the peak at no measured time cost (benchmarks/README.md,
    crossover, with the figures, their date and command).

    `dense_min_density` = 1.0: the suffix computes the LM head over every suffix slot, the hidden
    path over the S targets only, so below full density the suffix does 1/density times the work for
    nothing; `quaero bench crossover` measured it slower at every density below 1 (benchmarks/README.md).
    """

    dense_min_density: float = option(1.0, "backend.options.train_selective_dense_min_density", gt=0, le=1)
    suffix_max_bytes: int = option(64 * 2**20, "backend.options.train_selective_suffix_max_bytes", ge=0)
    hidden_max_bytes: int = option(128 * 2**20, "backend.options.train_selective_hidden_max_bytes", ge=0)
    chunk_size: int | None = option(None, "backend.options.train_logprob_chunk_size", ge=1)
    compile_mode: CompileMode = option("off", "backend.options.train_compile_selective_ce")  # noqa: RUF009
    compile_min_tokens: int = option(128, "backend.options.train_compile_selective_ce_min_tokens", ge=1)

    def __post_init__(self) -> None:
        if self.compile_mode not in ("off", "auto", "require"):
            raise ValueError(f"SelectivePolicy compile_mode={self.compile_mode!r}: use 'off', 'auto' or "
                             "'require'")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"SelectivePolicy chunk_size={self.chunk_size}: must be >= 1, or None to not "
                             "chunk")


@dataclass(frozen=True)
class MemoryPolicy:
    """Memory controls: saved-tensor CPU offload (trainers/memory.py) and the context crop
    (trainers/batch.py).

    `supervised_context_tokens` = K > 0 keeps K tokens before each row's first target: an
    approximation; 0 is exact full-context training.
    """

    save_on_cpu: bool = option(False, "backend.options.train_save_on_cpu")
    save_on_cpu_pin_memory: bool = option(False, "backend.options.train_save_on_cpu_pin_memory")
    save_on_cpu_min_numel: int = option(1048576, "backend.options.train_save_on_cpu_min_numel", ge=0)
    supervised_context_tokens: int = option(0, "backend.options.train_supervised_context_tokens", ge=0)


@dataclass(frozen=True)
class TrainerSpec:
    """Everything `Trainer` (trainers/base.py) and its step read."""

    # the model: a name quaero.model resolves (the embedded default, a local folder or a hub id)
    model: str = option("tiny-qwen3", "model.name")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option("float32", "model.dtype")
    max_seq_len: int = option(4096, "model.max_seq_len", ge=64)  # unsloth sizes its kernels with it
    seed: int = option(0, "run.seed")
    # the optimizer (AdamW, constant lr set per phase by the recipe) and the step
    lr: float = option(1e-4, "backend.lr", gt=0)
    betas: tuple[float, float] = option((0.9, 0.999), "backend.betas")
    weight_decay: float = option(0.0, "backend.weight_decay", ge=0)
    # None: never clip (the norm is still measured)
    max_grad_norm: float | None = option(1.0, "backend.max_grad_norm", gt=0)
    micro_batch_tokens: int = option(8192, "backend.micro_batch_tokens", ge=1)
    lora: bool = option(False, "backend.lora")
    lora_r: int = option(16, "backend.lora_r", ge=1)
    lora_alpha: int = option(32, "backend.lora_alpha", ge=1)
    gradient_checkpointing: bool = option(False, "backend.gradient_checkpointing")
    # unsloth on CUDA: load its vLLM engine next to the model (backend.vllm_engine) for sampling
    unsloth_fast_inference: bool = option(False, "backend.unsloth_fast_inference")
    # the losses: the importance ratio compares with the sampler's tempered distribution
    temperature: float = option(1.0, "sampler.temperature", gt=0)
    clip_eps: float | None = option(0.2, "training.clip_eps", gt=0)  # None: no PPO clipping
    # how each term averages over the step (trainers/aggregation.py); loss_constant: Dr. GRPO's normaliser
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] = option("token_mean",
                                                                                  "training.loss_aggregation")
    loss_constant: int = 0  # derived from the config by the recipe (quaero/recipe/plan.py rl_loss_constant)
    echo: bool = option(True, "echo.enabled")
    # λ; a step may be given another (a schedule: `train_step(echo_weight=...)`)
    echo_weight: float = option(0.1, "echo.weight", ge=0)
    echo_normalization: Literal["token", "sequence"] = option("token", "echo.normalization")
    # the selective-logit path and its memory controls
    selective_logits: bool = option(True, "backend.options.train_selective_suffix_logits")
    selective: SelectivePolicy = field(default_factory=SelectivePolicy)
    memory: MemoryPolicy = field(default_factory=MemoryPolicy)
    # data parallelism under torchrun (trainers/distributed.py); "none" is one process
    distributed: Literal["none", "ddp", "fsdp2"] = option("none", "distributed.strategy")
    # the hook a benchmark compares other LM-head methods through: "package.module:function" with the
    # signature of trainers.selective.selected_logprobs, run on the backbone's hidden states in place of it
    # (resolved once, when the trainer is built; trainers/step.py). "": the selective path itself.
    logprob_fn: str = ""


def options(cls: type = TrainerSpec, path: tuple[str, ...] = ()) -> list[Option]:
    """Every option of `cls` and of the policies it holds, in field order."""
    hints = typing.get_type_hints(cls)
    out: list[Option] = []
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            out += options(hints[f.name], (*path, f.name))
        elif "key" in f.metadata:
            out.append(Option((*path, f.name), f.metadata["key"], hints[f.name], f.default,
                              f.metadata["bounds"]))
    return out


def spec_from(read: Callable[[str], Any], cls: type = TrainerSpec, **given: Any) -> Any:
    """A `cls` (a TrainerSpec) whose every option is `read(key)`, and the fields no key sets from `given`."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            values[f.name] = spec_from(read, hints[f.name])
        elif "key" in f.metadata:
            values[f.name] = read(f.metadata["key"])
    return cls(**values, **given)
