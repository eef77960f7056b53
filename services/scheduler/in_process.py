"""EngineCore driven in this process by a runner: the engine the scheduler actor runs over
sockets, with the worker's runner called directly. Parity tests and the speculative-decoding
benchmark drive it; the plans, the window of steps in flight and the token bookkeeping are
the ones that ship."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
from collections import deque
from typing import Any, Protocol

from common.config import Config
from common.messages import (
    CompileGrammar,
    GrammarCompiled,
    LoadLora,
    LoraAdapterResult,
    LorasChanged,
    ModelChanged,
    ModelInfo,
    RequestError,
    Retokenize,
    SamplingParams,
    StepPlan,
    StepResult,
    SwapResult,
    TokenBatch,
    TokenizedRequest,
    UnloadLora,
)
from services.scheduler.engine_core import EngineCore
from services.scheduler.outbox import ToDetokenizer, ToGateway, ToWorker
from services.scheduler.policy import PolicyConfig

SequenceId = tuple[str, int]  # (request id, index of the sequence)


class StepRunner(Protocol):
    """What the in-process engine needs of a worker runner (gpu_worker's Runner has it)."""

    def execute(self, plan: StepPlan) -> StepResult: ...

    def model_info(self) -> ModelInfo: ...

    def compile_grammar(
        self, kind: str, spec: str, tokenizer_fingerprint: str
    ) -> concurrent.futures.Future[None]: ...


@dataclasses.dataclass
class _Collector:
    """The EngineOutbox of an in-process engine: plans queue for the runner, outputs are kept."""

    plans: deque[StepPlan] = dataclasses.field(default_factory=deque)
    compiles: deque[CompileGrammar] = dataclasses.field(default_factory=deque)
    outputs: dict[SequenceId, list[int]] = dataclasses.field(default_factory=dict)
    errors: list[RequestError | Retokenize] = dataclasses.field(default_factory=list)
    announced: list[ModelChanged] = dataclasses.field(default_factory=list)
    batches: list[TokenBatch] = dataclasses.field(default_factory=list)  # as sent, in order
    lora_messages: list[LoadLora | UnloadLora] = dataclasses.field(default_factory=list)
    lora_results: list[LoraAdapterResult] = dataclasses.field(default_factory=list)
    loras_changed: list[LorasChanged] = dataclasses.field(default_factory=list)

    def to_worker(self, msg: ToWorker) -> None:
        if isinstance(msg, CompileGrammar):
            self.compiles.append(msg)
            return
        if isinstance(msg, LoadLora | UnloadLora):  # the runner's owner acts on them
            self.lora_messages.append(msg)
            return
        if not isinstance(msg, StepPlan):
            raise NotImplementedError("the in-process engine does not hot-swap")
        self.plans.append(msg)

    def to_detokenizer(self, msg: ToDetokenizer) -> None:
        if isinstance(msg, TokenBatch):
            self.batches.append(msg)
            indices = msg.seq_indices or [0] * len(msg.request_ids)
            for rid, i, tokens in zip(msg.request_ids, indices, msg.token_ids, strict=True):
                self.outputs.setdefault((rid, i), []).extend(tokens)

    def to_gateway(self, msg: ToGateway) -> None:
        if isinstance(msg, LorasChanged):
            self.loras_changed.append(msg)
        else:
            self.errors.append(msg)

    def announce(self, msg: ModelChanged) -> None:
        self.announced.append(msg)

    def reply(self, address: str, msg: SwapResult | LoraAdapterResult) -> None:
        if isinstance(msg, SwapResult):
            raise NotImplementedError("the in-process engine does not hot-swap")
        self.lora_results.append(msg)


class InProcessEngine:
    """Add requests, then `run()` until every one has finished."""

    def __init__(
        self,
        runner: StepRunner,
        config: Config | None = None,
        policy_config: PolicyConfig | None = None,
        *,
        num_blocks: int | None = None,
        num_host_blocks: int | None = None,
        check_integrity: bool = True,
    ) -> None:
        self.runner = runner
        self.collector = _Collector()
        self.core = EngineCore(config or Config(), self.collector, policy_config)
        info = runner.model_info()
        if num_blocks is not None:  # a smaller pool than the runner's, to force preemption
            info = dataclasses.replace(info, num_blocks=num_blocks)
        if num_host_blocks is not None:
            info = dataclasses.replace(info, num_host_blocks=num_host_blocks)
        self.core.on_worker_ready(info)
        self.check_integrity = check_integrity
        self.results: list[StepResult] = []  # every step's result, in order
        self._ids = itertools.count(1)

    @property
    def policy(self) -> Any:
        return self.core.policy

    @property
    def outputs(self) -> dict[SequenceId, list[int]]:
        return self.collector.outputs

    @property
    def batches(self) -> list[TokenBatch]:
        """Every TokenBatch the engine sent (logprobs included), in order."""
        return self.collector.batches

    def add(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        lora_name: str = "",
    ) -> list[SequenceId]:
        """Queue a request (n sequences for sampling.n > 1, with the LoRA adapter
        `lora_name` loaded in the runner); returns the sequences' ids."""
        rid = request_id or f"r{next(self._ids)}"
        served = self.core.served
        self.core.add(
            TokenizedRequest(
                request_id=rid,
                prompt_token_ids=list(prompt),
                sampling=sampling,
                eos_token_ids=list(served.info.eos_token_ids) if served else [],
                lora_name=lora_name,
            )
        )
        self._compile_grammars()
        if self.collector.errors:
            raise ValueError(f"request refused: {self.collector.errors.pop()}")
        ids = [(rid, i) for i in range(sampling.n)]
        for sid in ids:
            self.outputs.setdefault(sid, [])
        return ids

    def run(self) -> dict[SequenceId, list[int]]:
        """The step loop: plan while the window has room, execute the oldest plan, apply
        its result; until no request is left. Integrity is checked after every step."""
        core, plans = self.core, self.collector.plans
        core.step()
        while plans:
            result = self.runner.execute(plans.popleft())
            self.results.append(result)
            core.on_step_result(result)
            if self.check_integrity and core.policy is not None:
                core.policy.check_integrity()
            core.step()
        return self.outputs

    def _compile_grammars(self) -> None:
        """The worker's answers to the grammars asked for (compiled here, in this thread)."""
        while self.collector.compiles:
            msg = self.collector.compiles.popleft()
            future = self.runner.compile_grammar(msg.kind, msg.spec, msg.tokenizer_fingerprint)
            error = future.exception()
            self.core.on_grammar_compiled(
                GrammarCompiled(msg.request_id, str(error or ""), msg.tokenizer_fingerprint)
            )
