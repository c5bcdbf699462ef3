"""quaero/rollout/env_text.py on its own: `defuse` (its bound on real renders: test_render.py, test_lengths.py
for `bound_text`)."""
from __future__ import annotations

import re

import pytest

from quaero.rollout.env_text import WORD_JOINER, defuse


@pytest.mark.hostile
def test_defuse_is_the_identity_on_clean_text_and_breaks_overlapping_matches():
    pattern = re.compile("ab|bc")
    assert defuse("plain text, no tokens", pattern) == "plain text, no tokens"
    out = defuse("abc", pattern)
    assert not pattern.search(out) and out.replace(WORD_JOINER, "") == "abc"
    assert defuse(out, pattern) == out
