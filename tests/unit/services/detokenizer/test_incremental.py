"""IncrementalDetokenizer: streamed text equals the full decode, cut at the earliest stop."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.detokenizer.incremental import MAX_PENDING_TOKENS, IncrementalDetokenizer

SMOLLM2_TOKENIZER = Path("/root/.cache/shuttle/models/SmolLM2-135M-Instruct/tokenizer.json")
SPECIALS = ["<|endoftext|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "Le café est très chaud, déjà prêt à être bu. Voilà, naïve façade.",
    "Grüße aus München: Straße, Übermut, schön und größer.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "こんにちは、世界。ありがとう。",
    "Emoji time 🎉🚀👍🏽 and 😀 smiles, ❤️ hearts.",
    "Русский текст: привет, мир. Ελληνικά: γειά σου κόσμε.",
    "def add(a, b):\n    return a + b  # numbers 12345 67890\n",
]
TEXTS = [
    *CORPUS,
    "Hello 世界 🎉 café",
    "🎉🎉🎉 new words never seen: 龍 🦄 ẞ ǅ",
    " leading space and trailing space ",
    "a\n\nb\tc",
    "",
]
ALPHABET = "abc xyz ,.!\nééüñ你好世界龍🎉🚀👍🏽❤️\ufffd"


def _train_bpe() -> Tokenizer:
    """A tiny byte-level BPE: too few merges for most multi-byte characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


BPE = _train_bpe()


@pytest.fixture(scope="module", params=["bpe", "smollm2"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "bpe":
        return BPE
    if not SMOLLM2_TOKENIZER.exists():
        pytest.skip("SmolLM2 tokenizer not present")
    return Tokenizer.from_file(str(SMOLLM2_TOKENIZER))


def _stream(
    tok: Tokenizer,
    ids: Sequence[int],
    chunks: Sequence[int] | None = None,
    stop: Sequence[str] = (),
    prompt_tail: Sequence[int] = (),
    skip_special_tokens: bool = True,
    min_tokens: int = 0,
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `ids` in chunks of the given sizes (default 1), final on the last call."""
    detok = IncrementalDetokenizer(
        tok, list(stop), list(prompt_tail), skip_special_tokens, min_tokens=min_tokens
    )
    sizes = list(chunks or [1] * len(ids)) or [0]
    emits, pos = [], 0
    for i, size in enumerate(sizes):
        final = i == len(sizes) - 1
        part = ids[pos:] if final else ids[pos : pos + size]
        pos += size
        emits.append(detok.add(list(part), final)[0])
    return emits, detok


def _cut_at_stop(text: str, stop: Sequence[str]) -> str:
    starts = [text.find(s) for s in stop if s and s in text]
    return text[: min(starts)] if starts else text


def test_bpe_splits_multibyte_characters_over_tokens() -> None:
    # Guards the other tests' meaning: the tiny BPE must put one character in many tokens.
    ids = BPE.encode("🎉龍").ids
    assert len(ids) >= 4
    assert "\ufffd" in BPE.decode(ids[:1])


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text).ids
    emits, detok = _stream(tokenizer, ids)
    assert "".join(emits) == tokenizer.decode(ids) == detok.text
    assert detok.output_token_ids == ids
    assert not detok.stop_hit


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_never_split(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text).ids
    emits, _ = _stream(tokenizer, ids)
    expected_fffd = text.count("\ufffd")
    assert sum(e.count("\ufffd") for e in emits) == expected_fffd
    # Every emit is whole characters: re-encoding each and joining gives the text back.
    assert b"".join(e.encode() for e in emits) == text.encode()


def test_emits_whole_characters_each_token() -> None:
    ids = BPE.encode("🎉").ids
    emits, _ = _stream(BPE, ids)
    assert emits[:-1] == [""] * (len(ids) - 1)
    assert emits[-1] == "🎉"


def test_stop_string_spanning_tokens(tokenizer: Tokenizer) -> None:
    text = "Say 你好世界 and then stop here"
    ids = tokenizer.encode(text).ids
    emits, detok = _stream(tokenizer, ids, stop=["世界 and"])
    assert "".join(emits) == "Say 你好"
    assert detok.stop_hit and detok.stop_reason == "世界 and"
    # Output ends at the token that completed the stop string.
    kept = detok.output_token_ids
    assert "世界 and" in tokenizer.decode(kept)
    assert "世界 and" not in tokenizer.decode(kept[:-1])
    assert len(kept) < len(ids)


def test_stop_string_at_start(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world").ids
    emits, detok = _stream(tokenizer, ids, stop=["Hello"])
    assert emits[-1] == "" and "".join(emits) == ""
    assert detok.stop_hit


def test_after_stop_every_call_returns_empty(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three four").ids
    detok = IncrementalDetokenizer(tokenizer, stop=["two"], prompt_tail=[])
    out = "".join(detok.add([i], final=False)[0] for i in ids)
    assert out == "one " and detok.stop_hit
    num_kept = len(detok.output_token_ids)
    assert detok.add(ids, final=False) == ("", True)
    assert detok.add(ids, final=True) == ("", True)
    assert len(detok.output_token_ids) == num_kept


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (["bcd", "ab"], "xx "),  # "ab" starts first
        (["ab", "bcd"], "xx "),
        (["b", "abc"], "xx "),  # "b" completes first, but "abc" starts earlier
        (["d", "abcdefgh"], "xx abc"),  # the longer one never completes
    ],
)
def test_two_stop_strings_earliest_wins(stop: list[str], expected: str) -> None:
    ids = BPE.encode("xx abcdefg").ids
    for chunks in ([1] * len(ids), [len(ids)], [2] * len(ids)):
        emits, detok = _stream(BPE, ids, chunks=chunks, stop=stop)
        assert "".join(emits) == expected
        assert detok.stop_hit


def test_held_back_text_flushed_on_final(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The END").ids
    detok = IncrementalDetokenizer(tokenizer, stop=["END OF TEXT"], prompt_tail=[])
    out, hit = detok.add(ids, final=False)
    assert out == "The " and not hit  # "END" could still become the stop string
    assert detok.add([], final=True) == ("END", False)
    assert detok.text == "The END"


def test_held_back_text_released_when_stop_diverges() -> None:
    detok = IncrementalDetokenizer(BPE, stop=["END OF"], prompt_tail=[])
    out = "".join(detok.add([i], final=False)[0] for i in BPE.encode("The ENDgame").ids)
    assert out == "The ENDgame"  # released before final, once "g" ruled the stop out
    assert detok.add([], final=True) == ("", False)


def test_special_tokens_skipped(tokenizer: Tokenizer) -> None:
    end = tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode("hi 世界").ids
    ids = [end, *ids[:2], end, *ids[2:], end]
    emits, _ = _stream(tokenizer, ids)
    assert "".join(emits) == tokenizer.decode(ids) == "hi 世界"
    emits, _ = _stream(tokenizer, ids, skip_special_tokens=False)
    assert "".join(emits) == tokenizer.decode(ids, skip_special_tokens=False)
    assert "".join(emits).count("<|im_end|>") == 3


def test_prompt_tail_leading_space_byte_level(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Hello").ids
    output = tokenizer.encode(" world").ids
    emits, detok = _stream(tokenizer, output, prompt_tail=prompt)
    assert "".join(emits) == " world"
    assert detok.output_token_ids == output  # the tail is context, never output


def test_prompt_tail_leading_space_sentencepiece_style() -> None:
    # A Metaspace decoder drops the first token's leading space; the prompt tail keeps it.
    tok = Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "▁again": 2, "<unk>": 3}, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    assert "".join(_stream(tok, [1, 2])[0]) == "world again"
    assert "".join(_stream(tok, [1, 2], prompt_tail=[0])[0]) == " world again"
    assert tok.decode([0, 1, 2]) == "Hello world again"


def test_window_stays_small() -> None:
    lengths: list[int] = []

    class Recorder:
        def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            lengths.append(len(ids))
            return BPE.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = BPE.encode(" ".join(TEXTS) * 5).ids
    detok = IncrementalDetokenizer(Recorder(), [], [])  # type: ignore[arg-type]
    text = "".join(detok.add([i], final=False)[0] for i in ids)
    assert text == BPE.decode(ids)
    assert len(ids) > 500 and max(lengths) <= 2 * MAX_PENDING_TOKENS


def test_invalid_utf8_run_is_emitted_without_growing_window() -> None:
    byte_ff = BPE.token_to_id("ÿ")  # the byte-level symbol of 0xFF, never valid UTF-8
    ids = [byte_ff] * 40 + BPE.encode("ok").ids
    emits, _ = _stream(BPE, ids)
    assert "".join(emits) == BPE.decode(ids)
    assert "".join(emits[:30]).count("\ufffd") >= 20  # emitted as it came, not held to the end


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    seed=st.integers(0, 2**32 - 1),
    stop=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3),
)
def test_property_random_chunks_equal_decode(text: str, seed: int, stop: list[str]) -> None:
    rng = random.Random(seed)
    ids = BPE.encode(text).ids
    if stop and rng.random() < 0.5 and len(text) > 2:  # often a stop string that does occur
        start = rng.randrange(len(text) - 1)
        stop = [*stop, text[start : start + rng.randint(1, 4)]]
    chunks = [rng.randint(0, 4) for _ in range(len(ids) + 1)]
    emits, detok = _stream(BPE, ids, chunks=chunks, stop=stop)
    full = BPE.decode(ids)
    assert "".join(emits) == _cut_at_stop(full, stop)
    assert detok.stop_hit == any(s in full for s in stop)
    if "\ufffd" not in full:
        assert not any("\ufffd" in e for e in emits)


def _num_tokens(text: str) -> int:
    return len(BPE.encode(text).ids)


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (["e"], "one two thr"),  # the e of "one" is within min_tokens; the next one is not
        (["o"], "one two three f"),  # both o's of "one two" are inside it
        (["two three"], "one "),  # starts inside min_tokens, ends past it: counts
        (["one two"], "one two three four"),  # ends exactly where min_tokens end: ignored
    ],
)
def test_stop_strings_wait_for_min_tokens(stop: list[str], expected: str) -> None:
    """As vLLM: a stop string counts only if it ends in the text of a token after the
    first min_tokens (here the tokens of "one two")."""
    ids = BPE.encode("one two three four").ids
    min_tokens = _num_tokens("one two")
    assert ids[:min_tokens] == BPE.encode("one two").ids  # (the boundary is a word's)
    for chunks in ([1] * len(ids), [len(ids)], [3] * len(ids)):
        emits, detok = _stream(BPE, ids, chunks=chunks, stop=stop, min_tokens=min_tokens)
        assert "".join(emits) == expected
        assert detok.stop_hit == (expected != "one two three four")
    # without min_tokens the first occurrence wins, as before
    assert "".join(_stream(BPE, ids, stop=["e"])[0]) == "on"


def test_min_tokens_covering_the_whole_output_never_stops() -> None:
    ids = BPE.encode("abc abc").ids
    emits, detok = _stream(BPE, ids, stop=["abc"], min_tokens=len(ids))
    assert "".join(emits) == "abc abc" and not detok.stop_hit


def _min_tokens_reference(ids: list[int], stop: list[str], min_tokens: int) -> str:
    """The full decode cut at the earliest stop string that ends past the text of the
    first min_tokens tokens (decoded incrementally, as the stream saw it)."""
    full = BPE.decode(ids)
    if min_tokens >= len(ids):
        return full
    plain = IncrementalDetokenizer(BPE, [], [])
    floor = len("".join(plain.add([i], final=False)[0] for i in ids[:min_tokens]))
    starts = [full.find(s, max(0, floor - len(s) + 1)) for s in stop]
    found = [start for start in starts if start >= 0]
    return full[: min(found)] if found else full


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    seed=st.integers(0, 2**32 - 1),
    stop=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_property_min_tokens_stop(text: str, seed: int, stop: list[str]) -> None:
    rng = random.Random(seed)
    ids = BPE.encode(text).ids
    if len(text) > 2:  # a stop string that does occur, somewhere
        start = rng.randrange(len(text) - 1)
        stop = [*stop, text[start : start + rng.randint(1, 4)]]
    min_tokens = rng.randint(0, len(ids) + 1)
    chunks = [rng.randint(0, 4) for _ in range(len(ids) + 1)]
    emits, _ = _stream(BPE, ids, chunks=chunks, stop=stop, min_tokens=min_tokens)
    assert "".join(emits) == _min_tokens_reference(ids, stop, min_tokens)


@settings(max_examples=100, deadline=None)
@given(
    ids=st.lists(st.integers(0, 399), max_size=40),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_random_ids_equal_decode(ids: list[int], seed: int) -> None:
    rng = random.Random(seed)
    chunks = [rng.randint(0, 3) for _ in range(len(ids) + 1)]
    emits, _ = _stream(BPE, ids, chunks=chunks)
    assert "".join(emits) == BPE.decode(ids)


def test_smollm2_property_sample() -> None:
    if not SMOLLM2_TOKENIZER.exists():
        pytest.skip("SmolLM2 tokenizer not present")
    tok = Tokenizer.from_file(str(SMOLLM2_TOKENIZER))
    rng = random.Random(0)
    for _ in range(50):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 30)))
        stop = [text[3:5]] if len(text) > 5 and rng.random() < 0.5 else []
        ids = tok.encode(text).ids
        chunks = [rng.randint(0, 3) for _ in range(len(ids) + 1)]
        emits, _ = _stream(tok, ids, chunks=chunks, stop=stop)
        assert "".join(emits) == _cut_at_stop(tok.decode(ids), stop)
