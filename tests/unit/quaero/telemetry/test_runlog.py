"""The run log: valid JSON lines with stable fields, flushed per event, torn lines tolerated."""
import json

import pytest

from quaero.telemetry import runlog


def test_events_are_json_lines_with_stable_fields(tmp_path):
    runlog.configure(console="none")
    log = runlog.get_logger("test")
    with runlog.RunLog(tmp_path, run_id="abc123") as run:
        runlog.set_step(3)
        log.info("train_step", loss=1.5, local_train_selective_hidden_logprob_batches=2)
        # flushed per event: readable before the run closes
        lines = run.path.read_text().splitlines()
        assert len(lines) == 1
        runlog.set_step(4)
        log.warning("env_episode_dropped", reason="timeout")
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["train_step", "env_episode_dropped"]
    for e in events:
        assert {"run_id", "step", "event", "timestamp", "level"} <= set(e)
        assert e["run_id"] == "abc123"
    assert events[0]["step"] == 3 and events[1]["step"] == 4
    assert events[0]["local_train_selective_hidden_logprob_batches"] == 2


@pytest.mark.hostile
def test_a_deleted_or_replaced_events_file_is_recreated_with_a_notice(tmp_path):
    runlog.configure(console="none")
    log = runlog.get_logger("test")
    with runlog.RunLog(tmp_path, run_id="abc123") as run:
        runlog.set_step(1)
        log.info("train_step", loss=1.0)
        run.path.unlink()  # `rm events.jsonl` while the run goes on
        runlog.set_step(2)
        log.info("train_step", loss=0.5)
        log.info("train_step", loss=0.25)  # one notice, not one per event
        run.path.rename(tmp_path / "moved.jsonl")  # replaced: a new file under the same name
        run.path.write_text("")
        log.info("eval", eval_reward=1.0)
    events, _ = runlog.read_events(run.path)
    assert [e["event"] for e in events] == ["events_file_recreated", "eval"]
    moved, _ = runlog.read_events(tmp_path / "moved.jsonl")
    assert [e["event"] for e in moved] == ["events_file_recreated", "train_step", "train_step"]
    notice = moved[0]
    assert notice["run_id"] == "abc123" and notice["step"] == 2 and notice["level"] == "warning"
    assert [e["loss"] for e in moved[1:]] == [0.5, 0.25]


@pytest.mark.hostile
def test_read_events_skips_a_torn_last_line(tmp_path):
    p = tmp_path / "events.jsonl"
    p.write_text('{"event": "a", "step": 1}\n{"event": "b", "st')
    events, unreadable = runlog.read_events(p)
    assert [e["event"] for e in events] == ["a"] and unreadable == 1


@pytest.mark.hostile
def test_read_events_counts_lines_that_are_not_utf8_json_objects(tmp_path):
    p = tmp_path / "events.jsonl"
    p.write_bytes(b'{"event": "a"}\n\xff\xfe{"event": "b"}\n[1, 2]\n"text"\nnull\n\n   \n' + b"[" * 100_000
                  + b'\n{"event": "c"}\n')
    events, unreadable = runlog.read_events(p)
    assert [e["event"] for e in events] == ["a", "c"] and unreadable == 5  # blank lines are not counted


def test_cumulative_rules():
    c = runlog.Cumulative()
    c.add({"local_train_selective_hidden_logprob_batches": 2, "peak_mem_mb": 10.0, "loss": 1.0,
           "local_train_compile_selective_ce_mode": "auto", "local_train_selective_suffix_logits": True,
           "policy_staleness": 1})
    tot = c.add({"local_train_selective_hidden_logprob_batches": 3, "peak_mem_mb": 7.0, "loss": 0.5,
                 "local_train_compile_selective_ce_mode": "off", "policy_staleness": 1})
    assert tot["local_train_selective_hidden_logprob_batches"] == 5
    assert tot["policy_staleness"] == 1  # a level, not a count: the run's largest, never a sum
    assert tot["peak_mem_mb"] == 10.0 and "loss" not in tot
    assert tot["local_train_compile_selective_ce_mode"] == "off"
    assert tot["local_train_selective_suffix_logits"] is True


def test_cumulative_totals_each_metric_as_names_declares_it():
    """How a metric totals is its declaration (quaero/telemetry/names.py), never its spelling; a name declared
    nowhere totals by its type."""
    from quaero.telemetry import metrics, names

    totals = {metrics.SUM, metrics.MAX, metrics.LATEST, metrics.STEP}
    assert {m.total for m in metrics.METRICS.values()} <= totals
    c = runlog.Cumulative()
    for _ in range(2):
        tot = c.add({names.RANKS: 2, names.RANK_PEAK_MEM_MB: [1.0, 2.0], names.DROP_REASON + "timeout": 1,
                     names.SAVE_ON_CPU_OFFLOADED_MB: 3.0, "a_benchmark_count": 4, "a_benchmark_label": "x"})
    assert tot[names.RANKS] == 2  # a level, declared LATEST: never summed
    assert names.RANK_PEAK_MEM_MB not in tot and names.SAVE_ON_CPU_OFFLOADED_MB not in tot  # per step only
    assert tot[names.DROP_REASON + "timeout"] == 2  # a family's member sums as the family declares
    assert tot["a_benchmark_count"] == 8 and tot["a_benchmark_label"] == "x"  # undeclared: by type


@pytest.mark.hostile
def test_a_full_disk_loses_only_the_events_it_could_not_write_and_never_ends_the_run(tmp_path):
    """A real failing write (the file size limit, EFBIG) in a child process: the run's logging goes on, the
    torn line is closed, and an `events_lost` line counts what is missing once writing works again."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    code = textwrap.dedent(f"""
        import resource, signal
        from pathlib import Path
        from quaero.telemetry import runlog
        run = Path({str(tmp_path)!r})
        runlog.configure(console="none")
        log = runlog.get_logger("t")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        with runlog.RunLog(run, run_id="r"):
            log.info("run_start")
            limit = (run / "events.jsonl").stat().st_size + 200
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
            for i in range(5):
                log.info("train_step", pad="y" * 150)
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            log.info("run_end")
    """)
    root = Path(__file__).resolve().parents[4]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("cannot append events") == 1  # said once, not per event
    events, unreadable = runlog.read_events(tmp_path / "events.jsonl")
    # the torn one
    assert [e["event"] for e in events] == ["run_start", "events_lost", "run_end"] and unreadable == 1
    assert events[1]["events"] == 5


def test_an_error_line_keeps_the_lines_that_name_the_fix_and_cuts_a_dump():
    # carla_env's real message: the fix is on its second line
    carla = ImportError("CARLA package not available. Install with: pip install carla\nOr use mode='mock'")
    assert runlog.error_line(carla) == ("ImportError: CARLA package not available. Install with: pip install "
                                        "carla Or use mode='mock'")
    # nltk's opens on a blank and a rule of stars, and its fix is three lines down
    nltk = LookupError("\n" + "*" * 70 + "\n  Resource words not found.\n  Please use the NLTK Downloader to "
                       "obtain the resource:\n\n  >>> import nltk\n  >>> nltk.download('words')\n" + "*" * 70)
    assert runlog.error_line(nltk) == ("LookupError: Resource words not found. Please use the NLTK "
                                       "Downloader to obtain the resource: >>> import nltk >>> "
                                       "nltk.download('words')")
    # a dump: the lines that fit in the limit, never a cut line after the first
    dump = ValueError("first line\n" + "\n".join(f"frame {i} " + "x" * 40 for i in range(100)))
    line = runlog.error_line(dump, limit=120)
    assert line.startswith("ValueError: first line frame 0 ") and len(line) <= len("ValueError: ") + 120
    assert line.endswith("x" * 40) and "\n" not in line
    assert runlog.error_line(ValueError("y" * 500), limit=50) == "ValueError: " + "y" * 50
    assert runlog.error_line(ValueError()) == "ValueError: "
