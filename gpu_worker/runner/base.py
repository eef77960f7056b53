"""The worker's runner seam: the `Runner` protocol WorkerActor drives, and `PlanRunner`, the
part of it every runner shares (the real `ModelRunner` and the compute-free
`SyntheticRunner`) over one `RequestTable` (gpu_worker/runner/request_table.py)."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from common.messages.scheduler_worker import StepPlan, StepResult
from common.messages.types import ModelInfo
from gpu_worker.runner.request_table import KVCopier, RequestState, RequestTable
from gpu_worker.runner.version_table import VersionTable

if TYPE_CHECKING:  # the synthetic runner runs without torch ever being imported
    import concurrent.futures

    from gpu_worker.lora.adapter import AdapterSpec


class Runner(Protocol):
    """Everything the worker (and the in-process engines of tests/ and tools/) uses of a
    runner: run a plan, forget requests, describe the model, and hot-swap versions."""

    @property
    def model_path(self) -> str:
        """The folder of the default version."""
        ...

    @property
    def default_version(self) -> str:
        """The version new requests without an explicit one run on."""
        ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def eos_token_ids(self) -> list[int]:
        """The default version's end-of-sequence tokens."""
        ...

    def execute(self, plan: StepPlan, report: Callable[[Any], None] | None = None) -> StepResult:
        """Apply the plan's diffs, run its batch, return the sampled tokens; `report` (the
        scheduler's outbox) takes what is sent before the step ends (KvExported)."""
        ...

    def compile_grammar(
        self, kind: str, spec: str, tokenizer_fingerprint: str
    ) -> concurrent.futures.Future[None]:
        """Compile a structured-output grammar for that tokenizer ("": the default
        version's) in the background, into the cache new requests take it from; the future
        raises ValueError for a spec that does not compile."""
        ...

    def drop(self, req_id: str) -> None:
        """Forget one request (idempotent), e.g. after its step failed."""
        ...

    def reset(self) -> None:
        """Forget every request (a new scheduler starts from an empty pool)."""
        ...

    def close(self) -> None:
        """Finish background work that outlives a step (the disk tier's writes) before the
        runner is replaced."""
        ...

    def num_requests(self) -> int: ...

    def model_info(self) -> ModelInfo:
        """What the worker tells the scheduler (the Ready message's model)."""
        ...

    def load_version(self, path: str, version: str = "") -> str:
        """Load another model beside the served ones; returns its version."""
        ...

    def set_default_version(self, version: str) -> None: ...

    def unload_version(self, version: str) -> None: ...

    def relabel(self, version: str) -> None:
        """Give the default version an operator-chosen label."""
        ...

    def load_lora(self, name: str, path: str) -> AdapterSpec:
        """Read and check a PEFT adapter folder and keep it under `name` (replacing one of
        that name); a LoraAdapterError naming the file and field leaves everything as it was."""
        ...

    def unload_lora(self, name: str) -> None:
        """Forget an adapter (a KeyError when it is not loaded)."""
        ...


VersionT = TypeVar("VersionT")


class PlanRunner(abc.ABC, Generic[VersionT]):
    """The part of `Runner` every runner shares: the request table, the loaded versions
    (a `VersionT` each, in a `VersionTable`) and the members that only read or relabel them."""

    requests: RequestTable
    versions: VersionTable[VersionT]

    @property
    def default_version(self) -> str:
        """The version new requests without an explicit one run on."""
        return self.versions.default_version

    def set_default_version(self, version: str) -> None:
        """New requests without an explicit version run on `version` from now on."""
        self.versions.set_default(version)

    def num_requests(self) -> int:
        return len(self.requests)

    def drop(self, req_id: str) -> None:
        """Forget a request (idempotent), e.g. after its step failed."""
        self.requests.drop(req_id)

    def reset(self) -> None:
        """Forget every request."""
        self.requests.clear()

    def close(self) -> None:
        """Nothing runs in the background unless a subclass says so."""

    def relabel(self, version: str) -> None:
        """Give the default version an operator-chosen label (its requests follow)."""
        old = self.default_version
        self.versions.relabel(old, version)  # (refused when `version` is another's label)
        self.requests.relabel(old, version)

    def _begin_step(self, plan: StepPlan, kv: KVCopier | None = None) -> list[RequestState]:
        """Apply the plan's diffs (with `kv`'s copies) and check its batch: the states of
        the batch's requests, in plan order, their new tokens counted as computed."""
        self.requests.apply_diffs(plan, self.default_version, self.versions, kv)
        return self.requests.schedule(plan)
