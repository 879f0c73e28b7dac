"""Incremental detokenizer and stop strings, against the tokenizer's own full decode."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdtb.router.detok import REPLACEMENT, IncrementalDetokenizer, OutputText, StopMatcher

TEXTS = ["Grüße 東京 🙂", "Héllo wörld, ça va? 와 서울 — 🙂🙂 end", "plain ascii text", "🙂"]


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(llama_dir)


def stream(tokenizer, ids: list[int], batch: int) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(ids[i:i + batch]) for i in range(0, len(ids), batch)]
    return pieces + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_multibyte_text_is_never_split(tokenizer, text, batch):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # byte-level BPE splits these characters across tokens: the case under test
    assert any(REPLACEMENT in tokenizer.decode([t]) for t in ids) or text.isascii()
    pieces = stream(tokenizer, ids, batch)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any(REPLACEMENT in p for p in pieces)


def test_special_tokens_are_skipped(tokenizer):
    ids = [tokenizer.bos_token_id] + tokenizer("Grüße", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert "".join(stream(tokenizer, ids, 1)) == "Grüße"


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_sequences_concatenate_to_full_decode(tokenizer, data):
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=40))
    batches = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=40))
    detok, pieces, i = IncrementalDetokenizer(tokenizer), [], 0
    for b in batches:
        pieces.append(detok.push(ids[i:i + b]))
        i += b
    pieces.append(detok.push(ids[i:]))
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    # only the final flush may carry an incomplete character (at the very end of the output)
    assert not any(p.endswith(REPLACEMENT) for p in pieces[:-1])


def feed_all(stops, chunks):
    m = StopMatcher(stops)
    out = [m.feed(c) for c in chunks]
    return "".join(out) + m.flush(), m.stopped


@pytest.mark.parametrize("chunks", [["hello ST", "OP world"], ["hello STOP world"], list("hello STOP world")])
def test_stop_string_across_chunks(chunks):
    assert feed_all(("STOP",), chunks) == ("hello ", True)


def test_stop_earliest_of_several_and_no_match():
    assert feed_all(("world", "lo"), ["hel", "lo world"]) == ("hel", True)
    assert feed_all(("xyz",), ["abc xy", "z?"]) == ("abc ", True)
    assert feed_all(("xyz",), ["abc xy", "q"]) == ("abc xyq", False)
    assert feed_all((), ["a", "b"]) == ("ab", False)


def test_stop_holds_back_only_a_possible_prefix():
    m = StopMatcher(("END", "xyz"))
    assert m.feed("abcdEN") == "abcd"  # "EN" could begin "END"
    assert m.feed("g") == "ENg"
    assert m.feed("abcdE") == "abcd"
    assert m.feed("x") == "E"
    assert m.flush() == "x"
    assert m.feed("NEVER") == "NEVER" and not m.stopped


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_output_text_with_stop_over_multibyte(tokenizer, batch):
    text = "Grüße 東京 🙂 and more"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    out, released, stopped = OutputText(tokenizer, ("東京",)), [], False
    for i in range(0, len(ids), batch):
        delta = out.add(ids[i:i + batch])
        released.append(delta.text)
        if delta.stopped:
            stopped = True
            break
    assert stopped and "".join(released) == "Grüße "


def test_output_text_finish_releases_tail(tokenizer):
    ids = tokenizer("Grüße 🙂", add_special_tokens=False)["input_ids"]
    out = OutputText(tokenizer, ("zzz",))
    text = "".join(out.add([t]).text for t in ids)
    end = out.finish()
    assert text + end.text == "Grüße 🙂" and not end.stopped
    out = OutputText(tokenizer, ("🙂",))  # the stop string only completes with the last token
    text = "".join(out.add([t]).text for t in ids[:-1])
    final = out.add(ids[-1:])
    assert final.stopped and text + final.text == "Grüße "


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abXY\n", max_size=30), stops=st.lists(st.text(alphabet="abXY\n", min_size=1, max_size=4),
       max_size=4), cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_matcher_equals_reference(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    # Brute force: the stream stops after the first chunk whose arrival makes the text so far
    # contain a stop string, cut before the earliest such string in it. (A longer stop string
    # that starts earlier but would complete in a later chunk never gets the chance: text =
    # "XaX", stops "a" and "XaX", chunks "Xa" + "X" give "X".)
    expected = (text, False)
    for b in bounds[1:]:
        hits = [i for i in (text[:b].find(s) for s in stops) if i >= 0]
        if hits:
            expected = (text[:min(hits)], True)
            break
    assert feed_all(tuple(stops), chunks) == expected


def test_stop_matcher_stops_at_the_first_chunk_that_completes_a_stop():
    assert feed_all(("a", "XaX"), ["Xa", "X"]) == ("X", True)
    assert feed_all(("a", "XaX"), ["XaX"]) == ("", True)


def test_the_stop_string_that_matched_first_is_recorded():
    m = StopMatcher(("xyz", "END"))
    assert m.feed("abc EN") == "abc " and m.matched is None
    assert m.feed("D and xyz") == "" and m.stopped and m.matched == "END"  # END comes before xyz
