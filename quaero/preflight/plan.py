"""A config judged against the installed components, and the trainer spec the recipe builds from it.

quaero/config/ judges what the config alone decides; this module judges what depends on the
code and hardware at hand: a known trainer and its declared capabilities (trainers/registry.py),
CUDA for `[run] device = "cuda"` and for compiled CE in `require` mode, vLLM for the vllm sampler, CUDA
devices for server mode's weight transfer and server placement, the logging sinks' packages.
`quaero check` and `quaero train` call `load_checked`, and the recipe calls `check_components` again
before it builds anything, so a config that cannot run fails before any model loads, with one line.
"""
from __future__ import annotations

import os
import stat
import tempfile
from operator import attrgetter
from pathlib import Path

from quaero import sampler_registry as samplers
from quaero.config import ConfigError, QuaeroConfig, load_config
from trainers import registry
from trainers.spec import TrainerSpec, spec_from


def check_components(cfg: QuaeroConfig, source: str = "config") -> None:
    """Raise ConfigError when the installed trainers, CUDA or vLLM cannot run `cfg`."""
    name = cfg.backend.backend
    if name not in registry.TRAINERS:
        raise ConfigError(f"{source} [backend] backend={name!r}: unknown backend; "
                          f"use one of {', '.join(sorted(registry.TRAINERS))}")
    caps = registry.TRAINERS[name]
    if cfg.echo.enabled and not caps.strict_shared_forward:
        raise ConfigError(f"{source} [backend] backend={name!r}: ECHO needs strict shared-forward; "
                          "use 'local' or 'unsloth' (or set [echo] enabled=false)")
    if cfg.backend.lora and not caps.lora:
        raise ConfigError(f"{source} [backend] lora=true: backend {name!r} has no LoRA support")
    if cfg.distributed.strategy not in caps.strategies:
        raise ConfigError(f"{source} [distributed] strategy={cfg.distributed.strategy!r}: backend {name!r} "
                          f"is built for {', '.join(map(repr, caps.strategies))} only; use backend='local' "
                          "for more than one process, or strategy='none'")
    launched = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; quaero/process_group.py joins its group
    if launched > 1 and cfg.distributed.strategy == "none":
        raise ConfigError(f"{source} [distributed] strategy='none' under torchrun with {launched} ranks: "
                          "every rank would train on all rows alone; set strategy = 'ddp' or 'fsdp2'")
    if launched > 1 and cfg.rollout.dynamic_sampling:
        raise ConfigError(f"{source} [rollout] dynamic_sampling=true under torchrun ({launched} ranks): each "
                          "rank would sample a different number of further tasks; it is built for one "
                          "process: set dynamic_sampling = false, or run one process")
    import torch

    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{source} [run] device='cuda': this torch has no CUDA device (built "
                          f"{'without CUDA' if torch.version.cuda is None else 'with CUDA, none visible'}); "
                          "use device = 'auto' (CUDA where there is one, else the CPU) or 'cpu'")
    opts = cfg.backend.options
    if opts.train_compile_selective_ce == "require" and not torch.cuda.is_available():
        raise ConfigError(f"{source} [backend.options] train_compile_selective_ce='require': needs CUDA "
                          "and none is available; use 'auto' (falls back with a reason) or 'off'")
    backend = cfg.sampler.backend
    if backend != samplers.AUTO and not samplers.installed(backend):
        engine = samplers.SAMPLERS[backend]
        raise ConfigError(f"{source} [sampler] backend={backend!r}: {engine.package} is not installed; "
                          f"pip install {engine.install}, or use {samplers.FALLBACK!r}")
    check_server_devices(cfg, source)
    check_server_urls(cfg, source)
    from quaero.telemetry.sinks import unavailable_reason

    for sink in cfg.logging.report_to:
        if reason := unavailable_reason(sink):
            raise ConfigError(f"{source} [logging] report_to={sink!r}: {reason}")


def check_server_urls(cfg: QuaeroConfig, source: str = "config") -> None:
    """The running servers of `[sampler] urls`, asked what they are (quaero/sampling/server.py
    server_problem)."""
    if cfg.sampler.mode != "server" or not cfg.sampler.urls:
        return
    from quaero.sampling.server import server_problem

    for url in cfg.sampler.urls:
        problem = server_problem(url, cfg.sampler, max_seq_len=cfg.model.max_seq_len)
        if problem:
            raise ConfigError(f"{source} [sampler] urls: {url} {problem}")


def check_server_devices(cfg: QuaeroConfig, source: str = "config") -> None:
    """[sampler] weight_transfer and server_devices against this machine's CUDA devices and torchrun's ranks.

    Under torchrun each rank starts its own `servers`; `server_devices` lists those of every local rank of a
    node, local rank l taking entries l*servers .. (l+1)*servers - 1 (`quaero/sampling/server.py`
    `server_devices`), so no two ranks' servers share a device. A CUDA trainer rank runs on cuda:LOCAL_RANK
    (one process: cuda:0); NCCL refuses a server on a trainer's device (two ranks on one device).
    """
    sm = cfg.sampler
    if sm.weight_transfer == "file" and not sm.server_devices:
        return
    import torch

    if not torch.cuda.is_available():
        if sm.weight_transfer != "file":
            raise ConfigError(f"{source} [sampler] weight_transfer={sm.weight_transfer!r}: vLLM's NCCL/IPC "
                              "weight transfer needs CUDA and none is available here (the CPU build has "
                              "neither); use weight_transfer = 'file'")
        raise ConfigError(f"{source} [sampler] server_devices={sm.server_devices}: CUDA device indices, and "
                          "no CUDA device is available here; remove server_devices")
    if sm.weight_transfer != "file" and cfg.run.device == "cpu":
        raise ConfigError(f"{source} [sampler] weight_transfer={sm.weight_transfer!r} with [run] "
                          "device='cpu': the engine sends the trainer's CUDA tensors; set device = 'cuda' "
                          "(or 'auto'), or weight_transfer = 'file'")
    if not sm.server_devices:
        return
    from quaero.process_group import local_ranks

    local = local_ranks()
    if len(sm.server_devices) != sm.servers * local:
        per_node = f" x {local} local ranks (each starts its own; local rank l takes entries l*servers ..)" \
            if local > 1 else ""
        raise ConfigError(f"{source} [sampler] server_devices={sm.server_devices} lists "
                          f"{len(sm.server_devices)} device(s) for servers={sm.servers}{per_node}: one "
                          f"device per started server; list {sm.servers * local}")
    count = torch.cuda.device_count()
    if missing := [d for d in sm.server_devices if d >= count]:
        raise ConfigError(f"{source} [sampler] server_devices={sm.server_devices}: device {missing[0]} does "
                          f"not exist here ({count} CUDA device(s): 0..{count - 1})")
    trainers = set(range(local))  # cuda:LOCAL_RANK (quaero/process_group.py setup); one process: cuda:0
    if sm.weight_transfer == "nccl" and (shared := sorted(trainers & set(sm.server_devices))):
        raise ConfigError(f"{source} [sampler] weight_transfer='nccl' with "
                          f"server_devices={sm.server_devices}: cuda:{shared[0]} is a trainer rank's device "
                          "and NCCL refuses two ranks on one device; pick server devices from "
                          f"{local}..{count - 1}")


def resolve_oracle(cfg: QuaeroConfig, source: str = "config", without: str | None = None):
    """The warm start's `oracle_policy(info)` (guidance's guide too): `[training] oracle`, else the one in
    the env entry's module. `without`: the fix's other way out (default: no warm start)."""
    from quaero.resolve import resolve_name

    where = cfg.training.oracle or f"{(cfg.env.entry or '').partition(':')[0]}:oracle_policy"
    key = "[training] oracle" if cfg.training.oracle else "[training] oracle (unset: beside [env] entry)"
    fix = ("write oracle_policy(info) (docs/environments.md: Warm start), point [training] oracle at one, "
           + (without or f"or set [training] warmup_sft_steps = 0 (now {cfg.training.warmup_sft_steps})"))
    return resolve_name(where, f"{source} {key}", want=callable, wanted="a function oracle_policy(info)",
                        fix=fix, error=ConfigError, example="my_env.oracle:oracle_policy")


def check_trace_path(path: str, key: str) -> None:
    """A trace file named by `key` is a regular file (read in full when the run builds, and by `check`)."""
    if not Path(path).expanduser().is_file():
        what = "a folder, a FIFO or a device" if Path(path).expanduser().exists() else "no such file"
        raise ConfigError(f"{key}={path!r}: {what}; name a .jsonl file of recorded episodes (`quaero inspect "
                          "rows RUN --export rfc010 OUT.jsonl` writes one)")


def check_openenv_install(source: str = "config") -> None:
    """openenv's own files are on disk (not overwritten by openenv-core), judged before anything loads."""
    from quaero.openenv_client.loading import overwritten_openenv

    if fix := overwritten_openenv():
        raise ConfigError(f"{source}: {fix}")


def check_run_folder(cfg: QuaeroConfig, source: str = "config") -> None:
    """The run folder can be created under `[run] output_dir` (probed with a temp folder, then removed)."""
    out = Path(cfg.run.output_dir).expanduser()
    existing = next((p for p in (out, *out.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise ConfigError(f"{source} [run] output_dir={cfg.run.output_dir!r}: {existing} is a file, not a "
                          "folder; point output_dir at a folder")
    try:
        tempfile.TemporaryDirectory(dir=existing, prefix=".quaero-probe-").cleanup()
    except OSError as e:
        raise ConfigError(f"{source} [run] output_dir={cfg.run.output_dir!r}: cannot create folders in "
                          f"{existing} ({e.strerror}); choose a writable output_dir") from None
    run_dir = cfg.run_dir
    if run_dir.is_symlink() and not run_dir.resolve().is_relative_to(out.resolve()):
        # a link planted in output_dir would have checkpoints written, renamed and pruned wherever it points
        raise ConfigError(f"{source} [run] name={cfg.run.name!r}: {run_dir} is a link to "
                          f"{run_dir.resolve()}, "
                          "outside output_dir; a run writes only under output_dir: set output_dir to where "
                          "runs should go, or remove the link")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{source} [run] name={cfg.run.name!r}: {run_dir} is a file, not a run folder; "
                          "choose another [run] name or move the file")
    if found := _first_link(run_dir):
        link, what = found
        raise ConfigError(f"{source} [run] name={cfg.run.name!r}: {link} is {what}; quaero would write "
                          "through it (train.lock, config.json, events, checkpoints): a run folder holds no "
                          "links; remove it (or replace it by a copy)")


def _first_link(run_dir: Path) -> tuple[Path, str] | None:
    """A link inside the run folder (not followed), if there is one, and what it is: a symbolic link, or a
    hard link (a file with another name elsewhere, st_nlink > 1: writing it writes that file too)."""
    for root, dirs, files in os.walk(run_dir):  # os.walk never descends into linked folders
        for name in sorted(dirs + files):
            path = os.path.join(root, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                return Path(path), f"a link to {os.path.realpath(path)}"
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                return Path(path), f"a hard link ({st.st_nlink} names for one file)"
    return None


def unbuilt_shape(name: str) -> bool:
    """A named Qwen3 shape (quaero/models/qwen3.py NAMED_SHAPES) not built yet: `quaero check` says what its
    first build costs instead of building it (qwen3-1.7b-shape: minutes, ~10 GB of memory)."""
    from quaero.models.cache import is_built
    from quaero.models.qwen3 import NAMED_SHAPES

    return name in NAMED_SHAPES and not is_built(name)


def check_model_and_renderer(cfg: QuaeroConfig, source: str = "config") -> None:
    """The model folder exists and the renderer works with its tokenizer: it renders a prompt twice alike,
    encodes a tool call and, when packing with ECHO, bridges a tool result exactly. Loads the tokenizer, never
    the weights. Records the renderer chosen and why (`quaero check` prints it)."""
    from quaero.chat import registry
    from quaero.models.base import ModelNotFound
    from quaero.models.cache import build_note
    from quaero.models.config import tokenizer_problem
    from quaero.models.folders import folder_problem
    from quaero.models.load import config_fields, dtype_problem, load_tokenizer, resolve_device, resolve_model
    from quaero.models.qwen3 import build_qwen3_tokenizer
    from quaero.rollout.render import BridgeFailure, RenderAdapter

    name = cfg.model.name
    try:
        if unbuilt_shape(name):  # its weights are quaero's own: the check needs the tokenizer alone
            cfg.model._build, problem = build_note(name), None
            tokenizer = build_qwen3_tokenizer()
            tokenizer.name_or_path = name
        else:
            folder = resolve_model(name)
            # the folder's config.json and files judged first: the tokenizer's loader reads config.json too
            problem = folder_problem(folder) or tokenizer_problem(folder)
            tokenizer = None if problem else load_tokenizer(name)
    except (ModelNotFound, OSError, ValueError) as e:
        raise ConfigError(f"{source} [model] name={name!r}: {e}") from None
    if problem:
        raise ConfigError(f"{source} [model] name={name!r}: {problem}")
    device = resolve_device(cfg.run.device)
    if problem := dtype_problem(cfg.model.dtype, device):
        raise ConfigError(f"{source} [model] dtype={cfg.model.dtype!r}: {problem}; use dtype = 'float32'")
    choice = registry.choose(tokenizer, cfg.model.renderer, (config_fields(name) or {}).get("model_type"))
    said = f"{source} [model] name={name!r}, renderer {choice.name!r} ({choice.why})"
    render = None
    try:
        render = RenderAdapter(tokenizer, cfg.model)
        prompts = [render.prompt_ids(_PROBE, _PROBE_TOOLS) for _ in range(2)]
        action = render.encode_assistant(_PROBE, _PROBE_TOOLS, _PROBE_CALL)
    except registry.RendererUnavailable as e:
        raise ConfigError(f"{said}: {e}") from None
    except (AssertionError, ValueError, KeyError, TypeError) as e:
        advice = renderer_advice(str(e), choice.name)
        raise ConfigError(f"{said} does not fit the tokenizer ({str(e)[:200]}); {advice}") from None
    if prompts[0] != prompts[1]:
        raise ConfigError(f"{said}: the chat template renders the same conversation differently twice (it is "
                          "not deterministic), so no prompt is reproducible; "
                          f"{renderer_advice('not deterministic', choice.name)}")
    cfg.model._chosen = f"{choice.name!r} ({choice.why})"
    if why := getattr(render.renderer, "tool_format_why", None):  # the template renderer's round trip
        cfg.model._chosen += f", tool calls {why}"
    for line in getattr(render.renderer, "adaptations", []):
        cfg.model._chosen += f", {line}"
    if cfg.rollout.packing and cfg.echo.enabled:
        try:
            render.bridge(prompts[0], action, [{"role": "tool", "content": "probe"}], _PROBE_TOOLS)
        except BridgeFailure as e:
            whole = e.reason == "template_raised" and WHOLE_RAISED in str(e)
            key = f"{e.reason}_whole" if whole else e.reason
            raise ConfigError(f"{said} cannot append an env response exactly ({e}), so no ECHO row could be "
                              f"built; {BRIDGE_ADVICE.get(key, BRIDGE_ADVICE[''])}, or set [echo] "
                              "enabled = false") from None


# a `template_raised` refusal's detail (quaero/chat/template.py) where the short probes rendered and the
# bridge's whole conversation (the history, the model's own reply as a message, the new messages) raised
WHOLE_RAISED = "the template raises on the whole conversation"
# what to do about each bridge refusal at check (the reasons `TemplateRenderer` names)
BRIDGE_ADVICE = {
    "template_no_close": "give the tokenizer the token that ends an assistant turn as an added token (its "
                         "model's own tokenizer holds it)",
    "template_history_dependent": "use a template that renders a message the same after any history (or name "
                                  "a hand-written renderer, [model] renderer, e.g. 'qwen3')",
    "template_token_merge": "use a tokenizer that splits at the turn's close token (a SentencePiece prefix "
                            "space merges into it), or name a hand-written renderer ([model] renderer)",
    "template_raised": "the template raises on a tool result after a call: give it a template that renders "
                       "`tool` messages (renderer_options chat_template) or set [model] renderer_options "
                       "tool_format = 'prompt'",
    "template_raised_whole": "give it a template that renders the whole conversation, the model's reply as "
                             "an assistant message included ([model] renderer_options chat_template), or "
                             "name a renderer that parses the reply ([model] renderer)",
    "": "name a renderer that bridges this model ([model] renderer, e.g. 'qwen3' for Qwen3 models)",
}
# what to do about each way a tokenizer's chat template does not fit (read from the error's text)
_TEMPLATE_ADVICE = (
    ("has no chat template", ("give the tokenizer a chat template ([model] renderer_options chat_template) "
                             "or name the renderer of this model family ([model] renderer, e.g. 'qwen3')")),
    ("not deterministic", ("remove the randomness or the clock from the template ([model] renderer_options "
                          "chat_template)")),
    ("does not extend the generation prompt", ("set the template variable that makes its generation prompt "
                                              "and its turns agree ([model] renderer_options, e.g. "
                                              "enable_thinking = true or false)")),
    ("no close token", ("give the tokenizer the token that ends an assistant turn as an added token (its "
                       "model's own tokenizer holds it)")),
    ("generation prompt is not an append", ("use a template whose generation prompt follows the conversation "
                                           "as rendered ([model] renderer_options chat_template)")),
    ("round-trip", "use a template that renders an assistant message's content and tool calls"),
    ("is undefined", ("give the tokenizer the special token the template reads (its model's own tokenizer "
                     "holds it), or set it as a template variable in [model] renderer_options")),
    ("eos_token", "set eos_token to the model's end-of-text token"),
)


def renderer_advice(error: str, renderer: str) -> str:
    """The advice that fits a renderer's error at check (a generic one where none does)."""
    if renderer != "template":
        return ("name the renderer of this model family ([model] renderer, e.g. 'qwen3'), or 'template' with "
                "a tokenizer that has a chat template")
    for needle, advice in _TEMPLATE_ADVICE:
        if needle in error:
            return advice
    if "raised" in error:
        return ("the template raised on quaero's probe conversation (system, user, an assistant tool call, a "
                "tool result): give it a template that renders them ([model] renderer_options chat_template) "
                "or name the renderer of this model family ([model] renderer)")
    return ("name the renderer of this model family ([model] renderer, e.g. 'qwen3'), or a template that "
            "fits ([model] renderer_options chat_template)")


_PROBE = [{"role": "system", "content": "probe"}, {"role": "user", "content": "probe"}]
_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "probe",
                                                  "parameters": {"type": "object", "properties": {
                                                      "x": {"type": "string"}}}}}]
_PROBE_CALL = {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function", "function": {"name": "probe", "arguments": {"x": "y"}}}]}


def load_checked(path: str | Path, overrides: list[str] = ()) -> QuaeroConfig:
    """`load_config`, then everything that depends on what is installed and on disk: what `quaero check` and
    `quaero train` run first, so a config that cannot run fails before any model loads."""
    cfg = load_config(path, overrides)
    source = str(path)
    check_components(cfg, source)
    check_openenv_install(source)
    if cfg.training.warmup_sft_steps and not cfg.data.traces:  # [data] traces replace the oracle's demos
        for name, view in cfg.views().items():  # each env's own (a mixture's warm start plays every env)
            resolve_oracle(view, source if not cfg.is_mixture else f"{source} [[envs]] name={name!r}:")
    for name, view in cfg.views().items():  # the guide of guided episodes: recordings, else the env's oracle
        g = view.guidance
        where = source if not cfg.is_mixture else f"{source} [[envs]] name={name!r}:"
        if g.mode != "none" and g.traces:
            check_trace_path(g.traces, f"{where} [guidance] traces")
        elif g.mode != "none":
            resolve_oracle(view, f"{where} [guidance] mode={g.mode!r} needs the env's oracle:",
                           without="or set [guidance] traces, or mode = 'none'")
    check_run_folder(cfg, source)
    check_model_and_renderer(cfg, source)
    return cfg


def rl_loss_constant(cfg: QuaeroConfig) -> int:
    """Dr. GRPO's normaliser: the most action tokens an RL step can sample (tasks x group x turns x
    max_tokens)."""
    # a mixture's largest env's
    most = max(v.rollout.group_size * v.env.max_turns for v in cfg.views().values())
    return cfg.rollout.tasks_per_step * most * cfg.sampler.max_tokens


def trainer_spec(cfg: QuaeroConfig) -> TrainerSpec:
    """The part of the config a trainer reads: every option trainers/spec.py declares, read at its config
    key, Dr. GRPO's normaliser, which the config implies, and the policy loss `[loss.policy]` makes."""
    constant = rl_loss_constant(cfg) if cfg.loss.aggregation == "constant" else 0
    return spec_from(lambda key: attrgetter(key)(cfg), loss_constant=constant,
                     policy_loss=cfg.loss.policy.build())
