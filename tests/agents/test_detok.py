from __future__ import annotations

import pytest

from agents.detok import TextAssembler


class CharTokenizer:
    """One token per UTF-8 byte, decoded with replacement characters like byte-level BPE."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def run(text: str, stop=()):
    tok = CharTokenizer()
    asm = TextAssembler(tok, stop)
    chunks = []
    for token in tok.encode(text):
        chunks.append(asm.push(token))
        if asm.stopped:
            break
    chunks.append(asm.finish())
    return asm, chunks


def test_streamed_chunks_join_to_the_text_and_hold_partial_utf8():
    asm, chunks = run("héllo ✓ done")
    assert "".join(chunks) == asm.text == "héllo ✓ done"
    assert all("\ufffd" not in c for c in chunks)


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        ("answer: 42\n\nmore text", ("\n\n",), "answer: 42"),
        ("abcENDxyz", ("END", "xy"), "abc"),
        ("abcxyzEND", ("END", "xy"), "abc"),
        ("no stop here", ("STOP",), "no stop here"),
        ("ends with partial ST", ("STOP",), "ends with partial ST"),
    ],
)
def test_stop_strings(text, stop, expected):
    asm, chunks = run(text, stop)
    assert asm.text == expected
    assert "".join(chunks) == expected


def test_text_that_may_start_a_stop_string_is_held_back():
    tok = CharTokenizer()
    asm = TextAssembler(tok, ("<END>",))
    out = [asm.push(t) for t in tok.encode("ab<EN")]
    assert "".join(out) == "ab"  # "<EN" might become "<END>"
    out.append(asm.push(ord("X")))
    assert "".join(out) == "ab<ENX"


def test_the_stop_string_that_ended_the_text_is_named():
    asm, _ = run("a summary.\n### DOCUMENT START ===\nYou write clear reports", ("\n\n", "DOCUMENT START", "DOCUMENT END"))
    assert asm.text == "a summary.\n### "
    assert asm.stopped_by == "DOCUMENT START"
    unstopped, _ = run("no marker here", ("DOCUMENT START",))
    assert unstopped.stopped_by is None
