"""The detokenizer process: token ids -> text deltas, stop strings, finish reasons.

A sequence is (request id, index): a request with n > 1 has n of them. Each is decoded by
the tokenizer its prompt was tokenised with (DetokNew names its fingerprint): across a
hot-swap that changes the tokenizer, sequences of the old model and of the new one stream
side by side. The scheduler pushes `ModelChanged` before the first sequence of a new model;
a tokenizer no sequence uses and that is not the current one is dropped.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from tokenizers import Tokenizer

from common.actor import Actor
from common.config import Config
from common.messages import (
    Abort,
    DetokNew,
    FinishReason,
    ModelChanged,
    OutputBatch,
    ProcessDown,
    RequestError,
    TokenBatch,
)
from common.model_facts import tokenizer_fingerprint
from common.model_paths import tokenizer_dir
from common.topology import replica_addrs
from services.detokenizer.incremental import IncrementalDetokenizer

log = logging.getLogger(__name__)

SeqKey = tuple[str, int]  # (request id, sequence index)


def load_tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir(model_dir) / "tokenizer.json"))


class _DetokStream:
    __slots__ = (
        "detok",
        "fingerprint",
        "num_prompt_tokens",
        "stop_token_ids",
        "tokenizer",
        "version",
    )

    def __init__(
        self,
        detok: IncrementalDetokenizer,
        num_prompt_tokens: int,
        fingerprint: str,
        tokenizer: Tokenizer,
        stop_token_ids: list[int] | None = None,
    ) -> None:
        self.detok = detok
        self.stop_token_ids = stop_token_ids or []  # what stop_reason may name
        self.tokenizer = tokenizer  # for logprobs' token texts
        self.num_prompt_tokens = num_prompt_tokens
        self.fingerprint = fingerprint  # of the tokenizer decoding it
        self.version = ""  # the model version serving it, once the scheduler says

    def stop_reason(self, reason: FinishReason) -> str | int | None:
        """vLLM's stop_reason of a sequence finishing for `reason`: the stop string, or the
        stop token id, that ended it (None: EOS, the length, or not finished)."""
        if reason != FinishReason.STOP:
            return None
        if self.detok.stop_reason is not None:
            return self.detok.stop_reason
        ids = self.detok.output_token_ids
        return ids[-1] if ids and ids[-1] in self.stop_token_ids else None


class Tokenizers:
    """The tokenizers in use, by fingerprint: the current model's, and any an unfinished
    sequence still decodes with. "" names the start-up model's."""

    def __init__(self, startup: Tokenizer, startup_fingerprint: str) -> None:
        self.startup_fingerprint = startup_fingerprint
        self.current = startup_fingerprint
        self._by_fingerprint = {startup_fingerprint: startup}
        self._num_users: Counter[str] = Counter()

    def resolve(self, fingerprint: str) -> str:
        return fingerprint or self.startup_fingerprint

    def __contains__(self, fingerprint: str) -> bool:
        return self.resolve(fingerprint) in self._by_fingerprint

    def __len__(self) -> int:
        return len(self._by_fingerprint)

    def use(self, fingerprint: str) -> Tokenizer:
        """The tokenizer of `fingerprint` (KeyError when not loaded), held until release."""
        fp = self.resolve(fingerprint)
        tokenizer = self._by_fingerprint[fp]
        self._num_users[fp] += 1
        return tokenizer

    def release(self, fingerprint: str) -> None:
        fp = self.resolve(fingerprint)
        self._num_users[fp] -= 1
        if self._num_users[fp] <= 0:
            del self._num_users[fp]
            self._drop_unused()

    def set_current(self, fingerprint: str, path: Path) -> None:
        """Serve `fingerprint` from now on, loading it from `path` when it is new. Raises
        when it cannot be loaded (the current one stays)."""
        if fingerprint not in self._by_fingerprint:
            self._by_fingerprint[fingerprint] = load_tokenizer(path)
            log.info("loaded tokenizer %s from %s", fingerprint, path)
        self.current = fingerprint
        self._drop_unused()

    def _drop_unused(self) -> None:
        for fp in sorted(self._by_fingerprint):
            if fp != self.current and not self._num_users[fp]:
                del self._by_fingerprint[fp]
                log.info("dropped tokenizer %s", fp)


class DetokenizerActor(Actor):
    name = "detokenizer"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.streams: dict[SeqKey, _DetokStream] = {}
        self.handlers.update(
            {
                DetokNew: self._on_new,
                TokenBatch: self._on_tokens,
                ModelChanged: self._on_model_changed,
                ProcessDown: self._on_process_down,
            }
        )

    async def start(self) -> None:
        model_dir = Path(self.config.model.model)
        self.tokenizers = Tokenizers(load_tokenizer(model_dir), tokenizer_fingerprint(model_dir))
        self.gateway = self.gateways()
        # a stop string's abort goes to every replica: whichever holds the request ends it
        self.scheduler = self.outboxes(replica_addrs(self.config, "scheduler"))

    def _on_model_changed(self, msg: ModelChanged) -> None:
        try:
            self.tokenizers.set_current(msg.tokenizer_fingerprint, Path(msg.path))
        except Exception:
            log.exception(
                "cannot load the tokenizer of %s (%s); sequences that need it fail",
                msg.path,
                msg.tokenizer_fingerprint,
            )

    def _on_process_down(self, msg: ProcessDown) -> None:
        """The scheduler died: no sequence it held gets another token (the gateway sends the
        requests again, under new ids), so none is kept."""
        if msg.name == "scheduler":
            log.warning("the scheduler died: forgetting %d sequences", len(self.streams))
            for key in list(self.streams):
                self._forget(key)

    def _on_new(self, msg: DetokNew) -> None:
        n = len(msg.request_ids)
        tails = msg.prompt_tails or [[] for _ in range(n)]
        indices = msg.seq_indices or [0] * n
        fingerprints = msg.tokenizers or [""] * n
        min_tokens = msg.min_tokens or [0] * n
        include_stop = msg.include_stop_str or [False] * n
        skip_special = msg.skip_special_tokens or [True] * n
        stop_token_ids = msg.stop_token_ids or [[] for _ in range(n)]
        resumed = msg.resumed_token_ids or [[] for _ in range(n)]
        unknown: dict[str, str] = {}  # request id -> the fingerprint no tokenizer has
        seqs = zip(msg.request_ids, indices, fingerprints, strict=True)
        for i, (rid, index, fp) in enumerate(seqs):
            if fp not in self.tokenizers:
                unknown[rid] = fp
                continue
            self._forget((rid, index))  # (a request id reused after a retokenisation)
            tokenizer = self.tokenizers.use(fp)
            detok = IncrementalDetokenizer(
                tokenizer,
                stop=msg.stop[i],
                prompt_tail=tails[i],
                skip_special_tokens=skip_special[i],
                min_tokens=min_tokens[i],
                include_stop_str=include_stop[i],
            )
            # a resumed sequence: the client has these tokens' text (one at a time, as when
            # they came, so the stop-string screen holds back what it held back then)
            detok.add(resumed[i], final=False)
            stream = _DetokStream(detok, msg.num_prompt_tokens[i], fp, tokenizer, stop_token_ids[i])
            self.streams[rid, index] = stream
        for rid, fp in unknown.items():
            self._fail(rid, f"no tokenizer with fingerprint {fp!r} is loaded to decode it")

    def _on_tokens(self, msg: TokenBatch) -> None:
        out = OutputBatch([], [], [], [], [], [], [], [])
        stop_reasons: list[str | int | None] = []
        stopped: list[SeqKey] = []
        n = len(msg.request_ids)
        versions = msg.versions or [""] * n
        indices = msg.seq_indices or [0] * n
        cached = msg.num_cached_tokens or [0] * n
        for i, (rid, index, ids, reason, version) in enumerate(
            zip(msg.request_ids, indices, msg.token_ids, msg.finish_reasons, versions, strict=True)
        ):
            key = (rid, index)
            stream = self.streams.get(key)
            if stream is None:
                continue  # finished already (a stop string); late tokens are dropped
            stream.version = version or stream.version
            if reason == FinishReason.ERROR:  # the scheduler told the gateway itself: forget it
                self._forget(key)
                continue
            text, stop_hit = stream.detok.add(ids, final=reason != FinishReason.NONE)
            if stop_hit and reason == FinishReason.NONE:
                reason = FinishReason.STOP
                stopped.append(key)
            if reason != FinishReason.NONE:
                self._forget(key)
            out.request_ids.append(rid)
            out.seq_indices.append(index)
            out.texts.append(text)
            out.token_ids.append(ids)
            out.finish_reasons.append(int(reason))
            out.num_prompt_tokens.append(stream.num_prompt_tokens)
            out.num_output_tokens.append(len(stream.detok.output_token_ids))
            out.num_cached_tokens.append(cached[i])
            out.versions.append(stream.version)
            stop_reasons.append(stream.stop_reason(FinishReason(reason)))
            _add_logprobs(out, msg, i, stream.tokenizer)
            if msg.embeddings:  # an embeddings request's vector travels on as it came
                out.embeddings.append(msg.embeddings[i])
        if any(r is not None for r in stop_reasons):  # (commonly none: nothing on the wire)
            out.stop_reasons.extend(stop_reasons)
        if not any(out.num_cached_tokens):  # (no prefix hit in the batch: nothing on the wire)
            out.num_cached_tokens.clear()
        if out.request_ids:
            self.gateway.send(out)
        if stopped:  # the scheduler ends them now, so no step is spent after the stop
            self.scheduler.send(
                Abort(
                    request_ids=[rid for rid, _ in stopped],
                    reason=int(FinishReason.STOP),
                    seq_indices=[index for _, index in stopped],
                )
            )

    def _forget(self, key: SeqKey) -> None:
        stream = self.streams.pop(key, None)
        if stream is not None:
            self.tokenizers.release(stream.fingerprint)

    def _fail(self, request_id: str, why: str) -> None:
        """A request none of whose text can be decoded: the gateway answers it, the
        scheduler ends every sequence of it."""
        log.error("%s", why, extra={"request_id": request_id})
        for key in [k for k in self.streams if k[0] == request_id]:
            self._forget(key)
        self.gateway.send(RequestError(request_id=request_id, status=500, message=why))
        self.scheduler.send(Abort(request_ids=[request_id], reason=int(FinishReason.ERROR)))


def _add_logprobs(out: OutputBatch, msg: TokenBatch, i: int, tokenizer: Tokenizer) -> None:
    """Request i's logprobs (if the batch has any), each id with its text beside it."""
    if msg.logprob_token_ids:
        out.logprob_token_ids.append(msg.logprob_token_ids[i])
        out.logprob_values.append(msg.logprob_values[i])
        out.logprob_tokens.append(token_texts(tokenizer, msg.logprob_token_ids[i]))
    if msg.prompt_logprob_token_ids:
        out.prompt_logprob_token_ids.append(msg.prompt_logprob_token_ids[i])
        out.prompt_logprob_values.append(msg.prompt_logprob_values[i])
        out.prompt_logprob_tokens.append(token_texts(tokenizer, msg.prompt_logprob_token_ids[i]))
        if msg.prompt_logprob_ranks:
            out.prompt_logprob_ranks.append(msg.prompt_logprob_ranks[i])


def token_texts(tokenizer: Tokenizer, entries: list[list[int]]) -> list[list[str]]:
    """Each id's text, decoded alone (special tokens shown), in one batched decode."""
    flat = [[token] for entry in entries for token in entry]
    texts = iter(tokenizer.decode_batch(flat, skip_special_tokens=False) if flat else [])
    return [[next(texts) for _ in entry] for entry in entries]
