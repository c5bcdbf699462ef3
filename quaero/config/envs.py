"""The env sections: [env] (one env), [[envs]] (a mixture: each named, with a ratio) and their [env.tasks]
task sampler; `shares_of`, a mixture's ratios as shares that cannot overflow.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from quaero import launcher_registry as launchers
from quaero.config.base import Located, _Section
from quaero.task_sampler_registry import TASK_SAMPLERS

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
    # how long one call of the sampler (sample, update, state_dict, load_state_dict; a first draw reads the
    # spec of every candidate when key is not "task") may run before the run fails naming it; a call still
    # running logs a progress line every 30 s (quaero/bounded.py)
    timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False)
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

    @model_validator(mode="after")
    def _servers_it_can_reach(self) -> EnvConfig:
        if self.server_urls and self.starts_env:
            raise Located(f"url/urls is set but launcher={self.launcher!r}; set "
                          f"launcher={launchers.CONNECTING[0]!r} or remove url/urls")
        if self.server_urls and self.entry:
            servers = f"url={self.url!r}" if self.url else f"urls={self.urls!r}"
            raise Located(f"entry={self.entry!r} and {servers} are both set: quaero either starts the env "
                          "(entry) or connects to running servers (url/urls); remove one")
        for url in self.server_urls:  # what the remote launcher accepts (openenv_client/transport.py)
            if not re.fullmatch(r"(wss?|https?)://[^/\s]+(/\S*)?", url):
                raise Located(f"url: {url!r} is not an OpenEnv server address; write it as "
                              "\"ws://host:port\" or \"http://host:port\"")
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
    group_size: int | None = Field(None, ge=1)  # unset: [rollout] group_size
    eval_tasks: int | None = Field(None, ge=0)  # unset: [training] eval_tasks
    oracle: str | None = None  # the warm start's demonstrator (unset: [training] oracle, else the entry's)
    echo_weight: float | None = Field(None, ge=0)  # ECHO's λ on this env's rows (unset: [echo]'s)
    # guided episodes on this env (unset: [guidance] mode)
    guidance: Literal["none", "episode", "prefix"] | None = None
    guidance_traces: str | None = None  # this env's recorded episodes as its guide (unset: [guidance] traces)

    @field_validator("name")
    @classmethod
    def _a_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise ValueError(f"name={name!r}: an env's name is 1-64 letters, digits, _ or - (it names "
                             "metrics and rows)")
        if name == AGGREGATE:
            raise ValueError(f"name={name!r} is reserved for the cross-env aggregate; choose another name")
        return name


