"""What a trainer is told: the model, the optimizer, the step's options. Nothing about environments.

The recipe builds a `TrainerSpec` from the app config (quaero/recipe/plan.py: `trainer_spec`); tests and
benchmarks build one directly. Plain frozen dataclasses without torch: the defaults written here are the
config's too (quaero/config.py reads them, one definition each), and a bad config still fails before
torch is imported. tests/unit/quaero/recipe/test_plan.py holds the default config's spec equal to
`TrainerSpec()` (every option reaches the spec).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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

    dense_min_density: float = 1.0
    suffix_max_bytes: int = 64 * 2**20
    hidden_max_bytes: int = 128 * 2**20
    chunk_size: int | None = None
    compile_mode: CompileMode = "off"
    compile_min_tokens: int = 128

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

    save_on_cpu: bool = False
    save_on_cpu_pin_memory: bool = False
    save_on_cpu_min_numel: int = 1048576
    supervised_context_tokens: int = 0


@dataclass(frozen=True)
class TrainerSpec:
    """Everything `Trainer` (trainers/base.py) and its step read."""

    # the model: a name quaero.model resolves (the embedded default, a local folder or a hub id)
    model: str = "tiny-qwen3"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    max_seq_len: int = 4096  # unsloth sizes its kernels with it
    seed: int = 0
    # the optimizer (AdamW, constant lr set per phase by the recipe) and the step
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0  # None: never clip (the norm is still measured)
    micro_batch_tokens: int = 8192
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    gradient_checkpointing: bool = False
    unsloth_fast_inference: bool = False  # unsloth on CUDA: load its vLLM engine next to the model
    # the losses: the importance ratio compares with the sampler's tempered distribution
    temperature: float = 1.0
    clip_eps: float | None = 0.2  # None: no PPO clipping
    # the policy-loss family (trainers/policy_losses.py has each formula): the variant; the clip range
    # [1 - clip_eps_low, 1 + clip_eps_high] (each None: clip_eps; DAPO's clip-higher sets high > low; CISPO
    # caps its weight at 1 + clip_eps_high); one ratio per token or per row (GSPO's; "gspo" is always
    # "sequence"); the sampler-mismatch weight, truncated or masked past sampler_correction_cap; SAPO's
    # gate temperatures for positive and negative advantages
    policy_loss: Literal["ppo_clip", "gspo", "cispo", "sapo"] = "ppo_clip"
    clip_eps_low: float | None = None
    clip_eps_high: float | None = None
    importance_sampling_level: Literal["token", "sequence"] = "token"
    sampler_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate",
                                "sequence_mask"] = "none"
    sampler_correction_cap: float = 3.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    # optimizer steps per rollout batch (trainers/mini_steps.py, TRL's names): its episodes split into
    # steps_per_generation mini-batches, an optimizer step each, the pass repeated num_iterations times
    steps_per_generation: int = 1
    num_iterations: int = 1
    # how each term averages over the step (trainers/aggregation.py); loss_constant: Dr. GRPO's normaliser
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    loss_constant: int = 0
    echo: bool = True
    echo_weight: float = 0.1  # λ; a step may be given another (a schedule: `train_step(echo_weight=...)`)
    echo_normalization: Literal["token", "sequence"] = "token"
    # the selective-logit path and its memory controls
    selective_logits: bool = True
    selective: SelectivePolicy = field(default_factory=SelectivePolicy)
    memory: MemoryPolicy = field(default_factory=MemoryPolicy)
    # data parallelism under torchrun (trainers/distributed.py); "none" is one process
    distributed: Literal["none", "ddp", "fsdp2"] = "none"
    # the hook a benchmark compares other LM-head methods through: "package.module:function" with the
    # signature of trainers.selective.selected_logprobs, run on the backbone's hidden states in place of it
    # (resolved once, when the trainer is built; trainers/step.py). "": the selective path itself.
    logprob_fn: str = ""

    def describe_policy_loss(self) -> str:
        """The RL loss in one line (`quaero check`): the variant, its formula with this spec's numbers, and
        what its ratio compares with (trainers/policy_losses.py)."""
        low, high = self.clip_range
        lo = "-inf" if low is None else f"{1 - low:g}"
        hi = "inf" if high is None else f"{1 + high:g}"
        r = "s" if self.policy_loss == "gspo" or self.importance_sampling_level == "sequence" else "r"
        formula = {"ppo_clip": f"-min({r} A, clip({r}, {lo}, {hi}) A)",
                   "gspo": f"-min(s A, clip(s, {lo}, {hi}) A)",
                   "cispo": f"-sg(min({r}, {hi})) A log pi",
                   "sapo": f"-(4/tau) sigmoid(tau ({r} - 1)) A, tau {self.sapo_temperature_pos:g} (A > 0) / "
                           f"{self.sapo_temperature_neg:g} (A < 0)"}[self.policy_loss]
        ratio = ("s = exp(mean over the row of lp - lp_old), one per row" if r == "s"
                 else "r = exp(lp - lp_old) per token")
        if self.sampler_correction == "none":
            old = "lp_old = the sampler's log-probs"
        else:
            old = (f"lp_old = the trainer's before the step, x the sampler weight {self.sampler_correction} "
                   f"at cap {self.sampler_correction_cap:g}")
        return f"{self.policy_loss} {formula}; {ratio}, {old}; {self.loss_aggregation}"

    @property
    def clip_range(self) -> tuple[float | None, float | None]:
        """(ε_low, ε_high): each its own setting, else `clip_eps` (None: no bound on that side)."""
        low = self.clip_eps if self.clip_eps_low is None else self.clip_eps_low
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        return low, high
