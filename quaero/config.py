"""One typed, validated schema for a quaero TOML config.

Judged here, before anything heavy is imported: unknown keys (with the closest valid key), wrong
types, out-of-range values, and the rules the config alone decides. What depends on the installed
components (a known trainer, its capabilities, CUDA, vLLM) is judged in quaero/recipe/plan.py.
Errors are `ConfigError`s whose message names the file, section, key, value and the fix.
"""
from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from quaero import launcher_registry as launchers
from quaero import sampler_registry as samplers
from quaero.chat import registry as chat_registry
from quaero.resolve import split_name
from quaero.task_sampler_registry import TASK_SAMPLERS
from trainers.spec import options

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A config problem, phrased for the user: file, key, value and the fix, on one line."""


class _Section(BaseModel):
    # inf/nan are never meaningful settings (a weight of inf trains nothing but NaNs)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def with_trainer_options(section: str):
    """The section class written below it, plus the trainer options whose key is in `section`: each is
    defined once, by its `option(...)` in trainers/spec.py (type, default, meaning, bounds), and reaches the
    trainer's spec by that key (quaero/recipe/plan.py `trainer_spec`)."""

    def build(cls: type[_Section]) -> type[_Section]:
        fields = {o.name: (o.type, Field(o.default, description=o.about, **o.bounds)) for o in options()
                  if o.section == section}
        return create_model(cls.__name__, __base__=cls, __module__=cls.__module__, __doc__=cls.__doc__,
                            **fields)

    return build


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
    # what `quaero check` chose and why (set by quaero/recipe/plan.py once the tokenizer is read)
    _chosen: str | None = PrivateAttr(default=None)

    @field_validator("renderer")
    @classmethod
    def _known_renderer(cls, renderer: str) -> str:
        if renderer not in chat_registry.NAMES:
            raise ValueError(f"renderer={renderer!r} is not a renderer quaero knows: "
                             f"{', '.join(map(repr, chat_registry.NAMES))}")
        return renderer

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


MAX_TASK_WEIGHT = 1e6  # the largest [env.tasks] epsilon or pool weight: a draw's weights stay finite


class TaskSamplerConfig(_Section):
    """`[env.tasks]` (or `[envs.tasks]`): which train tasks an env's groups play
    (quaero/rollout/task_samplers.py)."""

    # "sequential" (the run seed's order of the split: what quaero always did), "uniform", "curriculum"
    # (OpenEnv RFC 013: expected learning signal per unit of cost), "difficulty_pools" (prime-rl's), or a
    # sampler of your own, "package.module:Class" (its sample/update/state_dict/load_state_dict)
    sampler: str = "sequential"  # quaero/task_sampler_registry.py
    # what outcomes are remembered by: "task" (each task), or the RFC 013 keys of the task's spec (its Task
    # API's get_task): "group" (e.g. toolbench's template) or "difficulty"; pooled keys suit splits whose
    # tasks rarely repeat
    key: Literal["task", "group", "difficulty"] = "task"
    # curriculum: the cost a task's weight is divided by: generated tokens or episodes
    cost: Literal["tokens", "episodes"] = "tokens"
    gamma: float = Field(0.9, gt=0, le=1)  # discount of the outcome memory (RFC 013's γ)
    # curriculum: the weight every task keeps (RFC 013's ε); bounded so a weight, divided by a cost as small
    # as 1e-9 and summed over the candidates, stays a finite float
    epsilon: float = Field(0.05, ge=0, le=MAX_TASK_WEIGHT, allow_inf_nan=False)
    # how many tasks a learning sampler weighs per draw (drawn uniformly; the whole split when it holds fewer)
    candidates: int = Field(256, ge=1)
    # difficulty_pools: a key's latest group success rate puts it in a pool (prime-rl's defaults)
    hard_max: float = Field(0.25, ge=0, le=1)
    easy_min: float = Field(0.75, ge=0, le=1)
    hard_weight: float = Field(0.2, ge=0, le=MAX_TASK_WEIGHT, allow_inf_nan=False)
    normal_weight: float = Field(1.0, ge=0, le=MAX_TASK_WEIGHT, allow_inf_nan=False)
    easy_weight: float = Field(0.2, ge=0, le=MAX_TASK_WEIGHT, allow_inf_nan=False)
    unseen_weight: float = Field(1.0, ge=0, le=MAX_TASK_WEIGHT, allow_inf_nan=False)

    @model_validator(mode="after")
    def _pools_draw(self) -> TaskSamplerConfig:
        if self.sampler != "difficulty_pools":
            return self
        if self.hard_max >= self.easy_min:
            raise ValueError(f"hard_max={self.hard_max} >= easy_min={self.easy_min}: the hard and easy pools "
                             "overlap (a rate in both is only ever hard); set hard_max below easy_min")
        if not any((self.hard_weight, self.normal_weight, self.easy_weight, self.unseen_weight)):
            raise ValueError("hard_weight, normal_weight, easy_weight and unseen_weight are all 0: no task "
                             "has a weight to be drawn by; give at least one pool a weight > 0")
        return self

    @field_validator("sampler")
    @classmethod
    def _known(cls, sampler: str) -> str:
        if sampler not in TASK_SAMPLERS and not re.fullmatch(r"[\w.]+:[\w.]+", sampler):
            raise ValueError(f"sampler={sampler!r} is not one of {', '.join(TASK_SAMPLERS)}; or name a class "
                             "of your own as \"package.module:Class\"")
        return sampler

    @property
    def learns(self) -> bool:
        """Whether its draws depend on outcomes (a user's sampler may: assumed so)."""
        kind = TASK_SAMPLERS.get(self.sampler)
        return kind.learns if kind else True


class EnvConfig(_Section):
    # Exactly one of entry ("package.module:Class", an OpenEnv Environment/MCPEnvironment or factory),
    # url ("ws://host:port" or "http://host:port" of a running OpenEnv server) and urls (several
    # servers of one env; sessions spread over them).
    entry: str | None = None
    url: str | None = None
    urls: list[str] = Field(default_factory=list)
    # keyword arguments for the entry (class or factory), for envs quaero starts (inprocess, local-server)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    launcher: Literal[tuple(launchers.LAUNCHERS)] = launchers.DEFAULT  # quaero/launcher_registry.py
    host: str = "127.0.0.1"
    train_split: str = "train"
    eval_split: str = "eval"
    reset_kwargs: dict[str, Any] = Field(default_factory=dict)
    system_prompt: str | None = None
    # "package.module:function(observation_dict) -> str", for plain (non-MCP) environments.
    formatter: str | None = None
    # "package.module:ActionClass": the Action of a plain env that does not declare one (its step takes the
    # base Action and no server app of its package names one); used only when the env itself says nothing.
    action: str | None = None
    # The reward of a malformed reply (the turn quaero answers with a corrective message). 0.0 is neutral for
    # envs whose rewards are >= 0; an env with penalties sets it at or below its own (e.g. -1 for an illegal
    # move) so invalid output never outscores legal play.
    malformed_reward: float = 0.0
    # MCP envs: the corrective message when the model's reply calls no tool (default: names the env's tools).
    no_tool_call_message: str | None = None
    max_turns: int = Field(8, ge=1)
    # an env message longer than this is cut, with a marker saying how much (unset: half of [model]
    # max_seq_len)
    max_observation_tokens: int | None = Field(None, ge=64)
    step_timeout_s: float = Field(30.0, gt=0)
    reset_timeout_s: float = Field(30.0, gt=0)
    max_retries: int = Field(2, ge=0)
    retry_backoff_s: float = Field(0.2, ge=0)
    server_start_timeout_s: float = Field(60.0, gt=0)
    # A session lost mid-episode cannot resume: "replay" reopens one and replays the episode's actions
    # (checked against the recorded observations; for deterministic envs), "drop" drops the episode.
    on_session_loss: Literal["replay", "drop"] = "replay"
    tasks: TaskSamplerConfig = Field(default_factory=TaskSamplerConfig)

    @model_validator(mode="before")
    @classmethod
    def _default_launcher(cls, data: Any) -> Any:
        # a url alone means a remote server: [env] url = "ws://..." is enough
        if isinstance(data, dict) and (data.get("url") or data.get("urls")) and "launcher" not in data:
            data = {**data, "launcher": launchers.CONNECTING[0]}
        return data

    @model_validator(mode="after")
    def _one_source(self) -> EnvConfig:
        if not self.starts_env and not self.url and not self.urls:
            raise ValueError(f"launcher={self.launcher!r} needs url = \"ws://HOST:PORT\" (or urls = [...] "
                             "for several)")
        if self.url and self.urls:
            raise ValueError("set url (one server) or urls (several), not both: put every server in urls")
        if self.starts_env and not self.entry:
            raise ValueError(f"launcher={self.launcher!r} needs entry = \"package.module:Class\"")
        if not self.starts_env and self.kwargs:
            raise ValueError("kwargs construct envs quaero starts; a remote server was started with its own "
                             "arguments: remove kwargs, or start that server with them")
        if not self.starts_env and self.action:
            raise ValueError("action names the Action of an env quaero starts; a remote server accepts the "
                             "Action its app was built with (read from its /schema): remove action")
        return self

    @property
    def starts_env(self) -> bool:
        """quaero starts the env from `entry` (its launcher does); else it connects to `url`/`urls`."""
        return launchers.LAUNCHERS[self.launcher].starts_env

    @property
    def server_urls(self) -> list[str]:
        """The remote servers ([env] url or urls)."""
        return list(self.urls) or ([self.url] if self.url else [])


AGGREGATE = "all"  # the name of the cross-env aggregate: no env may take it
SINGLE = "env"  # the name of a one-env run's env ([env])


def shares_of(ratios: dict[str, float]) -> dict[str, float]:
    """Each env's share, fractions summing to 1: the ratios (finite, > 0) scaled by the largest first, so
    their sum cannot overflow (1e308:1e308:1 is 0.5/0.5/~0, not 0/0/0). `quaero check` prints these and
    quaero/rollout/mixture.py's `Mixture` draws by them: the one owner of the shares."""
    top = max(ratios.values())
    scaled = {name: r / top for name, r in ratios.items()}  # each in (0, 1]: the sum is at most len(ratios)
    total = sum(scaled.values())
    return {name: r / total for name, r in scaled.items()}


class MixtureEnv(EnvConfig):
    """One env of a mixture (`[[envs]]`): everything `[env]` has, its name and ratio, and the settings a
    mixture sets per env (unset: the run's)."""

    name: str
    # relative: a step's groups are shared out in proportion to the ratios (mixture.py shares_of)
    ratio: float = Field(1.0, gt=0, allow_inf_nan=False)
    group_size: int | None = Field(None, ge=1)  # unset: [training] group_size
    eval_tasks: int | None = Field(None, ge=0)  # unset: [training] eval_tasks
    oracle: str | None = None  # the warm start's demonstrator (unset: [training] oracle, else the entry's)
    echo_weight: float | None = Field(None, ge=0)  # ECHO's λ on this env's rows (unset: [echo]'s)
    guidance: Literal["none", "episode"] | None = None  # guided episodes on this env (unset: [training]'s)

    @field_validator("name")
    @classmethod
    def _a_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise ValueError(f"name={name!r}: an env's name is 1-64 letters, digits, _ or - (it names "
                             "metrics and rows)")
        if name == AGGREGATE:
            raise ValueError(f"name={name!r} is reserved for the cross-env aggregate; choose another name")
        return name


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
    urls: list[str] = []
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
    server_devices: list[Annotated[int, Field(ge=0)]] = []


@with_trainer_options("backend.options")
class BackendOptions(_Section):
    """retrain's option names and meanings, kept for compatibility, plus quaero's documented thresholds
    (trainers/spec.py SelectivePolicy, MemoryPolicy)."""


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
    rl_weight: float | None = Field(None, ge=0)
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


@with_trainer_options("training")
class TrainingConfig(_Section):
    """With the trainer's `clip_eps` (PPO's; unset: no clipping) and `loss_aggregation` (the RL term's
    average, trainers/aggregation.py: "token_mean" (DAPO), "sequence_mean" (GRPO: per episode, then over
    episodes), "constant" (Dr. GRPO: / tasks_per_step x group_size x max_turns x max_tokens))."""

    # small first-run defaults: `quaero check` prints the work they mean (episodes x turns x max_tokens)
    steps: int = Field(5, ge=0)
    tasks_per_step: int = Field(4, ge=1)
    group_size: int = Field(4, ge=1)
    # advantages (quaero/rollout/advantages.py): the baseline, "grpo" (the group's mean, today's) or "rloo"
    # (the mean of the others); scale_rewards: divide by the group's reward std ("group", GRPO), the step's
    # ("batch") or not at all ("none", today's); negative-sample reinforcement: positive_advantage_weight
    # multiplies positive advantages (W-REINFORCE: 0.1; 0: negatives only), all_fail_advantage is every
    # member's advantage in a group with no success and no spread (e.g. -1.0; 0: untrained, today's)
    advantage: Literal["grpo", "rloo"] = "grpo"
    scale_rewards: Literal["none", "group", "batch"] = "none"
    positive_advantage_weight: float = Field(1.0, ge=0)
    all_fail_advantage: float = Field(0.0, le=0)
    warmup_sft_steps: int = Field(0, ge=0)
    # the warm start's demonstrator, "package.module:function" (oracle_policy(info) -> policy); unset =
    # `oracle_policy` in the [env] entry's module. Required for a warm start against url/urls servers.
    oracle: str | None = None
    # learning rate of the warm-start SFT steps; unset = [backend] lr (which the RL steps always use)
    warmup_sft_lr: float | None = Field(None, gt=0)
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
    # guided_members to 0 at RL step guidance_until_step (unset: never, a warning at check). "none": today's
    guidance: Literal["none", "episode"] = "none"
    guided_members: int = Field(1, ge=1)
    guidance_until_step: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _a_policy_loss_that_runs(self) -> TrainingConfig:
        low = self.clip_eps if self.clip_eps_low is None else self.clip_eps_low
        if low is not None and low >= 1.0 and self.policy_loss in ("ppo_clip", "gspo"):
            raise ValueError(f"clip_eps_low={low:g}: the clip range's lower end 1 - {low:g} is <= 0, below "
                             "every ratio (the range inverts); use a value below 1 (DAPO: 0.2)")
        if self.sampler_correction != "none" and self.sampler_correction_cap < 1.0:
            raise ValueError(f"sampler_correction_cap={self.sampler_correction_cap:g}: below 1, the "
                             f"{self.sampler_correction!r} weight of every on-policy token (1) would be cut; "
                             "use a cap >= 1 (TRL's default: 3)")
        if self.guidance != "none" and self.guided_members > self.group_size:
            raise ValueError(f"guided_members={self.guided_members} > group_size={self.group_size}: a group "
                             "has only group_size members to guide; use guided_members <= group_size")
        if self.policy_loss == "gspo" and "importance_sampling_level" in self.model_fields_set \
                and self.importance_sampling_level == "token":
            raise ValueError("policy_loss='gspo' with importance_sampling_level='token': GSPO is the "
                             "sequence ratio; drop the level, or use policy_loss='ppo_clip' (a token ratio)")
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


class QuaeroConfig(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig | None = None  # one env ...
    # ... or a mixture: [[envs]], each named, with a ratio
    envs: list[MixtureEnv] = Field(default_factory=list)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    echo: EchoConfig = Field(default_factory=EchoConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    @model_validator(mode="after")
    def _one_env_or_a_mixture(self) -> QuaeroConfig:
        if (self.env is None) == (not self.envs):
            raise ValueError("set [env] (one env) or [[envs]] (a mixture, each with name and ratio), not both"
                             if self.env is not None else "no env: add an [env] section (or [[envs]] for a "
                                                          "mixture)")
        seen: set[str] = set()
        for e in self.envs:
            if e.name in seen:
                raise ValueError(f"name={e.name!r} is used by two [[envs]]: give each env a name of its own")
            seen.add(e.name)
        return self

    @property
    def is_mixture(self) -> bool:
        return bool(self.envs)

    def views(self) -> dict[str, QuaeroConfig]:
        """Each env's own config, as a one-env run would read it: `[env]` its settings, its per-env settings
        in [training] and [echo]. A one-env run's is the config itself, under the name "env"."""
        if not self.envs:
            return {SINGLE: self}
        out = {}
        for e in self.envs:
            env = EnvConfig(**e.model_dump(exclude={"name", "ratio", "group_size", "eval_tasks", "oracle",
                                                    "echo_weight", "guidance"}, exclude_unset=True))
            training = self.training.model_copy(update={k: v for k, v in (
                ("group_size", e.group_size), ("eval_tasks", e.eval_tasks), ("oracle", e.oracle),
                ("guidance", e.guidance)) if v is not None})
            echo = self.echo if e.echo_weight is None else self.echo.model_copy(
                update={"weight": e.echo_weight, "rl_weight": e.echo_weight})
            out[e.name] = self.model_copy(update={"env": env, "envs": [], "training": training, "echo": echo})
        return out

    def ratios(self) -> dict[str, float]:
        """Each env's share of a step's groups, as fractions summing to 1."""
        if not self.envs:
            return {SINGLE: 1.0}
        return shares_of({e.name: e.ratio for e in self.envs})

    @property
    def run_dir(self) -> Path:
        # "~/runs" is the home's, as check judges it
        return Path(self.run.output_dir).expanduser() / self.run.name

    @property
    def observation_token_limit(self) -> int:
        """Tokens one env message may hold: `[env] max_observation_tokens`, else half the context."""
        env = self.env or self.envs[0]
        return env.max_observation_tokens or self.model.max_seq_len // 2

    def lr_for(self, *, sft: bool) -> float:
        """The learning rate of a warm-start (sft) or RL step."""
        return (self.training.warmup_sft_lr or self.backend.lr) if sft else self.backend.lr


# Keys that change when and what a run logs or keeps, not what any of its steps trains
UNTRAINED_KEYS = ("training.steps", "training.checkpoint_every", "training.keep_checkpoints",
                  "training.eval_every", "training.eval_tasks", "logging.", "run.output_dir")


def changed_keys(old: dict, new: dict, prefix: str = "") -> dict[str, list]:
    """The dotted keys whose values differ between two `model_dump(mode="json")` configs: {key: [old, new]}
    (a key one of them lacks is None there)."""
    out: dict[str, list] = {}
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out |= changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            out[f"{prefix}{key}"] = [a, b]
    return out


def _closest(key: str, model: type[BaseModel]) -> str:
    match = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else f"; valid keys: {', '.join(model.model_fields)}"


def _section_model(loc: tuple) -> type[BaseModel]:
    model: type[BaseModel] = QuaeroConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            break
    return model


def _lookup(data: dict, loc: tuple) -> Any:
    node: Any = data
    for part in loc:
        if (
            isinstance(node, dict)
            and part in node
            or isinstance(node, list)
            and isinstance(part, int)
            and 0 <= part < len(node)
        ):
            node = node[part]
        else:
            return None
    return node


def _format_error(source: str, data: dict, err: dict) -> str:
    if err["loc"][:1] == ("envs",) and len(err["loc"]) > 1 and isinstance(err["loc"][1], int):  # which env
        env = _lookup(data, ("envs",))
        env = env[err["loc"][1]] if isinstance(env, list) and len(env) > err["loc"][1] else {}
        name = env.get("name") if isinstance(env, dict) else None
        source = f"{source} [[envs]] #{err['loc'][1] + 1}" + (f" name={name!r}" if name else "")
    loc = tuple(p for p in err["loc"] if not isinstance(p, int))
    section = ".".join(str(p) for p in loc[:-1]) or "(top level)"
    key = str(loc[-1]) if loc else "?"
    value = _lookup(data, tuple(err["loc"]))
    where = f"{source} [{section}] {key}"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key{_closest(key, _section_model(loc[:-1]))}"
    if err["type"] == "missing":
        return f"{where}: required section/key is missing"
    msg = err["msg"]
    if err["type"] == "value_error":
        msg = msg.removeprefix("Value error, ")
        return f"{source} [{'.'.join(str(p) for p in loc) or 'config'}]: {msg}"
    return f"{where}={_brief(value)}: {msg}"


def _brief(value: Any, limit: int = 200) -> str:
    """`repr(value)`, cut to `limit` characters: an error line stays one readable line whatever was pasted
    in."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse_override(text: str) -> tuple[list[str], Any]:
    """`section.key=value` -> (["section", "key"], parsed value); the value is read as TOML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set training.steps=3")
    path, raw = text.split("=", 1)
    if not path.strip() or any(not part.strip() for part in path.split(".")):
        raise ConfigError(f"--set {text!r}: the key is empty; expected section.key=value, e.g. --set "
                          "training.steps=3")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word is a string: --set run.name=smoke
    except RecursionError:
        raise ConfigError(f"--set {path.strip()}=...: the value nests too deeply to read; a setting nests a "
                          "few levels at most") from None
    return path.strip().split("."), value


def load_config(path: str | Path, overrides: list[str] = ()) -> QuaeroConfig:
    """Read, override and validate a config. Raises ConfigError with a one-line, user-facing message."""
    path = Path(path)
    source = str(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{source}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a folder; pass a TOML file, e.g. envs/toolbench.toml") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source}: not UTF-8 text (byte {e.start}); save the config as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nests arrays or tables too deeply to read; a config nests a few levels "
                          "at most") from None
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            if isinstance(node, list):  # [[envs]]: --set envs.NAME.key=value picks the env named NAME
                named = [e for e in node if isinstance(e, dict) and e.get("name") == k]
                if not named:
                    raise ConfigError(f"--set {text!r}: no [[envs]] entry is named {k!r}; write "
                                      "envs.NAME.key=value with one of the mixture's names")
                node = named[0]
                continue
            node = node.setdefault(k, {})
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"--set {text!r}: {k!r} is not a section")
        if isinstance(node, list):
            raise ConfigError(f"--set {text!r}: [[envs]] holds several envs; write envs.NAME.key=value")
        node[keys[-1]] = value
    try:
        cfg = QuaeroConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(source, data, e.errors()[0])) from None
    except RecursionError:
        raise ConfigError(f"{source}: a value nests too deeply to check; a config nests a few levels at "
                          "most") from None
    check_rules(cfg, source)
    return cfg


def _check_weight_transfer(sm: SamplerConfig, source: str) -> None:
    """[sampler] weight_transfer and server_devices, judged from the config alone (quaero/recipe/plan.py
    judges them against this machine's CUDA devices and torchrun's ranks)."""
    wt = sm.weight_transfer
    if wt != "file" and sm.mode != "server":
        raise ConfigError(f"{source} [sampler] weight_transfer={wt!r} with mode={sm.mode!r}: vLLM's "
                          "weight-transfer engines push to `vllm serve` processes; set mode = 'server', or "
                          "weight_transfer = 'file'")
    if sm.server_devices and sm.mode != "server":
        raise ConfigError(f"{source} [sampler] server_devices={sm.server_devices} with mode={sm.mode!r}: "
                          "they place the servers quaero starts; set mode = 'server' or remove "
                          "server_devices")
    if sm.server_devices and sm.urls:
        raise ConfigError(f"{source} [sampler] server_devices={sm.server_devices} and urls={sm.urls!r} are "
                          "both set: quaero places only the servers it starts; remove server_devices (start "
                          "the urls servers with CUDA_VISIBLE_DEVICES yourself) or urls")
    if len(set(sm.server_devices)) != len(sm.server_devices):
        raise ConfigError(f"{source} [sampler] server_devices={sm.server_devices} names a device twice: each "
                          "server gets a device of its own; list each once")
    if wt == "nccl" and sm.urls:
        raise ConfigError(f"{source} [sampler] weight_transfer='nccl' with urls={sm.urls!r}: quaero opens "
                          "the NCCL group on 127.0.0.1 with servers it starts on devices of their own; "
                          "remove urls and set servers and server_devices, or use weight_transfer = 'file'")
    if wt == "nccl" and not sm.server_devices:
        raise ConfigError(f"{source} [sampler] weight_transfer='nccl' without server_devices: the servers "
                          "would share the trainer's GPU and NCCL refuses two ranks on one device; set "
                          "server_devices = [1] (one GPU per server, not the trainer's), or use "
                          "weight_transfer = 'ipc'")
    if wt == "ipc" and sm.server_devices:
        raise ConfigError(f"{source} [sampler] weight_transfer='ipc' with "
                          f"server_devices={sm.server_devices}: CUDA "
                          "IPC shares the trainer's GPU memory, so the servers must run on the trainer's "
                          "GPU; remove server_devices, or use weight_transfer = 'nccl' for servers on GPUs "
                          "of their own")


def check_rules(cfg: QuaeroConfig, source: str = "config") -> None:
    """Rules judged from the config alone (quaero/recipe/plan.py judges it against the installed components);
    a mixture's, for each env's view (its name in the message)."""
    if not cfg.envs:
        return _check_one(cfg, source)
    if cfg.data.traces:
        raise ConfigError(f"{source} [data] traces={cfg.data.traces!r} with [[envs]]: recorded episodes name "
                          "no env of the mixture; use traces with a one-env [env] config, or remove traces")
    for name, view in cfg.views().items():
        _check_one(view, f"{source} [[envs]] name={name!r}:")


def _check_one(cfg: QuaeroConfig, source: str) -> None:
    if cfg.env.server_urls and cfg.env.starts_env:
        raise ConfigError(f"{source} [env] url/urls is set but launcher={cfg.env.launcher!r}; "
                          f"set launcher={launchers.CONNECTING[0]!r} or remove url/urls")
    if cfg.env.server_urls and cfg.env.entry:
        servers = f"url={cfg.env.url!r}" if cfg.env.url else f"urls={cfg.env.urls!r}"
        raise ConfigError(f"{source} [env] entry={cfg.env.entry!r} and {servers} are both set: quaero either "
                          "starts the env (entry) or connects to running servers (url/urls); remove one")
    t = cfg.training
    if cfg.data.traces and not t.warmup_sft_steps:
        raise ConfigError(f"{source} [data] traces={cfg.data.traces!r} with [training] warmup_sft_steps=0: "
                          "recorded episodes train as warm-start steps; set warmup_sft_steps >= 1 (each "
                          "takes tasks_per_step rows) or remove traces")
    if t.warmup_sft_steps and not (t.oracle or cfg.env.entry or cfg.data.traces):
        raise ConfigError(f"{source} [training] warmup_sft_steps={t.warmup_sft_steps} with a remote env: "
                          "quaero finds oracle_policy next to [env] entry, and there is none; set [training] "
                          "oracle = \"package.module:oracle_policy\" (importable here), or warmup_sft_steps "
                          "= 0")
    if t.guidance != "none" and not (t.oracle or cfg.env.entry):
        raise ConfigError(f"{source} [training] guidance={t.guidance!r} with a remote env and no oracle: the "
                          "guide is the env's oracle_policy(info), found beside [env] entry, and there is "
                          "none (recorded traces do not guide yet); set [training] oracle = "
                          "\"package.module:oracle_policy\" (importable here), or guidance = 'none'")
    if t.dynamic_sampling and t.max_off_policy_steps:
        raise ConfigError(f"{source} [training] dynamic_sampling=true with max_off_policy_steps="
                          f"{t.max_off_policy_steps}: a step sampled ahead cannot know how many tasks the "
                          "steps before it used; set one of them off")
    if t.guidance != "none" and t.guided_members > t.group_size:  # a mixture env's own group_size
        raise ConfigError(f"{source} [training] guided_members={t.guided_members} > group_size="
                          f"{t.group_size}: a group has only group_size members to guide; use guided_members "
                          "<= group_size")
    if t.oracle is not None:
        split_name(t.oracle, f"{source} [training] oracle", error=ConfigError,
                   example="my_env.oracle:oracle_policy")
    if t.steps and t.group_size < 2:
        raise ConfigError(f"{source} [training] group_size={t.group_size} with steps={t.steps}: a group of "
                          "one episode has advantage 0 (reward minus its own mean), so RL learns nothing; "
                          "use group_size >= 2 (or steps = 0 for a warm start only)")
    if t.steps and cfg.sampler.top_p < 1:
        raise ConfigError(f"{source} [sampler] top_p={cfg.sampler.top_p} with [training] steps={t.steps}: "
                          "the sampler's log-probs are renormalised over the nucleus and the trainer's are "
                          "not, so the importance ratio is biased; use top_p = 1 for RL (top_p < 1 is fine "
                          "for eval)")
    if cfg.distributed.strategy == "fsdp2" and cfg.backend.lora:
        raise ConfigError(f"{source} [distributed] strategy='fsdp2' with [backend] lora=true: sharded LoRA "
                          "checkpoints and exports are not built; use strategy = 'ddp' (the adapter is "
                          "small: replicating it costs little) or lora = false")
    sm = cfg.sampler
    if sm.backend != samplers.AUTO and sm.mode not in samplers.SAMPLERS[sm.backend].modes:
        serving = " or ".join(repr(n) for n in samplers.serving(sm.mode))
        raise ConfigError(f"{source} [sampler] mode={sm.mode!r} with backend={sm.backend!r}: {sm.backend} "
                          f"does not run in {sm.mode} mode; set backend = {serving} (or 'auto'), or mode = "
                          "'colocated'")
    if sm.urls and sm.mode != "server":
        raise ConfigError(f"{source} [sampler] urls={sm.urls!r} with mode={sm.mode!r}: urls name running "
                          "vLLM servers; set mode = 'server' or remove urls")
    if sm.urls and sm.servers != 1:
        raise ConfigError(f"{source} [sampler] servers={sm.servers} and urls={sm.urls!r} are both set: "
                          "quaero either starts servers (servers) or connects to running ones (urls); remove "
                          "one")
    _check_weight_transfer(sm, source)
    # what the remote launcher accepts (quaero/openenv_client/transport.py endpoints)
    for url in cfg.env.server_urls:
        if not re.fullmatch(r"(wss?|https?)://[^/\s]+(/\S*)?", url):
            raise ConfigError(f"{source} [env] url: {url!r} is not an OpenEnv server address; write it as "
                              "\"ws://host:port\" or \"http://host:port\"")
    for url in sm.urls:
        if not re.fullmatch(r"https?://[^/\s]+/?", url):
            raise ConfigError(f"{source} [sampler] urls: {url!r} is not a server address; write it as "
                              "\"http://host:port\"")
    # a turn starts only when its prompt leaves room for max_tokens (quaero/rollout/driver.py)
    ctx = cfg.model.max_seq_len
    if cfg.sampler.max_tokens >= ctx:
        raise ConfigError(f"{source} [sampler] max_tokens={cfg.sampler.max_tokens} >= [model] "
                          f"max_seq_len={ctx}: "
                          "no room is left for a prompt; set max_tokens well below max_seq_len")
    if cfg.env.max_observation_tokens is not None and cfg.env.max_observation_tokens >= ctx:
        raise ConfigError(f"{source} [env] max_observation_tokens={cfg.env.max_observation_tokens} >= "
                          f"[model] max_seq_len={ctx}: one observation would fill the context; set it well "
                          "below max_seq_len or remove it (default: half of max_seq_len)")
