"""Whether a run's process memory stayed flat: per phase, its RSS after the warm-up against the largest after
it (what `quaero review`'s "process memory flat" check judges, quaero/telemetry/proofs.py `memory_flat`)."""
from __future__ import annotations

from typing import Any

from quaero.telemetry import names, proofs
from quaero.tools.display import finite_number


def rss_growth(steps: list[dict]) -> dict[str, dict[str, Any]]:
    """Per phase: its steps logged by one process (`run_id`: a resume is another process, whose RSS starts
    afresh), `proofs.RSS_MIN_STEPS` or more that logged `process_rss_mb`: the reading after the warm-up
    (`proofs.RSS_WARM_UP_STEPS`, at most a fifth of them), the largest from there on and the growth between
    them (of the process that grew most), what `proofs.memory_flat` judges. Where those two steps also logged
    `process_malloc_in_use_mb`: malloc's memory in use at each (`reference_malloc_mb`, `largest_malloc_mb`),
    which tells memory the process still holds from memory the allocator kept after it was freed."""
    series: dict[tuple[str, Any], list[tuple[Any, float, float | None]]] = {}
    for st in steps:
        if (v := finite_number(st.get(names.PROCESS_RSS_MB))) is not None and v > 0:
            key = (st.get(names.PHASE, names.PHASE_RL), st.get("run_id"))
            series.setdefault(key, []).append((st.get("step"), v,
                                               finite_number(st.get(names.PROCESS_MALLOC_IN_USE_MB))))
    out: dict[str, dict[str, Any]] = {}
    for (phase, _), points in series.items():
        if len(points) < proofs.RSS_MIN_STEPS:
            continue
        warm = min(proofs.RSS_WARM_UP_STEPS, len(points) // 5)
        (ref_step, ref, ref_malloc), (top_step, top, top_malloc) = points[warm], max(points[warm:],
                                                                                     key=lambda p: p[1])
        growth = round((top - ref) / ref, 3)
        if phase not in out or growth > out[phase]["growth"]:
            out[phase] = {"reference_step": ref_step, "reference_rss_mb": ref, "largest_step": top_step,
                          "largest_rss_mb": top, "growth": growth}
            if ref_malloc is not None and top_malloc is not None:
                out[phase].update(reference_malloc_mb=ref_malloc, largest_malloc_mb=top_malloc)
    return out
