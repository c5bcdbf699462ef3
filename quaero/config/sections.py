"""The sections of a run: [run], [model], [sampler], [backend] and [backend.options], [echo], [training],
[data], [logging], [distributed]. Each takes its trainer options from trainers/spec.py
(`with_trainer_options`); the env sections are quaero/config/envs.py.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from quaero import sampler_registry as samplers
from quaero.chat import registry as chat_registry
from quaero.config.advantages import AdvantageOptions, check_estimator
from quaero.config.base import _Section, with_trainer_options


@with_trainer_options("run")
class RunConfig(_Section):
    name: str = "run"
    output_dir: str = "runs"
    device: Literal["auto", "cpu", "cuda"] = "auto"

    @field_validator("name")
    @classmethod
    def _one_folder(cls, name: str) -> str:
        # one folder name under output_dir: a run never writes outside it
        if not re.fullmatch(r"[A-Za-z0-9._+=@-]{1,200}", name) or name in (".", ".."):
            raise ValueError(f"name={name!r} must be one folder name (letters, digits, . _ + = @ -; not '.' "
                             "or '..'): the run folder is output_dir/name")
        return name


@with_trainer_options("model")
class ModelConfig(_Section):
    """With the trainer's `name` ("tiny-qwen3", the embedded default built offline; a hub id or a local
    folder), `dtype` and `max_seq_len`."""

    # "auto" (the renderers==0.1.7 family the model is one of, else "template"), "template" (quaero's renderer
    # over the model's own chat template) or a renderers registry name (quaero/chat/registry.py)
    renderer: str = "auto"
    # the renderer's options: its constructor keywords (Qwen3: enable_thinking, preserve_all_thinking, ...);
    # for "template": tool_format ("auto" | "template" | "prompt") and chat template variables
    renderer_options: dict[str, Any] = Field(default_factory=dict)
    # the option enable_thinking, as a key of its own (older configs); unset: the renderer's default
    enable_thinking: bool | None = None
    # what `quaero check` chose and why (set by quaero/preflight/plan.py once the tokenizer is read)
    _chosen: str | None = PrivateAttr(default=None)
    # a named model not built yet: its size and the first run's build (`quaero check` builds nothing)
    _build: str | None = PrivateAttr(default=None)

    @field_validator("renderer")
    @classmethod
    def _known_renderer(cls, renderer: str) -> str:
        if renderer not in chat_registry.NAMES:
            raise ValueError(f"renderer={renderer!r} is not a renderer quaero knows: "
                             f"{', '.join(map(repr, chat_registry.NAMES))}")
        return renderer

    @field_validator("renderer_options")
    @classmethod
    def _no_render_variable(cls, options: dict[str, Any]) -> dict[str, Any]:
        from quaero.chat.template import RENDER_VARIABLES

        if taken := [k for k in options if k in RENDER_VARIABLES]:
            raise ValueError(f"renderer_options {taken}: set by the renderer on every render (the "
                             "conversation, its tools, the generation prompt: "
                             f"{', '.join(RENDER_VARIABLES)}); remove them")
        return options

    @model_validator(mode="after")
    def _one_thinking_switch(self) -> ModelConfig:
        both = self.renderer_options.get("enable_thinking", self.enable_thinking)
        if self.enable_thinking is not None and both != self.enable_thinking:
            raise ValueError(f"enable_thinking={self.enable_thinking} and renderer_options.enable_thinking="
                             f"{both} disagree; keep one of them")
        return self

    @property
    def options(self) -> dict[str, Any]:
        """The renderer's options: `renderer_options`, with `enable_thinking` when that key is set."""
        extra = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        return {**self.renderer_options, **extra}


@with_trainer_options("sampler")
class SamplerConfig(_Section):
    """With the trainer's `temperature` (the importance ratio compares with the tempered distribution)."""

    backend: Literal[samplers.BACKENDS] = samplers.AUTO  # the engines of quaero/sampler_registry.py, or auto
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(256, ge=1)
    gpu_memory_utilization: float = Field(0.4, gt=0, lt=1)
    enable_prefix_caching: bool = True
    # "colocated": vLLM's engine inside the trainer process; "server": `vllm serve` processes spoken to over
    # HTTP (quaero/sampling/server.py). quaero starts `servers` of them per rank, or connects to `urls`.
    mode: Literal[samplers.MODES] = "colocated"
    servers: int = Field(1, ge=1)
    urls: list[str] = Field(default_factory=list)
    server_start_timeout_s: float = Field(600.0, gt=0)
    # server mode, each request: how long a server may sample before its reply's first byte (one prompt's n
    # completions), and how long a wait goes on after a stop request (Ctrl-C, SIGTERM) before the run stops
    # without that step (quaero/sampling/wire.py)
    request_timeout_s: float = Field(900.0, gt=0)
    stop_grace_s: float = Field(10.0, ge=0)
    # how server mode pushes weights: "file" = a safetensors folder every server reloads (any device, servers
    # on this filesystem); "nccl" / "ipc" = vLLM's weight-transfer engines (CUDA only;
    # quaero/sampling/transfer.py)
    weight_transfer: Literal["file", "nccl", "ipc"] = "file"
    # CUDA device index of each server quaero starts (under torchrun: of every local rank's servers, local
    # rank l taking entries l*servers ..); empty = the servers share the rank's device
    server_devices: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)


@with_trainer_options("backend.options")
class BackendOptions(_Section):
    """retrain's option names and meanings, kept for compatibility, plus quaero's documented thresholds
    (trainers/spec.py SelectivePolicy, MemoryPolicy)."""

    @model_validator(mode="after")
    def _one_cpu_malloc_setting(self) -> BackendOptions:
        if self.train_cpu_malloc_cache and self.train_cpu_mmap_threshold:
            raise ValueError(f"train_cpu_malloc_cache=true with train_cpu_mmap_threshold="
                             f"{self.train_cpu_mmap_threshold}: the cache keeps freed memory, the threshold "
                             "gives it back; set one of them")
        return self


@with_trainer_options("backend")
class BackendConfig(_Section):
    """The trainer (trainers/registry.py) and its own options: the optimizer's, LoRA's, the step's."""

    backend: str = "local"
    options: BackendOptions = Field(default_factory=BackendOptions)


@with_trainer_options("echo")
class EchoConfig(_Section):
    """With the trainer's `enabled`, `weight` (λ, OpenEnv RFC 010's `world_model_coeff`: the ECHO term's
    coefficient, the RL term's being 1) and `normalization` (the ECHO term's average, trainers/aggregation.py:
    "token" over the step's ECHO tokens; "sequence" per episode over its observation tokens, then over
    episodes, the ECHO paper's full_observation_tokens)."""

    # λ of the RL steps (unset: `weight`; the warm start always uses `weight`), which `schedule` then scales
    rl_weight: float | None = Field(None, ge=0, le=1e6)  # as `weight`'s bound
    # λ over the RL steps (the warm start uses `weight`): "constant"; "warmup" = weight * min(1, k / S);
    # "decay" = weight * max(0, 1 - (k - 1) / S); k = the RL step (1, 2, ...), S = schedule_steps (0: all RL
    # steps)
    schedule: Literal["constant", "warmup", "decay"] = "constant"
    schedule_steps: int = Field(0, ge=0)
    # RFC 010's `world_loss_target`: false = "env_only" (the env's own tokens), true = "all" (template
    # scaffolding such as <|im_start|>user\n and <tool_response> wrappers too)
    include_scaffold: bool = False

    @property
    def world_loss_target(self) -> str:
        return "all" if self.include_scaffold else "env_only"

    def weight_at(self, rl_step: int, rl_steps: int) -> float:
        """λ at RL step `rl_step` (1-based) of `rl_steps`."""
        span = self.schedule_steps or max(rl_steps, 1)
        weight = self.weight if self.rl_weight is None else self.rl_weight
        if self.schedule == "warmup":
            return weight * min(1.0, rl_step / span)
        if self.schedule == "decay":
            return weight * max(0.0, 1.0 - (rl_step - 1) / span)
        return weight


# |positive_advantage_weight| and |all_fail_advantage| at most this: a group's advantages are reward
# differences (within [-1, 1] for rewards in [0, 1]); far past them the loss overflows and nothing trains
MAX_ADVANTAGE_SETTING = 100.0


@with_trainer_options("training", AdvantageOptions)
class TrainingConfig(_Section):
    """With the trainer's `loss_aggregation` (the RL term's average, trainers/aggregation.py: "token_mean"
    (DAPO), "sequence_mean" (GRPO: per episode, then over episodes), "constant" (Dr. GRPO: / tasks_per_step x
    group_size x max_turns x max_tokens))."""

    # small first-run defaults: `quaero check` prints the work they mean (episodes x turns x max_tokens)
    steps: int = Field(5, ge=0)
    tasks_per_step: int = Field(4, ge=1)
    group_size: int = Field(4, ge=1)
    warmup_sft_steps: int = Field(0, ge=0)
    # the warm start's demonstrator, "package.module:function" (oracle_policy(info) -> policy); unset =
    # `oracle_policy` in the [env] entry's module. Required for a warm start against url/urls servers.
    oracle: str | None = None
    # learning rate of the warm-start SFT steps; unset = [backend] lr (which the RL steps always use)
    warmup_sft_lr: float | None = Field(None, gt=0, le=1)  # as [backend] lr's bound
    # AdamW's state at the first RL step after a warm start: "continue" keeps the warm start's moments (its
    # momentum keeps moving the weights along the SFT gradient for ~10 RL steps, beta1 0.9); "reset_momentum"
    # zeroes the first moment only (RL's updates ramp up from 0, still scaled by the warm start's second
    # moment); "reset" zeroes both (AdamW's first steps are then sign-like, lr on every weight with a
    # gradient)
    rl_optimizer_start: Literal["continue", "reset_momentum", "reset"] = "continue"
    checkpoint_every: int = Field(5, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    eval_every: int = Field(5, ge=0)
    eval_tasks: int = Field(4, ge=0)
    # pass@k at each evaluation: k > 1 also samples k episodes per eval task at the sampler's temperature
    # (k times the greedy eval's episodes); 1 = off
    eval_pass_k: int = Field(1, ge=1)
    packing: bool = True
    # strict = any exactness mismatch (prefix, bridge) is an error instead of a counted fallback.
    strict: bool = False
    # this many consecutive steps without a trained row (every episode dropped) end the run with exit 1
    max_empty_steps: int = Field(3, ge=1)
    # RL's budget of generated tokens (the action tokens of the kept episodes, summed over RL steps, resumes
    # included): RL ends after the step that reaches it, `steps` its upper bound; unset, `steps` alone
    # decides. Comparisons of task samplers hold it equal (one sampler's groups may cost more tokens than
    # another's)
    rl_token_budget: int | None = Field(None, gt=0)
    # an RL step whose env lost episodes (a server that died, timeouts past the retries; a lost episode is
    # never trained): "continue" with the rest (counted, per env in a mixture's `by_env`), or "stop" the run
    # before that step trains, naming the env (the last checkpoint stays the resume point)
    on_env_loss: Literal["continue", "stop"] = "continue"
    # asynchronous rollouts: the next steps' rollouts are sampled while a step trains, each at most this many
    # policy versions behind the weights it trains (quaero/recipe/ahead.py); 0 = sample each step's rollout
    # right before it trains. >= 1 gives the hf sampler a copy of the model of its own.
    max_off_policy_steps: int = Field(0, ge=0)
    # DAPO-style dynamic sampling: while fewer than tasks_per_step groups have reward spread (a non-zero
    # advantage), sample groups of further tasks, at most dynamic_sampling_max_groups x tasks_per_step groups
    # in all per step (at most 100x: each round is logged, and a stop request ends the rounds); all-equal
    # groups still train ECHO
    dynamic_sampling: bool = False
    dynamic_sampling_max_groups: float = Field(3.0, ge=1.0, le=100.0)
    # guided episodes (quaero/recipe/guidance.py): "episode" = when an RL group's kept episodes all fail, up
    # to guided_members of them are replaced by episodes the env's oracle plays whole on the same task (its
    # tokens trained off-policy with policy shaping, `guidance_gamma`); the members anneal linearly from
    # guided_members to 0 at RL step guidance_until_step (unset: never, a warning at check). "prefix" =
    # those members' first guidance_prefix_turns turns (annealed by the same schedule) are the oracle's, the
    # rest the policy's (on-policy). A guide's call past guide_timeout_s seconds, or one that raises, drops
    # its member (counted, never the run). "none": today's
    guidance: Literal["none", "episode", "prefix"] = "none"
    guided_members: int = Field(1, ge=1)
    guidance_until_step: int | None = Field(None, ge=1)
    guidance_prefix_turns: int = Field(1, ge=1)
    guide_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    # the guide is recorded episodes instead of the oracle: a file of RFC 010 records and/or OpenEnv
    # TrainingTraces (`quaero inspect rows RUN --export rfc010 OUT.jsonl` of an expert's run), each action
    # replayed verbatim where the live prompt's ids equal the ids before it in a recording; a member whose
    # prompt no recording reached (a task not recorded, an env that answered otherwise) is dropped, counted
    # (`guides_unmatched`)
    guidance_traces: str | None = None

    # AdvantageOptions' options, [training] keys
    @field_validator("positive_advantage_weight", "all_fail_advantage", check_fields=False)
    @classmethod
    def _an_advantage_that_trains(cls, value: float, info) -> float:
        # -1e308 passes le=0, yet every step's loss is then inf and its gradient skipped: nothing trains
        if abs(value) > MAX_ADVANTAGE_SETTING:
            raise ValueError(f"{info.field_name}={value:g}: advantages past +-{MAX_ADVANTAGE_SETTING:g} "
                             "make the loss overflow (inf: every step's gradient is skipped and nothing "
                             "trains); use a value within it (a group's advantages are reward differences: "
                             "NSR's all_fail_advantage is -1, W-REINFORCE's positive_advantage_weight 0.1)")
        return value

    @field_validator("advantage", check_fields=False)  # an AdvantageOptions option
    @classmethod
    def _an_estimator(cls, name: str) -> str:
        return check_estimator(name)

    @model_validator(mode="after")
    def _a_correction_that_keeps_on_policy_tokens(self) -> TrainingConfig:
        if self.sampler_correction != "none" and self.sampler_correction_cap < 1.0:
            raise ValueError(f"sampler_correction_cap={self.sampler_correction_cap:g}: below 1, the "
                             f"{self.sampler_correction!r} weight of every on-policy token (1) would be cut; "
                             "use a cap >= 1 (TRL's default: 3)")
        return self

    @model_validator(mode="after")
    def _members_a_group_has(self) -> TrainingConfig:
        # judged again for each env of a mixture, with its own group_size (QuaeroConfig.views)
        if self.guidance != "none" and self.guided_members > self.group_size:
            raise ValueError(f"guided_members={self.guided_members} > group_size={self.group_size}: a group "
                             "has only group_size members to guide; use guided_members <= group_size")
        return self


class DataConfig(_Section):
    # recorded episodes (RFC 010 records and/or OpenEnv TrainingTrace lines, quaero/rollout/traces.py) trained
    # as the warm start's steps (with traces_loss's loss) instead of the oracle's demos; rows rebuilt from
    # their ids, never re-tokenized
    traces: str | None = None
    # the loss those rows train with: "sft" (SFT + ECHO, a warm start from demonstrations) or "rl" (the RL
    # loss off-policy, its importance ratio over the records' own sampler log-probs, + ECHO; records need an
    # `advantage`, or a `reward` and a `group`, and log-probs on their action tokens; the others are refused)
    traces_loss: Literal["sft", "rl"] = "sft"


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    console: Literal["pretty", "plain", "none"] = "pretty"
    progress: bool = True
    # mirrors of train_step / eval scalars: any of "tensorboard", "wandb", "trackio"
    # (quaero/telemetry/sinks.py)
    report_to: list[str] = Field(default_factory=list)
    # trained rows written to runs/NAME/rows/step-N.jsonl for `quaero inspect rows`
    # (quaero/recipe/saved_rows.py); "sample": the first 2 rows of each step
    save_rows: Literal["none", "sample", "all"] = "sample"


@with_trainer_options("distributed")
class DistributedConfig(_Section):
    """`strategy`: data parallelism when launched by torchrun (`quaero train --nproc N`, or torchrun -m
    quaero.cli train; trainers/distributed.py, quaero/recipe/ranks.py): "ddp" replicates the model, "fsdp2"
    shards it (and its checkpoints, through torch.distributed.checkpoint); both give the one-process step on
    the same rows. "none": one process."""


