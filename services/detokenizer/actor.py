"""The detokenizer process: token ids -> text deltas, stop strings, finish reasons."""

from __future__ import annotations

import logging
from pathlib import Path

from common.actor import Actor
from common.config import Config
from common.messages import Abort, DetokNew, FinishReason, OutputBatch, TokenBatch
from services.detokenizer.incremental import IncrementalDetokenizer

log = logging.getLogger(__name__)


class _Stream:
    __slots__ = ("detok", "num_prompt_tokens", "version")

    def __init__(self, detok: IncrementalDetokenizer, num_prompt_tokens: int) -> None:
        self.detok = detok
        self.num_prompt_tokens = num_prompt_tokens
        self.version = ""  # the model version serving it, once the scheduler says


class DetokenizerActor(Actor):
    name = "detokenizer"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.streams: dict[str, _Stream] = {}
        self.handlers.update({DetokNew: self._on_new, TokenBatch: self._on_tokens})

    async def start(self) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(self.config.model.model) / "tokenizer.json"))
        self.gateway = self.outbox(self.config.addr("gateway"))
        self.scheduler = self.outbox(self.config.addr("scheduler"))

    def _on_new(self, msg: DetokNew) -> None:
        tails = msg.prompt_tails or [[] for _ in msg.request_ids]
        for rid, stop, n, tail in zip(msg.request_ids, msg.stop, msg.num_prompt_tokens, tails,
                                      strict=True):
            detok = IncrementalDetokenizer(self.tokenizer, stop=stop, prompt_tail=tail)
            self.streams[rid] = _Stream(detok, n)

    def _on_tokens(self, msg: TokenBatch) -> None:
        out = OutputBatch([], [], [], [], [], [], [])
        stopped: list[str] = []
        versions = msg.versions or [""] * len(msg.request_ids)
        for rid, ids, reason, version in zip(msg.request_ids, msg.token_ids, msg.finish_reasons,
                                             versions, strict=True):
            stream = self.streams.get(rid)
            if stream is None:
                continue  # finished already (a stop string); late tokens are dropped
            stream.version = version or stream.version
            if reason == FinishReason.ERROR:  # the scheduler told the gateway itself: forget it
                del self.streams[rid]
                continue
            text, stop_hit = stream.detok.add(ids, final=reason != FinishReason.NONE)
            if stop_hit and reason == FinishReason.NONE:
                reason = FinishReason.STOP
                stopped.append(rid)
            if reason != FinishReason.NONE:
                del self.streams[rid]
            out.request_ids.append(rid)
            out.texts.append(text)
            out.token_ids.append(ids)
            out.finish_reasons.append(int(reason))
            out.num_prompt_tokens.append(stream.num_prompt_tokens)
            out.num_output_tokens.append(len(stream.detok.output_token_ids))
            out.versions.append(stream.version)
        if out.request_ids:
            self.gateway.send(out)
        if stopped:  # the scheduler ends them now, so no step is spent after the stop
            self.scheduler.send(Abort(request_ids=stopped, reason=int(FinishReason.STOP)))
