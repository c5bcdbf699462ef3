"""The Gemma 3 family without its 253 MB file: the chat template quaero supplies, the GGUF vocabulary rebuilt
as a BPE whose merges follow the scores, and the chunk packages checked before a byte is assembled."""
import hashlib

import pytest

from quaero.chat.sandbox import TemplateProblem, TemplateRunner
from quaero.models import gemma3
from quaero.models.base import ModelNotFound


def render(messages, generation_prompt=False):
    return TemplateRunner(gemma3.CHAT_TEMPLATE).render(messages=messages, bos_token="<bos>",
                                                       add_generation_prompt=generation_prompt)


def test_the_template_renders_gemma_3s_format_with_the_system_prompt_in_the_first_user_turn():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [{"type": "text",
                                                                                      "text": "Bye"}]}]
    assert render(chat, generation_prompt=True) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert render(chat[1:2]) == "<bos><start_of_turn>user\nHi<end_of_turn>\n"


@pytest.mark.parametrize("roles", [("user", "user"), ("assistant",), ("user", "assistant", "assistant")])
def test_the_template_refuses_turns_that_do_not_alternate(roles):
    with pytest.raises(TemplateProblem, match="alternate"):
        render([{"role": r, "content": "x"} for r in roles])


def vocabulary():
    """A Gemma-like GGUF vocabulary: specials, filler, the turn markers at 105/106, the 256 bytes, letters and
    three merged pieces whose scores (minus their rank) make "user" one BPE token, where the sum of scores a
    Unigram maximizes prefers "us" + "er" (-21 against -30)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + [f"<unused{i}>" for i in range(100)]
    types = [gemma3.CONTROL] * len(tokens)
    tokens += ["<start_of_turn>", "<end_of_turn>", "\n"]
    types += [gemma3.CONTROL, gemma3.CONTROL, gemma3.USER_DEFINED]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = [("u", -1), ("s", -2), ("e", -3), ("r", -4), ("\u2581", -5), ("us", -10), ("er", -11),
              ("user", -30), ("\u2581user", -40)]
    tokens += [p for p, _ in pieces]
    types += [gemma3.NORMAL] * len(pieces)
    scores = [-1000.0] * (len(tokens) - len(pieces)) + [float(s) for _, s in pieces]
    return {"tokens": tokens, "scores": scores, "token_type": types}


def test_the_gguf_vocabulary_becomes_a_bpe_whose_merges_follow_the_scores():
    vocab = vocabulary()
    tok = gemma3.gguf_tokenizer(vocab, "gemma3-270m")
    ids = {t: i for i, t in enumerate(vocab["tokens"])}
    text = "<start_of_turn>user\n user é<end_of_turn>\n"
    got = tok.encode(text, add_special_tokens=False)
    assert got[:5] == [105, ids["user"], ids["\n"], ids["\u2581user"], ids["\u2581"]]
    assert got[5:7] == [ids["<0xC3>"], ids["<0xA9>"]]  # é, not in the vocabulary: its UTF-8 bytes
    assert got[7:] == [106, ids["\n"]]
    assert tok.decode(got) == text
    assert tok.encode("user")[0] == 2  # <bos> first, as the GGUF's add_bos_token says
    assert tok.chat_template == gemma3.CHAT_TEMPLATE and tok.eos_token == "<eos>"


def test_a_vocabulary_without_gemma_3s_turn_markers_is_refused():
    vocab = vocabulary()
    vocab["tokens"][106] = "<unused_x>"
    with pytest.raises(ModelNotFound, match="no Gemma 3 turn markers"):
        gemma3.gguf_tokenizer(vocab, "gemma3-270m")


@pytest.fixture
def chunks(tmp_path, monkeypatch):
    """The four chunk packages on sys.path, holding a small stand-in GGUF whose size and sha256 are set as the
    real one's."""
    data = b"GGUF" + bytes(range(256)) * 4
    cuts = [0, 100, 400, 700, len(data)]
    paths = []
    for i, module in enumerate(gemma3.PARTS):
        folder = tmp_path / module / "data"
        folder.mkdir(parents=True)
        (tmp_path / module / "__init__.py").write_text("")
        paths.append(folder / f"{gemma3.GGUF_NAME}.part{i:02d}")
        paths[-1].write_bytes(data[cuts[i]:cuts[i + 1]])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(gemma3, "GGUF_BYTES", len(data))
    monkeypatch.setattr(gemma3, "GGUF_SHA256", hashlib.sha256(data).hexdigest())
    return data, paths


def test_the_chunks_assemble_into_the_checked_gguf(chunks, tmp_path):
    data, _ = chunks
    assert gemma3.assemble_gguf(tmp_path / "out.gguf", "gemma3-270m").read_bytes() == data


def test_missing_truncated_or_corrupt_chunks_are_one_line_naming_the_reinstall(chunks, tmp_path):
    data, paths = chunks
    paths[2].write_bytes(paths[2].read_bytes()[:-1])
    with pytest.raises(ModelNotFound, match=f"hold {len(data) - 1:,} bytes.*force-reinstall"):
        gemma3.assemble_gguf(tmp_path / "out.gguf", "gemma3-270m")
    paths[2].write_bytes(b"x" + data[401:700])  # the same size, other bytes
    with pytest.raises(ModelNotFound, match="corrupt"):
        gemma3.assemble_gguf(tmp_path / "out.gguf", "gemma3-270m")
    assert not (tmp_path / "out.gguf").exists()  # nothing half-checked is left to be read
    paths[3].unlink()
    with pytest.raises(ModelNotFound, match="part03 is missing"):
        gemma3.assemble_gguf(tmp_path / "out.gguf", "gemma3-270m")


def test_a_missing_chunk_package_names_the_install(chunks, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec  # the others resolve to the fixture's packages, installed or not
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == gemma3.PARTS[1] else real(name, *a))
    with pytest.raises(ModelNotFound, match=r"q4_k_m_gguf_part2 is not installed.*quaero\[gemma3\]"):
        gemma3.chunk_paths("gemma3-270m")
