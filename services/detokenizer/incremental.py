"""Incremental detokenisation with stop strings: one `IncrementalDetokenizer` per request.

Decoding. Text is decoded from a small window of recent tokens, as vLLM does
(prefix_offset / read_offset), never from the whole output:

    tokens: [ prompt tail | ... emitted ... | prefix_offset .. read_offset | pending ]
                                             '---- prefix_text -------'
                                             '------------ new_text ---------------'

`new_text[len(prefix_text):]` is the text the pending tokens add. Decoding the window from
`prefix_offset` (a token already emitted) rather than from `read_offset` keeps the
tokenizer's view of a word start right: a SentencePiece decoder strips the leading space of
the first token it sees, so the first pending word would lose its space. For the same
reason the last prompt tokens seed the window. While `new_text` ends in U+FFFD the pending
tokens end inside a multi-byte character; they wait for the tokens that complete it.

Stop strings. Decoded text passes through a screen that holds back the longest suffix that
could still grow into a stop string, and also a complete match while a longer stop string
that starts earlier could still complete, so the earliest occurrence in the full text
wins. The stop string and everything after it are never emitted.

min_tokens (as vLLM): no stop string ends inside the text of the first `min_tokens` output
tokens; one that starts there and ends past it does count. The screen keeps a floor, the
text length once the min_tokens-th token is decoded, and a match must end past it:

    text:  | first min_tokens tokens' text | later text ...
                                    floor ^
           "ab" ending before the floor: ignored;  "ab" across it, or after it: a stop
(EOS and stop token ids are masked on the worker until then; stop strings are text, so here.)
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# A character is at most 4 bytes and every byte-level token carries at least one, so an
# incomplete trailing character spans at most 3 tokens.
MAX_INCOMPLETE_TOKENS = 3
# Past this many pending tokens the text is invalid UTF-8 (or a run of literal U+FFFD), not an
# unfinished character: emit all but the last MAX_INCOMPLETE_TOKENS so the window stays small.
MAX_PENDING_TOKENS = 8


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas and finds its stop strings.

    `add(token_ids, final)` returns `(text, stop_hit)`. The emitted texts concatenate to
    `tokenizer.decode(output_token_ids, skip_special_tokens)` cut at the earliest stop
    string (after it, with `include_stop_str`). Once a stop string is hit, tokens after the
    one that completed it are dropped (not in `output_token_ids`) and every later call
    returns `("", True)`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        prompt_tail: Sequence[int] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        include_stop_str: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._include_stop_str = include_stop_str  # vLLM's include_stop_str_in_output
        self._skip_special_tokens = skip_special_tokens
        self._stops = [s for s in dict.fromkeys(stop) if s]  # dedupe, keep order, drop ""
        self._tokens: list[int] = list(prompt_tail)  # prompt tail + output, for the window
        self._output_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._prefix_text = self._decode(self._tokens)
        self._held = ""  # decoded, not yet emitted: may be the start of a stop string
        self._num_emitted_chars = 0  # where `_held` starts in the whole text
        self._min_tokens = min_tokens
        self._stop_floor = 0  # a stop string counts only if it ends past this character
        self._chunks: list[str] = []  # emitted text, joined on demand
        self._stop_reason: str | None = None
        self._is_finished = False

    @property
    def output_token_ids(self) -> list[int]:
        """Output ids accepted so far (read-only view; do not mutate)."""
        return self._output_ids

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stop_hit(self) -> bool:
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the request, if any."""
        return self._stop_reason

    @property
    def is_finished(self) -> bool:
        """True after a stop string or a call with final=True."""
        return self._is_finished

    def add(self, token_ids: Sequence[int], final: bool) -> tuple[str, bool]:
        """Take new output tokens; return (new text to emit, stop_hit)."""
        if self._is_finished:
            return "", self.stop_hit
        pieces: list[str] = []
        # One token at a time, so a stop string ends the output at the token completing it.
        for token_id in token_ids:
            self._tokens.append(token_id)
            self._output_ids.append(token_id)
            pieces.append(self._screen(self._decode_pending(force=False), final=False))
            if self.stop_hit:
                break
        if final and not self.stop_hit:
            # Nothing more will come: unfinished bytes decode as U+FFFD, as in a full decode.
            pieces.append(self._screen(self._decode_pending(force=True), final=True))
        self._is_finished = final or self.stop_hit
        out = "".join(pieces)
        if out:
            self._chunks.append(out)
        return out, self.stop_hit

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_pending(self, force: bool) -> str:
        """Text that the pending tokens add, or "" while they may end mid-character."""
        end = len(self._tokens)
        if self._read_offset == end:
            return ""
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if not force and new_text.endswith(REPLACEMENT_CHAR):
            if end - self._read_offset <= MAX_PENDING_TOKENS:
                return ""
            end -= MAX_INCOMPLETE_TOKENS
            new_text = self._decode(self._tokens[self._prefix_offset : end])
        if len(new_text) <= len(self._prefix_text):
            # Only skipped special tokens (or nothing decodable) so far: keep waiting.
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._prefix_text = self._decode(self._tokens[self._prefix_offset : end])
        return delta

    def _screen(self, delta: str, final: bool) -> str:
        """Pass decoded text through the stop-string screen; return what may be emitted."""
        if not self._stops:
            return delta
        text = self._held + delta
        base = self._num_emitted_chars  # where `text` starts in the whole output
        if len(self._output_ids) <= self._min_tokens:  # (within min_tokens: nothing ends here)
            self._stop_floor = base + len(text)
        start, stop = self._earliest_stop(text, self._stop_floor - base)
        # Everything before the longest suffix that may still become a stop string is safe.
        cut = len(text) if final else len(text) - self._partial_stop_len(text)
        if stop is not None and start <= cut:
            self._stop_reason = stop
            self._held = ""
            return text[: start + len(stop)] if self._include_stop_str else text[:start]
        self._held = text[cut:]
        self._num_emitted_chars += cut
        return text[:cut]

    def _earliest_stop(self, text: str, floor: int) -> tuple[int, str | None]:
        """(start, stop string) of the earliest complete stop string in `text` that ends past
        character `floor`."""
        best_start, best_stop = len(text) + 1, None
        for stop in self._stops:
            start = text.find(stop, max(0, floor - len(stop) + 1))
            if 0 <= start < best_start:
                best_start, best_stop = start, stop
        return best_start, best_stop

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:size]):
                    best = size
                    break
        return best
