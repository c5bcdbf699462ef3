"""scripts/curves.py on the committed events of seed 0's ECHO pair (benchmarks/results/cpu-2026-12-06d): the
ECHO-on arm, started from the ECHO-off run's copied step-10 checkpoint, is paired against that run's
warm-start eval and against the ECHO-off arm at the same step, as benchmarks/README.md reports them."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "results" / "cpu-2026-12-06d" / "smollm2-echo"


def test_curves_pairs_each_arm_with_its_seeds_warm_start_and_first_arm(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("curves", ROOT / "scripts" / "curves.py")
    curves = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(curves)
    figure = tmp_path / "arms.png"
    assert curves.main(["--warm-step", "10", "--plot", str(figure),
                        "--run", "off", "0", str(RESULTS / "off-events.jsonl"),
                        "--run", "on", "0", str(RESULTS / "on-events.jsonl")]) == 0
    lines = capsys.readouterr().out.splitlines()
    off, on = lines.index(next(x for x in lines if x.startswith("== off"))), lines.index(
        next(x for x in lines if x.startswith("== on")))
    rows = {(label, x.split()[0]): x for label, part in (("off", lines[off:on]), ("on", lines[on:]))
            for x in part if x[:4].strip().isdigit()}
    assert rows["off", "10"].split()[1:4] == ["0", "0.344", "±"]  # the warm start, 0 RL tokens
    assert "+19/-1 p 4e-05" in rows["off", "40"]  # steps 10 -> 40 without ECHO
    assert ("on", "10") not in rows  # the ECHO-on arm logged no warm start of its own
    assert rows["on", "30"].split()[1] == "29,153" and rows["on", "30"].endswith("+2/-15 p 0.0023")
    assert "+10/-2 p 0.039" in rows["on", "40"]  # against the ECHO-off run's warm start
    assert any(x.startswith("  by template, step 40: city 0.70") for x in lines[off:on])
    assert figure.read_bytes().startswith(b"\x89PNG")
