"""Prefill/decode hand-over, the scheduler's part (no sockets; docs/architecture.md,
"Prefill and decode replicas"). The worker moves the bytes (gpu_worker/kv_handover.py);
this module decides which blocks move, when, and what becomes of the sequence.

    prefill replica                                   decode replica
    add: the sequence stops after 1 token  ...        on_handover: the chain of the received
    result: its first token streams; its               keys is checked against its own root
      full blocks (cached now) are exported in         and tokens; keys it caches already
      the next plan (file or bytes)                    are prefix hits, the others are
    written (KvExported): KvHandover -> router         imported into fresh blocks (next plan)
      -> the decode replica with the least load       that plan's result: the landed blocks
                                                       are cached under their keys; the
                                                       sequence joins the queue as a resumed
                                                       one (its outputs known) and admission
                                                       takes the imported blocks as hits

Imports are chunked: a plan carries at most IMPORT_BLOCKS_PER_STEP of them (the worker reads
them at the start of the step, which every running sequence waits for), so a long prompt's
blocks land over a few decode steps instead of stalling one; its sequence is queued when the
last of them has landed.

The prompt's partial last block moves too (`tail_key`; never cached, held for its sequence
until admission), so the decode side computes only the first token. A block that fails its
checks on arrival (key, tokens, layout, model version, checksum) is not written and is
recomputed (a tail whose full blocks did not all land is computed again too).

A cancel finds the sequence wherever it is: in the prefill's queue or step (the policy), in
an export (`_exports`), on its way (the decode side keeps the ids of recent aborts it did not
hold: a hand-over that arrives for one is dropped), in an import (`_imports`), or decoding.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from common.messages import FinishReason, KvHandover, StepResult
from common.model_facts import lora_root, salted_root
from common.prefix_hash import block_hash
from services.scheduler.block_manager import BlockManager
from services.scheduler.current_model import CurrentModel
from services.scheduler.intake import sequence_key
from services.scheduler.request import Request, Status

log = logging.getLogger(__name__)

MAX_TOMBSTONES = 4096  # recent aborts of sequences a decode replica did not hold
# blocks one plan imports at most: ~0.3 ms each to read, check and copy in (a 737 KiB float32
# block of SmolLM2-135M). Decode streams under prompt bursts (docs/benchmarks.md), ITL p99
# over the quiet p50: all at once 2.04x, 32 a plan 1.74x, 16 1.69x, 8 1.55x; the price is
# the moved sequence's wait for its last block (its second token): 8 a plan, ~1.9 s per 1k
# tokens on 2 busy cores
IMPORT_BLOCKS_PER_STEP = 8


def tail_key(parent: int, tokens: tuple[int, ...], request_id: str, seq_index: int) -> int:
    """The key of a sequence's partial last prompt block in a hand-over: its tokens on its
    chain, and the sequence (never cached, so never shared: two sequences of one prompt
    each move their own), computed alike by both replicas (no per-process string hash)."""
    digest = hashlib.blake2b(f"{request_id}:{seq_index}".encode(), digest_size=8).digest()
    return block_hash(block_hash(parent, tokens), (int.from_bytes(digest, "little"), -1))


def file_name(key: int) -> str:
    """A block's file in a hand-over folder (the tier files' name: gpu_worker/kv_tiers.py)."""
    return f"{key & ((1 << 64) - 1):016x}.kv"


@dataclasses.dataclass
class Moves:
    """The hand-over's part of one plan (plan.py turns it into StepPlan's kv_* fields)."""

    # exports: (device block, key, tokens, version, path or "" for the result's bytes)
    exports: list[tuple[int, int, list[int], str, str]] = dataclasses.field(default_factory=list)
    # imports: (device block, key, tokens, version, path, base64 bytes or "")
    imports: list[tuple[int, int, list[int], str, str, str]] = dataclasses.field(
        default_factory=list
    )

    @property
    def is_empty(self) -> bool:
        return not (self.exports or self.imports)


@dataclasses.dataclass
class _Export:
    req: Request
    keys: list[int]
    tokens: list[list[int]]
    folder: str  # shm: where its files go ("": tcp)
    started: float  # monotonic, when the export was planned
    cancelled: bool = False


@dataclasses.dataclass
class _Import:
    req: Request
    keys: list[int]  # those this import writes (the others were hits or failed the chain)
    tokens: list[tuple[int, ...]]
    msg: KvHandover
    cancelled: bool = False
    num_landed: int = 0  # keys whose plan's result came back (landed or failed)
    tail: tuple[int, int] | None = None  # (key, tokens) of its partial last prompt block


@dataclasses.dataclass
class HandoverStats:
    """Counters for /admin/stats and /metrics (docs/operations.md)."""

    num_handed_over: int = 0  # sequences a prefill replica handed over
    num_received: int = 0  # sequences a decode replica took
    num_refused: int = 0  # hand-overs refused (another version, no worker) or cancelled
    bytes_sent: int = 0
    bytes_received: int = 0
    blocks_received: int = 0  # imported
    blocks_hit: int = 0  # found cached on the decode side: not moved
    blocks_failed: int = 0  # failed their checks on arrival: recomputed
    prefill_queue_s: float = 0.0  # sums over the sequences: TTFT's parts
    prefill_s: float = 0.0
    transfer_s: float = 0.0  # export + travel + import, measured on the decode side
    last_transfer_s: float = 0.0
    last_transfer_bytes: int = 0


class Handover:
    """The hand-over state of one scheduler, prefill or decode side (`role`)."""

    def __init__(
        self,
        role: str,
        folder: str,
        send: Callable[[KvHandover], None] | None,
    ) -> None:
        self.role = role
        self.folder = folder  # shm: the shared folder ("": tcp, the bytes in messages)
        self.send = send
        self.pending = Moves()  # for the next plan
        self._exports: dict[int, list[_Export]] = {}  # step id -> exports it carries
        # step id -> the imports it carries: each with the keys (and tokens) it carries
        self._imports: dict[int, list[tuple[_Import, list[tuple[int, tuple[int, ...]]]]]] = {}
        self._unsent_exports: list[_Export] = []
        self._unsent_imports: list[_Import] = []  # some of whose blocks are in no plan yet
        self._import_owners: list[_Import] = []  # of each of pending.imports
        self._send_after_tokens: list[_Export] = []  # nothing to move: sent after the step
        # (request id, sequence or None: all) -> when its abort came (wall clock)
        self._tombstones: OrderedDict[tuple[str, int | None], float] = OrderedDict()
        self.stats = HandoverStats()

    @property
    def is_prefill(self) -> bool:
        return self.role == "prefill"

    @property
    def busy(self) -> bool:
        """Moves planned or in flight (the pool is not idle)."""
        return bool(self._exports or self._imports or self._unsent_exports or self._unsent_imports)

    @property
    def num_exporting(self) -> int:
        """Sequences whose blocks are being exported here (planned, not yet sent)."""
        exports = (*self._exports.values(), self._unsent_exports, self._send_after_tokens)
        return sum(not e.cancelled for es in exports for e in es)

    @property
    def num_importing(self) -> int:
        """Sequences whose blocks are being imported here (some not landed yet)."""
        return sum(not i.cancelled for i in self._import_entries())

    def holds(self, request_id: str) -> bool:
        """A sequence of this request is in an export or an import here."""
        return any(r.group_id == request_id for r in self._live())

    def _live(self) -> list[Request]:
        exports = [
            e
            for es in (*self._exports.values(), self._unsent_exports, self._send_after_tokens)
            for e in es
        ]
        imports = self._import_entries()
        return [e.req for e in exports if not e.cancelled] + [
            i.req for i in imports if not i.cancelled
        ]

    # the prefill side ----------------------------------------------------------------------
    def cap(self, seqs: list[Request]) -> None:
        """A prefill replica's new sequences stop after their next token, to be handed
        over; a structured-output or embeddings request runs to its end here (the grammar's
        state does not travel), as does one that may produce only one token."""
        for req in seqs:
            if req.sampling.pooling or req.sampling.is_structured:
                continue
            limit = req.num_tokens + 1
            if req.max_total_tokens > limit:
                req.handover_limit, req.max_total_tokens = req.max_total_tokens, limit

    def is_handed_over(self, req: Request, reason: FinishReason) -> bool:
        """Did `req` stop only because a prefill replica stops there?"""
        return (
            reason == FinishReason.LENGTH
            and req.handover_limit is not None
            and req.num_tokens < req.handover_limit
        )

    def export(self, req: Request, blocks: BlockManager) -> None:
        """Plan the export of the full blocks `req` computed (cached now, its blocks just
        freed: the next plan reads them before anything overwrites them); with none to
        move, the hand-over leaves once the first token has gone to the detokenizer
        (`send_unmoved`)."""
        keys, tokens, bs = [], [], blocks.block_size
        parent, ids = req.cache_root, req.all_token_ids
        folder = f"{self.folder}/{uuid.uuid4().hex}" if self.folder else ""
        for i in range(req.num_computed_tokens // bs):
            block_tokens = tuple(ids[i * bs : (i + 1) * bs])
            parent = block_hash(parent, block_tokens)
            block = blocks.cached_block(parent, block_tokens)
            if block is None:
                break  # (evicted already, or never cached: the decode side recomputes)
            keys.append(parent)
            tokens.append(list(block_tokens))
            path = f"{folder}/{file_name(parent)}" if folder else ""
            self.pending.exports.append(
                (block, parent, list(block_tokens), req.version or "", path)
            )
        n_full, num_tail = req.num_computed_tokens // bs, req.num_computed_tokens % bs
        if num_tail and len(keys) == n_full and len(req.handover_blocks) > n_full:
            # the partial last prompt block too (freed, not cached: read by the same next
            # plan), so that the decode side computes only the first token, not the tail
            tail = tuple(ids[n_full * bs : req.num_computed_tokens])
            key = tail_key(parent, tail, req.group_id, req.seq_index)
            keys.append(key)
            tokens.append(list(tail))
            path = f"{folder}/{file_name(key)}" if folder else ""
            block = req.handover_blocks[n_full]
            self.pending.exports.append((block, key, list(tail), req.version or "", path))
        entry = _Export(req, keys, tokens, folder if keys else "", time.monotonic())
        if keys:
            self._unsent_exports.append(entry)
        else:
            self._send_after_tokens.append(entry)

    def send_unmoved(self, tokenizer_fingerprint: str) -> list[Request]:
        """The hand-overs with no block to move leave now (after their first token went
        out); returns their sequences."""
        sent, self._send_after_tokens = self._send_after_tokens, []
        for e in sent:
            if not e.cancelled:
                self._send(e, [], tokenizer_fingerprint)
        return [e.req for e in sent]

    def planned(self, step_id: int) -> Moves:
        """The moves of the plan `step_id`, which is being sent now."""
        n = IMPORT_BLOCKS_PER_STEP
        pending, owners = self.pending, self._import_owners
        moves = Moves(exports=pending.exports, imports=pending.imports[:n])
        self.pending, self._import_owners = Moves(imports=pending.imports[n:]), owners[n:]
        if self._unsent_exports:
            self._exports[step_id], self._unsent_exports = self._unsent_exports, []
        carried: dict[int, tuple[_Import, list[tuple[int, tuple[int, ...]]]]] = {}
        for imp, (_, key, tokens, *_rest) in zip(owners[:n], moves.imports, strict=True):
            carried.setdefault(id(imp), (imp, []))[1].append((key, tuple(tokens)))
        if carried:
            self._imports[step_id] = list(carried.values())
            left = {id(i) for i in self._import_owners}
            self._unsent_imports = [i for i in self._unsent_imports if id(i) in left]
        return moves

    def on_exported(
        self, step_id: int, export_data: list[str], tokenizer_fingerprint: str
    ) -> list[Request]:
        """The plan `step_id`'s exports are written (the worker said so before its step
        ran, or its result says so): each sequence's KvHandover leaves (to the router);
        returns the sequences whose hand-over is over here (sent or cancelled)."""
        done = []
        data = iter(export_data)
        for e in self._exports.pop(step_id, []):
            blocks = [next(data, "") for _ in e.keys] if export_data else []
            done.append(e.req)
            if e.cancelled:
                _remove(e.folder)
                continue
            self._send(e, blocks, tokenizer_fingerprint)
        return done

    def _send(self, e: _Export, blocks: list[str], tokenizer_fingerprint: str) -> None:
        req, now = e.req, time.time()
        sampling = dataclasses.replace(req.sampling, prompt_logprobs=None)  # (sent with t1)
        num_bytes = _folder_bytes(e.folder) if e.folder else sum(len(b) * 3 // 4 for b in blocks)
        queue_s = max(0.0, req.started_at - req.arrival_time)
        prefill_s = max(0.0, now - req.started_at)
        self.stats.num_handed_over += 1
        self.stats.bytes_sent += num_bytes
        self.stats.prefill_queue_s += queue_s
        self.stats.prefill_s += prefill_s
        assert self.send is not None, "a prefill replica sends its hand-overs to the router"
        self.send(
            KvHandover(
                request_id=req.group_id,
                seq_index=req.seq_index,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids,
                sampling=sampling,
                # (its stop ids less the client's: the EOS ids, unless it ignores them)
                eos_token_ids=[
                    t for t in req.stop_token_ids if t not in req.sampling.stop_token_ids
                ],
                arrival_time=req.arrival_time,
                priority=req.priority,
                timeout=None if req.deadline is None else req.deadline - req.arrival_time,
                tokenizer_fingerprint=tokenizer_fingerprint,
                cache_salt=req.cache_salt,
                version=req.version or "",
                cache_root=req.cache_root,
                block_keys=e.keys,
                block_tokens=e.tokens,
                lora_name=req.lora_name,
                lora_hash=req.lora_hash,
                transfer_dir=e.folder,
                block_data=blocks,
                num_bytes=num_bytes,
                prefill_queue_s=queue_s,
                prefill_s=prefill_s,
                export_s=time.monotonic() - e.started,
                sent_at=now,
            )
        )

    # the decode side -----------------------------------------------------------------------
    def refusal(self, msg: KvHandover, serving: list[CurrentModel], adapter_refusal: str) -> str:
        """Why this replica cannot take `msg` ("": it can): it does not serve the sequence's
        LoRA adapter with the same weights (`adapter_refusal`, from lora_registry.py), none
        of the models it runs sequences on (`serving`: the served one, a retiring one) has
        its version, tokenizer and root (adapter included: its KV is never accepted), or it
        has no worker."""
        if not serving:
            return "the decode replica's worker is restarting"
        if adapter_refusal:
            return adapter_refusal
        for model in serving:
            root = salted_root(model.root, msg.cache_salt)
            if msg.version == model.version and msg.cache_root == lora_root(
                root, msg.lora_name, msg.lora_hash
            ):
                return ""
        return (
            f"the decode replica serves model version {serving[0].version}, the prefill "
            f"replica computed {msg.version or '?'}"
        )

    def receive(self, msg: KvHandover, req: Request, blocks: BlockManager, reserve: int) -> bool:
        """Plan the import of `msg`'s blocks that this replica does not cache, after checking
        the chain they claim: each key must be the hash of its tokens on this replica's
        root (the version root, salt included), and the tokens the sequence's. Returns
        whether the sequence waits for the import (else it may be queued now)."""
        self.stats.num_received += 1
        bs, ids = blocks.block_size, req.all_token_ids
        keys, tokens = [], []
        parent = req.cache_root
        data = msg.block_data or [""] * len(msg.block_keys)
        tail: tuple[int, int] | None = None  # (key, tokens) of the partial last block
        for i, (key, claimed, raw) in enumerate(
            zip(msg.block_keys, msg.block_tokens, data, strict=True)
        ):
            if len(claimed) < bs:  # the partial last prompt block: this sequence's own
                block_tokens = tuple(ids[i * bs : i * bs + len(claimed)])
                want = tail_key(parent, block_tokens, msg.request_id, msg.seq_index)
                ends_prompt = i * bs + len(claimed) == req.num_prompt_tokens
                if key != want or tuple(claimed) != block_tokens or not ends_prompt:
                    log.warning("KV hand-over %s: its last block does not fit", msg.request_id)
                    break
                tail = (key, len(claimed))
            else:
                block_tokens = tuple(ids[i * bs : (i + 1) * bs])
                parent = block_hash(parent, block_tokens)
                if key != parent or tuple(claimed) != block_tokens:
                    log.warning("KV hand-over %s: block %d is not of this chain", msg.request_id, i)
                    break
            if tail is None and (
                blocks.cached_block(key, block_tokens) is not None or blocks.is_importing(key)
            ):
                self.stats.blocks_hit += 1
                continue
            if not blocks.can_allocate(1, reserve=reserve):
                break  # (no room: the rest is recomputed)
            block = blocks.reserve_import(key)
            path = f"{msg.transfer_dir}/{file_name(key)}" if msg.transfer_dir else ""
            self.pending.imports.append((block, key, list(block_tokens), msg.version, path, raw))
            keys.append(key)
            tokens.append(block_tokens)
        if not keys:  # (every block cached here already, or none came)
            _remove(msg.transfer_dir)
            self._account(msg)
            return False
        if tail is not None and tail[0] not in keys:
            tail = None  # (no room for it: the tail is computed again)
        imp = _Import(req, keys, tokens, msg, tail=tail)
        self._unsent_imports.append(imp)
        self._import_owners += [imp] * len(keys)
        return True

    def on_imported(self, msg: StepResult, blocks: BlockManager) -> list[Request]:
        """The plan that imported ended: the blocks that landed are cached under their keys;
        returns the sequences to queue now (not cancelled meanwhile)."""
        failed = set(msg.kv_import_failed_dst)
        ready = []
        for imp, carried in self._imports.pop(msg.step_id, []):
            for key, block_tokens in carried:
                landed = blocks.import_block(key) not in failed
                if imp.tail is not None and key == imp.tail[0]:  # (held for the sequence)
                    held = landed and not imp.cancelled
                    blocks.finish_tail_import(key, imp.req.request_id, imp.tail[1], held)
                else:
                    blocks.finish_import(key, block_tokens, landed, imp.req.lora_name)
                self.stats.blocks_received += landed
                self.stats.blocks_failed += not landed
            imp.num_landed += len(carried)
            if imp.num_landed < len(imp.keys):
                continue  # (the rest of its blocks come with later plans)
            _remove(imp.msg.transfer_dir)
            self._account(imp.msg)
            if not imp.cancelled:
                ready.append(imp.req)
        return ready

    def _account(self, msg: KvHandover) -> None:
        """A hand-over's transfer is over: its bytes and time (export, travel, import)."""
        transfer_s = max(0.0, time.time() - msg.sent_at) + msg.export_s
        self.stats.bytes_received += msg.num_bytes
        self.stats.transfer_s += transfer_s
        self.stats.last_transfer_s, self.stats.last_transfer_bytes = transfer_s, msg.num_bytes

    def drop(self, msg: KvHandover) -> None:
        """A hand-over this replica does not take: its files go."""
        self.stats.num_refused += 1
        _remove(msg.transfer_dir)

    def was_aborted(self, msg: KvHandover) -> bool:
        """Was this sequence cancelled before its hand-over arrived? (An abort newer than
        the request: a client may use an id again for a later request.)"""
        for key in ((msg.request_id, None), (msg.request_id, msg.seq_index)):
            when = self._tombstones.get(key)
            if when is not None and msg.arrival_time <= when:
                return True
        return False

    def remember_abort(self, request_id: str, seq_index: int | None) -> None:
        """An abort for a sequence this replica may not hold yet: its hand-over may be on
        its way (the abort reached every replica first); it is dropped when it arrives."""
        self._tombstones[(request_id, seq_index)] = time.time()
        self._tombstones.move_to_end((request_id, seq_index))
        while len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    # either side ---------------------------------------------------------------------------
    def end(self, request_id: str, reason: FinishReason, seq_index: int | None) -> list[Request]:
        """Cancel the sequences of `request_id` (or one) in an export or an import; their
        blocks are settled when the plan's result arrives. Returns those ended."""
        ended = []
        for req in self._live():
            if req.group_id == request_id and seq_index in (None, req.seq_index):
                ended.append(req)
                req.status, req.finish_reason = Status.FINISHED, reason
        for entry in self._entries():
            if entry.req in ended:
                entry.cancelled = True
        return ended

    def _entries(self) -> list[_Export | _Import]:
        out: list[_Export | _Import] = []
        for es in (*self._exports.values(), self._unsent_exports, self._send_after_tokens):
            out += es
        return out + self._import_entries()

    def _import_entries(self) -> list[_Import]:
        """Every import in a plan or waiting for one, once each."""
        seen: dict[int, _Import] = {}
        for carried in self._imports.values():
            for imp, _ in carried:
                seen.setdefault(id(imp), imp)
        for imp in self._unsent_imports:
            seen.setdefault(id(imp), imp)
        return list(seen.values())

    def end_all(self, reason: FinishReason) -> list[Request]:
        """Every sequence in a move ends (its blocks are settled by the plan's result)."""
        live = self._live()
        for req in live:
            req.status, req.finish_reason = Status.FINISHED, reason
        for entry in self._entries():
            entry.cancelled = True
        return live

    def reset(self) -> None:
        """The worker died (its pool with it): every move is void."""
        for entry in self._entries():
            _remove(entry.folder if isinstance(entry, _Export) else entry.msg.transfer_dir)
        self._exports.clear()
        self._imports.clear()
        self._unsent_exports.clear()
        self._unsent_imports.clear()
        self._import_owners.clear()
        self._send_after_tokens.clear()
        self.pending = Moves()


def _remove(folder: str) -> None:
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def _folder_bytes(folder: str) -> int:
    try:
        return sum(p.stat().st_size for p in Path(folder).iterdir())
    except OSError:
        return 0


def decode_sequence(msg: KvHandover, served: CurrentModel | None) -> Request:
    """The decode side's record of a handed-over sequence: a resumed one, whose outputs so
    far are known tokens without KV (admission takes the imported blocks as hits), run
    with the adapter the prefill replica ran it with (`refusal` checked this one serves it)."""
    req = Request(
        sequence_key(msg.request_id, msg.seq_index),
        msg.prompt_token_ids,
        msg.sampling,
        msg.eos_token_ids,
        max_model_len=served.max_model_len if served is not None else 1 << 30,
        arrival_time=msg.arrival_time,
        cache_root=salted_root(served.root, msg.cache_salt) if served is not None else 0,
        cache_salt=msg.cache_salt,
        lora_name=msg.lora_name,
        lora_hash=msg.lora_hash,
        priority=msg.priority,
        timeout=msg.timeout,
        group_id=msg.request_id,
        seq_index=msg.seq_index,
    )
    req.output_token_ids = list(msg.output_token_ids)
    # it started on the prefill replica: it stays on that version (a swap waits for it)
    req.version, req.cache_root = msg.version, msg.cache_root
    return req
