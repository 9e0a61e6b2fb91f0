"""Incremental detokenizer against a tiny byte-level BPE: deltas add up to tokenizer.decode,
characters split across tokens come out whole, stop strings truncate and never leak."""

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from jpaged import detokenizer
from jpaged.detokenizer import IncrementalDetokenizer, StopMatcher
from jpaged.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS

SENTENCES = ["héllo wörld ✓ this is a test", "the quick brown fox jumps over the lazy dog",
             "日本語のテキスト 🎉 emoji", "héllo again, wörld!", "stop here. STOP. end"] * 3
ALPHABET = "abehlorwdst .!STOPéö✓日本🎉"
EOS = "<eos>"


@pytest.fixture(scope="module")
def tokenizer() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # The tests below mean something only if some characters are split across tokens.
    ids = tok.encode("✓ 日本 🎉").ids
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    return tok


def chunked(ids, sizes):
    """Split ids into consecutive chunks of the given sizes (cycled)."""
    chunks, start, i = [], 0, 0
    while start < len(ids):
        size = sizes[i % len(sizes)] if sizes else 1
        chunks.append(ids[start:start + size])
        start, i = start + size, i + 1
    return chunks


def stream(tokenizer, ids, stop=(), sizes=(1,), prompt=()):
    """Run a detokenizer over ids; return (detokenizer, deltas of append calls)."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt), tuple(stop))
    deltas = []
    for chunk in chunked(ids, list(sizes)):
        delta, is_stopped = detok.append(chunk)
        deltas.append(delta)
        assert is_stopped == detok.is_stopped
        assert tokenizer is None or detok.text.startswith("".join(deltas))
    return detok, deltas


texts = st.text(alphabet=ALPHABET, max_size=40)
chunk_sizes = st.lists(st.integers(1, 4), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(text=texts, sizes=chunk_sizes, prompt=texts)
def test_deltas_add_up_to_decode_and_characters_come_out_whole(tokenizer, text, sizes, prompt):
    ids = tokenizer.encode(text).ids
    detok, deltas = stream(tokenizer, ids, sizes=sizes, prompt=tokenizer.encode(prompt).ids)
    assert all("\ufffd" not in delta for delta in deltas)
    assert detok.flush() == ""  # nothing was held back: no stop strings, text complete
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text
    assert detok.num_tokens == len(ids) and not detok.is_stopped


@settings(max_examples=200, deadline=None)
@given(text=texts, sizes=chunk_sizes, data=st.data())
def test_a_stop_string_truncates_and_never_leaks(tokenizer, text, sizes, data):
    stop = data.draw(st.one_of(
        st.text(alphabet=ALPHABET, min_size=1, max_size=5),
        st.integers(0, max(len(text) - 1, 0)).flatmap(
            lambda start: st.integers(start + 1, start + 6).map(lambda end: text[start:end]))
    ).filter(bool), label="stop")
    ids = tokenizer.encode(text).ids
    detok, deltas = stream(tokenizer, ids, stop=[stop], sizes=sizes)
    streamed = "".join(deltas)
    if stop in text:
        assert detok.text == text[:text.index(stop)] and detok.stop_reason == stop
        assert streamed == detok.text  # stopping releases everything before the stop string
        assert detok.flush() == ""
    else:
        assert detok.text == text and not detok.is_stopped
        assert streamed + detok.flush() == text


def test_a_stop_string_spanning_split_characters(tokenizer):
    text = "héllo wörld ✓ 日本 🎉 end"
    ids = tokenizer.encode(text).ids
    detok, deltas = stream(tokenizer, ids, stop=["✓ 日"])
    assert detok.text == "héllo wörld " and "".join(deltas) == "héllo wörld "
    stopping_token = next(n for n in range(len(ids)) if "✓ 日" in tokenizer.decode(ids[:n + 1]))
    assert detok.num_tokens == stopping_token + 1


def test_tokens_after_the_stop_in_the_same_call_are_ignored(tokenizer):
    ids = tokenizer.encode("stop here. STOP. end").ids
    detok = IncrementalDetokenizer(tokenizer, [], ("STOP",))
    delta, is_stopped = detok.append(ids)
    assert (delta, is_stopped, detok.text) == ("stop here. ", True, "stop here. ")
    assert tokenizer.decode(ids[:detok.num_tokens]).endswith("STOP")
    assert detok.append(ids) == ("", True) and detok.num_tokens < len(ids)


def test_the_first_completed_stop_string_wins(tokenizer):
    ids = tokenizer.encode("héllo wörld!").ids  # "llo" completes first, though it starts later
    detok, _ = stream(tokenizer, ids, stop=["héllo wörld!", "llo"])
    assert detok.text == "hé" and detok.stop_reason == "llo"
    assert len(tokenizer.encode("héllo").ids) == 1  # both complete at once: the earliest start wins
    detok, _ = stream(tokenizer, tokenizer.encode("héllo").ids, stop=["llo", "héllo"])
    assert detok.text == "" and detok.stop_reason == "héllo"


def test_a_possible_stop_prefix_is_held_back_then_released(tokenizer):
    text = "héllo wörld"
    ids = tokenizer.encode(text).ids
    detok, deltas = stream(tokenizer, ids, stop=["wörldX"])
    assert "".join(deltas) == "héllo " and detok.text == text  # "wörld" may still become a stop
    assert detok.flush() == "wörld" and detok.flush() == ""
    detok, deltas = stream(tokenizer, tokenizer.encode(text + "!").ids, stop=["wörldX"])
    assert "".join(deltas) == text + "!"  # released as soon as it cannot match


def test_flush_emits_an_incomplete_trailing_character(tokenizer):
    ids = tokenizer.encode("ok €").ids[:-1]  # "€" is unseen in training: three byte tokens
    detok, deltas = stream(tokenizer, ids)
    assert "".join(deltas) == "ok "
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids) == detok.text
    assert detok.text.endswith("\ufffd")


def test_special_tokens_are_skipped_by_default(tokenizer):
    eos = tokenizer.token_to_id(EOS)
    ids = tokenizer.encode("the fox").ids + [eos]
    detok, deltas = stream(tokenizer, ids)
    assert "".join(deltas) + detok.flush() == "the fox"
    detok = IncrementalDetokenizer(tokenizer, [], (), skip_special_tokens=False)
    delta, _ = detok.append(ids)
    assert delta + detok.flush() == "the fox" + EOS


def test_without_a_tokenizer_text_stays_empty_and_stops_never_match():
    detok, deltas = stream(None, [1, 2, 3, 4], stop=["a"], sizes=[3])
    assert deltas == ["", ""] and detok.text == "" and detok.flush() == ""
    assert detok.num_tokens == 4 and not detok.is_stopped


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call sees."""

    def __init__(self, tokenizer):
        self.tokenizer, self.window_sizes = tokenizer, []

    def decode(self, ids, skip_special_tokens=True):
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_token_decodes_a_small_window_not_the_whole_output(tokenizer):
    ids = tokenizer.encode(" ".join(SENTENCES * 4)).ids
    counting = CountingTokenizer(tokenizer)
    detok, deltas = stream(counting, ids, prompt=ids[:50])
    assert len(ids) > 500 and "".join(deltas) == tokenizer.decode(ids)
    assert max(counting.window_sizes) <= 8 and len(counting.window_sizes) <= 2 * len(ids)


class CountingList(list):
    """A list that counts its reads: the automaton's fail links, to bound its work."""
    reads = 0

    def __getitem__(self, index):
        CountingList.reads += 1
        return super().__getitem__(index)


def worst_case_stops(length: int) -> tuple[str, ...]:
    """The most stop strings of the given length for a text of "ab" runs: half keep being almost
    completed (long partial matches: the automaton's hard case), half never start (every prefix
    length fails: the old suffix-by-suffix check's hard case)."""
    run = ("ab" * length)[:length - 1]
    half = MAX_STOP_STRINGS // 2
    return (tuple(run + chr(0x4e00 + i) for i in range(half))
            + tuple(chr(0x4e00 + i) + run for i in range(half)))


@pytest.mark.parametrize("length", [MAX_STOP_LENGTH // 4, MAX_STOP_LENGTH])
def test_stop_matching_is_linear_in_the_text_at_the_caps(length):
    """Each character costs O(1) transitions amortized, however many and however long the stop
    strings: the fail links followed never exceed the characters fed."""
    stops = worst_case_stops(length)
    matcher = StopMatcher(stops)
    matcher._fail = CountingList(matcher._fail)
    CountingList.reads, state, text = 0, matcher.start(), "ab" * 5000 + "b" + "ab" * 5000
    for start in range(0, len(text), 3):  # fed a token's worth at a time
        state, consumed, stop = matcher.feed(state, text[start:start + 3])
        assert stop is None and consumed == len(text[start:start + 3])
        if start % 999 == 0:  # against the quadratic definition, now and then
            fed = text[:start + 3]
            assert matcher.held_back_len(state) == max(
                n for n in range(length) if any(fed.endswith(s[:n]) for s in stops))
    assert CountingList.reads <= len(text)
    state, consumed, stop = matcher.feed(matcher.start(), "xx" + stops[5] + "yy")
    assert (consumed, stop) == (2 + length, stops[5])


class CountingMatcher:
    """A StopMatcher that counts its work: characters fed, fail links followed, hold-back
    queries."""

    def __init__(self, matcher: StopMatcher):
        self._matcher = matcher
        self._matcher._fail = CountingList(matcher._fail)
        self.chars_fed = self.held_back_queries = 0

    def start(self) -> int:
        return self._matcher.start()

    def feed(self, state: int, text: str):
        self.chars_fed += len(text)
        return self._matcher.feed(state, text)

    def held_back_len(self, state: int) -> int:
        self.held_back_queries += 1
        return self._matcher.held_back_len(state)


def test_max_stop_strings_at_max_length_cost_little_per_token(tokenizer, monkeypatch):
    """The old per-token hold-back sliced every prefix of every stop string: 64 x 255 slices per
    token, 17x the cost of decoding here. Now each character of the output is fed to the
    automaton once, its fail links are followed at most once per character, and a token's
    hold-back is one query of the automaton's state, whatever the stop set."""
    ids = tokenizer.encode("ab" * 1500).ids
    assert len(ids) >= 1000
    plain, _ = stream(tokenizer, ids)
    matchers = []
    monkeypatch.setattr(detokenizer, "stop_matcher",
                        lambda stop: matchers.append(CountingMatcher(StopMatcher(stop)))
                        or matchers[-1])
    CountingList.reads = 0
    detok, deltas = stream(tokenizer, ids, stop=worst_case_stops(MAX_STOP_LENGTH))
    (matcher,) = matchers
    assert matcher.chars_fed == len(plain.text)
    assert CountingList.reads <= len(plain.text)
    assert matcher.held_back_queries <= len(ids)   # one per append, a token at a time
    assert not detok.is_stopped and "".join(deltas) + detok.flush() == plain.text
