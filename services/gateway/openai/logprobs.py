"""Logprobs as OpenAI and vLLM shape them, from the engine's per-token entries.

An entry is one token (sampled, or of the prompt) with its logprob and the top k of the
distribution it came from, best first (the engine computed them: services' messages carry
them as `[token, top 1..k]` id and value lists, the detokenizer adds each id's text).

    chat         choices[i].logprobs = {"content": [{token, logprob, bytes,
                                         top_logprobs: [{token, logprob, bytes}, ...]}]}
    completions  choices[i].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}
                 (top_logprobs: {token: logprob} of the token and the top k; with echo the
                 prompt's entries come first, the first of them null)
    prompt_logprobs (vLLM)  [null, {token_id: {logprob, rank, decoded_token}}, ...]
"""

from __future__ import annotations

from typing import Any

from services.gateway.engine.client import TokenLogprob


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(tokens: list[TokenLogprob], num_top: int) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs`, with `num_top` alternatives per token."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": _bytes(e.token),
                "top_logprobs": [
                    {"token": text, "logprob": lp, "bytes": _bytes(text)}
                    for _, text, lp in e.top[:num_top]
                ],
            }
            for e in tokens
        ]
    }


class CompletionLogprobs:
    """A completion choice's `logprobs`, built token by token: in a stream, each chunk's
    tokens with text offsets that go on from the previous chunk's."""

    def __init__(self, num_top: int, text_offset: int = 0) -> None:
        self.num_top = num_top
        self.text_offset = text_offset  # where the next token's text starts

    def add(self, tokens: list[TokenLogprob]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for e in tokens:
            out["tokens"].append(e.token)
            out["token_logprobs"].append(e.logprob)
            top: dict[str, float] | None = None
            if e.logprob is not None:  # (the prompt's first token has neither)
                top = {e.token: e.logprob}
                for _, text, lp in e.top[: self.num_top]:
                    top.setdefault(text, lp)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(e.token)
        return out


def prompt_logprobs(tokens: list[TokenLogprob]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: null for the first token, then per token a map of token id
    (a string, as JSON keys) to its logprob, rank (1 = most likely: the engine's count of
    more likely tokens, so also outside the top k; from the top k's order where an engine
    gives none) and text."""
    out: list[dict[str, Any] | None] = []
    for e in tokens:
        if e.logprob is None:
            out.append(None)
            continue
        ranks = {token_id: r for r, (token_id, _, _) in enumerate(e.top, 1)}
        entry = {
            str(e.token_id): {
                "logprob": e.logprob,
                "rank": e.rank if e.rank is not None else ranks.get(e.token_id),
                "decoded_token": e.token,
            }
        }
        for r, (token_id, text, lp) in enumerate(e.top, 1):
            entry.setdefault(str(token_id), {"logprob": lp, "rank": r, "decoded_token": text})
        out.append(entry)
    return out


class ChoiceLogprobs:
    """What one response adds to its choices for logprobs and echo: settings from the
    request body, and per choice (a stream's) running completion text offsets. Choice
    `index` belongs to prompt `index // n` (a batch of prompts, `n` choices each); a prompt's
    entries come with its first sequence's first delta (`see_prompt`)."""

    def __init__(
        self,
        kind: str,
        num_logprobs: int | None = None,
        *,
        echo_texts: list[str] | None = None,
        with_prompt_logprobs: bool = False,
        n: int = 1,
    ) -> None:
        self.kind = kind
        self.num_logprobs = num_logprobs  # None: the client asked for none
        self.echo_texts = echo_texts  # per prompt, when echo is on (completions)
        self.with_prompt_logprobs = with_prompt_logprobs  # vLLM's prompt_logprobs field
        self.n = n
        self._prompts: dict[int, list[TokenLogprob]] = {}  # prompt index -> its entries
        self._completion: dict[int, CompletionLogprobs] = {}  # choice index -> its offsets
        self._streamed_prompt: set[int] = set()  # choices (chat: -1) whose chunk had them

    @property
    def is_on(self) -> bool:
        return self.num_logprobs is not None

    def see_prompt(self, index: int, tokens: list[TokenLogprob]) -> None:
        if tokens:
            self._prompts.setdefault(index // self.n, tokens)

    def prompt_entries(self, index: int) -> list[TokenLogprob]:
        return self._prompts.get(index // self.n, [])

    def echo_text(self, index: int) -> str:
        return self.echo_texts[index // self.n] if self.echo_texts is not None else ""

    def tokens(self, index: int, tokens: list[TokenLogprob]) -> dict[str, Any] | None:
        """`logprobs` for these output tokens of choice `index` (a chunk's, or all of them;
        with echo, call `echo` first), or None when not asked."""
        if self.num_logprobs is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(tokens, self.num_logprobs)
        return self._offsets(index).add(tokens)

    def echo(self, index: int) -> dict[str, Any] | None:
        """The completion logprobs of choice `index`'s echoed prompt (None when not asked)."""
        if self.num_logprobs is None:
            return None
        return self._offsets(index).add(self.prompt_entries(index))

    def extra(self, index: int) -> dict[str, Any]:
        """The choice's `prompt_logprobs` when the client asked for them."""
        if not self.with_prompt_logprobs:
            return {}
        return {"prompt_logprobs": prompt_logprobs(self.prompt_entries(index)) or None}

    def stream_extra(self, index: int) -> dict[str, Any]:
        """`prompt_logprobs` for a stream chunk of choice `index`, sent once as soon as its
        prompt's entries are known: in a completion choice, per choice (as in the answer
        that is not streamed); in chat, once for the response (its chunk's field). vLLM
        itself refuses prompt_logprobs with `stream`; this is where a stream carries them."""
        if not self.with_prompt_logprobs:
            return {}
        key = index if self.kind == "completion" else -1
        entries = self.prompt_entries(index)
        if key in self._streamed_prompt or not entries:
            return {}
        self._streamed_prompt.add(key)
        return {"prompt_logprobs": prompt_logprobs(entries)}

    def _offsets(self, index: int) -> CompletionLogprobs:
        if index not in self._completion:
            self._completion[index] = CompletionLogprobs(self.num_logprobs or 0)
        return self._completion[index]


def merge_completion(first: dict[str, Any] | None, second: dict[str, Any] | None) -> Any:
    """Two completion `logprobs` objects as one (echo's, then the output's)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}
