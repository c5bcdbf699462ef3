"""quaero/rollout/env_text.py on its own: `defuse` (its bound on real renders: test_render.py, test_lengths.py
for `bound_text`)."""
from __future__ import annotations

import re

import pytest

from quaero.rollout.env_text import WORD_JOINER, added_token_pattern, defuse, marker_vocab, probe_markers


@pytest.mark.hostile
def test_defuse_is_the_identity_on_clean_text_and_breaks_overlapping_matches():
    pattern = re.compile("ab|bc")
    assert defuse("plain text, no tokens", pattern) == "plain text, no tokens"
    out = defuse("abc", pattern)
    assert not pattern.search(out) and out.replace(WORD_JOINER, "") == "abc"
    assert defuse(out, pattern) == out


class _Tokenizer:
    """What env_text reads of a tokenizer: its added vocabulary, template and special tokens."""

    def __init__(self, added: dict[str, int], chat_template: str = "", special: tuple[str, ...] = ()):
        self._added, self.chat_template, self.all_special_tokens = added, chat_template, list(special)

    def get_added_vocab(self) -> dict[str, int]:
        return dict(self._added)


def test_whitespace_added_tokens_are_text_never_defused():
    # Gemma 3's user-defined tokens: newline and space runs are added tokens, and env text is full of them
    tok = _Tokenizer({"\n": 107, "\n\n": 108, "  ": 138, "\t\t": 255969, "<end_of_turn>": 106})
    pattern = added_token_pattern(tok)
    text = "line one\n\nline  two\t\t<end_of_turn>"
    assert defuse(text, pattern) == f"line one\n\nline  two\t\t<{WORD_JOINER}end_of_turn>"
    assert marker_vocab(tok) == {"<end_of_turn>": 106}


def test_the_probe_spells_a_bounded_set_led_by_the_markers_the_template_names():
    added = {f"<unused{i}>": i for i in range(6000)} | {"<start_of_turn>": 6001, "<end_of_turn>": 6002}
    tok = _Tokenizer(added, chat_template="<start_of_turn>{{ m }}<end_of_turn>", special=("<unused7>",))
    probe = probe_markers(tok, most=64)
    assert len(probe) == 64 and set(probe[:3]) == {"<start_of_turn>", "<end_of_turn>", "<unused7>"}
    assert probe_markers(_Tokenizer({"<a>": 1, "<b>": 2}), most=64) == ["<a>", "<b>"]
