"""Structs that travel inside messages of more than one connection."""

from __future__ import annotations

import dataclasses
import enum

from common.codec import struct


class FinishReason(enum.IntEnum):
    """Why a request ended; int on the wire, OpenAI's string at the edge."""

    NONE = 0
    STOP = 1  # EOS token or a stop string
    LENGTH = 2  # max_tokens or the model length
    CANCELLED = 3
    TIMEOUT = 4
    ERROR = 5

    @property
    def openai(self) -> str | None:
        return _OPENAI_NAMES[self]


_OPENAI_NAMES = {
    FinishReason.NONE: None,
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "cancelled",
    FinishReason.TIMEOUT: "timeout",
    FinishReason.ERROR: "error",
}


@struct
class SamplingParams:
    """How one request samples and when it stops. Validated by the gateway and tokenizer."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None  # reproducible sampling when set
    stop: list[str] = dataclasses.field(default_factory=list)  # stop strings, not emitted
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # sequences per request; they share the prompt's KV blocks

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
