"""Structured outputs on the worker: grammars compiled per (spec, tokenizer) in a cache, one
matcher per sequence, and the token bitmask applied to a step's logits before sampling.

Where compiling happens, and why there: the worker owns the model versions and so the
tokenizer each one serves with; a grammar belongs to (spec, tokenizer fingerprint). The
scheduler asks for a compile (`CompileGrammar`) when a constrained request arrives and holds
the request out of its queues until the worker answers; the worker compiles on a background
thread (`GrammarCache.submit`), so no step ever waits for a compile. When the request then
starts, its matcher is built from the cached grammar (`GrammarCache.matcher`).

A matcher follows the request's tokens, never the other way round: `RowGrammar.sync` accepts
whatever output tokens the worker holds beyond those it has seen (one per step, or several
after a step whose tokens it has not seen yet), and rolls back when the request holds fewer
(tokens cut away). Preemption by recompute or swap keeps a request's tokens on the worker,
so its matcher needs nothing; the check is there so that any rule that cuts tokens stays
consistent by construction.

    logits [S, V] ──▶ rows with a grammar ──fill_next_token_bitmask──▶ bitmask [R, ceil(V/32)]
                                          ──apply_token_bitmask_inplace(indices=rows)──▶ sample
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from common.messages.types import STRUCTURED_KINDS, SamplingParams

if TYPE_CHECKING:
    import torch
    import xgrammar

log = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 512
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:[0-9]+: ")  # xgrammar's "[time] file.cc:line: "

GrammarKey = tuple[str, str, str]  # (kind, spec, tokenizer fingerprint)


class GrammarError(ValueError):
    """A spec that does not compile; the message says what is wrong."""


def clean_error(e: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _CPP_PREFIX.sub("", text)


def choice_regex(spec: str) -> str:
    """A regex matching exactly one of the choices (a JSON list of strings)."""
    choices = orjson.loads(spec)
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


class GrammarCache:
    """Compiled grammars by (kind, spec, tokenizer fingerprint), most recent last; one
    xgrammar compiler per tokenizer. Thread-safe: compiles run on a background pool.

    `tokenizer_info` builds xgrammar's view of the tokenizer with a fingerprint (its
    vocabulary, as the model's logits index it, and its stop tokens: `hf_tokenizer_info`), or
    raises KeyError for a tokenizer no loaded version has."""

    def __init__(
        self,
        tokenizer_info: Callable[[str], xgrammar.TokenizerInfo],
        max_workers: int = 1,
    ) -> None:
        self._tokenizer_info = tokenizer_info
        self._lock = threading.Lock()
        self._compilers: dict[str, xgrammar.GrammarCompiler] = {}
        self._grammars: OrderedDict[GrammarKey, xgrammar.CompiledGrammar] = OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, "grammar")
        self.num_compiles = 0

    def submit(self, kind: str, spec: str, fingerprint: str) -> concurrent.futures.Future[None]:
        """Compile in the background; the future raises GrammarError for a bad spec."""
        return self._pool.submit(self._warm, kind, spec, fingerprint)

    def _warm(self, kind: str, spec: str, fingerprint: str) -> None:
        self.compile(kind, spec, fingerprint)

    def compile(self, kind: str, spec: str, fingerprint: str) -> xgrammar.CompiledGrammar:
        """The compiled grammar, from the cache or compiled now (GrammarError if bad)."""
        key = (kind, spec, fingerprint)
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        compiled = _compile(self._compiler(fingerprint), kind, spec)
        with self._lock:
            self.num_compiles += 1
            self._grammars[key] = compiled
            while len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return compiled

    @property
    def num_tokenizers(self) -> int:
        """Tokenizers a compiler was built for."""
        with self._lock:
            return len(self._compilers)

    def is_cached(self, kind: str, spec: str, fingerprint: str) -> bool:
        with self._lock:
            return (kind, spec, fingerprint) in self._grammars

    def matcher(self, params: SamplingParams, fingerprint: str) -> RowGrammar | None:
        """A new sequence's matcher (None for free text). Its grammar is normally cached by
        the compile the scheduler asked for; a miss (a worker that restarted in between)
        compiles here, in the step, and says so."""
        if not params.is_structured:
            return None
        kind, spec = params.structured_kind, params.structured_spec
        if not self.is_cached(kind, spec, fingerprint):
            log.warning("grammar not compiled ahead of its request: compiling in the step")
        import xgrammar

        matcher = xgrammar.GrammarMatcher(self.compile(kind, spec, fingerprint))
        return RowGrammar(matcher, params.structured_after_ids)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compiler(self, fingerprint: str) -> xgrammar.GrammarCompiler:
        with self._lock:
            compiler = self._compilers.get(fingerprint)
        if compiler is not None:
            return compiler
        import xgrammar

        try:
            info = self._tokenizer_info(fingerprint)
        except KeyError:
            raise GrammarError(
                "the tokenizer of this request is no longer served; retry the request"
            ) from None
        compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        with self._lock:
            return self._compilers.setdefault(fingerprint, compiler)


def hf_tokenizer_info(path: str, vocab_size: int, stop_ids: list[int]) -> xgrammar.TokenizerInfo:
    """xgrammar's view of a Hugging Face tokenizer folder (or a GGUF file's), padded to the
    model's vocabulary (its logits may have more rows than the tokenizer has tokens)."""
    import xgrammar
    from transformers import AutoTokenizer

    from common.model_paths import tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(path))  # a GGUF file's folder too
    return xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids
    )


def _compile(compiler: xgrammar.GrammarCompiler, kind: str, spec: str) -> xgrammar.CompiledGrammar:
    if kind not in STRUCTURED_KINDS:
        raise GrammarError(f"unknown structured output kind {kind!r}")
    try:
        if kind == "json":
            # compact JSON: free whitespace lets a small model pad forever
            return compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "json_object":  # any object, compact (as json, above)
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_regex(choice_regex(spec))
        return compiler.compile_grammar(spec)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with a C++ location
        raise GrammarError(clean_error(e)) from e


class RowGrammar:
    """One sequence's matcher and how many of its output tokens it has accepted.

    With `start_after` (the token ids that end a reasoning model's thinking, "</think>"),
    the grammar covers only the output after them: the reasoning before is free text.

        output   <think> ... </think> {"a": 1}
                 free text ---------- grammar (starts at `start`)
    """

    def __init__(self, matcher: Any, start_after: list[int] | None = None) -> None:
        self.matcher = matcher
        self.num_accepted = 0
        self.start_after = list(start_after or [])
        self.start: int | None = None if self.start_after else 0  # where the grammar begins
        self._num_scanned = 0  # output tokens searched for start_after so far

    def is_started(self, output_ids: list[int]) -> bool:
        """Whether the grammar covers the next token (the reasoning has ended)."""
        if self.start is not None and len(output_ids) < self.start:
            self.sync(output_ids)  # (a rollback into the reasoning)
        if self.start is None:
            # search only what is new (and the marker's length back), not the whole output
            begin = max(0, min(self._num_scanned, len(output_ids)) - len(self.start_after) + 1)
            self.start = _end_of(self.start_after, output_ids, begin)
            self._num_scanned = len(output_ids)
        return self.start is not None

    def sync(self, output_ids: list[int]) -> None:
        """Follow the sequence's output tokens: roll back past tokens it no longer holds,
        accept the ones not seen yet. (The tokens kept are always a prefix of those seen:
        the worker appends, and only a rollback cuts.)"""
        if self.start is None and not self.is_started(output_ids):
            return
        assert self.start is not None
        if len(output_ids) < self.start:  # cut back into the reasoning: not started again
            self.matcher.rollback(self.num_accepted)
            self.num_accepted, self.start = 0, None
            return
        output_ids = output_ids[self.start :]
        if len(output_ids) < self.num_accepted:
            self.matcher.rollback(self.num_accepted - len(output_ids))
            self.num_accepted = len(output_ids)
        for token in output_ids[self.num_accepted :]:
            if self.matcher.is_terminated():
                break  # the stop token ended it: the request finishes with it
            if not self.matcher.accept_token(token):
                raise ValueError(f"token {token} breaks the request's grammar")
            self.num_accepted += 1

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


def _end_of(marker: list[int], output_ids: list[int], begin: int = 0) -> int | None:
    """The index just past the first occurrence of `marker` in `output_ids` from `begin`
    (None: none)."""
    n = len(marker)
    for i in range(begin, len(output_ids) - n + 1):
        if output_ids[i : i + n] == marker:
            return i + n
    return None


def apply_grammars(
    logits: torch.Tensor,  # [S, vocab] the rows sampled from, changed in place
    grammars: list[tuple[int, RowGrammar, list[int]]],  # (row, grammar, its output tokens)
) -> None:
    """Mask each constrained row's logits to the tokens its grammar allows next."""
    if not grammars:
        return
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(logits), logits.shape[-1])
    rows = []
    for row, grammar, output_ids in grammars:
        if not grammar.is_started(output_ids):
            continue  # still reasoning: free text
        grammar.sync(output_ids)
        # a terminated matcher took the stop token that ends the request; with overlapped
        # scheduling the step planned before that result still runs, and its token is
        # thrown away by the scheduler: nothing to mask
        if not grammar.is_terminated:
            grammar.matcher.fill_next_token_bitmask(bitmask, row)
            rows.append(row)
    if rows:
        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
