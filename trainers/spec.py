"""What a trainer is told: the model, the optimizer, the step's options. Nothing about environments.

Each trainer option is written once, here: `option(default, "section.key", about=..., bounds)` names the
config key that sets it and says what it means. quaero/config/ gives that section the key (type, default,
meaning and bounds read from here; see `options`), docs/reference.md lists it (scripts/gen_reference.py),
`quaero check` prints it (quaero/cli.py), and the recipe's spec reads every option back at its key
(`spec_from`, called by quaero/preflight/plan.py `trainer_spec`): adding an option is its field here, the code
that reads it, and a test. Tests and benchmarks build a `TrainerSpec` directly. Plain frozen dataclasses
without torch, so a bad config still fails before torch is imported.
"""
from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Literal

from trainers.policy_losses import Behaviour, PolicyLoss, PPOClip

# passes over one rollout batch (PPO's epochs are 1-10): each a forward and backward of the whole batch, and
# each mini-step's metrics are kept until the batch's event; a billion passes exhausted memory, not the run
MAX_ITERATIONS = 64


def option(default: Any, key: str, *, about: str, **bounds: Any) -> Any:
    """A trainer option: its default, the config key that sets it ("backend.lr" is `[backend] lr`), what it
    means (docs/reference.md's options table) and the bounds the config checks (pydantic's gt, ge, lt, le)."""
    return field(default=default, metadata={"key": key, "about": about, "bounds": bounds})


def reads(key: str, default: Any = MISSING) -> Any:
    """A role's setting that another owner defines (a config section, or an `option` of the trainer's): the
    config key `spec_from` reads it at; no option of its own (`options` skips it)."""
    return field(default=default, metadata={"key": key, "reads": True})


@dataclass(frozen=True)
class Option:
    """One trainer option, as `options` lists it."""

    path: tuple[str, ...]  # where the spec holds it: ("selective", "chunk_size") is spec.selective.chunk_size
    key: str  # where the config holds it: "backend.options.train_logprob_chunk_size"
    type: Any
    default: Any
    about: str
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

    dense_min_density: float = option(
        1.0, "backend.options.train_selective_dense_min_density", gt=0, le=1,
        about="quaero: the suffix shortcut runs only when targets fill at least this fraction of the suffix"
              " they span (below 1.0 it computes logits no loss reads; the CPU crossover measured it slower"
              " there)...")
    suffix_max_bytes: int = option(
        64 * 2**20, "backend.options.train_selective_suffix_max_bytes", ge=0,
        about="...and its logits would take at most this many bytes")
    hidden_max_bytes: int = option(
        128 * 2**20, "backend.options.train_selective_hidden_max_bytes", ge=0,
        about="quaero: above this many bytes of selected `[S, V]` fp32 logits the hidden path runs chunked "
              "(256 rows, recompute in backward; exact): memory one chunk x vocab, time within the eager "
              "path's noise on the CPU crossover")
    chunk_size: int | None = option(
        None, "backend.options.train_logprob_chunk_size", ge=1,
        about="force hidden/chunked log-probs, this many rows of logits at a time (recomputed in backward: "
              "peak memory one chunk x vocab)")
    compile_mode: CompileMode = option(  # noqa: RUF009
        "off", "backend.options.train_compile_selective_ce",
        about="route selected LM-head/CE through `torch.compile` (plain `nn.Linear` head only); `auto` "
              "falls back with a recorded reason, `require` fails closed")
    compile_min_tokens: int = option(
        128, "backend.options.train_compile_selective_ce_min_tokens", ge=1,
        about="below this many selected tokens the eager path runs")

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

    save_on_cpu: bool = option(
        False, "backend.options.train_save_on_cpu",
        about="saved-tensor CPU offload for very long rows (a logged no-op on CPU)")
    save_on_cpu_pin_memory: bool = option(
        False, "backend.options.train_save_on_cpu_pin_memory",
        about="pin the offloaded tensors")
    save_on_cpu_min_numel: int = option(
        1048576, "backend.options.train_save_on_cpu_min_numel", ge=0,
        about="offload only tensors at least this large")
    cpu_mmap_threshold: int = option(
        0, "backend.options.train_cpu_mmap_threshold", ge=0,
        about="on a CPU device with glibc, a fixed malloc mmap threshold (bytes) the trainer sets, so a "
              "freed tensor's pages go back to the system (131072 in envs/toolbench_smollm2.toml: under "
              "glibc's dynamic threshold, 0, an RL step of SmolLM2-135M grew RSS by ~2.7 GiB a microbatch); "
              "it costs page faults: the tiny main job's warm-start step 1.15 s at 131072 vs 1.03 s at 0 "
              "(trainers/memory.py)")
    cpu_malloc_cache: bool = option(
        False, "backend.options.train_cpu_malloc_cache",
        about="on a CPU device with glibc, malloc keeps what a step frees for the next (no mmap, no trim), "
              "as CUDA's caching allocator does: no page faults on the LM head's logits and gradients each "
              "step (the tiny main job's warm-start step 0.92 -> 0.64 s, peak RSS 1.09 -> 1.51 GB; on in "
              "envs/toolbench.toml); off for large models, whose RSS it keeps (trainers/memory.py); not with "
              "train_cpu_mmap_threshold")
    supervised_context_tokens: int = option(
        0, "backend.options.train_supervised_context_tokens", ge=0,
        about="0: exact full context; K > 0 crops rows to K tokens before the first target (an "
              "approximation, logged as such)")


@dataclass(frozen=True)
class TrainerSpec:
    """Everything `Trainer` (trainers/base.py) and its step read."""

    # the model: a name quaero.models.load resolves (the embedded default, a local folder or a hub id)
    model: str = option(
        "tiny-qwen3", "model.name",
        about="`tiny-qwen3` (the embedded default, built offline), a hub id or a local folder")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "float32", "model.dtype",
        about="the trainer's weights (`auto`: the checkpoint's own)")
    # unsloth sizes its kernels with it
    max_seq_len: int = option(
        4096, "model.max_seq_len", ge=64,
        about="the context: no sampler generates past it and no row is longer")
    seed: int = option(
        0, "run.seed",
        about="the train tasks (their order in a Task-API split, else their reset seeds) and the sampler's "
              "seeds derive from it: a rerun repeats the run; a Task-API eval split and the embedded "
              "model's weights are the same for every seed")
    # the optimizer (AdamW, constant lr set per phase by the recipe) and the step
    lr: float = option(
        1e-4, "backend.lr", gt=0, le=1,
        about="the RL steps' learning rate (and the warm start's unless `warmup_sft_lr`); at most 1 (an "
              "AdamW step moves each weight by about lr: 1e308 made every weight -inf in one step)")
    betas: tuple[float, float] = option(
        (0.9, 0.999), "backend.betas",
        about="AdamW betas")
    weight_decay: float = option(
        0.0, "backend.weight_decay", ge=0,
        about="AdamW weight decay")
    max_grad_norm: float | None = option(
        1.0, "backend.max_grad_norm", gt=0,
        about="gradient-norm clip (unset: no clip); a non-finite norm skips the step")
    micro_batch_tokens: int = option(
        8192, "backend.micro_batch_tokens", ge=1,
        about="padded tokens per microbatch (a longer row gets one of its own)")
    lora: bool = option(
        False, "backend.lora",
        about="train a LoRA adapter (peft) instead of every weight")
    lora_r: int = option(
        16, "backend.lora_r", ge=1,
        about="LoRA rank")
    lora_alpha: int = option(
        32, "backend.lora_alpha", ge=1,
        about="LoRA alpha")
    gradient_checkpointing: bool = option(
        False, "backend.gradient_checkpointing",
        about="recompute activations in backward")
    unsloth_fast_inference: bool = option(
        False, "backend.unsloth_fast_inference",
        about="unsloth on CUDA: load unsloth's vLLM engine next to the model")
    # the losses: the importance ratio compares with the sampler's tempered distribution
    temperature: float = option(
        1.0, "sampler.temperature", ge=1e-5,
        about="sampling temperature; an RL step's log-probs use the same one (an SFT step scores at 1); at "
              "least 1e-5 (below it vLLM samples greedily while the loss would score at it)")
    # the policy loss (trainers/policy_losses.py: one class per variant, each with its own knobs, the config's
    # `[loss.policy]`; quaero/preflight/plan.py `trainer_spec` builds it from there)
    policy_loss: PolicyLoss = field(default_factory=PPOClip)
    # what every variant's lp_old is: the sampler's log-probs, or the trainer's own with the sampler-mismatch
    # weight, truncated or masked past sampler_correction_cap
    sampler_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate",
                                "sequence_mask"] = option(
        "none", "loss.sampler_correction",
        about="the sampler mismatch weighted apart, `token_`/`sequence_` x `truncate`/`mask` (TRL's "
              "`vllm_importance_sampling_mode`); the ratio then compares with the trainer's own log-probs "
              "before the step")
    sampler_correction_cap: float = option(
        3.0, "loss.sampler_correction_cap", gt=0, le=1e6,
        about="the weight's cap: truncated to it, or masked to 0 past it")
    # the KL penalty against a frozen reference model (trainers/reference.py, trainers/terms.py `KLTerm`): β
    # (TRL's `beta`; 0: no reference, no KL) and the per-token estimator of KL(π || π_ref)
    beta: float = option(
        0.0, "loss.beta", ge=0,
        about="the KL penalty's coefficient β against a frozen reference (the weights at the first RL step; "
              "the base model with LoRA); 0: no reference model at all (TRL's `beta`)")
    kl_estimator: Literal["k1", "k2", "k3"] = option(
        "k3", "loss.kl_estimator",
        about="the per-token KL estimator: `k1` = lp - lp_ref, `k2` = (lp - lp_ref)^2 / 2, `k3` = "
              "exp(lp_ref - lp) - (lp_ref - lp) - 1 (TRL's, Schulman's); see \"The KL penalty\" below")
    # guided tokens ([guidance] mode: the env's oracle played them) train with LUFFY's policy shaping
    # -f(π) A, f(p) = p / (p + γ), instead of a ratio (they have no sampler log-prob)
    guidance_gamma: float = option(
        0.1, "guidance.gamma", ge=1e-6, le=1e6,
        about="γ of the policy shaping f(π) = π / (π + γ) on guided tokens (LUFFY's 0.1)")
    # optimizer steps per rollout batch (trainers/mini_steps.py, TRL's names): its episodes split into
    # steps_per_generation mini-batches, an optimizer step each, the pass repeated num_iterations times
    steps_per_generation: int = option(
        1, "training.steps_per_generation", ge=1,
        about="optimizer steps per rollout batch: its episodes in this many mini-batches, an optimizer step "
              "each (TRL's name)")
    num_iterations: int = option(
        1, "training.num_iterations", ge=1, le=MAX_ITERATIONS,
        about="passes over each rollout batch's mini-batches (TRL's name; PPO's epochs), at most "
              f"{MAX_ITERATIONS}")
    # how each term averages over the step (trainers/aggregation.py); loss_constant: Dr. GRPO's normaliser
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] = option(
        "token_mean", "loss.aggregation",
        about="the RL term's average: `token_mean` (DAPO), `sequence_mean` (GRPO: per episode, then over "
              "episodes) or `constant` (Dr. GRPO)")
    loss_constant: int = 0  # derived from the config (quaero/preflight/plan.py rl_loss_constant)
    echo: bool = option(
        True, "echo.enabled",
        about="train the ECHO term")
    # λ; a step may be given another (a schedule: `train_step(echo_weight=...)`)
    echo_weight: float = option(
        0.1, "echo.weight", ge=0, le=1e6,
        about="the ECHO term's weight")
    echo_normalization: Literal["token", "sequence"] = option(
        "token", "echo.normalization",
        about="the ECHO term's average: `token` (over the step's ECHO tokens) or `sequence` (per episode "
              "over its observation tokens, then over episodes)")
    # the selective-logit path and its memory controls
    selective_logits: bool = option(
        True, "backend.options.train_selective_suffix_logits",
        about="build a target mask from tokens with RL advantage or positive ECHO weight and compute LM "
              "head + CE only there")
    tree_packing: Literal["auto", "on", "off"] = option(
        "off", "backend.options.train_tree_packing",
        about="exact tree training (trainers/tree.py): a microbatch's rows forwarded once as a token trie "
              "(shared prefixes computed once, gradients through them intact); `auto` packs a microbatch "
              "where the trie's estimated backbone FLOPs (N tokens, N^2 attention pairs) are at most 0.8 of "
              "the padded rows'; a model that cannot take the ancestor mask falls back to the rows, counted "
              "with its reason")
    selective: SelectivePolicy = field(default_factory=SelectivePolicy)
    memory: MemoryPolicy = field(default_factory=MemoryPolicy)
    # data parallelism under torchrun (trainers/distributed.py); "none" is one process
    distributed: Literal["none", "ddp", "fsdp2"] = option(
        "none", "distributed.strategy",
        about="data parallelism under torchrun: `none`, `ddp` or `fsdp2` (docs/scaling.md)")
    # the hook a benchmark compares other LM-head methods through: "package.module:function" with the
    # signature of trainers.selective.selected_logprobs, run on the backbone's hidden states in place of it
    # (resolved once, when the trainer is built; trainers/step.py). "": the selective path itself.
    logprob_fn: str = ""
    # the hook `quaero bench tree` compares microbatch planning through, never set by a config: "trie" costs
    # a microbatch that will run packed on its trie (trainers/batch.py `plan_tree_microbatches`), "padded" on
    # its padded rows, as packing planned before the trie planner
    tree_plan: Literal["trie", "padded"] = "trie"

    def describe_policy_loss(self) -> str:
        """The RL loss in one line (`quaero check`): the variant, its formula with this spec's numbers, and
        what its ratio compares with (trainers/policy_losses.py)."""
        loss = self.policy_loss
        r = "s" if loss.sequence else "r"
        ratio = ("s = exp(mean over the row of lp - lp_old), one per row" if r == "s"
                 else "r = exp(lp - lp_old) per token")
        if self.sampler_correction == "none":
            old = "lp_old = the sampler's log-probs"
        else:
            old = (f"lp_old = the trainer's before the step, x the sampler weight {self.sampler_correction} "
                   f"at cap {self.sampler_correction_cap:g}")
        kl = (f"; + {self.beta:g} x KL {self.kl_estimator} to the frozen reference (its own "
              f"{self.loss_aggregation} over sampled tokens)" if self.beta > 0 else "")
        return f"{loss.name} {loss.describe(r)}; {ratio}, {old}; {self.loss_aggregation}{kl}"

    @property
    def behaviour(self) -> Behaviour:
        """The policy loss's shared settings: lp_old's correction and its cap, the guided tokens' γ."""
        return Behaviour(self.sampler_correction, self.sampler_correction_cap, self.guidance_gamma)


def options(cls: type = TrainerSpec, path: tuple[str, ...] = ()) -> list[Option]:
    """Every option of `cls` and of the policies it holds, in field order."""
    hints = typing.get_type_hints(cls)
    out: list[Option] = []
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            out += options(hints[f.name], (*path, f.name))
        elif "key" in f.metadata and not f.metadata.get("reads"):
            out.append(Option((*path, f.name), f.metadata["key"], hints[f.name], f.default,
                              f.metadata["about"], f.metadata["bounds"]))
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
