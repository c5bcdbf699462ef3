"""`QuaeroConfig`, the whole config: its sections, one env or a mixture, each env's view; and what changed
between two configs (`changed_keys`: a resume under another config says so).
"""
from __future__ import annotations

from pathlib import Path

from pydantic import (
    Field,
    PrivateAttr,
    model_validator,
)

from quaero.config.base import _Section
from quaero.config.envs import SINGLE, EnvConfig, MixtureEnv, shares_of
from quaero.config.guidance import GuidanceConfig
from quaero.config.loop import TrainingConfig
from quaero.config.loss import LossConfig
from quaero.config.rollout import RolloutConfig
from quaero.config.sections import (
    BackendConfig,
    DataConfig,
    DistributedConfig,
    EchoConfig,
    LoggingConfig,
    ModelConfig,
    RunConfig,
    SamplerConfig,
)


class QuaeroConfig(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig | None = None  # one env ...
    # ... or a mixture: [[envs]], each named, with a ratio
    envs: list[MixtureEnv] = Field(default_factory=list)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    echo: EchoConfig = Field(default_factory=EchoConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)  # the loop
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    guidance: GuidanceConfig = Field(default_factory=GuidanceConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    # the old spellings the file used, one line each naming today's (quaero/config/renamed.py)
    _deprecated: list[str] = PrivateAttr(default_factory=list)

    @property
    def deprecations(self) -> list[str]:
        """One line per old key the config was written with, naming its new spelling."""
        return list(self._deprecated)

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
        in [training], [rollout], [guidance] and [echo]. A one-env run's is the config itself, under the name
        "env"."""
        if not self.envs:
            return {SINGLE: self}
        return {e.name: self.view(e) for e in self.envs}

    def view(self, e: MixtureEnv) -> QuaeroConfig:
        """The config of the mixture's env `e` (`quaero.config.check_rules` judges the sections it overrides
        again, and the rules across sections, on its own settings)."""
        env = EnvConfig(**e.model_dump(exclude=set(MixtureEnv.model_fields) - set(EnvConfig.model_fields),
                                       exclude_unset=True))
        update = {}
        for section, own in (("training", {"eval_tasks": e.eval_tasks, "oracle": e.oracle}),
                             ("rollout", {"group_size": e.group_size}),
                             ("guidance", {"mode": e.guidance, "traces": e.guidance_traces}),
                             ("echo", {"weight": e.echo_weight, "rl_weight": e.echo_weight})):
            if own := {k: v for k, v in own.items() if v is not None}:
                update[section] = getattr(self, section).model_copy(update=own)
        return self.model_copy(update={"env": env, "envs": [], **update})

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
                  "training.eval_every", "training.eval_tasks", "training.eval_pass_k", "logging.",
                  "run.output_dir", "run.name")  # a renamed or moved run trains the same


def changed_keys(old: dict, new: dict, prefix: str = "") -> dict[str, list]:
    """The dotted keys whose values differ between two `model_dump(mode="json")` configs: {key: [old, new]}
    (a key one of them lacks is None there). A list of tables (`[[envs]]`) is compared entry by entry
    (`envs[1].weight`; an entry one side lacks is None there), a list of plain values as one key."""
    out: dict[str, list] = {}
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out |= changed_keys(a, b, f"{prefix}{key}.")
        elif isinstance(a, list) and isinstance(b, list) and any(isinstance(v, dict) for v in a + b):
            def entries(values: list) -> dict:
                return {f"[{i}]": v for i, v in enumerate(values)}

            out |= changed_keys(entries(a), entries(b), f"{prefix}{key}")
        elif a != b:
            out[f"{prefix}{key}"] = [a, b]
    return out

