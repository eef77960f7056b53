"""The tensor-parallel group of worker ranks, and the collectives the model and worker use.

    rank 0 (WorkerActor)           rank 1..N-1 (RankFollower, gpu_worker/rank.py)
    ZMQ inbox ─▶ frame ─broadcast (gloo "control" group)─▶ frame ─▶ same handler
    forward: all_reduce after o_proj / down_proj, after the embedding lookup (main group:
             NCCL on CUDA, gloo on CPU); all_gather of the LM head's vocabulary shards

Two process groups: the main one carries the model's tensors; a gloo one carries the
worker's messages (plans, loads, resets) as encoded bytes, with a very long timeout because
ranks 1.. wait there while the server is idle, and the small integers ranks agree on (the
KV pool's size). A `TensorParallel` of size 1 is what a single worker holds: every
collective is then the identity, so the model code has one path.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpu_worker.distributed.sharding import vocab_range, vocab_shard_size

# ranks 1.. block in the control broadcast while nothing is served: never time that out
_CONTROL_TIMEOUT = datetime.timedelta(days=3650)
_GROUP_TIMEOUT = datetime.timedelta(minutes=10)


@dataclasses.dataclass
class TensorParallel:
    """This rank's place in the group (size 1: no group), plus timers of its collectives."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the model's collectives
    control: Any = None  # messages and agreements (always gloo)
    comm_s: float = 0.0  # seconds spent in the model's collectives (CPU: exact; CUDA: launch)
    comm_bytes: int = 0  # bytes this rank contributed to them
    num_collectives: int = 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` (contiguous) over the ranks, in place; the identity for one rank."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self._count(start, x)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[rows, shard] LM-head slices of every rank -> [rows, vocab_size] on every rank
        (an all-gather: each rank then samples identically, see gpu_worker/rank.py)."""
        if self.size == 1:
            return logits
        start = time.perf_counter()
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits, group=self.group)
        self._count(start, logits)
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def _count(self, start: float, x: torch.Tensor) -> None:
        self.comm_s += time.perf_counter() - start
        self.comm_bytes += x.numel() * x.element_size()
        self.num_collectives += 1

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks that fit), on every rank."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def agree_all(self, flags: list[bool]) -> list[bool]:
        """flags[i] on every rank when every rank's flags[i] is true (e.g. a block read)."""
        if self.size == 1 or not flags:
            return list(flags)
        t = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return [bool(v) for v in t.tolist()]

    def broadcast_frame(self, frame: bytes) -> None:
        """Rank 0: send one encoded message to every other rank."""
        assert self.is_leader and self.size > 1
        dist.broadcast(torch.tensor([len(frame)], dtype=torch.int64), 0, group=self.control)
        dist.broadcast(torch.frombuffer(bytearray(frame), dtype=torch.uint8), 0, group=self.control)

    def receive_frame(self) -> bytes:
        """Ranks 1..: wait for rank 0's next message (blocks while the server is idle)."""
        assert not self.is_leader
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, 0, group=self.control)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.control)
        return buf.numpy().tobytes()


def join_group(
    rank: int, size: int, init_addr: str, device_type: str, local_rank: int = 0
) -> TensorParallel:
    """Join the group of `size` ranks whose rendezvous (a TCP store) rank 0 serves at
    `init_addr` (host:port); blocks until every rank has joined. On CUDA the rank's device
    is cuda:`local_rank` (its index among this host's ranks)."""
    if size == 1:
        return TensorParallel()
    if device_type == "cuda":  # NCCL works on the current device: one per rank
        torch.cuda.set_device(local_rank)
    host = init_addr.rpartition(":")[0]
    if host in ("127.0.0.1", "localhost"):  # one host: gloo talks over the loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        init_method=f"tcp://{init_addr}",
        rank=rank,
        world_size=size,
        timeout=_GROUP_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    return TensorParallel(rank=rank, size=size, group=dist.group.WORLD, control=control)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows are split over the ranks: each looks up the ids in its shard
    (zeros for the others), and an all-reduce sums the one non-zero row per token."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.start, self.end = vocab_range(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(vocab_shard_size(vocab_size, tp.size), dim))
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        x = F.embedding(local, self.weight)
        x = x * mine.unsqueeze(-1).to(x.dtype)
        return self.tp.all_reduce(x.contiguous())
