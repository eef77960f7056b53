"""Parallelism's config sections: tensor parallelism (one worker split over ranks) and data
parallelism (the replica layout it implies is common/topology.py's)."""

from __future__ import annotations

import dataclasses

from common.config_base import ConfigError, check_field, config_field

ROUTINGS = ("prefix", "round-robin")


@dataclasses.dataclass(frozen=True)
class DataParallelConfig:
    data_parallel_size: int = config_field(1, "engine replicas (scheduler + worker each)")
    dp_routing: str = config_field(
        "prefix",
        "prefix: to the replica holding the request's leading blocks (bounded by "
        "--dp-load-bound), else the least loaded; round-robin: in turn",
    )
    dp_load_bound: float = config_field(
        1.25,
        "prefix routing: a replica takes a request only while its load (running + waiting "
        "requests) stays within this multiple of the mean (at least 1)",
    )
    replica_index: int = config_field(0, "this process's replica (set by the supervisor/compose)")
    router_addr: str = config_field("", "router inbox (data parallelism)")
    scheduler_addrs: str = config_field("", "comma-separated scheduler inboxes, one per replica")
    worker_addrs: str = config_field("", "comma-separated worker inboxes, one per replica")

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ConfigError("--data-parallel-size must be >= 1")
        if self.dp_routing not in ROUTINGS:
            raise ConfigError("--dp-routing must be prefix or round-robin")
        if self.dp_load_bound < 1.0:
            raise ConfigError("--dp-load-bound must be >= 1")
        if not 0 <= self.replica_index < self.data_parallel_size:
            raise ConfigError("--replica-index must be in [0, --data-parallel-size)")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: the worker is a group of ranks, one process per device."""

    tensor_parallel_size: int = config_field(
        1, "worker ranks that split each layer (heads, MLP, vocabulary), one process each"
    )
    dist_init_addr: str = config_field(
        "",
        "host:port where rank 0 serves the ranks' rendezvous (torch.distributed TCP store); "
        "empty: a free loopback port (one host only)",
    )
    nnodes: int = config_field(1, "hosts the worker ranks span (each runs an equal share)")
    node_rank: int = config_field(
        0, "this host's index among --nnodes: 0 runs `shuttle serve`, others `shuttle worker-ranks`"
    )

    def __post_init__(self) -> None:
        check_field(self.tensor_parallel_size >= 1, "tensor_parallel_size", ">= 1")
        check_field(
            self.nnodes >= 1 and self.tensor_parallel_size % self.nnodes == 0,
            "nnodes",
            f">= 1 and divide --tensor-parallel-size {self.tensor_parallel_size}",
        )
        check_field(0 <= self.node_rank < self.nnodes, "node_rank", f"in [0, {self.nnodes})")
        check_field(
            self.nnodes == 1 or ":" in self.dist_init_addr,
            "dist_init_addr",
            "host:port (rank 0's host) when the ranks span several hosts",
        )

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this host runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)
