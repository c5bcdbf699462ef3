"""Where a run's process memory goes before its first step: `quaero bench soak --stages` runs this module in
a fresh process (`python -m benchmarks.soak_stages CONFIG [SET ...]`) and reads one JSON line per stage:

    python started -> torch imported -> transformers imported -> quaero imported -> the trainer built (the
    model loaded) -> [vllm imported] -> the sampler built -> three sampling calls (4 prompts x 8 samples of
    300 tokens) -> malloc_trim(0)

At each: VmRSS and its anonymous and file-backed parts (/proc/self/status), glibc's heap (mallinfo2: the
arenas' bytes, the mmapped blocks', and the free bytes malloc holds), and the threads. The trainer turns on
`train_cpu_malloc_cache` as the config says (the main job's: no block mmapped, the heap never trimmed), so
what comes after it lands in malloc's heap. `PROCESS_BASELINE_CPU` (quaero/preflight/memory_lines.py) is
the trainer-built stage less the weights.
"""
from __future__ import annotations

import ctypes
import json
import sys

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):  # not glibc 2.33+: RSS only
        return None


LIBC = _libc()


def stage(name: str) -> dict:
    """One stage's reading, printed as a JSON line (MiB)."""
    fields = {}
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "Threads"):
                fields[key] = int(rest.split()[0])
    out = {"stage": name, "rss_mib": round(fields["VmRSS"] / 1024),
           "anon_mib": round(fields["RssAnon"] / 1024), "file_mib": round(fields["RssFile"] / 1024),
           "threads": fields["Threads"]}
    if LIBC is not None:
        m = LIBC.mallinfo2()
        out.update(heap_mib=round(m.arena / MIB), mmapped_mib=round(m.hblkhd / MIB),
                   malloc_free_mib=round(m.fordblks / MIB))
    print(json.dumps(out), flush=True)
    return out


def main(argv: list[str]) -> int:
    stage("python started")
    import torch  # noqa: F401 - the import is what is measured

    stage("torch imported")
    import transformers  # noqa: F401

    stage("transformers imported")
    from quaero.config.load import load_config
    from quaero.preflight.plan import trainer_spec
    from quaero.sampling import make_sampler, resolve_backend
    from trainers.registry import trainer_class

    stage("quaero imported")
    cfg = load_config(argv[0], argv[1:])
    trainer = trainer_class(cfg.backend.backend)(trainer_spec(cfg), "cpu")
    weights = round(sum(p.numel() * p.element_size() for p in trainer.model.parameters()) / MIB)
    built = stage("trainer built")
    print(json.dumps({"weights_mib": weights, "baseline_mib": built["rss_mib"] - weights}), flush=True)
    if resolve_backend(cfg.sampler.backend, "cpu") == "vllm":
        import vllm  # noqa: F401

        stage("vllm imported")
    sampler = make_sampler(cfg, model=trainer.model, stop_token_ids=[0], device="cpu")
    stage(f"sampler built ({type(sampler).__name__})")
    prompts = [[100 + i + j for j in range(300)] for i in range(4)]
    for call in range(3):
        sampler.generate(prompts, n=8, seed=call)
        stage(f"sampled 4 x 8 from 300-token prompts (call {call + 1})")
    if LIBC is not None:
        LIBC.malloc_trim(0)
        stage("malloc_trim(0)")
    sampler.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
