"""`quaero check`: everything judged and printed before a run trains, out of the recipe.

- plan.py: a config judged against what is installed and on disk (trainer, sampler, envs, model, renderer);
  `load_checked` is what `quaero check` and `quaero train` load a config through
- memory_plan.py: one train step's memory by arithmetic from the model's config fields
- memory_lines.py: the memory plan as `quaero check`'s lines, against the device's capacity
- guidance_lines.py: the guidance line and its schedule's warnings
- check.py: the `quaero check` command, a line per config section then the plan's lines
"""
