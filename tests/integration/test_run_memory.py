"""A real tiny warm start (toolbench in-process, tiny-qwen3, the local trainer) keeps no thread per oracle
call and logs the process's RSS every step, and malloc's memory in use beside it (what `quaero review`'s
"process memory flat" reads).

Each call of the env's oracle runs bounded on a thread (quaero/bounded.py); one left idle per call was ~14
threads a step of the main job, 1,968 at its step 137, whose thread states, allocated among the freed
tensors, pinned the malloc cache's heap (the RSS grew by one vocab x hidden block at steps 14 and 136)."""
import threading

import pytest
from fixtures.runs import events_of, make_config


def _oracle_threads() -> int:
    return sum(t.name == "quaero-user-call" for t in threading.enumerate())


@pytest.mark.slow
def test_a_warm_start_leaves_no_thread_per_oracle_call_and_logs_its_rss(tmp_path):
    from quaero.recipe.train import train

    before = _oracle_threads()
    _, cfg = make_config(tmp_path, "threads", steps=0, warmup=2, eval_every=0, eval_tasks=0,
                         extra=["env.launcher=inprocess"])
    run_dir = train(cfg)
    steps = events_of(run_dir, "train_step")
    assert len(steps) == 2 and sum(s["turns"] for s in steps) >= 4  # the oracle acted every turn
    for t in [t for t in threading.enumerate() if t.name == "quaero-user-call"]:
        t.join(5)  # a call's thread ends when it returns
    assert _oracle_threads() == before
    assert all(s["process_rss_mb"] > 100 for s in steps)
    # malloc's share of it (glibc's mallinfo2): the model's tensors at least, never more than the process has;
    # read where it costs at most 1% of the step (~20 ms here, against 2 s steps: some steps skip it)
    read = [s for s in steps if "process_malloc_in_use_mb" in s]
    assert read and all(10 < s["process_malloc_in_use_mb"] < s["process_rss_mb"] for s in read), steps
