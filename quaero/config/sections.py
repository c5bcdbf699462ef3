"""The sections of a run that no role module owns: [run], [model], [sampler], [backend] and
[backend.options], [echo], [data], [logging], [distributed]. Each takes its trainer options from
trainers/spec.py (`with_trainer_options`). The roles' sections have modules of their own: the loop's
[training] (loop.py), [rollout] (rollout.py), [guidance] (guidance.py), [loss] (loss.py); the envs' envs.py.
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
from quaero.config.base import Located, _Section, with_trainer_options


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
    # the `hf` engine's KV kept across calls (a group's shared prompt prefilled once, the next turn's prompt
    # prefilling only its new tokens; quaero/sampling/kv_reuse.py), at most this many MiB; 0 = off
    hf_kv_cache_mib: int = Field(512, ge=0)
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

    @model_validator(mode="after")
    def _servers_it_can_reach(self) -> SamplerConfig:
        if self.backend != samplers.AUTO and self.mode not in samplers.SAMPLERS[self.backend].modes:
            serving = " or ".join(repr(n) for n in samplers.serving(self.mode))
            raise Located(f"mode={self.mode!r} with backend={self.backend!r}: {self.backend} does not run in "
                          f"{self.mode} mode; set backend = {serving} (or 'auto'), or mode = 'colocated'")
        if self.urls and self.mode != "server":
            raise Located(f"urls={self.urls!r} with mode={self.mode!r}: urls name running vLLM servers; set "
                          "mode = 'server' or remove urls")
        if self.urls and self.servers != 1:
            raise Located(f"servers={self.servers} and urls={self.urls!r} are both set: quaero either starts "
                          "servers (servers) or connects to running ones (urls); remove one")
        for url in self.urls:
            if not re.fullmatch(r"https?://[^/\s]+/?", url):
                raise Located(f"urls: {url!r} is not a server address; write it as \"http://host:port\"")
        return self

    @model_validator(mode="after")
    def _weights_it_can_push(self) -> SamplerConfig:
        """weight_transfer and server_devices, judged from the config alone (quaero/preflight/plan.py judges
        them against this machine's CUDA devices and torchrun's ranks)."""
        wt, devices, urls = self.weight_transfer, self.server_devices, self.urls
        if wt != "file" and self.mode != "server":
            raise Located(f"weight_transfer={wt!r} with mode={self.mode!r}: vLLM's weight-transfer engines "
                          "push to `vllm serve` processes; set mode = 'server', or weight_transfer = 'file'")
        if devices and self.mode != "server":
            raise Located(f"server_devices={devices} with mode={self.mode!r}: they place the servers quaero "
                          "starts; set mode = 'server' or remove server_devices")
        if devices and urls:
            raise Located(f"server_devices={devices} and urls={urls!r} are both set: quaero places only the "
                          "servers it starts; remove server_devices (start the urls servers with "
                          "CUDA_VISIBLE_DEVICES yourself) or urls")
        if len(set(devices)) != len(devices):
            raise Located(f"server_devices={devices} names a device twice: each server gets a device of its "
                          "own; list each once")
        if wt == "nccl" and urls:
            raise Located(f"weight_transfer='nccl' with urls={urls!r}: quaero opens the NCCL group on "
                          "127.0.0.1 with servers it starts on devices of their own; remove urls and set "
                          "servers and server_devices, or use weight_transfer = 'file'")
        if wt == "nccl" and not devices:
            raise Located("weight_transfer='nccl' without server_devices: the servers would share the "
                          "trainer's GPU and NCCL refuses two ranks on one device; set server_devices = [1] "
                          "(one GPU per server, not the trainer's), or use weight_transfer = 'ipc'")
        if wt == "ipc" and devices:
            raise Located(f"weight_transfer='ipc' with server_devices={devices}: CUDA IPC shares the "
                          "trainer's GPU memory, so the servers must run on the trainer's GPU; remove "
                          "server_devices, or use weight_transfer = 'nccl' for servers on GPUs of their own")
        return self


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


