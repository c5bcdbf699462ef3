"""Environment text on its way to a chat template: `defuse` (an added-token string in a message stays text,
never the token's id) and `bound_text` (a message cut to a token budget as the template sees it, marked). The
render adapter (quaero/rollout/render.py) applies both on every render path."""
from __future__ import annotations

import re

# U+2060 WORD JOINER: invisible, kept by NFC, and in no added token, so it splits any of them.
WORD_JOINER = "\u2060"


def marker_vocab(tokenizer) -> dict[str, int]:
    """The tokenizer's added tokens that can be chat structure: every one but whitespace runs (Gemma's
    user-defined `\n`, `\n\n`, `  `, tabs are added tokens; they are text, the same text whichever way it is
    encoded, and a joiner in them would change what the env wrote)."""
    return {t: i for t, i in tokenizer.get_added_vocab().items() if t.strip()}


def added_token_pattern(tokenizer) -> re.Pattern:
    """Matches any added-token string of the tokenizer (`marker_vocab`, longest first), special or not:
    Qwen3's `<tool_call>` and `<think>` are not special but still encode to their single ids. A
    one-character token cannot be split, so it is left out (Qwen's added tokens are all longer)."""
    tokens = sorted((t for t in marker_vocab(tokenizer) if len(t) > 1), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens)) or r"(?!)")


def probe_markers(tokenizer, most: int = 256) -> list[str]:
    """The added-token strings the construction probe spells: all of them up to `most`; past that (Gemma 3
    has 6,400, most `<unusedN>`), those the chat template or the special-token map names, then others spread
    evenly over the rest (a render's own check, `_undone`, covers every token at run time)."""
    tokens = [t for t in marker_vocab(tokenizer) if len(t) > 1]
    if len(tokens) <= most:
        return tokens
    source = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    named = {t for t in tokens if t in source or t in tokenizer.all_special_tokens}
    rest = [t for t in tokens if t not in named]
    step = max(1, len(rest) // max(1, most - len(named)))
    return sorted(named) + rest[::step][:max(0, most - len(named))]


def defuse(text: str, pattern: re.Pattern) -> str:
    """`text` with a WORD JOINER after the first character of every added-token string in it, so the
    tokenizer's added-token matcher finds none and the string tokenizes as ordinary text.

    Why this and not `split_special_tokens`: the renderer encodes message text in the same call as
    template text that relies on added-token matching (the tools block's literal `<tool_call>`, the
    `<think>` block), so the tokenizer cannot tell content from template; the text must change
    before it reaches the template. The transform is a pure function of the text, the identity on
    text without added-token strings, and applied on every render path (sampling prompt, scripted
    action, bridge), so the bridge's exact prefix and the packed-row extension hold as on clean text.
    Removing the joiners gives the original text back. Repeated until nothing matches, because
    breaking one match could expose an overlapping one."""
    while pattern.search(text):
        text = pattern.sub(lambda m: m[0][0] + WORD_JOINER + m[0][1:], text)
    return text


def truncation_marker(dropped_chars: int) -> str:
    return f" … [truncated: {dropped_chars} more characters]"


def _raw_length(raw: str, defused: str, n: int) -> int:
    """How many characters of `raw` the first `n` characters of `defuse(raw)` hold: defuse only inserts
    joiners, and an inserted one is followed by an added token's second character, never by a joiner of
    `raw`, so a greedy walk matches them exactly."""
    i = 0
    for ch in defused[:n]:
        if i < len(raw) and ch == raw[i]:
            i += 1
    return i


def bound_text(text: str, max_tokens: int, tokenizer, pattern: re.Pattern | None = None) -> str:
    """`text` itself when it tokenizes to at most `max_tokens` tokens; else its longest token-aligned
    prefix that, with `truncation_marker` appended, still does.

    With `pattern` (the tokenizer's added tokens) the text is counted as the template will see it,
    defused: an added-token string is one token raw but several defused, so a bound counted on raw text
    let a flood of `<|im_end|>` through at about seven times the bound.

    Only a window of the text is tokenized (doubled until it holds more than `max_tokens` tokens or the
    whole text), so a megabyte observation costs what a few thousand tokens cost. The marker counts the
    dropped characters: counting dropped tokens would tokenize everything this avoids."""
    encode = tokenizer.backend_tokenizer.encode  # the Rust tokenizer: offsets, and no padding state to set

    def seen(s: str) -> str:
        return s if pattern is None else defuse(s, pattern)

    def fits(s: str) -> bool:
        return len(encode(seen(s), add_special_tokens=False).ids) <= max_tokens

    if len(text.encode()) <= max_tokens and (pattern is None or fits(text)):  # every token holds a byte
        return text
    window = 8 * max_tokens
    while True:
        view = seen(text[:window])
        enc = encode(view, add_special_tokens=False)
        if len(enc.ids) > max_tokens:
            break
        if window >= len(text):
            return text
        window *= 2
    keep = max_tokens - len(encode(truncation_marker(len(text)), add_special_tokens=False).ids)
    while keep > 0:
        cut = _raw_length(text, view, enc.offsets[keep - 1][1])
        out = text[:cut] + truncation_marker(len(text) - cut)
        if fits(out):
            return out
        keep -= 1  # a merge across the cut made it longer: give up one more token
    return truncation_marker(len(text)).strip()
