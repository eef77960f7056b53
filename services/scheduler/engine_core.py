"""EngineCore: the scheduler's engine, with no sockets.

It owns the scheduling policy (queues, KV blocks, prefix cache), the sequences of each
request (`n` > 1 forks), the window of steps in flight, hot-swaps and which model is served.
Transports are outside: messages leave through an `EngineOutbox` (outbox.py: the scheduler
actor's sockets, or an in-process collector), and step plans go to whatever executes them
(the worker process, or a runner in this process: `InProcessEngine`). One step loop serves
both:

    step():            while the window has room and there is work:
                           plan = policy.schedule() -> outbox.to_worker(plan)
    on_step_result():  policy.update(tokens) -> TokenBatch to the detokenizer

Beside it: intake.py (whether a request is admitted, its sequences and their keys),
step_window.py (the steps in flight), detok_messages.py (what the detokenizer hears),
current_model.py (the served model's facts).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable

from common.config import Config
from common.messages import (
    CompileGrammar,
    FinishReason,
    GrammarCompiled,
    KvExported,
    KvHandover,
    LoadLoraAdapter,
    LoraLoaded,
    ModelChanged,
    ModelInfo,
    ModelLoaded,
    RequestError,
    Retokenize,
    StepResult,
    SwapModel,
    SwapResult,
    TokenizedRequest,
    UnloadLoraAdapter,
)
from common.model_facts import cache_root
from common.topology import kv_transfer_dir
from common.wire_id import owner
from services.scheduler import detok_messages, intake
from services.scheduler.block_manager import BlockManager, HostBlockPool
from services.scheduler.current_model import CurrentModel
from services.scheduler.grammar_wait import GrammarWait
from services.scheduler.grouped_blocks import GroupedBlockManager
from services.scheduler.handover import Handover, decode_sequence
from services.scheduler.kv_tiers import TierIndex
from services.scheduler.lora_registry import ServedAdapters
from services.scheduler.outbox import EngineOutbox
from services.scheduler.plan import to_plan
from services.scheduler.policy import PolicyConfig, SchedulingPolicy
from services.scheduler.request import Request, Status
from services.scheduler.step_window import StepWindow
from services.scheduler.swap import SwapCoordinator

log = logging.getLogger(__name__)


class EngineCore:
    """The scheduler's engine: requests in, step plans out, step results in, tokens out."""

    def __init__(
        self,
        config: Config,
        outbox: EngineOutbox,
        policy_config: PolicyConfig | None = None,
        to_router: Callable[[KvHandover], None] | None = None,
    ) -> None:
        self.config = config
        self.outbox = outbox
        # the policy's settings come from the config's scheduler section; tests may pass them
        self.policy_config = policy_config or PolicyConfig.from_config(config)
        self.policy: SchedulingPolicy | None = None  # None until a worker is ready
        self.served: CurrentModel | None = None
        self.previous: CurrentModel | None = None  # the model served before the last adopt
        self.groups: dict[str, list[Request]] = {}  # request id -> its live sequences
        self.grammar_wait = GrammarWait()  # constrained requests until their grammar compiles
        # speculative decoding needs each step's result (how many drafts were accepted)
        # before its requests can be planned again: no overlap then
        overlap = (
            config.scheduler.async_scheduling and not self.policy_config.num_speculative_tokens
        )
        self.window = StepWindow(max_in_flight=2 if overlap else 1)
        self.swaps = SwapCoordinator(outbox.to_worker, outbox.reply)
        # LoRA adapters: which are served, their loads and unloads (lora_registry.py)
        self.loras = ServedAdapters(config, outbox.to_worker, outbox.reply, outbox.to_gateway)
        self._checked_at, self._checked_at_step = 0.0, -1  # the last block-by-block check
        self._tier_store_id = ""  # the worker's tiers the policy's index describes
        self._kv_pool_id = ""  # the worker's KV pool the policy's block manager describes
        # prefill/decode replicas: the hand-over of sequences and their blocks (handover.py)
        dp = config.data_parallel
        self._parked: list[KvHandover] = []  # hand-overs waiting for this replica's swap
        self.handover = (
            Handover(dp.own_role, kv_transfer_dir(config), to_router)
            if dp.is_disaggregated
            else None
        )

    @property
    def is_ready(self) -> bool:
        return self.policy is not None

    @property
    def has_work(self) -> bool:
        """Steps to plan, or results to wait for."""
        return (
            bool(self.window.in_flight)
            or (self.policy is not None and self.policy.has_work())
            or self._has_moves
        )

    # the worker ----------------------------------------------------------------------------
    def on_worker_ready(self, info: ModelInfo) -> None:
        """A worker announced its pool and model: serve it. A worker that announces itself
        again with another boot id restarted: every live request fails (retryable)."""
        if self.policy is not None and self.served is not None:
            same = info.boot_id == self.served.info.boot_id
            if same and not self.policy.requests and not self.window.in_flight:
                return  # the answer to our own Reset at start-up: nothing changed
            log.warning("worker re-announced itself; resetting the block pool")
            self.fail_all("the worker restarted", resumable=True)
            if self.handover is not None:
                self.handover.reset()
        s = self.config.scheduler
        self.policy = SchedulingPolicy(
            self._block_manager(info),
            self.policy_config,
            host_pool=HostBlockPool(info.num_host_blocks),
            tiers=self._tier_index(info),
        )
        self.window.clear()
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
        self.window.clear()
        self.policy = None
        if self.handover is not None:
            self.handover.reset()

    def _block_manager(self, info: ModelInfo) -> BlockManager | GroupedBlockManager:
        if info.kv_group_windows:  # sliding-window layers: one table per layer group
            return GroupedBlockManager(
                info.num_blocks,
                info.block_size,
                info.kv_group_windows,
                enable_prefix_caching=self.config.cache.enable_prefix_caching,
                track_hash_changes=self.config.data_parallel.data_parallel_size > 1,
            )
        return BlockManager(
            info.num_blocks,
            info.block_size,
            enable_prefix_caching=self.config.cache.enable_prefix_caching,
            # several replicas: the router hears which blocks each caches
            track_hash_changes=self.config.data_parallel.data_parallel_size > 1,
            record_evictions=info.num_tier_host_blocks > 0,  # saved down the tiers
        )

    def _tier_index(self, info: ModelInfo) -> TierIndex | None:
        """The index of the worker's lower tiers as it announced them (None: off): its host
        slots are empty, its disk holds what it found at start-up."""
        if not info.num_tier_host_blocks:
            return None
        tiers = TierIndex(info.num_tier_host_blocks, info.num_tier_disk_blocks)
        tiers.adopt_disk(info.tier_disk_keys, info.tier_disk_tokens)
        self._tier_store_id = info.tier_store_id
        return tiers

    def adopt(self, info: ModelInfo) -> None:
        """Serve the model `info` describes: new requests start on its version and root;
        everyone who depends on the served model hears of it."""
        policy = self.policy
        assert policy is not None
        name = self.served.name if self.served else info.model_name
        blocks = policy.blocks
        windows = list(blocks.windows) if isinstance(blocks, GroupedBlockManager) else []
        layout = (info.num_blocks, info.block_size, info.kv_group_windows) != (
            blocks.num_blocks,
            blocks.block_size,
            windows,
        )
        if layout or info.kv_pool_id != self._kv_pool_id:
            # a drain swap (or a failed one, which rebuilt the old model): the worker's new
            # pool holds nothing, so the prefixes cached in the old one are forgotten (the
            # same version's root would find them again); nothing holds blocks now
            assert blocks.num_used_blocks == 0, "pool rebuilt while blocks are in use"
            policy.blocks = self._block_manager(info)
            self._kv_pool_id = info.kv_pool_id
        if info.tier_store_id != self._tier_store_id:  # the worker rebuilt its tiers
            assert not self.window.in_flight, "tiers rebuilt while a step is in flight"
            policy.tiers = self._tier_index(info)
        # (the disk tier's keys live in its index: not in every stats answer and Ready)
        info = dataclasses.replace(info, tier_disk_keys=[], tier_disk_tokens=[])
        old_fingerprint = self.served.tokenizer_fingerprint if self.served else None
        root = cache_root(
            name, info.weights_version, info.tokenizer_fingerprint, info.position_config
        )
        chunk = self.policy_config.max_num_batched_tokens
        self.previous = self.served  # (an overlap swap serves it until it retires)
        self.served = CurrentModel(info=info, name=name, root=root, chunk=chunk)
        policy.set_version(self.served.version, root)
        self.window.expert_tokens = []  # a MoE's per-expert counts are the served model's
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
        error = intake.admission_error(
            msg,
            served,
            self.policy.num_waiting,
            self.config.scheduler.max_waiting,
            is_duplicate=msg.request_id in self.groups,
        )
        adapter = self.loras.check(msg) if msg.lora_name and error is None else None
        if isinstance(adapter, tuple):
            error, adapter = adapter, None
        if error is not None:
            self._reject(msg.request_id, *error)
            return
        seqs = intake.sequences(msg, served, adapter)
        if self.handover is not None and self.handover.is_prefill:
            self.handover.cap(seqs)  # (each stops after one token and is handed over)
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
        self.outbox.to_detokenizer(detok_messages.new_sequences(msg, len(seqs)))

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
            if self.handover is not None:  # in an export or an import, or on its way here
                ended += self.handover.end(request_id, reason, index)
                if not self.handover.is_prefill:
                    self.handover.remember_abort(request_id, index)
            for r in list(self.groups.get(request_id, ())):
                if seq_indices is None or r.seq_index == seq_indices[j]:
                    if self.policy.abort(r.request_id, reason) is not None:
                        ended.append(r)
        self._tell_detokenizer_finished(ended)

    def abort_owned_by(self, gateway: int, num_gateways: int) -> int:
        """A gateway process died: the requests it sent have no client any more; they end
        as cancelled (the other gateways' run on). Returns how many."""
        ids = sorted(rid for rid in self.groups if owner(rid, num_gateways) == gateway)
        self.abort(ids, FinishReason.CANCELLED)
        return len(ids)

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
                [
                    *self.policy.requests.values(),
                    *self.grammar_wait.end_all(FinishReason.ERROR),
                    *(self.handover.end_all(FinishReason.ERROR) if self.handover else ()),
                ],
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
            self.outbox.to_detokenizer(detok_messages.ended(reqs))
            self._forget_finished_groups(reqs)

    def _forget_finished_groups(self, reqs: Iterable[Request]) -> None:
        for request_id in {r.group_id for r in reqs}:
            seqs = self.groups.get(request_id)
            if self.handover is not None and self.handover.holds(request_id):
                continue  # (a sequence is being handed over: the router counts it here)
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
        handover = self.handover
        if self._parked and self.swaps.swap is None:
            self._take_parked()
        while self.window.has_room and (policy.has_work() or self._has_moves):
            out = policy.schedule()
            if out.is_empty and not self._has_moves:
                break
            step_id = self.window.open([s.request.request_id for s in out.scheduled])
            moves = handover.planned(step_id) if handover is not None else None
            self.outbox.to_worker(to_plan(step_id, out, moves))
        self.window.planned()
        # (a drain waits for the hand-overs' moves too: the pool is rebuilt after it)
        moving = handover is not None and handover.busy
        self.swaps.advance(policy, in_flight=bool(self.window.in_flight) or moving)
        if self._parked and self.swaps.swap is None:  # (the swap ended just now)
            self._take_parked()
            self.step()
            return
        self._advance_unloads()
        idle = not self.window.in_flight and not policy.has_work() and not policy.requests
        if idle and not (handover is not None and handover.busy):
            # whenever idle, every block is free (O(1)); block by block now and then (a
            # pool of 65k blocks takes ~7 ms to walk: not in the way of every request)
            policy.check_idle()
            now = time.monotonic()
            if self.window.num_steps != self._checked_at_step and now - self._checked_at > 5.0:
                policy.check_integrity()
                self._checked_at, self._checked_at_step = now, self.window.num_steps

    def on_step_result(self, msg: StepResult) -> None:
        """The worker's answer to the oldest step in flight: its sampled tokens."""
        if self.policy is None:
            return  # from a worker that has since died
        step = self.window.close(msg)
        if step is None:
            return
        if self.policy.tiers is not None:  # (a failed step reports its fetches failed)
            self.policy.tiers.on_fetched(msg.tier_fetched_keys, msg.tier_fetch_failed_keys)
        if self.handover is not None:  # (a failed step reports its imports failed)
            self._on_moved(msg)
        if msg.error:
            log.error("step %d failed on the worker: %s", msg.step_id, msg.error)
            reqs = [r for key in step.seq_keys if (r := self.policy.requests.get(key))]
            self._fail(reqs, 500, f"the model step failed ({msg.error})")
            return
        self.window.count(step, msg)
        results = self.policy.update(msg.req_ids, msg.token_ids, msg.num_tokens, msg.num_proposed)
        if self.handover is not None and self.handover.is_prefill:
            results = [self._hand_over_if_done(*result) for result in results]
        pooled = self.policy.pooled(msg.pooled_req_ids)  # embeddings: done, with a vector
        results += pooled
        if results:
            self.outbox.to_detokenizer(detok_messages.step_tokens(msg, results, len(pooled)))
            self._forget_finished_groups(r for r, _, f in results if f != FinishReason.NONE)
        if self.handover is not None and self.handover.is_prefill and self.served is not None:
            sent = self.handover.send_unmoved(self.served.tokenizer_fingerprint)
            self._forget_finished_groups(sent)

    # prefill/decode hand-over (handover.py) ----------------------------------------------
    @property
    def _has_moves(self) -> bool:
        return self.handover is not None and not self.handover.pending.is_empty

    def _hand_over_if_done(
        self, req: Request, tokens: list[int], reason: FinishReason
    ) -> tuple[Request, list[int], FinishReason]:
        """A prefill replica's sequence that stopped only because prefill stops there is
        not finished for the client: its blocks are exported in the next plan."""
        assert self.handover is not None and self.policy is not None
        if not self.handover.is_handed_over(req, reason):
            return req, tokens, reason
        self.handover.export(req, self._dense_blocks())
        return req, tokens, FinishReason.NONE

    def _dense_blocks(self) -> BlockManager:
        """The pool a hand-over moves blocks of: a prefill or decode replica's worker keeps
        the dense layout (gpu_worker/runner/kv_pool.py), so it is never grouped."""
        assert self.policy is not None
        blocks = self.policy.blocks
        assert isinstance(blocks, BlockManager), "a prefill/decode replica's pool is grouped"
        return blocks

    def _on_moved(self, msg: StepResult) -> None:
        """A plan's exports and imports ended: hand-overs leave; imported sequences queue."""
        assert self.handover is not None and self.policy is not None and self.served
        self.on_kv_exported(KvExported(msg.step_id, msg.kv_export_data))
        for req in self.handover.on_imported(msg, self._dense_blocks()):
            self.policy.add(req)

    def on_kv_exported(self, msg: KvExported) -> None:
        """A plan's exports are written: its hand-overs leave (before or with its result)."""
        if self.handover is None or self.served is None:
            return
        sent = self.handover.on_exported(msg.step_id, msg.data, self.served.tokenizer_fingerprint)
        self._forget_finished_groups(sent)

    def _serving(self) -> list[CurrentModel]:
        """The models a sequence may run on here: the served one, and during an overlap
        swap's retirement the one before (its requests still run on it)."""
        swap = self.swaps.swap
        retiring = swap is not None and swap.phase == "retiring"
        previous = [self.previous] if retiring and self.previous is not None else []
        return [m for m in (self.served, *previous) if m is not None]

    def _waits_for_swap(self, msg: KvHandover) -> bool:
        """A hand-over of a version this replica does not serve while a swap is on: the
        prefill replica may have finished its swap first (a drain, or an overlap's load), so
        it waits for this replica's swap rather than fail (a cancel meanwhile is found by
        its tombstone when it is taken again)."""
        if self.swaps.swap is None or self.policy is None or self.handover is None:
            return False
        if self.handover.was_aborted(msg):
            return False
        return msg.version not in {m.version for m in self._serving()}

    def _take_parked(self) -> None:
        """The swap is over: the hand-overs that waited for it are taken (or refused) now."""
        parked, self._parked = self._parked, []
        for msg in parked:
            self.on_handover(msg)

    def on_handover(self, msg: KvHandover) -> None:
        """A decode replica takes a sequence a prefill replica computed: it imports the
        blocks it does not cache, then queues the sequence (handover.py). One it cannot
        take (another model version, an adapter it does not serve with the same weights,
        no worker) fails retryably; one cancelled on its way ends as cancelled."""
        assert self.handover is not None
        req = decode_sequence(msg, self.served)
        refusal = "" if self.policy is not None else "the decode replica's worker is restarting"
        adapter = self.loras.handover_refusal(msg.lora_name, msg.lora_hash)
        refusal = refusal or self.handover.refusal(msg, self._serving(), adapter)
        if refusal and self._waits_for_swap(msg):
            self._parked.append(msg)  # (taken again when the swap is over: `step`)
            return
        if self.handover.was_aborted(msg) or refusal:
            self.handover.drop(msg)
            req.status = Status.FINISHED
            req.finish_reason = FinishReason.ERROR if refusal else FinishReason.CANCELLED
            if refusal:
                why = f"{refusal}; the request was not completed, retry it"
                self._reject(msg.request_id, 503, why, resumable=True)
            self.outbox.to_detokenizer(detok_messages.ended([req]))
            return
        assert self.policy is not None
        self.groups.setdefault(msg.request_id, []).append(req)
        if not self.handover.receive(
            msg, req, self._dense_blocks(), self.policy.num_watermark_blocks
        ):
            self.policy.add(req)  # (nothing to import: its blocks are cached here already)
