"""Tests for orchestrator.detok: streaming detokenization with the real SmolLM2 tokenizer, and stop strings."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specsplit.orchestrator.api.detok import IncrementalDetokenizer, StopMatcher, TokenTextAlignment

pytestmark = pytest.mark.unit

TEXTS = [
    "Hello, world! This is plain ASCII.",
    "Emoji: 😀🎉👩‍👩‍👧 and 🇯🇵 flags",
    "日本語のテキストと中文文本，还有한국어.",
    "Accents: café, naïve, Ångström, Zürich, façade",
    "spaces:  two   three    four\n\tnewline and tab  ",
    "  leading spaces, then mixed 😀日本 é at the end 🎉",
    "code:\n    def f(x):\n        return x ** 2  # ✓\n",
]


@pytest.fixture(scope="module")
def tokenizer(gguf_tokenizer):
    return gguf_tokenizer


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    messages = [{"role": "user", "content": "Say something with accents: é"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def random_chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        size = rng.randint(0, 5)  # empty chunks too: a round may commit nothing new
        chunks.append(ids[i : i + size])
        i += size
    return chunks


def stream(tokenizer, prompt_ids, chunks, skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    return [detok.add(chunk) for chunk in chunks] + [detok.flush()]


# --- IncrementalDetokenizer -------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_decode(tokenizer, prompt_ids, text):
    ids = tokenizer.encode(text)
    deltas = stream(tokenizer, prompt_ids, [[t] for t in ids])
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)  # incomplete characters are never emitted


@pytest.mark.parametrize("seed", range(20))
def test_random_chunkings_equal_decode(tokenizer, prompt_ids, seed):
    rng = random.Random(seed)
    text = "".join(rng.sample(TEXTS, 3))
    ids = tokenizer.encode(text)
    deltas = stream(tokenizer, prompt_ids, random_chunks(ids, rng))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, prompt_ids, skip_special_tokens):
    ids = tokenizer.encode("Done 😀.") + [tokenizer.convert_tokens_to_ids("<|im_end|>")] + tokenizer.encode(" After")
    deltas = stream(tokenizer, prompt_ids, [[t] for t in ids], skip_special_tokens)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected
    assert ("<|im_end|>" in expected) is not skip_special_tokens


@pytest.mark.parametrize("seed", range(10))
def test_random_token_ids_equal_decode(tokenizer, seed):
    # Arbitrary ids include stray UTF-8 bytes; the stream must still reproduce decode, U+FFFD and all.
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(60)]
    deltas = stream(tokenizer, tokenizer.encode("prompt:"), random_chunks(ids, rng))
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_multi_byte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("😀")
    assert len(ids) > 1, "the test needs an emoji split over several byte tokens"
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add([t]) for t in ids] == [""] * (len(ids) - 1) + ["😀"]
    assert detok.flush() == ""


def test_text_before_an_incomplete_character_is_not_held(tokenizer):
    ids = tokenizer.encode("ab 😀")
    detok = IncrementalDetokenizer(tokenizer, [])
    first = detok.add(ids[:-1])  # the emoji's last byte is missing
    assert first.startswith("ab") and "\ufffd" not in first
    assert first + detok.add(ids[-1:]) + detok.flush() == "ab 😀"


def test_flush_emits_an_unfinished_character_as_decode_does(tokenizer):
    ids = tokenizer.encode("x😀")[:-1]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add(ids) + detok.flush() == tokenizer.decode(ids) == "x\ufffd"
    assert detok.flush() == ""


def test_spaces_at_chunk_boundaries(tokenizer, prompt_ids):
    text = "a  b   c    d \n e"
    ids = tokenizer.encode(text)
    for cut in range(len(ids) + 1):
        assert "".join(stream(tokenizer, prompt_ids, [ids[:cut], ids[cut:]])) == text


def test_empty_prompt_and_empty_output(tokenizer):
    assert stream(tokenizer, [], []) == [""]
    assert stream(tokenizer, [], [[], []]) == ["", "", ""]


# --- StopMatcher ------------------------------------------------------------


def feed_all(matcher: StopMatcher, pieces) -> tuple[str, bool]:
    emitted, stopped = [], False
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        emitted.append(text)
    if not stopped:
        emitted.append(matcher.flush())
    return "".join(emitted), stopped


def reference_truncation(text: str, stops: list[str]) -> tuple[str, bool]:
    """Text up to the stop string that completes first (the longest on a tie), by brute force."""
    for end in range(1, len(text) + 1):
        for s in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(s):
                return text[: end - len(s)], True
    return text, False


def test_stop_split_across_feeds():
    matcher = StopMatcher(["<|end|>"])
    assert matcher.feed("Hello<|e") == ("Hello", False)
    assert matcher.feed("nd|>") == ("", True)
    assert matcher.stopped
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_stop_fed_one_character_at_a_time():
    assert feed_all(StopMatcher(["<|end|>"]), "Hi <|end|> world") == ("Hi ", True)


def test_false_start_is_released():
    matcher = StopMatcher(["<|end|>"])
    assert matcher.feed("a<|e") == ("a", False)
    assert matcher.feed("x") == ("<|ex", False)
    assert matcher.feed("<") == ("", False)
    assert matcher.flush() == "<"


def test_overlapping_partial_matches():
    assert feed_all(StopMatcher(["abab"]), "abababab") == ("", True)
    assert feed_all(StopMatcher(["abab"]), "abaabab") == ("aba", True)
    assert feed_all(StopMatcher(["abab"]), ["aba", "a", "bab"]) == ("aba", True)
    assert feed_all(StopMatcher(["aab"]), "aaaab") == ("aa", True)


def test_earliest_stop_wins():
    stops = ["STOP", "END"]
    assert feed_all(StopMatcher(stops), ["x STOP y END"]) == ("x ", True)
    assert feed_all(StopMatcher(stops), ["x END y STOP"]) == ("x ", True)
    assert feed_all(StopMatcher(stops), "x END y STOP") == ("x ", True)


def test_stop_completing_first_wins_however_the_text_is_chunked():
    # "bc" completes before "abcd" does, so it stops there whether or not "d" came in the same feed.
    stops = ["abcd", "bc"]
    assert feed_all(StopMatcher(stops), ["abcd"]) == ("a", True)
    assert feed_all(StopMatcher(stops), ["abc", "d"]) == ("a", True)


def test_no_stop_strings_passes_text_through():
    matcher = StopMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""


@pytest.mark.parametrize("bad", [[""], ["ok", ""], "<|end|>", [None]])
def test_bad_stop_strings_are_rejected(bad):
    with pytest.raises(ValueError, match="stop"):
        StopMatcher(bad)


@pytest.mark.parametrize("seed", range(300))
def test_streamed_stop_matching_equals_truncation(seed):
    rng = random.Random(seed)
    alphabet = "ab c"[: rng.randint(2, 4)]
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    pieces, i = [], 0
    while i < len(text):
        size = rng.randint(0, 6)
        pieces.append(text[i : i + size])
        i += size
    matcher = StopMatcher(stops)
    emitted, stopped = [], False
    for piece in pieces:
        out, stopped = matcher.feed(piece)
        emitted.append(out)
        assert not any(s in "".join(emitted) for s in stops)  # nothing sent contains a stop string
    tail = "" if stopped else matcher.flush()
    assert ("".join(emitted) + tail, stopped) == reference_truncation(text, stops)


# --- TokenTextAlignment: ids in step with the text -------------------------------


def stream_ids_and_text(tokenizer, prompt_ids, ids, stops) -> tuple[str, list[int]]:
    """What the orchestrator sends: text cut at the first stop string, and the ids that text covers."""
    detok, matcher, aligned = IncrementalDetokenizer(tokenizer, prompt_ids), StopMatcher(stops), TokenTextAlignment()
    text, sent_ids = "", []
    for token in ids:
        piece = detok.add([token])
        aligned.add(token, piece)
        out, stopped = matcher.feed(piece)
        text += out
        sent_ids += aligned.release(len(text))
        if stopped:
            return text, sent_ids
    tail = detok.flush()
    aligned.add_text(tail)
    out, stopped = matcher.feed(tail)
    text += out if stopped else out + matcher.flush()
    return text, sent_ids + (aligned.release(len(text)) if stopped else aligned.release_all())


@pytest.mark.parametrize("text", TEXTS)
def test_ids_stop_with_the_text_at_a_token_boundary(tokenizer, prompt_ids, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.decode(ids)

    def stop_at(cut: int) -> str | None:  # a 3-character stop starting at the cut, if it first completes there
        head = tokenizer.decode(ids[:cut])
        stop = whole[len(head) : len(head) + 3]
        whole_chars = whole.startswith(head)
        return stop if whole_chars and len(stop) == 3 and stop not in head + stop[:-1] else None

    cut = next(c for c in range(len(ids) // 2, len(ids)) if stop_at(c))
    head, stop = tokenizer.decode(ids[:cut]), stop_at(cut)
    sent_text, sent_ids = stream_ids_and_text(tokenizer, prompt_ids, ids, [stop])
    assert sent_text == head
    assert sent_ids == ids[:cut]
    assert tokenizer.decode(sent_ids) == sent_text


def test_a_stop_inside_a_token_sends_that_token_last(tokenizer, prompt_ids):
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    text = tokenizer.decode(ids)
    stop = "amm"  # inside " gamma"
    sent_text, sent_ids = stream_ids_and_text(tokenizer, prompt_ids, ids, [stop])
    assert sent_text == text[: text.index(stop)]
    assert tokenizer.decode(sent_ids).startswith(sent_text)
    assert tokenizer.decode(sent_ids[:-1]) == sent_text[: len(tokenizer.decode(sent_ids[:-1]))]
    assert len(tokenizer.decode(sent_ids[:-1])) < len(sent_text)  # the last id holds the cut


@pytest.mark.parametrize("text", TEXTS)
def test_without_a_stop_every_id_is_sent(tokenizer, prompt_ids, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    sent_text, sent_ids = stream_ids_and_text(tokenizer, prompt_ids, ids, ["\x00never"])
    assert sent_ids == ids and sent_text == tokenizer.decode(ids)


def test_ids_of_held_text_wait_for_it():
    aligned = TokenTextAlignment()
    aligned.add(1, "ab")
    aligned.add(2, "")  # part of a character still arriving
    aligned.add(3, "c")
    assert aligned.release(1) == [1]
    assert aligned.release(2) == []  # token 2's text (none yet, then "c") starts at 2
    assert aligned.release(3) == [2, 3]
    assert aligned.release_all() == []


@settings(max_examples=500, deadline=None)
@given(st.lists(st.text("ab", min_size=1, max_size=6), min_size=1, max_size=3), st.text("abc", max_size=10))
def test_held_back_text_is_the_longest_tail_that_starts_a_stop_string(stops, text):
    """The candidate scan equals the definition: every proper prefix length of every stop string, tried."""
    longest = max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
                  default=0)
    assert StopMatcher(stops)._partial_stop_length(text) == longest
