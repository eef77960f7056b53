"""The prefix cache's lower tiers on the worker: host-memory slots and files.

The scheduler decides every move (services/scheduler/kv_tiers.py holds the index); this
store only does them, in the plan's order, before the step computes:

    drops    delete files                      (queued to the writer thread)
    spills   host slot -> file                 (the slot is copied now, written in the
                                                background: a step never waits on a write)
    fetches  file -> host slot                 (read and checked now; answered in the result)
    saves    device block -> host slot
    loads    host slot -> device block         (after the plan's swap-outs: KVCache.tier_load)

A file holds one block of this rank (tensor parallelism: each rank its own shard, in its own
folder `rank<r>of<n>`), behind a header naming its key, tokens, dtype, shape, layer count,
block size, rank and model version, and a checksum of its bytes (CRC-32: it guards against
torn or damaged files, not against an adversary, and runs at memory speed, where blake2b
took 0.76 ms of a 737 KiB block's 0.86 ms read on the decode side of a hand-over):

    b"SHKV2\\n" | u32 header length | header (JSON) | K and V of every layer

A read checks all of it against what the scheduler asked for; a file that does not match is
deleted and the read fails (never served). At start-up the folder is scanned: files of this
layout and model version are kept (the newest, up to the disk budget) and announced to the
scheduler; the others (other weights, another dtype or block size) are deleted.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import struct
import threading
import uuid
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from common.messages.scheduler_worker import StepPlan
from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.kv_cache import GIB, KVCache

log = logging.getLogger(__name__)

MAGIC = b"SHKV2\n"  # 2: the CRC-32 checksum (1: blake2b; its files are not read)
_MASK = (1 << 64) - 1


class CorruptBlock(ValueError):
    """A file that does not hold the block asked for."""


def file_name(key: int) -> str:
    return f"{key & _MASK:016x}.kv"


def checksum(payload: bytes | memoryview) -> str:
    return f"crc32:{zlib.crc32(payload):08x}"


def encode_parts(header: dict[str, Any], block: torch.Tensor) -> tuple[bytes, memoryview]:
    """The file's two parts: its head (magic, `header`: layout, key, tokens, version, plus
    the checksum) and the block's bytes, a view of one contiguous copy (for a writev)."""
    payload = block.contiguous().view(torch.uint8).reshape(-1).numpy().data
    head = json.dumps({**header, "checksum": checksum(payload)}).encode()
    return MAGIC + struct.pack("<I", len(head)) + head, payload


def encode_block(header: dict[str, Any], block: torch.Tensor) -> bytes:
    """The file's bytes: `header` (layout, key, tokens, version) plus the checksum."""
    head, payload = encode_parts(header, block)
    return head + payload


def write_block_file(path: Path, header: dict[str, Any], block: torch.Tensor) -> None:
    """`path` holds the block's file once this returns, whole: written under a temporary
    name, then renamed (a reader never sees half a file); head and bytes in one writev."""
    head, payload = encode_parts(header, block)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        todo, parts = len(head) + len(payload), [memoryview(head), payload]
        while todo:
            n = os.writev(fd, parts)
            todo -= n
            while n and parts:  # (a short write: go on from where it stopped)
                if n >= len(parts[0]):
                    n -= len(parts.pop(0))
                else:
                    parts[0], n = parts[0][n:], 0
    finally:
        os.close(fd)
    os.replace(tmp, path)


class BlockReader:
    """Reads block files into one buffer, reused from file to file (the same pages each
    time, none faulted in fresh); a read's view is valid until the next read."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def read(self, path: str) -> memoryview:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if len(self._buffer) < size:  # (a new buffer: views of the old one stay valid)
                self._buffer = bytearray(size + 4096)
            view = memoryview(self._buffer)[:size]
            got = 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    raise CorruptBlock("the file is shorter than it said")
                got += n
        return view


def read_header(data: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """(header, offset of the payload); CorruptBlock when it is not one."""
    if bytes(data[: len(MAGIC)]) != MAGIC or len(data) < len(MAGIC) + 4:
        raise CorruptBlock("no block header")
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(bytes(data[start : start + n]))
    except ValueError as e:
        raise CorruptBlock(f"unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise CorruptBlock("unreadable header")
    return header, start + n


def decode_block(
    data: bytes | memoryview, expect: dict[str, Any], dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """The block in `data`, checked: every field of `expect` (key, tokens, layout) as in
    the header, and the checksum of its bytes; CorruptBlock otherwise. A writable `data`
    (read_block_file's view) is not copied: the tensor shares its memory."""
    header, offset = read_header(data)
    for field, want in expect.items():
        if header.get(field) != want:
            raise CorruptBlock(f"{field} is {header.get(field)!r}, wanted {want!r}")
    payload = memoryview(data)[offset:]
    if checksum(payload) != header.get("checksum"):
        raise CorruptBlock("checksum mismatch")
    writable = isinstance(data, memoryview) and not data.readonly
    flat = torch.frombuffer(payload if writable else bytearray(payload), dtype=torch.uint8)
    if flat.numel() != torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size():
        raise CorruptBlock("wrong size")
    return flat.view(dtype).reshape(shape)


def block_layout(kv: KVCache, tp: TensorParallel) -> dict[str, Any]:
    """What a block's file names of its layout, all of which a reader must share."""
    shape = kv.block_shape
    return {
        # the KV format, not only the tensor's dtype: fp8 e4m3 and e5m2 rows are both
        # uint8, and one must never read the other's bytes
        "dtype": kv.format.describe(),
        "shape": list(shape),
        "num_layers": shape[0],
        "block_size": kv.block_size,
        "tp_rank": tp.rank,
        "tp_size": tp.size,
    }


class DiskTier:
    """This rank's block files: written by a background thread, read in the step."""

    def __init__(self, folder: Path, layout: dict[str, Any], version: str, dtype: torch.dtype):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.layout = layout  # dtype, shape, layers, block size, rank: must match to be read
        self.version = version
        self.dtype = dtype
        self.shape = tuple(layout["shape"])
        # what is on disk or queued for it, oldest first (the scheduler's view after Reset)
        self.files: OrderedDict[int, list[int]] = OrderedDict()
        self._pending: dict[int, tuple[list[int], torch.Tensor]] = {}  # queued writes
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self.num_writes = self.num_write_errors = self.num_discarded = 0
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk", daemon=True)
        self._writer.start()

    # start-up ------------------------------------------------------------------------------
    def scan(self, capacity: int) -> None:
        """Keep the newest files of this layout and version, up to `capacity`; delete the
        rest (another model's or dtype's blocks can never be served by this one)."""
        found: list[tuple[float, int, list[int], Path]] = []
        for path in self.folder.glob("*.kv"):
            try:
                with path.open("rb") as f:
                    head = f.read(1 << 16)
                header, _ = read_header(head)
                ok = header.get("version") == self.version and all(
                    header.get(k) == v for k, v in self.layout.items()
                )
                key, tokens = int(header["key"]), list(header["tokens"])
                ok = ok and path.name == file_name(key)
            except (OSError, CorruptBlock, KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                log.info("KV offload: %s is not this model's or layout's; deleted", path.name)
                path.unlink(missing_ok=True)
                continue
            found.append((path.stat().st_mtime, key, tokens, path))
        found.sort()
        for _, _, _, path in found[: max(0, len(found) - capacity)]:
            path.unlink(missing_ok=True)
        for _, key, tokens, _ in found[max(0, len(found) - capacity) :]:
            self.files[key] = tokens
        for stale in self.folder.glob("*.tmp-*"):  # a write cut by a crash
            stale.unlink(missing_ok=True)

    # down ----------------------------------------------------------------------------------
    def put(self, key: int, tokens: list[int], block: torch.Tensor) -> None:
        """Write `block` (a copy the caller gives up) in the background."""
        with self._lock:
            self._pending[key] = (tokens, block)
        self.files[key] = tokens
        self._queue.put(("put", key))

    def drop(self, key: int) -> None:
        self.files.pop(key, None)
        self._queue.put(("drop", key))

    def _write_loop(self) -> None:
        while (op := self._queue.get()) is not None:
            try:
                self._do(*op)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _do(self, kind: str, key: int) -> None:
        path = self.folder / file_name(key)
        if kind == "drop":
            with self._lock:
                self._pending.pop(key, None)
            path.unlink(missing_ok=True)
            return
        with self._lock:
            item = self._pending.get(key)
        if item is None:
            return  # dropped before it was written
        tokens, block = item
        header = {**self.layout, "key": key, "tokens": tokens, "version": self.version}
        try:
            write_block_file(path, header, block)
            self.num_writes += 1
        except OSError as e:  # a full disk: the block is lost, a later read fails
            self.num_write_errors += 1
            log.warning("KV offload: writing %s failed: %s", path, e)
        with self._lock:
            if self._pending.get(key) is item:
                del self._pending[key]

    def flush(self) -> None:
        """Wait for the writes and deletes queued so far (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join()

    # up ------------------------------------------------------------------------------------
    def read(self, key: int, tokens: list[int]) -> torch.Tensor | None:
        """The block of `key`, checked; None (and the file deleted) when it is missing or
        does not match its key, tokens, layout or checksum."""
        with self._lock:
            item = self._pending.get(key)
        if item is not None:
            return item[1] if item[0] == tokens else None
        path = self.folder / file_name(key)
        try:
            data = path.read_bytes()
            expect = {**self.layout, "key": key, "tokens": tokens}
            return decode_block(data, expect, self.dtype, self.shape)
        except (OSError, CorruptBlock) as e:
            log.warning("KV offload: %s discarded: %s", path.name, e)
            self.discard(key)
            return None

    def discard(self, key: int) -> None:
        self.num_discarded += 1
        self.drop(key)


class KVTierStore:
    """The host slots (in the KVCache) and the disk tier of one runner."""

    def __init__(
        self,
        kv: KVCache,
        num_host_slots: int,
        disk: DiskTier | None,
        num_disk_blocks: int,
        tp: TensorParallel,
    ) -> None:
        self.kv = kv
        self.num_host_slots = num_host_slots
        self.disk = disk
        self.num_disk_blocks = num_disk_blocks
        self.tp = tp
        self.store_id = uuid.uuid4().hex

    @classmethod
    def create(
        cls,
        kv: KVCache,
        *,
        memory_gib: float,
        folder: str,
        disk_gib: float,
        version: str,
        tp: TensorParallel,
    ) -> KVTierStore | None:
        """The tiers the options ask for (None: --kv-offload-memory is 0)."""
        per_block = kv.block_bytes
        num_slots = tp.agree_min(int(memory_gib * GIB) // per_block) if memory_gib else 0
        if not num_slots:
            return None
        kv.allocate_tier(num_slots)
        disk, num_disk = None, 0
        if folder:
            num_disk = tp.agree_min(int(disk_gib * GIB) // per_block)
            disk = DiskTier(
                Path(folder) / f"rank{tp.rank}of{tp.size}",
                block_layout(kv, tp),
                version,
                kv.tensor.dtype,
            )
            disk.scan(num_disk)
        log.info(
            "KV offload: %d blocks in host memory, %d on disk (%s)",
            num_slots,
            num_disk,
            folder or "no disk tier",
        )
        return cls(kv, num_slots, disk, num_disk, tp)

    def set_version(self, version: str) -> None:
        """The model version new files are labelled with (the served one)."""
        if self.disk is not None:
            self.disk.version = version

    def disk_contents(self) -> tuple[list[int], list[list[int]]]:
        if self.disk is None:
            return [], []
        return list(self.disk.files), list(self.disk.files.values())

    def apply(self, plan: StepPlan) -> tuple[list[int], list[int]]:
        """The plan's drops, spills, fetches and saves (loads come after its swap-outs);
        returns (keys fetched, keys whose fetch failed), agreed by every rank."""
        disk = self.disk
        if disk is not None:
            for key in plan.tier_drop_keys:
                disk.drop(key)
            for slot, key, tokens in zip(
                plan.tier_spill_slots, plan.tier_spill_keys, plan.tier_spill_tokens, strict=True
            ):
                disk.put(key, tokens, self.kv.tier_block(slot).clone())
        ok: list[int] = []
        failed: list[int] = []
        if plan.tier_fetch_keys:
            blocks = [
                disk.read(key, tokens) if disk is not None else None
                for key, tokens in zip(plan.tier_fetch_keys, plan.tier_fetch_tokens, strict=True)
            ]
            agreed = self.tp.agree_all([b is not None for b in blocks])
            for key, slot, block, good in zip(
                plan.tier_fetch_keys, plan.tier_fetch_slots, blocks, agreed, strict=True
            ):
                if good and block is not None:
                    self.kv.set_tier_block(slot, block)
                    ok.append(key)
                else:
                    if block is not None and disk is not None:  # another rank's is bad
                        disk.discard(key)
                    failed.append(key)
        if plan.tier_save_src:
            self.kv.tier_save(plan.tier_save_src, plan.tier_save_dst)
        return ok, failed

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
