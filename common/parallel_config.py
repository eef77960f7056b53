"""Parallelism's config sections: tensor parallelism (one worker split over ranks) and data
parallelism (the replica layout it implies is common/topology.py's)."""

from __future__ import annotations

import dataclasses

from common.config_base import ConfigError, check_field, config_field

ROUTINGS = ("prefix", "round-robin")
ROLES = ("both", "prefill", "decode")
KV_TRANSFERS = ("shm", "tcp")


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
    # prefill/decode disaggregation (docs/architecture.md, "Prefill and decode replicas")
    prefill_replicas: int = config_field(
        0,
        "replicas that compute prompts and hand each request's KV blocks over (the first P "
        "replicas; with --decode-replicas; 0: every replica does both)",
    )
    decode_replicas: int = config_field(
        0, "replicas that continue the requests the prefill replicas hand over (the next D)"
    )
    role: str = config_field(
        "both",
        "this replica's part: both, prefill or decode (with --prefill-replicas/"
        "--decode-replicas it follows --replica-index; given, it must agree)",
    )
    kv_transfer: str = config_field(
        "shm",
        "how handed-over KV blocks travel: shm (files in shared memory, one host) or tcp "
        "(in ZeroMQ messages, across hosts)",
    )
    kv_transfer_dir: str = config_field(
        "", "shm transfer: the folder (default: /dev/shm/shuttle-kv-<run>, else the run dir)"
    )

    def __post_init__(self) -> None:
        p, d = self.prefill_replicas, self.decode_replicas
        if p or d:
            check_field(p >= 1 and d >= 1, "prefill_replicas", ">= 1, with --decode-replicas >= 1")
            if self.data_parallel_size == 1:  # (frozen: resolved once, here)
                object.__setattr__(self, "data_parallel_size", p + d)
            check_field(
                self.data_parallel_size == p + d,
                "data_parallel_size",
                f"--prefill-replicas + --decode-replicas ({p + d}) when both are given",
            )
        check_field(self.role in ROLES, "role", "both, prefill or decode")
        check_field(self.kv_transfer in KV_TRANSFERS, "kv_transfer", "shm or tcp")
        if self.data_parallel_size < 1:
            raise ConfigError("--data-parallel-size must be >= 1")
        if self.dp_routing not in ROUTINGS:
            raise ConfigError("--dp-routing must be prefix or round-robin")
        if self.dp_load_bound < 1.0:
            raise ConfigError("--dp-load-bound must be >= 1")
        if not 0 <= self.replica_index < self.data_parallel_size:
            raise ConfigError("--replica-index must be in [0, --data-parallel-size)")
        if self.role != "both" and not self.is_disaggregated:
            raise ConfigError(
                f"--role {self.role} needs --prefill-replicas and --decode-replicas (the router "
                "places requests by role)"
            )
        if self.role != "both" and self.role != self.role_of(self.replica_index):
            raise ConfigError(
                f"--role {self.role} disagrees with --replica-index {self.replica_index}: "
                f"replicas 0..{self.prefill_replicas - 1} prefill, the others decode"
            )

    @property
    def is_disaggregated(self) -> bool:
        """Prefill and decode run on separate replicas."""
        return self.prefill_replicas > 0

    def role_of(self, index: int) -> str:
        """Replica `index`'s part: the first --prefill-replicas prefill, the next decode."""
        if not self.is_disaggregated:
            return "both"
        return "prefill" if index < self.prefill_replicas else "decode"

    @property
    def own_role(self) -> str:
        """This process's replica's part."""
        return self.role_of(self.replica_index)


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
