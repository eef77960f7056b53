"""The processes' layout: names and inbox addresses of each replica's scheduler and worker,
the router, and where tokenised requests go (docs/architecture.md, "Processes"). Every
process that addresses a replica asks here; nothing else knows the layout.

    gateway ×G ─▶ tokenizer ×T ─▶ router ─▶ scheduler-0 ─▶ worker-0     replica 0
                                        └─▶ scheduler-1 ─▶ worker-1     replica 1
    detokenizer (shared) ◀── token ids from every scheduler

With --gateway-processes G > 1 the gateways are `gateway-0`..`gateway-{G-1}`, each with its
own inbox; whatever answers a gateway reaches the one that owns the request through
common/gateway_outbox.py. With G = 1 the one gateway is `gateway`.

A replica is one scheduler and its worker (group), addressed by index. With
--data-parallel-size 1 (the default) nothing changes: no router, the processes are named
`scheduler` and `worker`, and tokenizers push straight to the scheduler. With N > 1 each
replica's processes run on a config of their own (`replica_config`) whose scheduler and
worker addresses are the replica's, so the scheduler and worker code need not know N.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config import Config


def replica_name(base: str, index: int, size: int) -> str:
    """`scheduler`/`worker` with one replica; `scheduler-1`, `worker-1`, ... with several."""
    return base if size == 1 else f"{base}-{index}"


def own_name(config: Config, base: str) -> str:
    """This process's name for `base` (scheduler, worker) in its replica."""
    dp = config.data_parallel
    return replica_name(base, dp.replica_index, dp.data_parallel_size)


WORKER = "worker"
_RANK_PREFIX = "worker-rank-"


def worker_rank_name(rank: int) -> str:
    """Rank 0 of a tensor-parallel group is `worker` (the one its scheduler talks to)."""
    return WORKER if rank == 0 else f"{_RANK_PREFIX}{rank}"


def is_worker_rank(name: str) -> bool:
    return name == WORKER or name.startswith(_RANK_PREFIX)


def num_gateways(config: Config) -> int:
    """Gateway processes: --gateway-processes, resolved by `shuttle serve` (0 there: by the
    cores); a process started on its own with 0 counts one."""
    return max(1, config.server.gateway_processes)


def default_gateway_processes() -> int:
    """--gateway-processes 0: two where there are two cores or more, so one survives the
    other's death; one on a single core."""
    return min(2, os.cpu_count() or 1)


def gateway_name(index: int, size: int) -> str:
    """`gateway` with one gateway process; `gateway-0`, `gateway-1`, ... with several."""
    return "gateway" if size == 1 else f"gateway-{index}"


def gateway_index(name: str) -> int | None:
    """Which of several gateway processes `name` is (`gateway-1`: 1); None for any other."""
    base, sep, index = name.rpartition("-")
    return int(index) if base == "gateway" and sep and index.isdigit() else None


def gateway_addrs(config: Config) -> list[str]:
    """Inbox of each gateway process, by index: --gateway-addr (comma-separated, one per
    process), else `ipc://<run_dir>/gateway[-i].sock`."""
    size = num_gateways(config)
    explicit = _split(config.addresses.gateway_addr)
    if explicit:
        if len(explicit) < size:
            raise ValueError(
                f"--gateway-addr names {len(explicit)}, not one per gateway process ({size})"
            )
        return explicit[:size]
    return [config.addr(gateway_name(i, size)) for i in range(size)]


def process_names(config: Config) -> list[str]:
    """Every process `shuttle serve` runs on this host, by the names the supervisor gives
    them (and the console lists): each replica's worker (ranks) and scheduler, the router
    with several replicas, the detokenizer, each tokenizer and each gateway."""
    size = config.data_parallel.data_parallel_size
    names: list[str] = []
    for i in range(size):
        if size == 1:
            names += [worker_rank_name(r) for r in config.parallel.local_ranks]
        else:
            names.append(replica_name(WORKER, i, size))
        names.append(replica_name("scheduler", i, size))
    if size > 1:
        names.append("router")
    names.append("detokenizer")
    names += [f"tokenizer-{i}" for i in range(config.server.num_tokenizers)]
    gateways = num_gateways(config)
    names += [gateway_name(i, gateways) for i in range(gateways)]
    return names


def _split(addrs: str) -> list[str]:
    return [a.strip() for a in addrs.split(",") if a.strip()]


def replica_addrs(config: Config, base: str) -> list[str]:
    """Inbox of `base` (scheduler, worker) in each replica, by index."""
    dp = config.data_parallel
    explicit = _split(dp.scheduler_addrs if base == "scheduler" else dp.worker_addrs)
    if explicit:  # (more than N: the first N, so one list serves every layout up to it)
        if len(explicit) < dp.data_parallel_size:
            raise ValueError(f"--{base}-addrs names {len(explicit)}, not one per replica")
        return explicit[: dp.data_parallel_size]
    size = dp.data_parallel_size
    return [config.addr(replica_name(base, i, size)) for i in range(size)]


def router_addr(config: Config) -> str:
    return config.data_parallel.router_addr or config.addr("router")


def engine_entry_addr(config: Config) -> str:
    """Where tokenised requests go: the router with several replicas, else the scheduler."""
    return (
        router_addr(config)
        if config.data_parallel.data_parallel_size > 1
        else config.addr("scheduler")
    )


def replica_config(config: Config, index: int) -> Config:
    """The config of replica `index`'s scheduler and worker: their own addresses."""
    return config.replace(
        addresses={
            "scheduler_addr": replica_addrs(config, "scheduler")[index],
            "worker_addr": replica_addrs(config, "worker")[index],
        },
        data_parallel={"replica_index": index},
    )


def replica_gpus(visible: list[str], size: int) -> list[list[str]]:
    """The GPUs each replica's worker (group) sees: the visible ones split into `size`
    contiguous groups of equal size (a replica of a tensor-parallel group takes its ranks'
    GPUs from its own group). Fewer GPUs than replicas: every replica sees them all."""
    if len(visible) < size:
        return [list(visible)] * size
    per = len(visible) // size
    return [visible[i * per : (i + 1) * per] for i in range(size)]


def replica_roles(config: Config) -> list[str]:
    """Each replica's part, by index: with --prefill-replicas P --decode-replicas D the
    first P prefill and the next D decode; otherwise every one both."""
    dp = config.data_parallel
    if not dp.is_disaggregated:
        return ["both"] * dp.data_parallel_size
    return ["prefill"] * dp.prefill_replicas + ["decode"] * dp.decode_replicas


def kv_transfer_dir(config: Config) -> str:
    """Where a prefill replica's worker writes the blocks it hands over and a decode
    replica's reads them (--kv-transfer shm): --kv-transfer-dir, else a folder of this run
    in /dev/shm (shared memory), else in the run directory; "" with --kv-transfer tcp (the
    blocks travel in the messages)."""
    dp = config.data_parallel
    if dp.kv_transfer != "shm":
        return ""
    if dp.kv_transfer_dir:
        return dp.kv_transfer_dir
    run_dir = config.server.run_dir
    if os.path.isdir("/dev/shm"):
        tag = hashlib.sha256(os.path.abspath(run_dir or ".").encode()).hexdigest()[:16]
        return f"/dev/shm/shuttle-kv-{tag}"
    return os.path.join(run_dir or ".", "kv-handover")
