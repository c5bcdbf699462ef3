"""`quaero bench soak`: its verdict on an RSS series, the run's steps read as the events file grows, and its
own run settings kept from a user's --set."""
from pathlib import Path

import pytest

from benchmarks import soak


def _readings(rss: list[float], every: int = 25) -> list[dict]:
    return [{"step": every * (i + 1), "rss_gib": v} for i, v in enumerate(rss)]


def test_the_verdict_judges_the_drift_from_the_reference_step_and_the_ceiling():
    # the reported main job (GB at 100, 351, 376, 401...): far past 10%
    grown = soak.verdict([{"step": 100, "rss_gib": 1.4}, {"step": 351, "rss_gib": 1.6},
                          {"step": 376, "rss_gib": 2.1}, {"step": 476, "rss_gib": 5.45}],
                         reference_step=100, tolerance=0.1, ceiling_gib=1.94)
    assert grown["flat"] is False and grown["largest_drift_step"] == 476 and grown["largest_drift"] > 2.8
    assert "RSS at step 476 is +289% from step 100's" in grown["why"]
    assert "above the plan's expected RSS" in grown["why"]
    # a warm-up that rises, then flat within 10% (the readings before the reference step are not judged)
    flat = soak.verdict(_readings([0.9, 1.3, 1.37, 1.38, 1.37, 1.40]), reference_step=100, tolerance=0.1,
                        ceiling_gib=1.94)
    assert flat["flat"] is True and flat["reference_step"] == 100 and flat["reference_rss_gib"] == 1.38
    over = soak.verdict(_readings([1.3, 1.3, 1.37, 1.38]), reference_step=100, tolerance=0.1, ceiling_gib=1.0)
    assert over["flat"] is False and "above the plan's expected RSS plus the margin (1.0 GiB)" in over["why"]
    assert soak.verdict(_readings([1.0]), reference_step=100, tolerance=0.1, ceiling_gib=None)["flat"] is None


def test_the_run_s_steps_are_read_as_the_events_file_grows(tmp_path):
    events, seen = tmp_path / "events.jsonl", {}
    assert soak.new_steps(events, seen) == []
    events.write_text('{"event": "run_start"}\n{"phase": "sft", "event": "train_step", "step": 1, '
                      '"process_rss_mb": 1400.5}\n{"event": "train_st')  # a line being written: next time
    assert [(e["step"], e["process_rss_mb"]) for e in soak.new_steps(events, seen)] == [(1, 1400.5)]
    with open(events, "a") as f:
        f.write('ep", "step": 2}\n{"event": "eval", "note": "train_step"}\n')
    assert [e["step"] for e in soak.new_steps(events, seen)] == [2]
    assert soak.new_steps(events, seen) == []
    r = soak.reading({"step": 1, "process_rss_mb": 1536.0}, 1, 1, None, 3.0, 0.94)
    assert r == {"step": 1, "phase": "sft", "rss_gib": 1.5, "threads": None, "s": 3.0}


def test_a_live_process_s_rss_is_read_with_its_anonymous_and_file_backed_parts():
    import os

    st = soak.proc_status(os.getpid())
    assert st["rss"] > 0 and st["anon"] > 0 and st["file"] > 0 and st["threads"] >= 1
    # RssAnon + RssFile + RssShmem = VmRSS (the kernel's counters, read at slightly different instants)
    assert abs(st["anon"] + st["file"] - st["rss"]) < 0.1 * st["rss"]
    r = soak.reading({"step": 2}, 2, 1, os.getpid(), 1.0, 1.94)  # no process_rss_mb: the RSS read now
    assert r["phase"] == "rl" and r["rss_gib"] > 0 and r["anon_gib"] > 0 and r["file_gib"] > 0


@pytest.mark.parametrize("key", ["run.output_dir", "run.name", "training.steps"])
def test_a_set_of_the_bench_s_own_keys_is_refused_before_anything_runs(key, capsys):
    with pytest.raises(SystemExit, match=f"--set '{key}=x': the bench sets run.output_dir"):
        soak.main(["--set", f"{key}=x"])


def test_a_table_holding_one_of_the_bench_s_own_keys_is_refused_too():
    """A whole-table set (`training = {steps = 3}`) passed the old string check and set the bench's steps."""
    with pytest.raises(SystemExit, match=r"--set 'training = \{steps = 3\}': the bench sets run.output_dir"):
        soak.main(["--set", "training = {steps = 3}"])


def test_the_plan_beside_the_readings_is_quaero_check_s_for_the_config():
    # the main job's step peak 0.94 GiB (tiny-qwen3, its longest row's microbatch); with the hf sampler its
    # KV reuse store (hf_kv_cache_mib 512) and the process baseline (0.5 GiB) make the expected RSS
    plan = soak.plan_gib("envs/toolbench.toml", ["sampler.backend='hf'"])
    assert plan["peak"] == pytest.approx(0.94, abs=0.05)
    assert plan["sampler"] == 0.5 and plan["baseline"] == 0.5
    assert plan["process"] == pytest.approx(plan["peak"] + 1.0, abs=0.002)
    off = soak.plan_gib("envs/toolbench.toml", ["sampler.backend='hf'", "sampler.hf_kv_cache_mib=0"])
    assert off["sampler"] == 0 and off["process"] == pytest.approx(plan["process"] - 0.5, abs=0.002)


def test_threads_that_keep_multiplying_are_not_flat_whatever_the_rss():
    # the main job before the fix, 200 warm-start steps: RSS +1.4% from step 100, threads 1,451 -> 2,838
    before = [{"step": 100, "rss_gib": 1.464, "threads": 1451},
              {"step": 200, "rss_gib": 1.485, "threads": 2838}]
    v = soak.verdict(before, reference_step=100, tolerance=0.1, ceiling_gib=1.94)
    assert v["flat"] is False and v["why"] == "its threads grew 1451 -> 2838 (steps 100 -> 200)"
    after = [{"step": 100, "rss_gib": 1.274, "threads": 35}, {"step": 303, "rss_gib": 1.3, "threads": 60}]
    assert soak.verdict(after, reference_step=100, tolerance=0.1, ceiling_gib=1.94)["flat"] is True


def test_a_stage_reading_splits_the_rss_and_reads_malloc_s_heap():
    import json
    import platform
    import subprocess
    import sys

    # in a fresh process: a test worker's malloc may hand back memory it already holds (an earlier test's
    # malloc cache settings keep freed blocks resident), so 64 MiB more showed in no reading on a CI worker
    code = ("from benchmarks import soak_stages\n"
            "soak_stages.stage('before')\n"
            "block = bytearray(b'\\x01') * (64 * 2**20)  # 64 MiB, every byte written: resident, anonymous\n"
            "soak_stages.stage('after')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3]).stdout.splitlines()
    before, after = (json.loads(line) for line in out[-2:])
    assert before["stage"] == "before" and after["stage"] == "after"
    assert after["anon_mib"] - before["anon_mib"] >= 60 and after["rss_mib"] >= after["anon_mib"]
    if platform.libc_ver()[0] == "glibc":
        assert after["heap_mib"] + after["mmapped_mib"] - before["heap_mib"] - before["mmapped_mib"] >= 60


@pytest.mark.hostile
@pytest.mark.parametrize("bench", ["soak", "sampler_reuse"])
def test_a_json_path_a_bench_cannot_write_is_refused_before_its_work(tmp_path, monkeypatch, bench):
    """bench soak and bench sampler-reuse checked --json only when they wrote it: a FIFO or a link was
    refused after the whole run (an hour of soak), where every other bench refuses it first."""
    import importlib
    import os

    module = importlib.import_module(f"benchmarks.{bench}")
    monkeypatch.setattr(module, "soak" if bench == "soak" else "run",
                        lambda *a, **k: pytest.fail("the bench ran"))
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "link.json").symlink_to(tmp_path / "elsewhere.json")
    for path, says in ((tmp_path / "fifo.json", "a special file"), (tmp_path / "link.json", "a symlink")):
        with pytest.raises(SystemExit, match=f"--json {path}: {says}"):
            module.main(["--json", str(path)])
    assert not (tmp_path / "elsewhere.json").exists()
