"""`quaero eval --compare` on a mixture (quaero/tools/evaluate.py `pooled_line`): the pooled pairing keys
every episode by its env, so two envs' task 0 never pair with each other."""
from __future__ import annotations

import json

from quaero.tools.evaluate import pooled_line


def _write(folder, name, rows):
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("".join(json.dumps({"repeat": 0, "task": t, "success": s, "reward": float(s),
                                                   "dropped": d}) + "\n" for t, s, d in rows))


def test_the_pooled_comparison_pairs_each_env_on_its_own_tasks(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, "transcripts-a.jsonl", [(0, True, False), (1, True, False)])
    _write(a, "transcripts-b.jsonl", [(0, False, False), (1, True, False)])
    _write(b, "transcripts-a.jsonl", [(0, False, False), (1, True, True)])  # task 1 dropped: not paired
    _write(b, "transcripts-b.jsonl", [(0, False, False), (1, False, False)])
    line = pooled_line({"a": a, "b": b})
    assert line.startswith("pooled over 2 envs, A - B on 3 paired episodes: success +0.333 (A only 1, "
                           "B only 0;")
    (b / "transcripts-b.jsonl").unlink()
    assert pooled_line({"a": a, "b": b}) is None  # one env's comparison is missing: no pooled line
