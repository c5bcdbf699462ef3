"""Reading a config: the TOML file, `--set` overrides, one error line per problem (the file, the section,
the key, the value, the closest valid key) and the rules the config alone decides (`check_rules`).
"""
from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ValidationError,
)

from quaero import launcher_registry as launchers
from quaero import sampler_registry as samplers
from quaero.resolve import split_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
from quaero.config.base import ConfigError
from quaero.config.loss import VARIANTS
from quaero.config.renamed import migrate
from quaero.config.schema import QuaeroConfig
from quaero.config.sections import SamplerConfig, TrainingConfig


def _closest(key: str, model: type[BaseModel]) -> str:
    match = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else f"; valid keys: {', '.join(model.model_fields)}"


def _section_model(loc: tuple, data: dict) -> type[BaseModel]:
    if loc == ("loss", "policy"):  # the variant's section, by its type
        return VARIANTS.get(str(_lookup(data, (*loc, "type"))), QuaeroConfig)
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
    if err["loc"][:2] == ("loss", "policy") and len(err["loc"]) > 2 and err["loc"][2] in VARIANTS:
        err = {**err, "loc": err["loc"][:2] + err["loc"][3:]}  # the variant's tag is no key of the TOML
    if err["type"] == "union_tag_invalid":  # [loss.policy] type names no variant
        err = {**err, "loc": (*err["loc"], "type"), "msg": f"use one of {err['ctx']['expected_tags']}"}
    loc = tuple(p for p in err["loc"] if not isinstance(p, int))
    section = ".".join(str(p) for p in loc[:-1]) or "(top level)"
    key = str(loc[-1]) if loc else "?"
    value = _lookup(data, tuple(err["loc"]))
    where = f"{source} [{section}] {key}"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key{_closest(key, _section_model(loc[:-1], data))}"
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
    deprecated = migrate(data, source)
    try:
        cfg = QuaeroConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(source, data, e.errors()[0])) from None
    except RecursionError:
        raise ConfigError(f"{source}: a value nests too deeply to check; a config nests a few levels at "
                          "most") from None
    check_rules(cfg, source)
    cfg._deprecated = deprecated
    return cfg


def _check_weight_transfer(sm: SamplerConfig, source: str) -> None:
    """[sampler] weight_transfer and server_devices, judged from the config alone (quaero/preflight/plan.py
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
    """Rules judged from the config alone (quaero/preflight/plan.py judges it against the installed
    components); a mixture's, for each env's view (its name in the message)."""
    if not cfg.envs:
        return _check_one(cfg, source)
    if cfg.data.traces:
        raise ConfigError(f"{source} [data] traces={cfg.data.traces!r} with [[envs]]: recorded episodes name "
                          "no env of the mixture; use traces with a one-env [env] config, or remove traces")
    for e in cfg.envs:
        where = f"{source} [[envs]] name={e.name!r}:"
        view = cfg.view(e)
        try:  # [training]'s rules on the env's own settings (its group_size, guidance)
            TrainingConfig.model_validate(view.training.model_dump())
        except ValidationError as error:
            raise ConfigError(_format_error(where, {}, {**error.errors()[0], "loc": ("training",)})) from None
        _check_one(view, where)


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
    if t.guidance != "none" and not (t.oracle or cfg.env.entry or t.guidance_traces):
        raise ConfigError(f"{source} [training] guidance={t.guidance!r} with a remote env and no oracle: the "
                          "guide is the env's oracle_policy(info), found beside [env] entry, and there is "
                          "none; set [training] oracle = \"package.module:oracle_policy\" (importable "
                          "here), guidance_traces = \"recorded.jsonl\", or guidance = 'none'")
    if t.guidance_traces is not None and t.guidance == "none":
        raise ConfigError(f"{source} [training] guidance_traces={t.guidance_traces!r} with guidance='none': "
                          "the recordings would guide nothing; set guidance = 'episode' or 'prefix', or "
                          "remove guidance_traces")
    if t.dynamic_sampling and t.max_off_policy_steps:
        raise ConfigError(f"{source} [training] dynamic_sampling=true with max_off_policy_steps="
                          f"{t.max_off_policy_steps}: a step sampled ahead cannot know how many tasks the "
                          "steps before it used; set one of them off")
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
    if t.beta > 0 and cfg.distributed.strategy == "fsdp2":
        raise ConfigError(f"{source} [training] beta={t.beta:g} with [distributed] strategy='fsdp2': the KL "
                          "penalty's reference is a frozen copy of the model (trainers/reference.py) and a "
                          "sharded model has none yet; use strategy = 'ddp', or beta = 0")
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

