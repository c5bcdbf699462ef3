"""`quaero check`'s guidance line and its warnings: what guided episodes a config asks for (the schedule, the
guide, the shaping), and the settings that make guidance not do what it says (quaero/recipe/guidance.py plays
the guides)."""
from __future__ import annotations

from quaero.config import QuaeroConfig


def schedule_warning(cfg: QuaeroConfig) -> str | None:
    """A line when some env's guidance never reaches none within the run (its final policy would be measured
    while still guided); None when every schedule ends."""
    t, until = cfg.training, cfg.guidance.until_step
    guided = [name for name, view in cfg.views().items() if view.guidance.mode != "none"]
    if not guided or not t.steps:
        return None
    who = "" if not cfg.is_mixture else f" (envs {', '.join(guided)})"
    if until is None:
        return (f"warning: [guidance] mode{who} never anneals to none (until_step unset): every RL step of "
                f"{t.steps} guides; set [guidance] until_step <= [training] steps")
    if until > t.steps:
        return (f"warning: [guidance] until_step={until} > [training] steps={t.steps}: guidance{who} never "
                "reaches none in this run; set until_step <= steps")
    return None


def prefix_warnings(cfg: QuaeroConfig) -> list[str]:
    """A line for each env whose guided prefix covers every turn it allows (`[guidance] prefix_turns` >= its
    `max_turns`): the guide then plays whole episodes, and `prefix` is `episode` under another name."""
    out = []
    for name, view in cfg.views().items():
        turns, most = view.guidance.prefix_turns, view.env.max_turns
        if view.guidance.mode == "prefix" and turns >= most:
            where = "" if not cfg.is_mixture else f" (env {name})"
            out.append(f"warning: [guidance] prefix_turns={turns} >= [env] max_turns={most}{where}: "
                       "the guide plays every turn until the schedule anneals the prefix below it, and no "
                       f"policy token follows a guided prefix; set prefix_turns < {most}, or mode = "
                       "\"episode\" for whole guided episodes")
    return out


def guidance_lines(cfg: QuaeroConfig) -> list[str]:
    """`quaero check`'s guidance line (none when no env guides) and its schedule's warning."""
    g = cfg.guidance
    modes = {name: view.guidance.mode for name, view in cfg.views().items()}
    if set(modes.values()) == {"none"}:
        return []
    which = "" if not cfg.is_mixture else " on " + ", ".join(n for n, m in modes.items() if m != "none")
    until = (f"annealed linearly to 0 at RL step {g.until_step}" if g.until_step
             else "never annealed")
    used = sorted(set(modes.values()) - {"none"})
    files = sorted({v.guidance.traces for v in cfg.views().values() if v.guidance.traces})
    guide = (f"replayed from the recorded episodes in {', '.join(files)}" if files
             else "played by the env's oracle")
    played = (guide if used == ["episode"] else
              f"(prefix: their first {g.prefix_turns} turn(s)) {guide}, the rest by the policy")
    line = (f"guidance    {'/'.join(used)}{which}: an all-fail group's last {g.members} member(s) "
            f"{played}, {until}; guided tokens shaped by f(p) = p / (p + {g.gamma:g}); a guide's "
            f"call bounded by {g.timeout_s:g} s")
    warning = schedule_warning(cfg)
    return [line] + ([warning] if warning else []) + prefix_warnings(cfg)
