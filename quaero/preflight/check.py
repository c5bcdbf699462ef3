"""`quaero check`: what a config resolves to and what it will do, printed before anything trains.

Each section of the config gets a line (run, model, env, sampler, backend, the trainer options, echo,
training, rollout, loss, guidance, the work), then the memory plan (quaero/preflight/memory_plan.py), each
env's action and splits. Heavy imports (the model's config, the env) happen here, inside the command, never in
the CLI's import.
"""
from __future__ import annotations

from quaero.preflight.guidance_lines import guidance_lines


def _lora(supported: bool, backend) -> str:
    """`quaero check`'s LoRA words: whether this run trains an adapter, and whether the backend could."""
    if backend.lora:
        return f"on (r {backend.lora_r}, alpha {backend.lora_alpha})"
    return "off (supported: [backend] lora = true)" if supported else "off (not supported by this backend)"


def plan_lines(cfg, source: str) -> list[str]:
    from quaero.models.load import resolve_device
    from quaero.sampling import resolve_backend
    from trainers.registry import TRAINERS

    caps = TRAINERS[cfg.backend.backend]
    device = resolve_device(cfg.run.device)
    sampler = (f"vllm, server mode, weights by {cfg.sampler.weight_transfer}" if cfg.sampler.mode == "server"
               else resolve_backend(cfg.sampler.backend, device))  # what train will build in one process
    if (
        cfg.sampler.mode != "server"
        and cfg.sampler.backend == "auto"
        and sampler == "vllm"
        and not device.startswith("cuda")
    ):
        sampler += ", hf on each rank of `quaero train --nproc N`"
    lines = [
        f"config      {source}",
        *(f"deprecated  {line}" for line in cfg.deprecations),
        f"run         {cfg.run.name} -> {cfg.run_dir} (seed {cfg.run.seed}, device {cfg.run.device})",
        (f"model       {cfg.model.name} ({cfg.model.dtype}), renderer "
         f"{cfg.model._chosen or repr(cfg.model.renderer)}"
         + (f", options {cfg.model.options}" if cfg.model.options else "")),
        *([f"            {cfg.model._build}"] if cfg.model._build else []),
        *env_lines(cfg),
        (f"sampler     {sampler} (T={cfg.sampler.temperature}, top_p={cfg.sampler.top_p}, "
         f"max_tokens={cfg.sampler.max_tokens})"),
        (f"backend     {cfg.backend.backend}: strict_shared_forward={caps.strict_shared_forward}, "
         f"selective_logits={caps.selective_logits}, LoRA {_lora(caps.lora, cfg.backend)}, "
         f"devices={'/'.join(caps.devices)}"),
        *trainer_option_lines(cfg),
        (f"echo        enabled={cfg.echo.enabled}, weight (world_model_coeff)={cfg.echo.weight} "
         + (f"(RL steps {cfg.echo.rl_weight}) " if cfg.echo.rl_weight is not None else "")
         + f"schedule={cfg.echo.schedule!r}" + (f" over {cfg.echo.schedule_steps} steps"
                                                if cfg.echo.schedule_steps else "")
         + f", normalization={cfg.echo.normalization!r}, target={cfg.echo.world_loss_target!r} "
         f"(include_scaffold={cfg.echo.include_scaffold})"),
        loop_line(cfg),
        rollout_line(cfg),
        policy_loss_line(cfg),
        *guidance_lines(cfg),
        work_line(cfg),
    ]
    from quaero.preflight.memory_lines import memory_lines

    return lines + memory_lines(cfg, device)


# The trainer options the lines of their sections print (run, model, sampler, backend, echo, training, loss,
# guidance);
# trainer_option_lines prints every other one.
SHOWN_WITH_THEIR_SECTION = ("run.seed", "model.name", "model.dtype", "sampler.temperature", "backend.lora",
                            "backend.lora_r", "backend.lora_alpha", "echo.enabled", "echo.weight",
                            "echo.normalization", "loss.aggregation",
                            # the loss line (policy_loss_line) prints these, and [loss.policy]
                            "loss.sampler_correction", "loss.sampler_correction_cap", "loss.beta",
                            "loss.kl_estimator",
                            # the training line (loop_line) prints them
                            "training.steps_per_generation", "training.num_iterations",
                            # the guidance line prints it
                            "guidance.gamma")
# what a value of an option means, where its value alone does not say it
OPTION_NOTES = {"backend.options.train_supervised_context_tokens":
                lambda v: "(APPROXIMATION: rows cropped)" if v else "(exact full context)"}


def trainer_option_lines(cfg, width: int = 110) -> list[str]:
    """`quaero check`'s trainer options (trainers/spec.py `options`), each `key=value` as the config sets it:
    a policy of the spec on a line of its own ("selective", "memory"; `selective_logits` with its policy),
    the rest on a "trainer" line. A key of [backend] or [backend.options] is named alone, others with their
    section."""
    from operator import attrgetter

    from trainers.spec import options

    groups: dict[str, list[str]] = {"trainer": [], "selective": [], "memory": []}
    for o in options():
        if o.key in SHOWN_WITH_THEIR_SECTION:
            continue
        value = attrgetter(o.key)(cfg)
        named = o.name if o.section in ("backend", "backend.options") else o.key
        note = f" {OPTION_NOTES[o.key](value)}" if o.key in OPTION_NOTES else ""
        policy = o.path[0] if len(o.path) > 1 else o.path[0].partition("_")[0]
        groups[policy if policy in groups else "trainer"].append(f"{named}={value!r}{note}")
    lines = []
    for group, items in groups.items():
        line = f"{group:<12}"
        for i, item in enumerate(items):
            if i and len(line) + 2 + len(item) > width:
                lines.append(f"{line},")
                line = f"{'':12}{item}"
            else:
                line += f"{', ' if i else ''}{item}"
        lines.append(line)
    return lines


def loop_line(cfg) -> str:
    """`quaero check`'s [training] line: the loop's steps, learning rates, optimizer steps, checkpoints and
    evaluations."""
    t = cfg.training
    steps = t.steps_per_generation * t.num_iterations
    per_batch = (f", {steps} optimizer steps per rollout batch ({t.steps_per_generation} mini-batches x "
                 f"{t.num_iterations} passes)" if steps > 1 else "")
    return (f"training    steps={t.steps} (lr {cfg.lr_for(sft=False)}), "
            f"warmup_sft_steps={t.warmup_sft_steps} (lr {cfg.lr_for(sft=True)}){per_batch}, "
            f"checkpoint_every={t.checkpoint_every}, eval_every={t.eval_every}")


def rollout_line(cfg) -> str:
    """`quaero check`'s [rollout] line: a step's tasks and groups, dynamic sampling, packing, and the
    advantage estimator."""
    a = cfg.rollout
    dynamic = (f" (<= {a.dynamic_sampling_max_groups:g}x groups)" if a.dynamic_sampling else "")
    nsr = (f", positive_advantage_weight={a.positive_advantage_weight:g}"
           if a.positive_advantage_weight != 1.0 else "") + (
        f", all_fail_advantage={a.all_fail_advantage:g}" if a.all_fail_advantage else "")
    return (f"rollout     {a.tasks_per_step} tasks x group {a.group_size} a step, "
            f"dynamic_sampling={a.dynamic_sampling}{dynamic}, packing={a.packing}, "
            f"advantage={a.advantage!r}, scale_rewards={a.scale_rewards!r}{nsr}")


def policy_loss_line(cfg) -> str:
    """`quaero check`'s [loss] line: the policy loss with its formula, lp_old, the average and the KL
    term."""
    from quaero.preflight.plan import trainer_spec

    return f"loss        {trainer_spec(cfg).describe_policy_loss()}"


def env_lines(cfg) -> list[str]:
    """`quaero check`'s env line, one per env of a mixture (with its share of a step), and its task
    sampler."""
    lines, shares = [], cfg.ratios()
    for name, view in cfg.views().items():
        env = view.env
        src = env.entry if env.starts_env else ", ".join(env.server_urls)
        if env.kwargs:
            src += "(" + ", ".join(f"{k}={v!r}" for k, v in env.kwargs.items()) + ")"
        who = f"env {name!r}   " if cfg.is_mixture else "env         "
        share = (f", {shares[name]:.1%} of a step's groups, group {view.rollout.group_size}, eval "
                 f"{view.training.eval_tasks} tasks, ECHO weight {view.echo.weight}" if cfg.is_mixture
                 else "")
        ts = env.tasks
        tasks = ts.sampler + (f" (key {ts.key}, cost {ts.cost}, γ {ts.gamma}, ε {ts.epsilon})" if ts.learns
                              else "")
        lines.append(f"{who}{src} via {env.launcher} (train split {env.train_split!r}, eval "
                     f"{env.eval_split!r}, max_turns {env.max_turns}, step timeout {env.step_timeout_s}s, "
                     f"retries {env.max_retries}{share}); task sampler {tasks}")
    if cfg.is_mixture:
        n = cfg.rollout.tasks_per_step
        lines.append("mixture     " + ", ".join(f"{name} {share:.1%} (~{share * n:.2g} of {n} groups a step)"
                                                for name, share in shares.items())
                     + "; shared out by smooth weighted round robin: each env within one group of its share")
    return lines


def work_line(cfg) -> str:
    """The sampling work the config asks for, at most: episodes x turns x max_tokens, for train and eval."""
    t, tokens = cfg.training, cfg.sampler.max_tokens
    turns = max(v.env.max_turns for v in cfg.views().values())  # a mixture's longest env's
    total = t.warmup_sft_steps + t.steps
    # the untrained one, every eval_every-th step, and the last step (counted, not enumerated: steps may be
    # huge)
    evals = (1 + total // t.eval_every + (total % t.eval_every != 0) if t.eval_every and t.eval_tasks else 0)
    # a mixture's: its envs' group sizes by share, eval tasks summed
    shares, views = cfg.ratios(), cfg.views()
    group = sum(shares[n] * v.rollout.group_size for n, v in views.items())
    eval_tasks = sum(v.training.eval_tasks for v in views.values())
    n = cfg.rollout.tasks_per_step
    train_eps, eval_eps = round(t.steps * n * group), evals * eval_tasks
    return (f"work        train {train_eps} episodes ({t.steps} steps x {n} x {group:g}), "
            f"eval {eval_eps} ({evals} evals x {eval_tasks}); each <= {turns} turns x {tokens} tokens: <= "
            f"{train_eps * turns * tokens:,} + {eval_eps * turns * tokens:,} sampled tokens"
            + (f"; warm start {t.warmup_sft_steps * n} "
               + ("recorded rows ([data] traces)" if cfg.data.traces else "oracle episodes")
               if t.warmup_sft_steps
               else ""))


def check(args) -> int:
    """`quaero check CONFIG`: the resolved config and its plan, every env's splits, and 'config OK'."""
    from quaero.preflight.plan import load_checked

    cfg = load_checked(args.config, args.overrides)
    print("\n".join(plan_lines(cfg, args.config)))
    from quaero.openenv_client.loading import describe_env
    from quaero.openenv_client.tasks import check_lines

    for name, view in cfg.views().items():
        where = args.config if not cfg.is_mixture else f"{args.config} [[envs]] name={name!r}:"
        if cfg.is_mixture:
            print(f"── env {name!r}")
        # imports the env: its Action problems fail here, before any model
        print("\n".join(describe_env(view.env, view.observation_token_limit)))
        print("\n".join(check_lines(view, where)))  # the env's splits, when it has OpenEnv's Task API
        if view.guidance.mode != "none" and view.guidance.traces:
            from quaero.rollout.traces import guide_trace_line

            print(guide_trace_line(view, where))
    if cfg.data.traces:
        from quaero.rollout.traces import trace_line

        print(trace_line(cfg, args.config))
    print("config OK")
    return 0
