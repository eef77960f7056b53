"""Every wire message, one module per connection. Importing this registers them all."""

from common.messages import (  # noqa: F401
    control,
    detokenizer_gateway,
    gateway_tokenizer,
    scheduler_detokenizer,
    scheduler_router,
    scheduler_worker,
    tokenizer_scheduler,
    types,
)
from common.messages.control import (
    Abort,
    Drain,
    Drained,
    ModelChanged,
    Ping,
    Pong,
    ProcessDown,
    Progress,
    Ready,
    Reset,
    Shutdown,
    Stats,
    StatsQuery,
    SwapModel,
    SwapResult,
)
from common.messages.detokenizer_gateway import OutputBatch
from common.messages.gateway_tokenizer import (
    DetokenizeQuery,
    GenerateRequest,
    RequestError,
    Retokenize,
    TokenizeQuery,
    TokenizeResult,
)
from common.messages.scheduler_detokenizer import DetokNew, TokenBatch
from common.messages.scheduler_router import ReplicaNotice
from common.messages.scheduler_worker import (
    CompileGrammar,
    GrammarCompiled,
    LoadModel,
    ModelLoaded,
    StepPlan,
    StepResult,
    UnloadModel,
)
from common.messages.tokenizer_scheduler import TokenizedRequest
from common.messages.types import FinishReason, ModelInfo, SamplingParams

__all__ = [
    "Abort",
    "DetokNew",
    "FinishReason",
    "GenerateRequest",
    "OutputBatch",
    "Ping",
    "Pong",
    "Progress",
    "Ready",
    "RequestError",
    "SamplingParams",
    "Shutdown",
    "Stats",
    "StatsQuery",
    "StepPlan",
    "StepResult",
    "TokenBatch",
    "TokenizedRequest",
    "SwapModel",
    "SwapResult",
    "LoadModel",
    "ModelInfo",
    "ModelLoaded",
    "UnloadModel",
    "CompileGrammar",
    "GrammarCompiled",
    "ProcessDown",
    "Reset",
    "ReplicaNotice",
    "Drain",
    "Drained",
    "ModelChanged",
    "Retokenize",
    "TokenizeQuery",
    "DetokenizeQuery",
    "TokenizeResult",
]
