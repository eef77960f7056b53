"""Prefill/decode hand-over on the worker: a request's full KV blocks leave a prefill
replica's pool and enter a decode replica's, in the prefix cache's file format
(gpu_worker/kv_tiers.py: a header naming layout, key, tokens and model version, and a
checksum of the bytes), so that one format and one set of checks serve both:

    prefill worker                                    decode worker
    device block --encode_block--> file in the shm folder ----read, decode_block--> block
                                   or base64 in StepResult --(scheduler, router,
                                      scheduler: ZeroMQ/TCP)--> base64 in StepPlan

Only the target's KV moves: a draft model (--speculative draft) computes its own KV of a
received sequence from its tokens at its first proposal, as for any prefix hit
(gpu_worker/sample/speculative.py, DraftModel), so its pool's copy of a block never travels.

The scheduler decides every move (services/scheduler/handover.py) and names them in a
plan; both run at the start of the plan, before its step writes any block: an exported
block freed by the scheduler may be reused by that same plan, and an imported one is
computed on only by a later plan, after the result said it landed.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.messages.scheduler_worker import KvExported, StepPlan
from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.kv_cache import KVCache
from gpu_worker.kv_tiers import (
    BlockReader,
    CorruptBlock,
    block_layout,
    decode_block,
    encode_block,
    write_block_file,
)

log = logging.getLogger(__name__)


class KVHandover:
    """Exports and imports of whole blocks for one runner's KV cache."""

    def __init__(self, kv: KVCache, tp: TensorParallel) -> None:
        self.kv = kv
        self.layout = block_layout(kv, tp)
        self.num_exported = self.num_imported = self.num_import_failed = 0
        self._reader = BlockReader()  # block files, read into the same pages each time

    def apply(
        self, plan: StepPlan, report: Callable[[KvExported], None] | None = None
    ) -> dict[str, Any]:
        """The plan's exports, then its imports; StepResult's fields for them. With
        `report`, the exports are reported at once (KvExported), before the step runs, and
        not in the result: their hand-overs leave while the step computes."""
        if not (plan.kv_export_src or plan.kv_import_dst):
            return {}
        fields: dict[str, Any] = {}
        if plan.kv_export_src:
            data = self._export(plan)
            if report is not None:
                report(KvExported(plan.step_id, data))
            else:
                fields["kv_export_data"] = data
        return fields | {"kv_import_failed_dst": self._import(plan)}

    def _export(self, plan: StepPlan) -> list[str]:
        data: list[str] = []
        moves = zip(
            plan.kv_export_src,
            plan.kv_export_keys,
            plan.kv_export_tokens,
            plan.kv_export_versions,
            plan.kv_export_paths,
            strict=True,
        )
        for block, key, tokens, version, path in moves:
            header = {**self.layout, "key": key, "tokens": tokens, "version": version}
            rows = self.kv.tensor[:, :, block].to("cpu")
            if path:
                write_block_file(Path(path), header, rows)
                data.append("")
            else:
                data.append(base64.b64encode(encode_block(header, rows)).decode("ascii"))
            self.num_exported += 1
        return data if any(data) else []

    def _import(self, plan: StepPlan) -> list[int]:
        failed: list[int] = []
        data = plan.kv_import_data or [""] * len(plan.kv_import_dst)
        moves = zip(
            plan.kv_import_dst,
            plan.kv_import_keys,
            plan.kv_import_tokens,
            plan.kv_import_versions,
            plan.kv_import_paths,
            data,
            strict=True,
        )
        shape, dtype = self.kv.block_shape, self.kv.tensor.dtype
        for dst, key, tokens, version, path, encoded in moves:
            expect = {**self.layout, "key": key, "tokens": tokens, "version": version}
            try:
                raw = self._reader.read(path) if path else base64.b64decode(encoded)
                block = decode_block(raw, expect, dtype, shape)
            except (OSError, ValueError, CorruptBlock) as e:
                log.warning("KV hand-over: block %016x refused: %s", key & ((1 << 64) - 1), e)
                failed.append(dst)
                self.num_import_failed += 1
                continue
            self.kv.tensor.select(2, dst).copy_(block)  # (before the next read reuses it)
            self.num_imported += 1
        return failed
