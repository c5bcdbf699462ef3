"""`quaero check`'s guidance line and its warnings: what guided episodes a config asks for (the schedule, the
guide, the shaping), and the settings that make guidance not do what it says (quaero/recipe/guidance.py plays
the guides)."""
from __future__ import annotations

from quaero.config import QuaeroConfig


def schedule_warning(cfg: QuaeroConfig) -> str | None:
    """A line when some env's guidance never reaches none within the run (its final policy would be measured
    while still guided); None when every schedule ends."""
    t = cfg.training
    guided = [name for name, view in cfg.views().items() if view.training.guidance != "none"]
    if not guided or not t.steps:
        return None
    who = "" if not cfg.is_mixture else f" (envs {', '.join(guided)})"
    if t.guidance_until_step is None:
        return (f"warning: [training] guidance{who} never anneals to none (guidance_until_step unset): every "
                f"RL step of {t.steps} guides; set guidance_until_step <= steps")
    if t.guidance_until_step > t.steps:
        return (f"warning: [training] guidance_until_step={t.guidance_until_step} > steps={t.steps}: "
                f"guidance{who} never reaches none in this run; set guidance_until_step <= steps")
    return None


def prefix_warnings(cfg: QuaeroConfig) -> list[str]:
    """A line for each env whose guided prefix covers every turn it allows (`guidance_prefix_turns` >= its
    `max_turns`): the guide then plays whole episodes, and `prefix` is `episode` under another name."""
    out = []
    for name, view in cfg.views().items():
        turns, most = view.training.guidance_prefix_turns, view.env.max_turns
        if view.training.guidance == "prefix" and turns >= most:
            where = "" if not cfg.is_mixture else f" (env {name})"
            out.append(f"warning: [training] guidance_prefix_turns={turns} >= [env] max_turns={most}{where}: "
                       "the guide plays every turn until the schedule anneals the prefix below it, and no "
                       f"policy token follows a guided prefix; set guidance_prefix_turns < {most}, or "
                       "guidance = \"episode\" for whole guided episodes")
    return out


def guidance_lines(cfg: QuaeroConfig) -> list[str]:
    """`quaero check`'s guidance line (none when no env guides) and its schedule's warning."""
    t = cfg.training
    modes = {name: view.training.guidance for name, view in cfg.views().items()}
    if set(modes.values()) == {"none"}:
        return []
    which = "" if not cfg.is_mixture else " on " + ", ".join(n for n, m in modes.items() if m != "none")
    until = (f"annealed linearly to 0 at RL step {t.guidance_until_step}" if t.guidance_until_step
             else "never annealed")
    used = sorted(set(modes.values()) - {"none"})
    files = sorted({v.training.guidance_traces for v in cfg.views().values() if v.training.guidance_traces})
    guide = (f"replayed from the recorded episodes in {', '.join(files)}" if files
             else "played by the env's oracle")
    played = (guide if used == ["episode"] else
              f"(prefix: their first {t.guidance_prefix_turns} turn(s)) {guide}, the rest by the policy")
    line = (f"guidance    {'/'.join(used)}{which}: an all-fail group's last {t.guided_members} member(s) "
            f"{played}, {until}; guided tokens shaped by f(p) = p / (p + {t.guidance_gamma:g}); a guide's "
            f"call bounded by {t.guide_timeout_s:g} s")
    warning = schedule_warning(cfg)
    return [line] + ([warning] if warning else []) + prefix_warnings(cfg)
