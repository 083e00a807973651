"""Exact cases of the tag cutting (`arpo_trl.tools.tags`) where one token completes more than one stop string: the
model's text must be cut at the first tag to end, and the call read from it (the fuzz tests in test_fuzz.py check
the contract on random text)."""

from __future__ import annotations

from arpo_trl.tools.tags import cut_at_stop, extract_call, first_stop


class Pieces:
    """A tokenizer whose tokens are arbitrary strings: `decode` joins them, `encode` gives one token per character."""

    def __init__(self):
        self.vocab: list[str] = []

    def ids(self, *pieces: str) -> list[int]:
        for piece in pieces:
            if piece not in self.vocab:
                self.vocab.append(piece)
        return [self.vocab.index(piece) for piece in pieces]

    def decode(self, ids) -> str:
        return "".join(self.vocab[i] for i in ids)

    def encode(self, text: str) -> list[int]:
        return self.ids(*text)


def test_the_stop_string_that_ends_first_wins():
    tok = Pieces()
    ids = tok.ids("x=1", "</x></a_much_longer_stop>")
    assert first_stop(ids, tok.decode, ["</a_much_longer_stop>", "</x>"]) == (2, "</x>")
    ids = tok.ids("q", "</search></python></search>")  # a stop string that also occurs again later in the token
    assert first_stop(ids, tok.decode, ["</python>", "</search>"]) == (2, "</search>")


def test_a_token_holding_the_tag_twice_is_cut_after_the_first():
    tok = Pieces()
    ids = tok.ids("<python>1", "</python>x</python>")
    kept, rewritten, tag = cut_at_stop(ids, tok.decode, tok.encode, ["</python>"])
    assert tag == "</python>" and kept == ids[:1]
    assert tok.decode(kept + rewritten) == "<python>1</python>"


def test_the_call_is_the_first_closed_one():
    assert extract_call("<python>a</python><python>b</python>", "</python>") == "a"
    assert extract_call("<search> q </search> <python>x</python>", "</python>") == "x"
