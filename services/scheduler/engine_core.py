"""EngineCore: the scheduler's engine, with no sockets.

It owns the scheduling policy (queues, KV blocks, prefix cache), the sequences of each
request (`n` > 1 forks), the window of steps in flight, hot-swaps and which model is served.
Transports are outside: messages leave through an `EngineOutbox` (the scheduler actor's
sockets, or an in-process collector), and step plans go to whatever executes them (the
worker process, or a runner in this process: `InProcessEngine`). One step loop serves both:

    step():            while the window has room and there is work:
                           plan = policy.schedule() -> outbox.to_worker(plan)
    on_step_result():  policy.update(tokens) -> TokenBatch to the detokenizer

A request's sequences are keyed for the policy and the worker by `sequence_key(id, index)`,
which is built here and never parsed: messages to the detokenizer carry the request id and
the index side by side.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any, Protocol

from common.config import Config
from common.messages import (
    CompileGrammar,
    DetokNew,
    FinishReason,
    GrammarCompiled,
    LoadLora,
    LoadLoraAdapter,
    LoadModel,
    LoraAdapterResult,
    LoraLoaded,
    LorasChanged,
    ModelChanged,
    ModelInfo,
    ModelLoaded,
    RequestError,
    Retokenize,
    SamplingParams,
    StepPlan,
    StepResult,
    SwapModel,
    SwapResult,
    TokenBatch,
    TokenizedRequest,
    UnloadLora,
    UnloadLoraAdapter,
    UnloadModel,
)
from common.model_facts import cache_root, lora_root, salted_root
from services.scheduler.block_manager import BlockManager, HostBlockPool
from services.scheduler.grammar_wait import GrammarWait
from services.scheduler.lora_registry import Adapter, LoraRegistry
from services.scheduler.plan import to_plan
from services.scheduler.policy import PolicyConfig, Scheduler
from services.scheduler.request import Request, Status
from services.scheduler.swap import SwapCoordinator

log = logging.getLogger(__name__)

PROMPT_TAIL = 6  # prompt tokens the detokenizer needs to space the first output word


def sequence_key(request_id: str, index: int) -> str:
    """The policy's and the worker's key of sequence `index` of a request. Injective (the
    index comes first, before the first '/'), so client ids need no escaping."""
    return f"{index}/{request_id}"


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


@dataclasses.dataclass
class _InFlight:
    step_id: int
    seq_keys: list[str]
    sent_at: float


@dataclasses.dataclass
class _Served:
    """The model new requests start on, as the worker described it."""

    info: ModelInfo
    name: str
    root: int

    @property
    def version(self) -> str:
        return self.info.weights_version

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.info.tokenizer_fingerprint

    @property
    def max_model_len(self) -> int:
        return min(self.info.max_model_len, self.info.num_blocks * self.info.block_size)

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size  # 0: unknown (no check)


class EngineCore:
    """The scheduler's engine: requests in, step plans out, step results in, tokens out."""

    def __init__(
        self, config: Config, outbox: EngineOutbox, policy_config: PolicyConfig | None = None
    ) -> None:
        self.config = config
        self.outbox = outbox
        # the policy's settings come from the config's scheduler section; tests may pass them
        self.policy_config = policy_config or PolicyConfig.from_config(config)
        self.policy: Scheduler | None = None  # None until a worker is ready
        self.served: _Served | None = None
        self.groups: dict[str, list[Request]] = {}  # request id -> its live sequences
        self.grammar_wait = GrammarWait()  # constrained requests until their grammar compiles
        self.in_flight: deque[_InFlight] = deque()
        # speculative decoding needs each step's result (how many drafts were accepted)
        # before its requests can be planned again: no overlap then
        self.max_in_flight = (
            2
            if config.scheduler.async_scheduling and not self.policy_config.num_speculative_tokens
            else 1
        )
        self.swaps = SwapCoordinator(outbox.to_worker, outbox.reply)
        # LoRA adapters: which are served, their loads and unloads (lora_registry.py)
        self.loras = LoraRegistry(config, outbox.to_worker, outbox.reply, outbox.to_gateway)
        self.num_steps = 0
        self.step_counter = 0
        self.step_time_s = 0.0
        self.worker_time_s = 0.0
        # result-to-result intervals of back-to-back steps, against the worker's own time
        self.interval_s = self.interval_forward_s = self._last_result_at = 0.0
        self.num_intervals = 0
        self._busy_since_last_result = False
        self._checked_at, self._checked_at_step = 0.0, -1  # the last block-by-block check

    @property
    def is_ready(self) -> bool:
        return self.policy is not None

    @property
    def has_work(self) -> bool:
        """Steps to plan, or results to wait for."""
        return bool(self.in_flight) or (self.policy is not None and self.policy.has_work())

    # the worker ----------------------------------------------------------------------------
    def on_worker_ready(self, info: ModelInfo) -> None:
        """A worker announced its pool and model: serve it. A worker that announces itself
        again with another boot id restarted: every live request fails (retryable)."""
        if self.policy is not None and self.served is not None:
            same = info.boot_id == self.served.info.boot_id
            if same and not self.policy.requests and not self.in_flight:
                return  # the answer to our own Reset at start-up: nothing changed
            log.warning("worker re-announced itself; resetting the block pool")
            self.fail_all("the worker restarted", resumable=True)
        s = self.config.scheduler
        self.policy = Scheduler(
            self._block_manager(info),
            self.policy_config,
            host_pool=HostBlockPool(info.num_host_blocks),
        )
        self.in_flight.clear()
        self.adopt(info)
        self.loras.on_worker_ready(info)  # (a new worker holds no adapter)
        log.info(
            "worker ready: %d blocks of %d tokens (max %d seqs)",
            info.num_blocks,
            info.block_size,
            s.max_num_seqs,
        )

    def on_worker_down(self, why: str) -> None:
        """The worker died: nothing in flight can finish here; the gateway sends each request
        again (resumable) once the next worker's Ready has been announced."""
        self.fail_all(why, resumable=True)
        self.in_flight.clear()
        self.policy = None

    def _block_manager(self, info: ModelInfo) -> BlockManager:
        return BlockManager(
            info.num_blocks,
            info.block_size,
            enable_prefix_caching=self.config.cache.enable_prefix_caching,
            # several replicas: the router hears which blocks each caches
            track_hash_changes=self.config.data_parallel.data_parallel_size > 1,
        )

    def adopt(self, info: ModelInfo) -> None:
        """Serve the model `info` describes: new requests start on its version and root;
        everyone who depends on the served model hears of it."""
        policy = self.policy
        assert policy is not None
        name = self.served.name if self.served else info.model_name
        blocks = policy.blocks
        if (info.num_blocks, info.block_size) != (blocks.num_blocks, blocks.block_size):
            # a drain swap to another KV layout: nothing holds blocks now, rebuild the pool
            assert blocks.num_used_blocks == 0, "pool rebuilt while blocks are in use"
            policy.blocks = self._block_manager(info)
        old_fingerprint = self.served.tokenizer_fingerprint if self.served else None
        root = cache_root(
            name, info.weights_version, info.tokenizer_fingerprint, info.position_config
        )
        self.served = _Served(info=info, name=name, root=root)
        policy.set_version(self.served.version, root)
        if old_fingerprint not in (None, self.served.tokenizer_fingerprint):
            self._retokenize_unstarted()
        self.announce()

    def announce(self) -> None:
        """Tell every process that depends on the served model which one it is: after a
        change, and to a process that restarted with the start-up model's facts."""
        served = self.served
        if served is None:
            return  # the next worker's Ready announces it
        self.outbox.announce(
            ModelChanged(
                name=served.name,
                version=served.version,
                path=served.info.model_path,
                tokenizer_fingerprint=served.tokenizer_fingerprint,
                max_model_len=served.max_model_len,
                vocab_size=served.vocab_size,
                eos_token_ids=list(served.info.eos_token_ids),
            )
        )

    def _retokenize_unstarted(self) -> None:
        """The tokenizer changed: a request none of whose sequences has started goes back to
        the gateway to be tokenised again; unstarted forks of a started request stay on its
        version (its tokenizer made their prompt)."""
        assert self.policy is not None
        for request_id, seqs in list(self.groups.items()):
            started = next((r for r in seqs if r.version is not None), None)
            if started is None:
                self.grammar_wait.end(request_id, FinishReason.ERROR)
                for r in seqs:
                    self.policy.abort(r.request_id, FinishReason.ERROR)
                self._tell_detokenizer_finished(seqs)  # (forgets the group too)
                self.outbox.to_gateway(Retokenize(request_id=request_id))
            else:
                for r in seqs:
                    if r.version is None:
                        r.version, r.cache_root = started.version, started.cache_root

    # requests ------------------------------------------------------------------------------
    def add(self, msg: TokenizedRequest) -> None:
        """Admit a tokenised request into the waiting queue, or refuse it."""
        if self.policy is None or self.served is None:
            self._reject(
                msg.request_id, 503, "the worker is restarting; retry shortly", resumable=True
            )
            return
        served = self.served
        if msg.tokenizer_fingerprint and msg.tokenizer_fingerprint != served.tokenizer_fingerprint:
            self.outbox.to_gateway(Retokenize(request_id=msg.request_id))
            return
        error = self._admission_error(msg)
        adapter = self.loras.check(msg) if msg.lora_name and error is None else None
        if isinstance(adapter, tuple):
            error, adapter = adapter, None
        if error is not None:
            self._reject(msg.request_id, *error)
            return
        seqs = self._sequences(msg, adapter)
        if msg.sampling.is_structured:  # queued once its grammar is compiled (off the loop)
            self.grammar_wait.park(msg.request_id, seqs, msg.tokenizer_fingerprint)
            self.outbox.to_worker(
                CompileGrammar(
                    request_id=msg.request_id,
                    kind=msg.sampling.structured_kind,
                    spec=msg.sampling.structured_spec,
                    tokenizer_fingerprint=msg.tokenizer_fingerprint,
                )
            )
        else:
            for req in seqs:
                self.policy.add(req)
        self.groups[msg.request_id] = seqs
        n = len(seqs)
        self.outbox.to_detokenizer(
            DetokNew(
                request_ids=[msg.request_id] * n,
                stop=[list(msg.sampling.stop)] * n,
                num_prompt_tokens=[len(msg.prompt_token_ids)] * n,
                prompt_tails=[msg.prompt_token_ids[-PROMPT_TAIL:]] * n,
                seq_indices=list(range(n)),
                tokenizers=[msg.tokenizer_fingerprint] * n,
                min_tokens=[msg.sampling.min_tokens] * n if msg.sampling.min_tokens else [],
                resumed_token_ids=[list(msg.resumed_token_ids)] * n
                if msg.resumed_token_ids
                else [],
                **_output_options(msg.sampling, n),
            )
        )

    def _admission_error(self, msg: TokenizedRequest) -> tuple[int, str, str | None] | None:
        assert self.policy is not None and self.served is not None
        s, served = self.config.scheduler, self.served
        if self.policy.num_waiting >= s.max_waiting:
            return (
                429,
                f"server overloaded: {self.policy.num_waiting} requests waiting "
                f"(max_waiting={s.max_waiting}); retry later",
                None,
            )
        # (an embeddings request generates nothing: its prompt may fill the model's length)
        longest = served.max_model_len - (0 if msg.sampling.pooling else 1)
        if len(msg.prompt_token_ids) > longest:
            return (
                400,
                f"prompt: the prompt has {len(msg.prompt_token_ids)} tokens; this server "
                f"holds at most {longest}",
                "prompt",  # the request's prompt: the gateway names the endpoint's field
            )
        if served.vocab_size:
            bad = next((t for t in msg.prompt_token_ids if not 0 <= t < served.vocab_size), None)
            if bad is not None:
                return (
                    400,
                    f"token id {bad} is outside the vocabulary of model version "
                    f"{served.version} (ids must be in [0, {served.vocab_size}))",
                    "prompt",
                )
        if msg.request_id in self.groups:
            return (400, f"request id {msg.request_id!r} is already in flight", "X-Request-Id")
        if msg.resumed_token_ids and (
            msg.sampling.n != 1
            or len(msg.prompt_token_ids) + len(msg.resumed_token_ids)
            >= min(served.max_model_len, len(msg.prompt_token_ids) + msg.sampling.max_tokens)
        ):
            return (503, "the request cannot be resumed here; retry it", None)
        return None

    def _sequences(self, msg: TokenizedRequest, adapter: Adapter | None = None) -> list[Request]:
        """One Request per sequence: a leader, and for n > 1 n - 1 forks sharing its prompt."""
        assert self.served is not None
        lora_name, lora_hash = (adapter.name, adapter.weights_hash) if adapter else ("", "")
        root = lora_root(salted_root(self.served.root, msg.cache_salt), lora_name, lora_hash)
        seqs: list[Request] = []
        for i in range(msg.sampling.n):
            sampling = msg.sampling
            if sampling.seed is not None and i:
                sampling = dataclasses.replace(sampling, seed=sampling.seed + i)
            seqs.append(
                Request(
                    sequence_key(msg.request_id, i),
                    msg.prompt_token_ids,
                    sampling,
                    msg.eos_token_ids,
                    max_model_len=self.served.max_model_len,
                    arrival_time=msg.arrival_time,
                    cache_root=root,
                    cache_salt=msg.cache_salt,
                    lora_name=lora_name,
                    lora_hash=lora_hash,
                    priority=msg.priority,
                    timeout=msg.timeout,
                    fork_of=seqs[0] if i else None,
                    group_id=msg.request_id,
                    seq_index=i,
                )
            )
        # a resumed request: its outputs so far are known tokens without KV, as after a
        # preemption by recompute (the admission allows it only with one sequence)
        seqs[0].output_token_ids = list(msg.resumed_token_ids)
        return seqs

    def on_grammar_compiled(self, msg: GrammarCompiled) -> None:
        """A waiting request's grammar is ready: queue it; or it does not compile: a 400
        naming the field it came from."""
        seqs = self.grammar_wait.release(msg.request_id, msg.tokenizer_fingerprint)
        if not seqs or self.policy is None:
            return  # ended while it waited
        if msg.error:
            for r in seqs:
                r.status, r.finish_reason = Status.FINISHED, FinishReason.ERROR
            field = seqs[0].sampling.structured_field or None
            self._reject(msg.request_id, 400, f"{field or 'body'}: {msg.error}", field)
            self._tell_detokenizer_finished(seqs)
            return
        for req in seqs:
            self.policy.add(req)

    def abort(
        self, request_ids: list[str], reason: FinishReason, seq_indices: list[int] | None = None
    ) -> None:
        """End requests (every sequence, or one sequence each); idempotent."""
        if self.policy is None:
            return
        ended: list[Request] = []
        for j, request_id in enumerate(request_ids):
            index = None if seq_indices is None else seq_indices[j]
            ended += self.grammar_wait.end(request_id, reason, index)
            for r in list(self.groups.get(request_id, ())):
                if seq_indices is None or r.seq_index == seq_indices[j]:
                    if self.policy.abort(r.request_id, reason) is not None:
                        ended.append(r)
        self._tell_detokenizer_finished(ended)

    def expire(self) -> None:
        """Finish every request past its deadline (finish reason `timeout`)."""
        if self.policy is not None:
            late = self.policy.expire() + self.grammar_wait.expire(time.time())
            self._tell_detokenizer_finished(late)

    def fail_all(self, why: str, resumable: bool = False) -> None:
        """Every live request ends: the gateway answers 503 (retry), or with `resumable` (a
        process died, not the request) sends it again; the detokenizer drops it."""
        if self.policy is not None:
            self._fail(
                [*self.policy.requests.values(), *self.grammar_wait.end_all(FinishReason.ERROR)],
                503,
                f"{why}; the request was not completed, retry it",
                resumable,
            )
        self.groups.clear()

    def _fail(self, reqs: list[Request], status: int, why: str, resumable: bool = False) -> None:
        """End requests with an error: one RequestError per request to the gateway (the
        only path that tells it), and an ERROR finish so the detokenizer forgets them."""
        assert self.policy is not None
        for req in reqs:
            self.policy.abort(req.request_id, FinishReason.ERROR)
        for request_id in sorted({r.group_id for r in reqs}):
            self._reject(request_id, status, why, resumable=resumable)
        self._tell_detokenizer_finished(reqs)

    def _tell_detokenizer_finished(self, reqs: list[Request]) -> None:
        """These sequences ended without a new token (abort, timeout, error)."""
        if reqs:
            self.outbox.to_detokenizer(
                TokenBatch(
                    request_ids=[r.group_id for r in reqs],
                    token_ids=[[] for _ in reqs],
                    finish_reasons=[int(r.finish_reason) for r in reqs],
                    seq_indices=[r.seq_index for r in reqs],
                )
            )
            self._forget_finished_groups(reqs)

    def _forget_finished_groups(self, reqs: Iterable[Request]) -> None:
        for request_id in {r.group_id for r in reqs}:
            seqs = self.groups.get(request_id)
            if seqs is not None and all(r.is_finished for r in seqs):
                del self.groups[request_id]

    def _reject(
        self,
        request_id: str,
        status: int,
        message: str,
        param: str | None = None,
        resumable: bool = False,
    ) -> None:
        log.info("rejected: %s", message, extra={"request_id": request_id})
        self.outbox.to_gateway(
            RequestError(
                request_id=request_id,
                status=status,
                message=message,
                param=param,
                resumable=resumable,
            )
        )

    # hot swap ------------------------------------------------------------------------------
    def swap(self, msg: SwapModel) -> None:
        if self.policy is None:
            self.outbox.reply(
                msg.reply_to,
                SwapResult(
                    ticket=msg.ticket, ok=False, mode=msg.mode, error="the worker is restarting"
                ),
            )
            return
        self.swaps.start(msg, self.policy)

    def on_model_loaded(self, msg: ModelLoaded) -> None:
        if self.policy is not None:
            self.swaps.on_loaded(msg, self.policy, self._adopt_swapped)

    def _adopt_swapped(self, info: ModelInfo) -> None:
        """A hot swap's new model: serve it; adapters made for another base model are
        dropped, and their requests that have not started fail, saying why."""
        self.adopt(info)
        dropped = set(self.loras.on_model_swapped(info))
        unstarted = [
            r
            for seqs in self.groups.values()
            if all(r.version is None for r in seqs) and seqs[0].lora_name in dropped
            for r in seqs
        ]
        if unstarted:
            self._fail(
                unstarted,
                400,
                "model: the LoRA adapter was dropped by a hot swap: it was made for another "
                "base model, or does not fit the one served now",
            )

    # LoRA adapters -------------------------------------------------------------------------
    def load_lora(self, msg: LoadLoraAdapter) -> None:
        self.loras.load(msg)

    def on_lora_loaded(self, msg: LoraLoaded) -> None:
        self.loras.on_loaded(msg)

    def unload_lora(self, msg: UnloadLoraAdapter) -> None:
        self.loras.unload(msg, self.num_live_by_lora())
        self._advance_unloads()

    def num_live_by_lora(self) -> Counter[str]:
        """Live sequences per adapter (grammar waits included), the base model left out."""
        live = self.policy.requests.values() if self.policy is not None else ()
        waiting = (r for seqs in self.groups.values() for r in seqs if not r.is_finished)
        return Counter(r.lora_name for r in itertools.chain(live, waiting) if r.lora_name)

    def _advance_unloads(self) -> None:
        if self.loras.has_unloading and self.policy is not None:
            self.loras.advance(self.num_live_by_lora(), self.policy.blocks.drop_cached)

    # the step ------------------------------------------------------------------------------
    def step(self) -> None:
        """Plan steps while the window has room; move a swap on; check integrity when idle."""
        policy = self.policy
        if policy is None:
            return
        while len(self.in_flight) < self.max_in_flight and policy.has_work():
            out = policy.schedule()
            if out.is_empty:
                break
            self.step_counter += 1
            step = _InFlight(
                self.step_counter,
                [s.request.request_id for s in out.scheduled],
                time.perf_counter(),
            )
            self.in_flight.append(step)
            self.outbox.to_worker(to_plan(step.step_id, out))
        self._busy_since_last_result = bool(self.in_flight)
        self.swaps.advance(policy, in_flight=bool(self.in_flight))
        self._advance_unloads()
        if not self.in_flight and not policy.has_work() and not policy.requests:
            # whenever idle, every block is free (O(1)); block by block now and then (a
            # pool of 65k blocks takes ~7 ms to walk: not in the way of every request)
            policy.check_idle()
            now = time.monotonic()
            if self.num_steps != self._checked_at_step and now - self._checked_at > 5.0:
                policy.check_integrity()
                self._checked_at, self._checked_at_step = now, self.num_steps

    def on_step_result(self, msg: StepResult) -> None:
        """The worker's answer to the oldest step in flight: its sampled tokens."""
        if self.policy is None:
            return  # from a worker that has since died
        if not self.in_flight or msg.step_id != self.in_flight[0].step_id:
            log.warning("unexpected step result %d", msg.step_id)
            return
        step = self.in_flight.popleft()
        if msg.error:
            log.error("step %d failed on the worker: %s", msg.step_id, msg.error)
            reqs = [r for key in step.seq_keys if (r := self.policy.requests.get(key))]
            self._fail(reqs, 500, f"the model step failed ({msg.error})")
            return
        self._count_step(step, msg)
        results = self.policy.update(msg.req_ids, msg.token_ids, msg.num_tokens, msg.num_proposed)
        pooled = self.policy.pooled(msg.pooled_req_ids)  # embeddings: done, with a vector
        results += pooled
        if results:
            self.outbox.to_detokenizer(
                TokenBatch(
                    request_ids=[r.group_id for r, _, _ in results],
                    token_ids=[tokens for _, tokens, _ in results],
                    finish_reasons=[int(f) for _, _, f in results],
                    num_cached_tokens=[r.num_cached_tokens for r, _, _ in results],
                    versions=[r.version or "" for r, _, _ in results],
                    seq_indices=[r.seq_index for r, _, _ in results],
                    **_logprob_fields(msg, results),
                    **_embedding_fields(msg, results, len(pooled)),
                )
            )
            self._forget_finished_groups(r for r, _, f in results if f != FinishReason.NONE)

    def _count_step(self, step: _InFlight, msg: StepResult) -> None:
        self.num_steps += 1
        now = time.perf_counter()
        self.step_time_s += now - step.sent_at
        self.worker_time_s += msg.forward_s
        if self._busy_since_last_result and self._last_result_at:
            # back-to-back steps: the gap beyond the worker's own time is scheduling cost
            self.interval_s += now - self._last_result_at
            self.interval_forward_s += msg.forward_s
            self.num_intervals += 1
        self._last_result_at = now


def _logprob_fields(
    msg: StepResult, results: list[tuple[Request, list[int], FinishReason]]
) -> dict[str, Any]:
    """TokenBatch's logprob lists for `results` (the live requests of `msg`, each with the
    tokens it kept: a stop may cut a request's tokens short), or none when nobody asked."""
    out: dict[str, Any] = {}
    if not (msg.logprob_token_ids or msg.prompt_logprob_token_ids):
        return out
    counts = msg.num_tokens or [1] * len(msg.req_ids)
    starts = dict(zip(msg.req_ids, itertools.accumulate(counts, initial=0), strict=False))
    rows = {rid: i for i, rid in enumerate(msg.req_ids)}
    # (a pooled request, an embeddings one, sampled nothing: its entries are empty)
    if msg.logprob_token_ids:
        spans = [(starts.get(r.request_id, 0), len(kept)) for r, kept, _ in results]
        out["logprob_token_ids"] = [msg.logprob_token_ids[a : a + n] for a, n in spans]
        out["logprob_values"] = [msg.logprob_values[a : a + n] for a, n in spans]
    if msg.prompt_logprob_token_ids:
        index = [rows.get(r.request_id) for r, _, _ in results]

        def pick(entries: list[Any]) -> list[Any]:
            return [entries[i] if i is not None else [] for i in index]

        out["prompt_logprob_token_ids"] = pick(msg.prompt_logprob_token_ids)
        out["prompt_logprob_values"] = pick(msg.prompt_logprob_values)
        if msg.prompt_logprob_ranks:
            out["prompt_logprob_ranks"] = pick(msg.prompt_logprob_ranks)
    return out


def _embedding_fields(
    msg: StepResult, results: list[tuple[Request, list[int], FinishReason]], num_pooled: int
) -> dict[str, Any]:
    """TokenBatch's embeddings: the vectors of the last `num_pooled` results (the live
    pooled requests of `msg`), [] for the others; none when no request pooled."""
    if not num_pooled:
        return {}
    vectors = dict(zip(msg.pooled_req_ids, msg.embeddings, strict=True))
    head: list[list[float]] = [[] for _ in results[: len(results) - num_pooled]]
    return {"embeddings": head + [vectors[r.request_id] for r, _, _ in results[-num_pooled:]]}


def _output_options(sampling: SamplingParams, n: int) -> dict[str, Any]:
    """DetokNew's per-sequence output options for a request of `n` sequences: empty lists
    where every sequence takes the default (most requests: nothing more on the wire)."""
    out: dict[str, Any] = {}
    if sampling.include_stop_str_in_output:
        out["include_stop_str"] = [True] * n
    if not sampling.skip_special_tokens:
        out["skip_special_tokens"] = [False] * n
    if sampling.stop_token_ids:
        out["stop_token_ids"] = [list(sampling.stop_token_ids)] * n
    return out
