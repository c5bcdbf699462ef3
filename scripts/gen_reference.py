"""Render the options and metrics tables of docs/reference.md from the code that owns them.

    python scripts/gen_reference.py           # rewrite the generated blocks of docs/reference.md
    python scripts/gen_reference.py --check   # exit 1 when they differ from the code

Options: every field of `QuaeroConfig` (quaero/config/): section, key, type and default read from the
schema; the meaning from the field's `description=` when it has one (a trainer option's is its
`option(about=...)` in trainers/spec.py), else from OPTION_MEANINGS below.
Metrics: the tables quaero/telemetry/names.py declares (each name with its meaning and how it totals), listed
as their owners emit them: the branch counters (quaero/telemetry/proofs.py), the trainer step
(`trainers/step.py` `step_metrics`, called on an empty step), the rollout (`RolloutCounts` in
quaero/telemetry/counts.py, an empty snapshot), and the few names the recipe writes itself (each checked to
be written by the file named). A config key without a meaning, a metric emitted but not declared, or a
declared one no longer emitted is an error: tests/unit/test_docs.py runs `--check`, so the tables cannot drift
from the code.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference.md"

OPTION_MEANINGS = {
    "run.name": "the run folder's name: the run writes `output_dir/name` and nothing outside it",
    "run.output_dir": "the folder of run folders (for several nodes: on a filesystem every node sees)",
    "run.device": "`auto`: CUDA when available, else CPU",
    "model.renderer": "`auto`: the `renderers==0.1.7` family the model is one of (its exact hub id, or a "
                      "Qwen3 `model_type`), else `template`: quaero's renderer over the model's own chat "
                      "template; or a renderers registry name (Renderers, below)",
    "model.renderer_options": "the renderer's options: its constructor keywords (Qwen3: `enable_thinking`, "
                              "`preserve_all_thinking`); for `template`: `tool_format` and chat template "
                              "variables",
    "model.enable_thinking": "the option `enable_thinking` as a key of its own (older configs; unset: the "
                             "renderer's default, on for Qwen3)",
    "env.entry": "`package.module:Class` of an OpenEnv `Environment` / `MCPEnvironment` (or a factory); "
                 "exactly one of entry, url and urls",
    "env.url": "`ws://host:port` of a running OpenEnv server (implies `launcher = \"remote\"`)",
    "env.urls": "several running servers of one env; sessions spread over them",
    "env.kwargs": "keyword arguments of the entry in every session quaero starts, checked against its "
                  "signature",
    "env.host": "the address local env servers listen on",
    "env.train_split": "the reset `split` of training tasks",
    "env.eval_split": "the reset `split` of evaluation tasks",
    "env.reset_kwargs": "more keyword arguments of every `reset`",
    "env.system_prompt": "the system prompt (else the env's own: the reset's `system_prompt` or "
                         "`instructions`, a chat observation's system message; else a generic line; "
                         "docs/environments.md)",
    "env.formatter": "`package.module:function(observation_dict) -> str` for a plain env's observations",
    "env.action": "`package.module:ActionClass` for a plain env that declares no Action",
    "env.malformed_reward": "the reward of a reply that is no valid action (docs/environments.md)",
    "env.no_tool_call_message": "MCP envs: the corrective message when a reply calls no tool (default: names "
                                "the tools)",
    "env.max_turns": "turns per episode; an episode cut here is truncated, never a success",
    "env.max_observation_tokens": "an env message longer than this is cut, with a marker, field by field for "
                                  "a formatted observation (unset: half of `max_seq_len`)",
    "env.step_timeout_s": "seconds an env step may take before it counts as a fault",
    "env.reset_timeout_s": "seconds an env reset may take before it counts as a fault",
    "env.max_retries": "retries of a faulted step or reset before the episode is dropped (an env error is "
                       "asked once more whatever this is: twice the same is the action's)",
    "env.retry_backoff_s": "the wait before retry k is this times 2^k",
    "env.server_start_timeout_s": "seconds a local env server may take to start",
    "env.tasks.sampler": "which train tasks the env's groups play: `sequential` (the run seed's order of the "
                         "split), `uniform`, `curriculum` (OpenEnv RFC 013), `difficulty_pools` "
                         "(prime-rl's), or `package.module:Class` of your own "
                         "(quaero/rollout/task_samplers.py)",
    "env.tasks.key": "what a learning sampler remembers outcomes by: `task`, or the task spec's RFC 013 "
                     "`group` / `difficulty` (pools tasks that rarely repeat)",
    "env.tasks.cost": "the curriculum's cost per episode: generated `tokens` or `episodes`",
    "env.tasks.gamma": "discount of the outcome memory (RFC 013's γ)",
    "env.tasks.epsilon": "the curriculum weight every task keeps (RFC 013's ε; finite, at most 1e6)",
    "env.tasks.candidates": "tasks a learning sampler weighs per draw (the whole split when smaller)",
    "env.tasks.timeout_s": "seconds one call of the task sampler (sample, update, state_dict, "
                           "load_state_dict) may run before the run fails naming it; a progress line every "
                           "30 s meanwhile",
    "env.tasks.hard_max": "difficulty_pools: a latest group success rate at or below this is hard",
    "env.tasks.easy_min": "difficulty_pools: at or above this is easy (above hard_max: the pools never "
                          "overlap)",
    "env.tasks.hard_weight": "difficulty_pools: the hard pool's weight (each pool's finite, at most 1e6; not "
                             "all 0)",
    "env.tasks.normal_weight": "difficulty_pools: the normal pool's weight",
    "env.tasks.easy_weight": "difficulty_pools: the easy pool's weight",
    "env.tasks.unseen_weight": "difficulty_pools: an unseen task's weight",
    "envs.name": "a mixture env's name (unique; `all` is reserved): it names its metrics, rows and eval "
                 "results",
    "envs.ratio": "its relative share of each step's groups (finite, > 0; the shares are the ratios over "
                  "their sum, computed without overflow)",
    "envs.group_size": "its group size (unset: [rollout] group_size)",
    "envs.eval_tasks": "its eval tasks (unset: [training] eval_tasks)",
    "envs.oracle": "its warm start's demonstrator (unset: [training] oracle, else its entry's "
                   "`oracle_policy`)",
    "envs.echo_weight": "ECHO's λ on its rows, warm start and RL (unset: [echo]'s; 0: no ECHO on this env)",
    "envs.guidance": "guided episodes on this env's all-fail groups (unset: [guidance] mode)",
    "envs.guidance_traces": "this env's recorded episodes as its guide (unset: [guidance] traces)",
    "env.on_session_loss": "`replay` the episode's actions on a new session (deterministic envs) or `drop` "
                           "it",
    "sampler.top_p": "nucleus sampling; RL needs 1 (`check` refuses less with RL steps)",
    "sampler.max_tokens": "tokens per action; a turn starts only when the prompt leaves room for them",
    "sampler.gpu_memory_utilization": "vLLM's share of the device memory",
    "sampler.enable_prefix_caching": "vLLM's prefix cache (reset after each weight push)",
    "sampler.hf_kv_cache_mib": "`hf`: MiB of KV kept across calls by exact token ids (a group's "
                               "prompt prefilled once, a turn's prompt only its new tokens; dropped when the "
                               "weights change); 0 = off",
    "sampler.mode": "`colocated` (vLLM inside the trainer process) or `server` (docs/scaling.md)",
    "sampler.servers": "vLLM servers quaero starts per rank in server mode",
    "sampler.urls": "running vLLM servers to sample from instead (docs/scaling.md)",
    "sampler.server_start_timeout_s": "seconds a vLLM server may take to start",
    "sampler.request_timeout_s": "server mode: seconds a vLLM server may sample before its reply's first "
                                 "byte (one prompt's n completions)",
    "sampler.stop_grace_s": "server mode: seconds a wait on a vLLM server goes on after a stop request "
                            "(Ctrl-C, SIGTERM) before the run stops without that step",
    "sampler.weight_transfer": "how server mode pushes weights: `file`, `nccl` or `ipc` (docs/scaling.md)",
    "sampler.server_devices": "a CUDA device per server quaero starts; the placement rule is in "
                              "docs/scaling.md",
    "backend.backend": "the trainer: `local` or `unsloth` (trainers/registry.py)",
    "echo.rl_weight": "the ECHO term's weight in the RL steps (unset: `weight`); the warm start keeps "
                      "`weight`",
    "echo.schedule": "the weight over the RL steps k: `constant`, `warmup` (weight x min(1, k / S)) or "
                     "`decay` (weight x max(0, 1 - (k - 1) / S)), S = `schedule_steps`; the warm start uses "
                     "`weight`",
    "echo.schedule_steps": "S of the schedule (0: all RL steps)",
    "echo.include_scaffold": "also train ECHO on template scaffolding (`<|im_start|>user`, tool-response "
                             "wrappers)",
    "data.traces": "a JSONL file of recorded episodes (RFC 010 records or OpenEnv TrainingTraces) the warm "
                   "start trains on (SFT + ECHO, or RL with `traces_loss`) instead of the oracle's demos; "
                   "rows rebuilt from their ids, inexact records refused one line each",
    "data.traces_loss": "`sft` (those rows are demonstrations: SFT + ECHO) or `rl` (the RL loss off-policy, "
                        "the importance ratio over each record's own sampler log-probs, + ECHO; a record "
                        "needs an `advantage`, or a `reward` and a `group`, and log-probs on its actions, "
                        "else refused)",
    "logging.level": "the console's and the event log's level",
    "logging.console": "`pretty`, `plain` or `none`",
    "logging.progress": "a progress bar on a terminal",
    "logging.report_to": "mirror scalars to `tensorboard`, `wandb`, `trackio` (docs/after-training.md)",
    "logging.save_rows": "trained rows kept for `quaero inspect rows`: `none`, `sample` (2 a step) or `all`",
}

# How each metric table's names are read from the code that emits them (quaero/telemetry/names.py declares
# the tables, their names, meanings and totals): by title.
READ_BY = {
    "Branch counters (retrain's names, kept for compatibility)": "proofs",
    "Trainer step": "step",
    "Rollout": "rollout",
}


def _type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return " \\| ".join(_type(a) for a in inner) + (" or unset" if len(inner) < len(args) else "")
    if origin is typing.Annotated:
        return _type(args[0])
    if origin in (list, tuple):
        return f"{origin.__name__}[{', '.join(_type(a) for a in args)}]"
    if origin is dict:
        return "table"
    return getattr(annotation, "__name__", str(annotation))


def _toml(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:
        return f"{value} ({value // 2**20} MiB)"
    return str(value)


def registry_meanings() -> dict[str, str]:
    """The meanings of the options whose values are registry names, read from the registries: a new launcher
    or sampler engine documents itself."""
    from quaero.launcher_registry import LAUNCHERS
    from quaero.sampler_registry import SAMPLERS
    return {
        "env.launcher": "; ".join(f"`{name}`: {launcher.about}" for name, launcher in LAUNCHERS.items())
                        + " (quaero/launcher_registry.py)",
        "sampler.backend": "`auto`: vLLM where it imports and can start the model (not on CPU ranks under "
                           "torchrun), else `hf`; " + "; ".join(f"`{name}`: {e.about}" for name,
                                                                e in SAMPLERS.items())
                           + " (quaero/sampler_registry.py)",
    }


def option_rows(model: type[BaseModel] | None = None, section: str = "") -> list[tuple[str, str, str, str,
                                                                                       str]]:
    """(section, key, type, default, meaning) of every config field, in schema order."""
    if model is None:
        from quaero.config import EnvConfig, MixtureEnv, QuaeroConfig
        rows = []
        for name, field in QuaeroConfig.model_fields.items():
            if name == "envs":  # [[envs]]: everything [env] has (listed there), plus the mixture's own keys
                rows += [r for r in option_rows(MixtureEnv, name)
                         if r[0] == name and r[1] not in EnvConfig.model_fields]
                continue
            inner = [a for a in typing.get_args(field.annotation) if a is not type(None)]
            rows += option_rows(inner[0] if inner else field.annotation, name)
        return rows
    rows = []
    for key, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            continue  # a sub-section, listed after this one
        if _variants(field.annotation):
            kinds = ", ".join(f"`{v.model_fields['type'].default}`" for v in _variants(field.annotation))
            default = f"type = {_toml(field.get_default(call_default_factory=True).type)}"
            rows.append((section, key, "table", default,
                         f"{field.description} (`[{section}.{key}]` below: `type` = {kinds}, and its keys)"))
            continue
        default = "required" if field.is_required() else _toml(field.get_default(call_default_factory=True))
        meaning = field.description or {**OPTION_MEANINGS, **registry_meanings()}.get(f"{section}.{key}", "")
        rows.append((section, key, _type(field.annotation), default, meaning))
    for key, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            rows += option_rows(field.annotation, f"{section}.{key}")
        elif _variants(field.annotation):
            kind = field.get_default(call_default_factory=True).type
            rows += variant_rows(_variants(field.annotation), f"{section}.{key}", kind)
    return rows


def _variants(annotation: Any) -> list[type[BaseModel]]:
    """The sections of a table picked by its `type` (a union of sections, e.g. `[loss.policy]`), else []."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = typing.get_args(annotation) if union else ()
    return [a for a in args if isinstance(a, type) and issubclass(a, BaseModel) and "type" in a.model_fields]


def variant_rows(variants: list[type[BaseModel]], section: str, kind: str) -> list[tuple[str, str, str, str,
                                                                                           str]]:
    """One row per key of a table picked by `type`, the variants that take it named in its meaning."""
    takes: dict[str, dict[str, list[str]]] = {}  # key -> its meaning -> the variants that take it so
    first: dict[str, Any] = {}
    for v in variants:
        for key, field in v.model_fields.items():
            if key != "type":
                meanings = takes.setdefault(key, {})
                meanings.setdefault(field.description or "", []).append(v.model_fields["type"].default)
                first.setdefault(key, field)
    rows = [(section, "type", " \\| ".join(v.model_fields["type"].default for v in variants), _toml(kind),
             "which variant; the keys below are each variant's own")]
    for key, field in first.items():
        default = "required" if field.is_required() else _toml(field.get_default(call_default_factory=True))
        rows.append((section, key, _type(field.annotation), default, "; ".join(
            f"({', '.join(f'`{t}`' for t in kinds)}) {meaning}" for meaning, kinds in takes[key].items())))
    return rows


def _literals(path: Path) -> set[str]:
    """The metric names a file writes: the strings and keyword-argument names it spells out (`eval_reward=`)
    and the names.py constants it reads (`names.POLICY_STALENESS`, or imported from
    quaero.telemetry.names)."""
    from quaero.telemetry import names

    tree = list(ast.walk(ast.parse(path.read_text(encoding="utf-8"))))
    spelled = {n.value if isinstance(n, ast.Constant) else n.arg for n in tree
               if isinstance(n, ast.Constant) and isinstance(n.value, str) or isinstance(n,
                                                                                         ast.keyword)
               and n.arg}
    constants = {n.attr for n in tree if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                 and n.value.id == "names"}
    constants |= {a.name for n in tree if isinstance(n,
                                                     ast.ImportFrom) and n.module == "quaero.telemetry.names"
                  for a in n.names}
    return spelled | {v for c in constants if isinstance(v := getattr(names, c, None), str)}


def _step_names() -> list[str]:
    """The keys `step_metrics` writes, read by calling it on an empty two-rank step (no model). A scalar it
    takes beyond these (e.g. `echo_weight`) gets 0.0: only the names are read, never the values."""
    from trainers.spec import TrainerSpec
    from trainers.step import StepTotals, step_metrics
    from trainers.terms import TERMS, StepContext
    trainer = types.SimpleNamespace(spec=TrainerSpec(),
                                    scheduler=types.SimpleNamespace(get_last_lr=lambda: [0.0]))
    ranks = [StepTotals.empty({t.name: 0 for t in TERMS}) for _ in range(2)]
    given = {"ctx": StepContext(sft=False, echo_weight=0.0), "grad_norm": 0.0, "stepped": True,
             "peaks": [(0.0, "cpu"), (0.0, "cpu")], "seconds": 0.0}
    scalars = {name: 0.0 for name, p in inspect.signature(step_metrics).parameters.items()
               if p.kind is p.KEYWORD_ONLY and p.default is p.empty and name not in given}
    return list(step_metrics(trainer, ranks, **given, **scalars))


def metric_names(how: str, owner: str, declared: list[str]) -> list[str]:
    """The names a table's owner emits (for `literals`: the declared names the owner files, `a.py, b.py`,
    write)."""
    from quaero.telemetry import counts, metrics, names, proofs
    if how == "proofs":
        return [*names.SELECTIVE_METRICS,
                *(n for n in proofs.BRANCH_COUNTERS if n not in names.SELECTIVE_METRICS),
                names.SAVE_ON_CPU]
    if how == "step":
        branch = set(metric_names("proofs", "", []))
        return [n for n in _step_names() if n not in branch]
    if how == "rollout":
        snap = counts.RolloutCounts().snapshot_and_reset()
        return [*snap, *(m.name for m in metrics.FAMILIES.values() if m.table == "Rollout")]
    spelled = set().union(*(_literals(ROOT / path) for path in owner.split(", ")))
    return [n for n in declared if n in spelled]


def tables() -> list[tuple[str, str, dict[str, str], str]]:
    """(title, owner, {name: meaning}, how its names are read) of every metric table names.py declares."""
    from quaero.telemetry import metrics, names

    return [(t.title, t.owner, {n: metrics.METRICS[n].meaning for n in t.names}, READ_BY.get(t.title,
                                                                                           "literals"))
            for t in names.TABLES]


def problems() -> list[str]:
    """Every config key or metric without a meaning, and every meaning whose name is gone."""
    out = []
    rows = option_rows()
    out += [f"quaero/config/ [{s}] {k}: no meaning; add description= or an OPTION_MEANINGS entry in "
            f"scripts/gen_reference.py" for s, k, _, _, m in rows if not m]
    keys = {f"{s}.{k}" for s, k, *_ in rows}
    out += [f"scripts/gen_reference.py OPTION_MEANINGS[{k!r}]: no such config key" for k in OPTION_MEANINGS
            if k not in keys]
    for title, owner, meanings, how in tables():
        emitted = metric_names(how, owner, list(meanings))
        out += [f"{owner}: metric {n!r} is not declared in quaero/telemetry/names.py ({title})"
                for n in emitted if n not in meanings]
        out += [f"quaero/telemetry/names.py ({title}): {n!r} is not emitted by {owner}"
                for n in meanings if n not in emitted]
    return out


def _cell(text: str) -> str:
    """A table cell: a `|` (also inside a code span) would end the cell, so it is escaped."""
    return text.replace("|", "\\|")


def options_table() -> str:
    lines = ["| section | key | type | default | meaning |", "|---|---|---|---|---|"]
    for section, key, typ, default, meaning in option_rows():
        lines.append(f"| `[{section}]` | `{key}` | {typ} | `{_cell(default)}` | {_cell(meaning)} |")
    return "\n".join(lines)


def metrics_table() -> str:
    from quaero.telemetry import metrics

    parts = []
    for title, owner, meanings, how in tables():
        parts += [f"**{title}** (`{owner}`)", "", "| metric | totals | meaning |", "|---|---|---|"]
        parts += [f"| `{n}` | {metrics.METRICS[n].total if n in metrics.METRICS else ''} | "
                  f"{_cell(meanings.get(n, ''))} |"
                  for n in metric_names(how, owner, list(meanings))]
        parts.append("")
    return "\n".join(parts).rstrip()


BLOCKS = {"options": options_table, "metrics": metrics_table}


def _markers(name: str) -> tuple[str, str]:
    return (f"<!-- generated: {name} (python scripts/gen_reference.py); do not edit by hand -->",
            f"<!-- end generated: {name} -->")


def render(text: str) -> str:
    """`text` with every generated block replaced by what the code says now."""
    for name, table in BLOCKS.items():
        begin, end = _markers(name)
        head, sep, rest = text.partition(begin)
        _, sep2, tail = rest.partition(end)
        if not sep or not sep2:
            raise SystemExit(f"{REFERENCE.relative_to(ROOT)}: the markers of block {name!r} are missing")
        text = f"{head}{begin}\n{table()}\n{end}{tail}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/reference.md differs from the "
                                                             "code")
    args = parser.parse_args(argv)
    found = problems()
    for line in found:
        print(f"error: {line}", file=sys.stderr)
    current = REFERENCE.read_text(encoding="utf-8")
    wanted = render(current)
    if args.check:
        if wanted != current:
            print("error: docs/reference.md's generated tables differ from the code; run "
                  "python scripts/gen_reference.py", file=sys.stderr)
        return int(bool(found) or wanted != current)
    if found:
        return 1
    REFERENCE.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
