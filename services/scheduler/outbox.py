"""EngineOutbox: where EngineCore's messages go, and what it sends each peer. The scheduler
actor's sockets implement it (actor.py), and so does an in-process collector
(in_process.py)."""

from __future__ import annotations

from typing import Protocol

from common.messages import (
    CompileGrammar,
    DetokNew,
    LoadLora,
    LoadModel,
    LoraAdapterResult,
    LorasChanged,
    ModelChanged,
    RequestError,
    Retokenize,
    StepPlan,
    SwapResult,
    TokenBatch,
    UnloadLora,
    UnloadModel,
)

# what the core sends each peer
ToWorker = StepPlan | LoadModel | UnloadModel | CompileGrammar | LoadLora | UnloadLora
ToDetokenizer = DetokNew | TokenBatch
ToGateway = RequestError | Retokenize | LorasChanged


class EngineOutbox(Protocol):
    """Where EngineCore's messages go."""

    def to_worker(self, msg: ToWorker) -> None: ...

    def to_detokenizer(self, msg: ToDetokenizer) -> None: ...

    def to_gateway(self, msg: ToGateway) -> None: ...

    def announce(self, msg: ModelChanged) -> None:
        """To every process that depends on the served model: tokenizers, detokenizer and
        gateway (the gateway's copy before anything else the core sends it next)."""
        ...

    def reply(self, address: str, msg: SwapResult | LoraAdapterResult) -> None: ...
